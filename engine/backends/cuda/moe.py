"""Sparse mixture-of-experts layers (``engine.models.ops.MoE``) on the device.

``DeviceMoE`` owns a model's MoE weights, its kernels (engine/cu/moe.cu, moe_gemm.cu) and their
workspace, and runs one layer's MLP slot per call: ``decode`` for a decode round of 1..64 rows
(3 launches, no host decision, so it can be captured in a round's graph: the router GEMV whose
last block routes and groups; the grouped gate|up GEMV with the activation epilogue; the
grouped down GEMV whose last block per column tile adds the k weighted experts into the fp32
residual stream and writes the next RMSNorm's inputs; each chosen expert streamed once) and ``prefill`` for a chunk (the same router
and grouping, then grouped tensor-core GEMMs over 128-pair tiles of one expert). Routing and
grouping never leave the device; with an expert cache (``expert_cache.ExpertCache``) the active
experts are read back after routing and misses copied in first (one sync a layer), so cached
rounds are not graph-capturable (``graph_safe``). docs/MOE.md has the design.

MXFP4 experts (``MoELayer.mx``, engine/cu/mxfp4.py's blobs): decode rounds read them as stored
(moe_gemv.cu built with ``MOE_MX``); a prefill chunk of up to ``MX_PREFILL_AS_DECODE`` rows runs
the decode kernels too. A longer one goes through the grouped GEMMs built with ``MOE_MX``, which read
the blobs (moe_gemm.cu: each k-tile's blocks turned into the bf16 B tile in shared memory, exactly,
no scratch; ``MX_PREFILL_TILES``, the default); with ``MoEKernels(mx_tiles=False)`` it first
dequantizes the layer's experts into a bf16 scratch (``moe_mx_dequant``, exact) that the bf16 GEMMs
read. Both give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.cu import mxfp4
from engine.cu.launch import Kernel, module
from engine.model_config import ModelConfig
from engine.models.ops import MoE

MOE_THREADS = 256
MOE_GEMM_SMEM = 3 * (128 + 128) * 40 * 2  # STAGES * (BM + BN) * LDS * sizeof(bf16)
MAX_EXPERTS, MAX_TOP_K = 256, 16  # moe.cu's MAX_E, MAX_K
DOWN_ROWS = 128  # moe_gemv.cu's output columns a moe_down block (and a combine tile)
MAX_ROUTER_K = 32 * 16 * 8  # moe.cu's router: 32 lanes x ROUTER_CHUNKS 16-byte chunks
MAX_DECODE_ROWS = 64  # decode rounds (speculative rounds included) up to this many rows
COMBINE_COLS = MOE_THREADS  # moe_combine's (prefill) columns a block
ACTS = {"silu": 0, "swiglu_oai": 1}
# moe_gemv.cu's MXFP4 build: row groups in flight a warp (MX_U), and the down GEMV as 16-row blocks
# with K split over the warps (MX_DOWN_SPLIT) instead of a warp walking all of K; docs/MOE.md.
# The split build with MX_U 1: width 1 0.87x, width 8 0.98x, width 32 1.01x the (2, 0) build (H100,
# 2026-12-07, docs/PERFORMANCE.md).
MX_DEFINES = (("MX_U", 1), ("MX_DOWN_SPLIT", 1))
# An MXFP4 prefill chunk of up to this many rows runs the decode kernels instead of dequantizing the
# layer's experts (bench/bench_moe_mx.py --prefill-rows measures both sides).
MX_PREFILL_AS_DECODE = MAX_DECODE_ROWS
# A longer MXFP4 chunk: the grouped GEMMs read the blobs' tiles (True: a 512-row chunk of gpt-oss-20b's
# MoE layers in 25.3 ms against 43.0 through the scratch, H100, 2026-12-07) or a dequantized bf16
# scratch (False). Both give the same bits (tests/kernels/test_cuda_moe_mxfp4.py).
MX_PREFILL_TILES = True


@dataclass
class MoELayer:
    """Device addresses of one MoE layer. Expert e's gate|up is at ``gu_pool + slot_of[e] * gu_stride``
    (bf16, gate|up interleaved in 8-row groups), its down at ``down_pool + slot_of[e] * down_stride``."""

    router: int  # bf16 [E, H]
    router_bias: int  # fp32 [E] or 0
    gu_pool: int
    down_pool: int
    slot_of: int  # int32 [E]
    gu_bias: int  # fp32 [E, 2I] interleaved like the weights, or 0
    down_bias: int  # fp32 [E, H] or 0
    router_bias_ld: int = 0  # 0: one router bias vector; E: a row per input row (scripted routing)
    mx: bool = False  # the pools hold MXFP4 blobs (strides in bytes), not bf16


class MoEWorkspace:
    """Routing and expert activations for up to ``max_rows`` rows (one int32 groups table, moe.cu)."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, inter: int, max_rows: int, mem,
                 mx: bool = False, scratch: bool | None = None) -> None:  # fmt: skip
        E, P = num_experts, max_rows * top_k
        self.max_rows, self.tmax = max_rows, -(-P // 128) + E
        self.logits, self.ids, self.weights = mem.alloc(max_rows * E * 4), mem.alloc(P * 4), mem.alloc(P * 4)
        n_ints = 3 + 2 * E + 3 * self.tmax + P
        self.grp = mem.alloc(n_ints * 4)
        self.tiles = self.grp + (3 + 2 * E) * 4
        self.pairs = self.tiles + 3 * self.tmax * 4
        self.act = mem.alloc(P * inter * 2)  # bf16 [P, I], a row per (row, slot) pair
        self.y = mem.alloc(P * hidden * 4)  # fp32 [P, H]
        # self-resetting counters (zeroed here): the fused router's blocks, moe_down's column tiles
        n_done = 1 + -(-hidden // 16)
        self.done = mem.alloc(n_done * 4)
        import pycuda.driver as cuda

        cuda.memset_d32(self.done, 0, n_done)
        self.tile_done = self.done + 4
        # MXFP4 experts read through the scratch (``scratch``, default: not ``MX_PREFILL_TILES``): a
        # layer's gate|up or down as bf16 for prefill, expert e at e (``ident``)
        scratch = mx and (not MX_PREFILL_TILES if scratch is None else scratch)
        self.mx_scratch_bytes = mx_scratch_bytes(E, hidden, inter) if scratch else 0
        self.mx_scratch = mem.alloc(self.mx_scratch_bytes) if scratch else 0
        self.ident = 0
        if mx:
            ident = np.arange(E, dtype=np.int32)
            self.ident = mem.alloc(ident.nbytes)
            cuda.memcpy_htod(self.ident, ident)


def mx_scratch_bytes(num_experts: int, hidden: int, inter: int) -> int:
    """The bf16 scratch a prefill chunk dequantizes one MXFP4 layer's gate|up (then down) into."""
    return num_experts * 2 * inter * hidden * 2


def expert_bytes(cfg: ModelConfig, mx: bool = False) -> tuple[int, int]:
    """Device bytes of one expert's gate|up and of its down: bf16, or MXFP4 blobs (``mx``)."""
    H, inter = cfg.hidden_size, cfg.moe_intermediate_size
    if mx:
        return mxfp4.blob_bytes(2 * inter, H), mxfp4.blob_bytes(H, inter)
    return 2 * inter * H * 2, H * inter * 2


class MoEKernels:
    """moe.cu's and moe_gemm.cu's kernels, compiled and prepared (``launch.Kernel``)."""

    def __init__(self, cache_dir: str = "", mx: bool = False, mx_defines: tuple = (),
                 mx_tiles: bool = MX_PREFILL_TILES) -> None:  # fmt: skip
        import pycuda.driver as cuda

        T = MOE_THREADS
        d = (("MOE_THREADS", MOE_THREADS),)
        self.mx_tiles = mx and mx_tiles  # the grouped GEMMs read MXFP4 blobs (else bf16: the scratch)
        m, g = module("moe", d, cache_dir), module("moe_gemm", d + (("MOE_MX", 1),) * self.mx_tiles, cache_dir)
        mx_d = dict(MX_DEFINES, **dict(mx_defines))
        v = module("moe_gemv", d + (("MOE_MX", 1), *mx_d.items()) if mx else d, cache_dir)  # mx: they read MXFP4
        self.mx = mx
        self.down_rows = 16 if mx and mx_d["MX_DOWN_SPLIT"] else DOWN_ROWS  # moe_down's output rows a block
        self.mx_dequant = self.mx_pack = None
        if mx:
            self.mx_dequant = Kernel(v, "moe_mx_dequant", "pool:ptr stride:i64 slot_of:ptr N:i32 K:i32 out:ptr", T)
            self.mx_pack = Kernel(v, "moe_mx_pack", "blocks:ptr scales:ptr N:i32 G:i32 gu:i32 dst:ptr stride:i64", T)
        self.router = Kernel(m, "moe_router", "x:ptr ss_in:ptr ss_nparts:i32 eps:f32 W:ptr bias:ptr bias_ld:i32 logits:ptr "
                             "M:i32 E:i32 K:i32 done:ptr k:i32 normalize:i32 ids:ptr weights:ptr grp:ptr tmax:i32", T)  # fmt: skip
        self.route = Kernel(m, "moe_route", "logits:ptr M:i32 E:i32 k:i32 normalize:i32 ids:ptr weights:ptr grp:ptr "
                            "tmax:i32", 1024)  # fmt: skip
        self.gate_up = Kernel(v, "moe_gate_up", "x:ptr ss_in:ptr ss_nparts:i32 eps:f32 pool:ptr stride:i64 "
                              "slot_of:ptr bias:ptr grp:ptr E:i32 tmax:i32 k:i32 N:i32 K:i32 act:ptr oai:i32 "
                              "limit:f32", T)  # fmt: skip
        self.down = Kernel(v, "moe_down", "act:ptr pool:ptr stride:i64 slot_of:ptr bias:ptr grp:ptr E:i32 tmax:i32 "
                           "N:i32 K:i32 y:ptr done:ptr weights:ptr k:i32 M:i32 x:ptr nw:ptr xw:ptr ss_out:ptr", T)  # fmt: skip
        self.combine = Kernel(m, "moe_combine", "y:ptr weights:ptr k:i32 x:ptr H:i32 nw:ptr xw:ptr ss_out:ptr", T)
        head = "A:ptr a_div:i32 pool:ptr stride:i64 slot_of:ptr bias:ptr grp:ptr tiles:ptr pairs:ptr N:i32 K:i32 "
        self.gemm_gu = Kernel(g, "moe_gemm_gu", head + "act:ptr oai:i32 limit:f32", T, shared=MOE_GEMM_SMEM)
        self.gemm_down = Kernel(g, "moe_gemm_down", head + "y:ptr", T, shared=MOE_GEMM_SMEM)
        for kern in (self.gemm_gu, self.gemm_down):
            kern.fn.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, MOE_GEMM_SMEM)


def check_moe(op: MoE, cfg: ModelConfig, mx: bool = False) -> None:
    """Refuse, naming the field, what these kernels cannot run."""
    if not 1 <= op.num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts {op.num_experts} not supported (1..{MAX_EXPERTS})")
    if not 1 <= op.top_k <= min(MAX_TOP_K, op.num_experts):
        raise ValueError(f"num_experts_per_tok {op.top_k} not supported (1..{min(MAX_TOP_K, op.num_experts)})")
    if op.act not in ACTS:
        raise ValueError(f"MoE act {op.act!r} not supported ({', '.join(ACTS)})")
    if cfg.hidden_size % 8 or cfg.moe_intermediate_size % 8:
        raise ValueError("hidden_size and moe_intermediate_size must be multiples of 8")
    if mx and (cfg.hidden_size % 32 or cfg.moe_intermediate_size % 32):
        raise ValueError("MXFP4 experts: hidden_size and moe_intermediate_size must be multiples of 32")
    if cfg.hidden_size > MAX_ROUTER_K:
        raise ValueError(f"hidden_size {cfg.hidden_size} not supported by the router GEMV (<= {MAX_ROUTER_K})")


class DeviceMoE:
    """Runs layer ``i``'s MoE on ``stream``-ordered launches; ``layers[i]`` from ``expert_cache.upload_moe``."""

    def __init__(self, cfg: ModelConfig, op: MoE, kern: MoEKernels, layers: list[MoELayer], ws: MoEWorkspace,
                 cache=None) -> None:  # fmt: skip
        self.mx = bool(layers) and layers[0].mx
        check_moe(op, cfg, self.mx)
        self.cfg, self.op, self.kern, self.layers, self.ws, self.cache = cfg, op, kern, layers, ws, cache
        self.hidden, self.inter = cfg.hidden_size, cfg.moe_intermediate_size
        if self.mx and not (kern.mx and (kern.mx_tiles or ws.mx_scratch)):
            raise ValueError("MXFP4 experts need MoEKernels(mx=True) and, without its mx_tiles, a scratch")
        # an expert's gate|up and down in its pool: MXFP4 blob bytes, or bf16 elements
        self.strides = tuple(b if self.mx else b // 2 for b in expert_bytes(cfg, self.mx))
        self.oai, self.limit = ACTS[op.act], float("inf") if op.swiglu_limit is None else float(op.swiglu_limit)
        # prefill chunks of up to this many rows run ``decode`` (bf16 experts: never, unmeasured)
        self.prefill_as_decode = MX_PREFILL_AS_DECODE if self.mx else 0
        self._hdr = None
        if cache is not None:
            import pycuda.driver as cuda

            self._hdr = cuda.pagelocked_empty(2 + op.num_experts, np.int32)

    @property
    def graph_safe(self) -> bool:
        """Whether a round may be captured: only with every expert resident (no readback)."""
        return self.cache is None

    def _route(self, s, i: int, x: int, rows: int, ss_in: tuple[int, int], eps: float) -> None:
        """Router GEMV, then routing and grouping: in the router's last block for decode rounds (one
        launch), a 1024-thread moe_route for prefill chunks (rows spread over 32 warps)."""
        k, ws, L, E, op = self.kern, self.ws, self.layers[i], self.op.num_experts, self.op
        if not 1 <= rows <= ws.max_rows:
            raise ValueError(f"{rows} rows: the MoE workspace holds 1..{ws.max_rows}")
        fused = rows <= MAX_DECODE_ROWS
        route = dict(k=op.top_k, normalize=int(op.norm_topk_prob), ids=ws.ids, weights=ws.weights, grp=ws.grp,
                     tmax=ws.tmax)  # fmt: skip
        k.router(s, (-(-E // 8), rows), x=x, ss_in=ss_in[0], ss_nparts=ss_in[1], eps=eps, W=L.router,
                 bias=L.router_bias, bias_ld=L.router_bias_ld, logits=ws.logits, M=rows, E=E, K=self.hidden,
                 done=ws.done if fused else 0, **route)  # fmt: skip
        if not fused:
            k.route(s, (1,), logits=ws.logits, M=rows, E=E, **route)
        if self.cache is not None:  # the one sync: which experts this layer's round needs
            import pycuda.driver as cuda

            cuda.memcpy_dtoh_async(self._hdr, ws.grp, s)
            s.synchronize()
            n = int(self._hdr[0])
            self.cache.ensure(s, i, self._hdr[2 : 2 + n])

    def decode(self, s, i: int, xn: int, x: int, rows: int, ss_in: tuple[int, int] = (0, 0), eps: float = 0.0,
               norm_out: tuple[int, int, int] = (0, 0, 0)) -> int:  # fmt: skip
        """x[rows, H] += MoE(xn) for a decode round (1..64 rows). ``xn`` bf16 [rows, H]; with ``ss_in``
        = (partials, count per row) it holds bf16(h * norm weight) and each row is scaled by its RMSNorm
        (gemv.cu's fused norm). ``norm_out`` = (next norm weight, xw, ss_out): also writes the next
        RMSNorm's inputs. Returns the ss partials per row written (ceil(H / 128)) or 0."""
        k, ws, L, op, E, H, inter = self.kern, self.ws, self.layers[i], self.op, self.op.num_experts, self.hidden, self.inter  # fmt: skip
        if rows > MAX_DECODE_ROWS:
            raise ValueError(f"decode rounds of 1..{MAX_DECODE_ROWS} rows, got {rows}")
        self._route(s, i, xn, rows, ss_in, eps)
        groups = min(E, rows * op.top_k)
        k.gate_up(s, (2 * inter // 16, groups), x=xn, ss_in=ss_in[0], ss_nparts=ss_in[1], eps=eps, pool=L.gu_pool,
                  stride=self.strides[0], slot_of=L.slot_of, bias=L.gu_bias, grp=ws.grp, E=E, tmax=ws.tmax,
                  k=op.top_k, N=2 * inter, K=H, act=ws.act, oai=self.oai, limit=self.limit)  # fmt: skip
        nw, xw, ss = norm_out
        k.down(s, (-(-H // k.down_rows), groups), act=ws.act, pool=L.down_pool, stride=self.strides[1], slot_of=L.slot_of,
               bias=L.down_bias, grp=ws.grp, E=E, tmax=ws.tmax, N=H, K=inter, y=ws.y, done=ws.tile_done,
               weights=ws.weights, k=op.top_k, M=rows, x=x, nw=nw, xw=xw, ss_out=ss)  # fmt: skip
        return -(-H // DOWN_ROWS) if nw else 0

    def prefill(self, s, i: int, xn: int, x: int, rows: int) -> None:
        """x[rows, H] += MoE(xn) for a prefill chunk, ``xn`` bf16 [rows, H] already normalised."""
        if rows <= self.prefill_as_decode:
            self.decode(s, i, xn, x, rows)
            return
        k, ws, L, op, E, H, inter = self.kern, self.ws, self.layers[i], self.op, self.op.num_experts, self.hidden, self.inter  # fmt: skip
        self._route(s, i, xn, rows, (0, 0), 0.0)
        P = rows * op.top_k
        tiles = -(-P // 128) + min(E, P)
        common = dict(grp=ws.grp, tiles=ws.tiles, pairs=ws.pairs)
        gu_pool, down_pool, slot_of, strides = L.gu_pool, L.down_pool, L.slot_of, self.strides
        scratch = self.mx and not k.mx_tiles
        if scratch:  # every expert of the layer as bf16 in the scratch, expert e at e
            gu_pool, down_pool, slot_of = ws.mx_scratch, ws.mx_scratch, ws.ident
            strides = tuple(b // 2 for b in expert_bytes(self.cfg))  # bf16 experts' elements
            self._dequant(s, L.gu_pool, self.strides[0], L.slot_of, 2 * inter, H)
        k.gemm_gu(s, (tiles, -(-2 * inter // 128)), A=xn, a_div=op.top_k, pool=gu_pool, stride=strides[0],
                  slot_of=slot_of, bias=L.gu_bias, N=2 * inter, K=H, act=ws.act, oai=self.oai, limit=self.limit,
                  **common)  # fmt: skip
        if scratch:
            self._dequant(s, L.down_pool, self.strides[1], L.slot_of, H, inter)
        k.gemm_down(s, (tiles, -(-H // 128)), A=ws.act, a_div=1, pool=down_pool, stride=strides[1], slot_of=slot_of,
                    bias=L.down_bias, N=H, K=inter, y=ws.y, **common)  # fmt: skip
        self.kern.combine(s, (-(-H // COMBINE_COLS), rows), y=ws.y, weights=ws.weights, k=op.top_k, x=x, H=H, nw=0,
                          xw=0, ss_out=0)  # fmt: skip

    def _dequant(self, s, pool: int, stride: int, slot_of: int, N: int, K: int) -> None:
        """The layer's experts' N x K MXFP4 blobs -> bf16 [E, N, K] in the scratch."""
        words = N * mxfp4.padded_k(K) // 8
        self.kern.mx_dequant(s, (min(-(-words // MOE_THREADS), 1024), self.op.num_experts), pool=pool, stride=stride,
                             slot_of=slot_of, N=N, K=K, out=self.ws.mx_scratch)  # fmt: skip
