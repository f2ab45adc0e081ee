"""MoE expert weights on the device: all resident, or a cache of device slots over pinned host RAM.

``upload_moe`` plans by a byte budget for expert weights (``gpu_budget``; None = no limit): when
every layer's experts fit they are uploaded per layer as bf16 ``[E, 2I, H]`` gate|up (interleaved
in 8-row groups) and ``[E, H, I]`` down, with an identity slot table; experts that come as
``Mxfp4Tensor`` (gpt-oss's, kept as stored) go up as MXFP4 blobs instead (engine/cu/mxfp4.py: the
same rows, 17 bytes a 32 values), one a matrix and expert, and the MoE kernels' ``MOE_MX`` build
reads them. Otherwise every expert lives
in pinned host RAM and ``ExpertCache`` keeps the most recently used in a fixed pool of device slots;
a slot table ``[layers, E]`` int32 (host mirror + device copy) maps (layer, expert) to its slot or
-1. The kernels read weights through the layer's row of that table (engine/cu/moe.cu).

Miss path (docs/MOE.md): routing runs on the device, then ``DeviceMoE`` reads back the layer's
active experts (one small sync), ``ensure`` copies the misses host -> slot with async copies on
the same stream (least recently used slot evicted) and uploads the layer's table row, and the
expert kernels run after them in stream order. Counters ``hits``, ``misses``, ``bytes_moved``.
"""

from __future__ import annotations

import logging

import numpy as np

from engine.backends.cuda.moe import MoELayer, expert_bytes
from engine.cu import mxfp4
from engine.loaders.mxfp4 import Mxfp4Tensor
from engine.model_config import ModelConfig
from engine.models.ops import MoE

log = logging.getLogger(__name__)


def expert_nbytes(cfg: ModelConfig, mx: bool = False) -> int:
    """Device bytes of one expert's gate, up and down (bf16, or MXFP4 blobs)."""
    return sum(expert_bytes(cfg, mx))


def is_mxfp4(cfg: ModelConfig, weights) -> bool:
    """Whether ``weights`` hold every expert matrix as ``Mxfp4Tensor`` (the loader kept them as
    stored); experts of mixed formats all go up as bf16."""
    names = [n for n in weights if ".mlp.experts." in n and n.endswith("_proj.weight")]
    return bool(names) and all(isinstance(weights[n], Mxfp4Tensor) for n in names)


class ExpertCache:
    """``slots`` device slots over every (layer, expert) in pinned host RAM (``host_gu[layer]`` uint8
    ``[E, gu_bytes]``, ``host_down[layer]`` ``[E, down_bytes]``: fill them, then ``prime``)."""

    def __init__(self, layers: int, experts: int, gu_bytes: int, down_bytes: int, slots: int, mem) -> None:
        import pycuda.driver as cuda

        if slots < experts:
            raise ValueError(f"gpu_budget holds {slots} expert slots; a layer can need all {experts}")
        self.layers, self.E, self.slots = layers, experts, slots
        self.gu_bytes, self.down_bytes = gu_bytes, down_bytes
        self.host_gu = [cuda.pagelocked_empty((experts, gu_bytes), np.uint8) for _ in range(layers)]
        self.host_down = [cuda.pagelocked_empty((experts, down_bytes), np.uint8) for _ in range(layers)]
        self.gu_pool, self.down_pool = mem.alloc(slots * self.gu_bytes), mem.alloc(slots * self.down_bytes)
        self.table = cuda.pagelocked_empty((layers, experts), np.int32)
        self.table[:] = -1
        self.table_dev = mem.alloc(self.table.nbytes)
        self.owner = np.full(slots, -1, np.int64)  # layer * E + expert, or -1
        self.last_use = np.zeros(slots, np.int64)
        self.tick = 0
        self.hits = self.misses = self.bytes_moved = 0

    def slot_of(self, layer: int) -> int:
        return self.table_dev + layer * self.E * 4

    @property
    def resident(self) -> int:
        return int((self.owner >= 0).sum())

    def prime(self) -> None:
        """Fill the slots evenly across layers (experts 0.. of each) and upload the table."""
        import pycuda.driver as cuda

        per = self.slots // self.layers
        slot = 0
        for layer in range(self.layers):
            for e in range(min(self.E, per + (1 if layer < self.slots - per * self.layers else 0))):
                self._place(None, layer, e, slot)
                slot += 1
        cuda.memcpy_htod(self.table_dev, self.table)
        self.bytes_moved = 0
        total = self.layers * self.E
        log.info("expert cache: %d of %d experts resident (%d slots, %.2f GB), the rest in pinned host RAM",
                 self.resident, total, self.slots, self.slots * (self.gu_bytes + self.down_bytes) / 1e9)  # fmt: skip

    def _place(self, s, layer: int, e: int, slot: int) -> None:
        import pycuda.driver as cuda

        old = self.owner[slot]
        if old >= 0:
            self.table[old // self.E, old % self.E] = -1
        dst_gu, dst_down = self.gu_pool + slot * self.gu_bytes, self.down_pool + slot * self.down_bytes
        if s is None:
            cuda.memcpy_htod(dst_gu, self.host_gu[layer][e])
            cuda.memcpy_htod(dst_down, self.host_down[layer][e])
        else:
            cuda.memcpy_htod_async(dst_gu, self.host_gu[layer][e], s)
            cuda.memcpy_htod_async(dst_down, self.host_down[layer][e], s)
        self.owner[slot] = layer * self.E + e
        self.table[layer, e] = slot
        self.last_use[slot] = self.tick
        self.bytes_moved += self.gu_bytes + self.down_bytes

    def ensure(self, s, layer: int, experts) -> None:
        """Make ``experts`` of ``layer`` resident before the kernels queued next on ``s`` read them.
        Called after a sync (the table's pinned rows are not in flight)."""
        import pycuda.driver as cuda

        self.tick += 1
        experts = np.asarray(experts, np.int64)
        slots = self.table[layer, experts]
        hit = slots >= 0
        self.last_use[slots[hit]] = self.tick
        self.hits += int(hit.sum())
        missing = experts[~hit]
        for e in missing:
            victim = int(np.argmin(self.last_use))
            if self.last_use[victim] == self.tick:
                raise RuntimeError("expert cache: every slot is in use by this round")
            self._place(s, layer, int(e), victim)
        self.misses += len(missing)
        if len(missing):
            cuda.memcpy_htod_async(self.slot_of(layer), self.table[layer], s)


class MxPacker:
    """Packs one layer's MXFP4 experts into their blobs on the card (moe_gemv.cu's ``moe_mx_pack``):
    the checkpoint's bytes go up as they are, through staging buffers reused layer after layer, so
    a load does no per-value work on the host (``mxfp4.pack`` is the same layout in numpy)."""

    def __init__(self, kern, cfg: ModelConfig, experts: int) -> None:
        import pycuda.driver as cuda

        H, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.kern, self.E = kern, experts
        values = experts * 2 * inter * H  # gate|up, the larger matrix
        self.blocks, self.scales = cuda.mem_alloc(values // 2), cuda.mem_alloc(values // 32)

    def pack(self, s, mats: list[list[Mxfp4Tensor]], dst: int, stride: int) -> None:
        """``mats[e]``: expert e's [gate, up] (blob rows interleaved as the bf16 pools') or [down];
        their blobs land at ``dst + e * stride``."""
        import pycuda.driver as cuda

        n, g = sum(m.shape[0] for m in mats[0]), mats[0][0].scales.shape[-1]
        blocks, scales = np.empty((self.E, n, g, 16), np.uint8), np.empty((self.E, n, g), np.uint8)
        for e, parts in enumerate(mats):
            row = 0
            for m in parts:
                blocks[e, row : row + m.shape[0]], scales[e, row : row + m.shape[0]] = m.blocks, m.scales
                row += m.shape[0]
        cuda.memcpy_htod_async(self.blocks, blocks, s)
        cuda.memcpy_htod_async(self.scales, scales, s)
        words = n * mxfp4.padded_k(g * 32) // 8
        self.kern.mx_pack(s, (min(-(-words // 256), 2048), self.E), blocks=self.blocks, scales=self.scales, N=n, G=g,
                          gu=int(len(mats[0]) == 2), dst=dst, stride=stride)  # fmt: skip
        s.synchronize()  # the host arrays are reused by the next call

    def free(self) -> None:
        self.blocks.free()
        self.scales.free()


def upload_moe(cfg: ModelConfig, op: MoE, weights, mem, gpu_budget: int | None = None, kern=None):
    """Upload every MoE layer's router, biases and experts (canonical names: float32 ``[out, in]``,
    or every expert an ``Mxfp4Tensor``, see ``is_mxfp4``: packed on the card by ``kern``, the
    ``MoEKernels(mx=True)``); returns ``(layers, cache)``: ``cache`` None when all experts fit
    ``gpu_budget`` bytes."""
    import pycuda.driver as cuda

    from engine.backends.cuda.weights import dequantized, interleave_gate_up, to_bf16

    L, E = cfg.num_layers, op.num_experts
    mx = is_mxfp4(cfg, weights)
    slots = L * E if gpu_budget is None else int(gpu_budget) // expert_nbytes(cfg, mx)
    cache = ExpertCache(L, E, *expert_bytes(cfg, mx), slots, mem) if slots < L * E else None
    if cache is None:
        log.info("experts: all %d of %d layers' %d resident", L, L, E)

    def put(a) -> int:
        a = np.ascontiguousarray(a)
        dst = mem.alloc(a.nbytes)
        cuda.memcpy_htod(dst, a)
        return dst

    ident = put(np.arange(E, dtype=np.int32))
    layers = []
    packer = None
    if mx:
        if kern is None or not kern.mx:
            raise ValueError("MXFP4 experts are packed by MoEKernels(mx=True): pass it as kern")
        packer, s = MxPacker(kern, cfg, E), cuda.Stream()
        gu_bytes, down_bytes = expert_bytes(cfg, mx)
        if cache is not None:  # packed here, then copied to the cache's pinned host arrays
            staged = (cuda.mem_alloc(E * gu_bytes), cuda.mem_alloc(E * down_bytes))
    for i in range(L):
        p = f"model.layers.{i}.mlp."
        w = [weights[f"{p}experts.{e}.{n}_proj.weight"] for e in range(E) for n in ("gate", "up", "down")]
        if mx:
            gu, down = (int(a) for a in staged) if cache is not None else (mem.alloc(E * gu_bytes), mem.alloc(E * down_bytes))  # fmt: skip
            packer.pack(s, [w[3 * e : 3 * e + 2] for e in range(E)], gu, gu_bytes)
            packer.pack(s, [w[3 * e + 2 : 3 * e + 3] for e in range(E)], down, down_bytes)
            if cache is not None:
                cuda.memcpy_dtoh(cache.host_gu[i], gu)
                cuda.memcpy_dtoh(cache.host_down[i], down)
        else:
            w = [np.asarray(dequantized(a), np.float32) for a in w]
            gu = np.stack([to_bf16(interleave_gate_up(w[3 * e], w[3 * e + 1])).reshape(-1) for e in range(E)])
            down = np.stack([to_bf16(w[3 * e + 2]).reshape(-1) for e in range(E)])
        gu_bias = down_bias = 0
        if op.expert_bias:
            b = [np.asarray(dequantized(weights[f"{p}experts.{e}.{n}_proj.bias"]), np.float32) for e in range(E) for n in ("gate", "up", "down")]  # fmt: skip
            gu_bias = put(np.stack([interleave_gate_up(b[3 * e][:, None], b[3 * e + 1][:, None])[:, 0] for e in range(E)]))  # fmt: skip
            down_bias = put(np.stack([b[3 * e + 2] for e in range(E)]))
        if cache is None:
            gu_pool, down_pool, slot_of = (gu, down, ident) if mx else (put(gu), put(down), ident)
        else:
            if not mx:
                cache.host_gu[i][:], cache.host_down[i][:] = gu.view(np.uint8), down.view(np.uint8)
            gu_pool, down_pool, slot_of = cache.gu_pool, cache.down_pool, cache.slot_of(i)
        layers.append(MoELayer(
            router=put(to_bf16(np.asarray(dequantized(weights[p + "gate.weight"]), np.float32))),
            router_bias=put(np.asarray(dequantized(weights[p + "gate.bias"]), np.float32)) if op.router_bias else 0,
            gu_pool=gu_pool, down_pool=down_pool, slot_of=slot_of, gu_bias=gu_bias, down_bias=down_bias, mx=mx,
        ))  # fmt: skip
    if packer is not None:
        packer.free()
        if cache is not None:
            for a in staged:
                a.free()
    if cache is not None:
        cache.prime()
    return layers, cache
