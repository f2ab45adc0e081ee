"""The model's weights on the device, in the layouts the kernels read.

bf16 (biases fp32), torch ``[out, in]``; a GGUF matrix the loader kept as stored
(``QuantizedTensor``, the block types of ``engine.cu.quant.QUANT_FORMATS``) stays in its
blocks, every row as the file holds it (row permutations below move whole rows of
blocks). An fp8 matrix (``engine.loaders.fp8.Fp8Tensor``) stays as e4m3 bytes followed by its
fp32 scales: per output channel (format ``FP8``) or, for 128 x 128 tile scales, a row of
scales for each row, one a 128 columns (``FP8B``: each tile's scale repeated over its rows, 3% of
the bytes at K 4096); the row permutations move a row's scales with it. Each matrix is an ``engine.cu.quant.Matrix``:
parts of one format each (a fused q|k|v whose v has another block type than q and k is two
parts; a fused gate|up whose halves differ, or whose parts mix blocks and floats, is
dequantized to bf16 instead). The embedding table is bf16 (a quantized one is dequantized; a tied LM head then keeps
the blocks as its own matrix). q|k|v are fused into one matrix with each
head's rows rope-interleaved in 8-row groups (``interleave_rope``) and gate|up into one
matrix interleaved in 8-row groups (``interleave_gate_up``; plain gate-then-up when
I % 8 != 0), so a decode GEMV block holds both members of its rope pairs or matching
gate and up rows and applies rope or SwiGLU in its epilogue (with partial rotary only a
head's first ``rotary_dim`` rows are interleaved). RMSNorm weights with ``plus_one``
(gemma) are uploaded as ``1 + w``, so every norm kernel reads a plain scale. Each layer
carries what its ``Block`` needs (per-layer rope tables, q/k norms, post-norms, o bias,
sinks); ropes shared by several layers are uploaded once. A tied LM head is the
embedding. Weights arrive as the interface says: canonical (HF llama) names, float32
numpy arrays; torch tensors are accepted too (already-on-GPU ones are copied device
to device).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from engine.cu.kernels import AttnArgs, attention_scales
from engine.cu.quant import FP8, FP8_BLOCK, FP8B, QUANT_FORMATS, Matrix, Part
from engine.loaders import bf16
from engine.loaders.bf16 import is_bf16
from engine.loaders.fp8 import Fp8Tensor
from engine.loaders.gguf import QuantizedTensor
from engine.loaders.mxfp4 import Mxfp4Tensor
from engine.model_config import ModelConfig
from engine.models.ops import Block, Head, MoE, MRope, RMSNorm, Rope


@dataclass
class Layer:
    """Device addresses of one decoder layer's tensors, and the options its kernels take."""

    block: Block
    ln1: int
    ln2: int
    qkv: Matrix
    qkv_bias: int  # 0 when the model has none
    o: Matrix
    o_bias: int  # fp32 [hidden] or 0
    gate_up: Matrix | int  # 0 in a sparse layer
    down: Matrix | int
    inv_freq: int  # fp32 [rotary_dim / 2], this layer's rope (0 without rope)
    rope_factor: float  # multiplies cos and sin (rope_tables' attention factor)
    rotary_dim: int  # dims of each head rotated (0: no rope)
    q_norm: int  # bf16 [head_dim] or 0 (QKNorm)
    k_norm: int
    attn_post_norm: int  # bf16 [hidden] or 0
    mlp_post_norm: int
    attn: AttnArgs  # scale, soft-cap, window, sinks
    mrope: tuple[int, int] = (0, 0)  # multimodal rope: cumulative pair bounds of its first two runs (rope.cu)


@dataclass
class DeviceWeights:
    embed: int
    lm_head: Matrix
    final_norm: int
    layers: list[Layer]
    gate_up_interleaved: bool
    nbytes: int  # weight bytes uploaded, as stored (a tied head counts once, or twice when it keeps blocks)
    embed_scale: float = 1.0
    head_softcap: float | None = None

    @property
    def quantized(self) -> bool:
        """Whether a layer matrix is in blocks (prefill then needs the dequant scratch)."""
        mats = [m for L in self.layers for m in (L.qkv, L.o, L.gate_up, L.down) if isinstance(m, Matrix)]
        return any(f != "bf16" for m in mats for f in m.formats)

    @property
    def quant_k(self) -> int:
        """The largest K of a matrix with a part in a block format (lm_head too; 0: none)."""
        mats = [m for L in self.layers for m in (L.qkv, L.o, L.gate_up, L.down) if isinstance(m, Matrix)]
        mats.append(self.lm_head)
        return max((m.k for m in mats if isinstance(m, Matrix) and m.formats != ("bf16",)), default=0)


def upload(cfg: ModelConfig, blocks: list[Block], head: Head, weights, mem, embed_scale: float = 1.0,
           kern=None, pinned: bool = False) -> DeviceWeights:  # fmt: skip
    """Copy ``weights`` to the device through ``mem`` (``runtime.Allocations``); every layer's tensor
    names and options come from the definition's ``blocks`` (one per layer) and ``head``. ``kern``
    (``Kernels``): a quantized embedding table is dequantized on the device (else on the host).
    ``pinned``: bf16 tensors kept as stored go up through pinned staging buffers
    (engine/backends/cuda/pinned.py), the same bytes at the same addresses as the direct path."""
    copier = None
    if pinned and any(is_bf16(w) for w in weights.values()):
        from engine.backends.cuda.pinned import PinnedCopier

        copier = PinnedCopier()
    up = _Uploader(weights, mem, copier)
    ok = False
    try:
        out = _upload(cfg, blocks, head, weights, up, mem, embed_scale, kern)
        ok = True
    finally:
        if copier is not None:
            copier.close(send=ok)
    return out


def _upload(cfg: ModelConfig, blocks: list[Block], head: Head, weights, up, mem, embed_scale: float,
            kern) -> DeviceWeights:  # fmt: skip
    interleaved = cfg.intermediate_size % 8 == 0
    table = weights["model.embed_tokens.weight"]
    quant_table = isinstance(table, QuantizedTensor) and table.type_name in QUANT_FORMATS
    tied_blocks = up.matrix(["model.embed_tokens.weight"]) if quant_table and cfg.tie_word_embeddings else None
    if quant_table and kern is not None:
        embed = _dequantized_table(table, tied_blocks, mem, kern)
        up.nbytes += 2 * table.shape[0] * table.shape[1]
    else:
        embed = up(["model.embed_tokens.weight"])
    if not cfg.tie_word_embeddings:
        lm_head = up.matrix(["lm_head.weight"])
    elif tied_blocks is not None:  # the LM head reads the blocks, beside the bf16 table
        lm_head = tied_blocks
    else:
        lm_head = Matrix.bf16(embed, cfg.vocab_size, cfg.hidden_size)
    final_norm = up.norm(head.final_norm)
    ropes: dict[Rope, tuple[int, float]] = {}
    layers = [_layer(cfg, i, b, up, ropes, interleaved) for i, b in enumerate(blocks)]
    return DeviceWeights(embed=embed, lm_head=lm_head, final_norm=final_norm, layers=layers,
                         gate_up_interleaved=interleaved, nbytes=up.nbytes, embed_scale=embed_scale,
                         head_softcap=head.softcap)  # fmt: skip


def _dequantized_table(table: QuantizedTensor, blocks: Matrix | None, mem, kern) -> int:
    """The bf16 embedding table from its blocks, dequantized on the device (``blocks``: already there,
    the tied LM head's; else uploaded to a buffer freed here)."""
    import pycuda.driver as cuda

    rows, k = table.shape
    out = mem.alloc(2 * rows * k)
    tmp = None
    if blocks is None:
        tmp = cuda.to_device(np.ascontiguousarray(table.data))
    kern.quant(table.type_name).dequantize(None, int(tmp) if tmp is not None else blocks.ptr, out, rows, k)
    cuda.Context.synchronize()
    if tmp is not None:
        tmp.free()
    return out


def _layer(cfg: ModelConfig, i: int, block: Block, up, ropes: dict, interleaved: bool) -> Layer:
    import pycuda.driver as cuda

    from engine.models.rope import rope_tables

    p, d, attn = f"model.layers.{i}.", cfg.head_dim, block.attention
    rope = attn.rope
    rd = 0 if rope is None else rope.rotary_dim or d
    if rope is not None and rope not in ropes:
        inv, factor = rope_tables(cfg, rope)
        inv = np.ascontiguousarray(inv, dtype=np.float32)
        ptr = up.mem.alloc(inv.nbytes)
        cuda.memcpy_htod(ptr, inv)
        ropes[rope] = (ptr, float(factor))
    inv_freq, factor = ropes[rope] if rope is not None else (0, 1.0)
    proj = [p + f"self_attn.{x}_proj." for x in "qkv"]
    qk = attn.qk_norm

    def norm(op: RMSNorm | None) -> int:
        return 0 if op is None else up.norm(op, p)

    scale_log2, cap_log2 = attention_scales(d, attn.scale, attn.softcap)
    sinks = up([p + "self_attn.sinks"], fp32=True) if attn.sinks else 0
    sparse = isinstance(block.mlp, MoE)
    return Layer(
        block=block,
        ln1=norm(block.attn_norm),
        ln2=norm(block.mlp_norm),
        qkv=up.matrix([x + "weight" for x in proj], rope_dim=d, rotary_dim=rd),
        qkv_bias=up([x + "bias" for x in proj], fp32=True, rope_dim=d, rotary_dim=rd) if attn.qkv_bias else 0,
        o=up.matrix([p + "self_attn.o_proj.weight"]),
        o_bias=up([p + "self_attn.o_proj.bias"], fp32=True) if attn.o_bias else 0,
        # A sparse layer's experts are uploaded by expert_cache.upload_moe.
        gate_up=0
        if sparse
        else up.matrix([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], interleave=interleaved),  # fmt: skip
        down=0 if sparse else up.matrix([p + "mlp.down_proj.weight"]),
        inv_freq=inv_freq,
        rope_factor=factor,
        rotary_dim=rd,
        q_norm=norm(None if qk is None else RMSNorm(qk.q_weight, qk.plus_one)),
        k_norm=norm(None if qk is None else RMSNorm(qk.k_weight, qk.plus_one)),
        attn_post_norm=norm(block.attn_post_norm),
        mlp_post_norm=norm(block.mlp_post_norm),
        attn=AttnArgs(scale_log2, cap_log2, attn.sliding_window or 0, sinks),
        mrope=(rope.section[0], rope.section[0] + rope.section[1]) if isinstance(rope, MRope) else (0, 0),
    )


class _Uploader:
    def __init__(self, weights, mem, copier=None) -> None:
        self.weights, self.mem, self.nbytes = weights, mem, 0
        self.copier = copier  # pinned.PinnedCopier, for bf16 kept as stored (None: every tensor direct)

    def norm(self, op: RMSNorm, prefix: str = "") -> int:
        """An RMSNorm's weight (bf16), ``1 + w`` for ``plus_one``."""
        return self([prefix + op.weight + ".weight"], plus_one=op.plus_one)

    def __call__(self, names: list[str], fp32: bool = False, interleave: bool = False, rope_dim: int = 0,
                 rotary_dim: int | None = None, plus_one: bool = False) -> int:  # fmt: skip
        """Upload tensors ``names`` concatenated along dim 0 as bf16 (fp32 for biases); with
        ``interleave`` the two (gate, up) are interleaved in 8-row groups instead; with ``rope_dim``
        each part's heads (of ``rope_dim`` rows) are rope-interleaved over their first ``rotary_dim``
        rows (None: all); ``plus_one``: upload ``1 + w`` (computed in float32)."""
        import pycuda.driver as cuda

        # bf16 kept as stored goes up as its bits (to_bf16) unless it is computed on first.
        parts = [self.weights[n] for n in names]
        if self.copier is not None and not (fp32 or plus_one):
            from engine.backends.cuda.pinned import runs

            staged = runs(parts, interleave, rope_dim, rotary_dim)
            if staged is not None and self.copier.fits(staged):
                nbytes = sum(r.units * r.unit_bytes for r in staged)
                dst = self.mem.alloc(nbytes)
                self.nbytes += nbytes
                self.copier.put(dst, staged)
                return dst
        parts = [p if is_bf16(p) and not (fp32 or plus_one) else dequantized(p) for p in parts]
        if plus_one:
            parts = [(p.float() if _is_torch(p) else np.asarray(p, np.float32)) + 1.0 for p in parts]
        if rope_dim:
            parts = [interleave_rope(p, rope_dim, rotary_dim) for p in parts]
        if interleave:
            parts = [interleave_gate_up(*parts)]
        nbytes = sum(int(np.prod(p.shape)) for p in parts) * (4 if fp32 else 2)
        dst = self.mem.alloc(nbytes)
        self.nbytes += nbytes
        off = 0
        for p in parts:
            if _is_torch(p):
                import torch

                t = p.detach().to(torch.float32 if fp32 else torch.bfloat16).contiguous()
                if t.is_cuda:
                    torch.cuda.synchronize()
                    cuda.memcpy_dtod(dst + off, t.data_ptr(), t.numel() * t.element_size())
                else:
                    cuda.memcpy_htod(dst + off, t.view(torch.int32 if fp32 else torch.int16).numpy())
                off += t.numel() * t.element_size()
            else:
                a = np.ascontiguousarray(p, dtype=np.float32) if fp32 else to_bf16(p)
                cuda.memcpy_htod(dst + off, a)
                off += a.nbytes
        return dst

    def matrix(self, names: list[str], interleave: bool = False, rope_dim: int = 0,
               rotary_dim: int | None = None) -> Matrix:  # fmt: skip
        """Tensors ``names`` stacked along the rows as one weight matrix (``interleave``, ``rope_dim``,
        ``rotary_dim`` as ``__call__``): quantized parts stay in their blocks (the row permutations
        move rows of blocks), one ``Part`` per run of one block type; bf16 otherwise (see the module
        docstring for when a quantized matrix is dequantized)."""
        import pycuda.driver as cuda

        parts = [self.weights[n] for n in names]
        k = int(parts[0].shape[1])
        if all(isinstance(p, Fp8Tensor) for p in parts) and fp8_readable(parts):
            return self._fp8(parts, k, interleave, rope_dim, rotary_dim)
        # Anything else (fp8 of other block sizes, or parts of both fp8 kinds) goes up as bf16.
        if not _keeps_blocks(parts, interleave):
            return Matrix.bf16(self(names, interleave=interleave, rope_dim=rope_dim, rotary_dim=rotary_dim),
                               sum(int(p.shape[0]) for p in parts), k)  # fmt: skip
        raws = [np.asarray(p.data, dtype=np.uint8) for p in parts]
        if rope_dim:
            raws = [interleave_rope(r, rope_dim, rotary_dim) for r in raws]
        types = [p.type_name for p in parts]
        if interleave:
            raws, types = [interleave_gate_up(*raws)], types[:1]
        runs: list[tuple[str, list[np.ndarray]]] = []
        for t, r in zip(types, raws):
            if runs and runs[-1][0] == t:
                runs[-1][1].append(r)
            else:
                runs.append((t, [r]))
        out = []
        for t, rs in runs:
            a = np.ascontiguousarray(np.concatenate(rs) if len(rs) > 1 else rs[0])
            dst = self.mem.alloc(a.nbytes)
            cuda.memcpy_htod(dst, a)
            self.nbytes += a.nbytes
            out.append(Part(int(dst), t, a.shape[0]))
        return Matrix(tuple(out), k)

    def _fp8(self, parts: list[Fp8Tensor], k: int, interleave: bool, rope_dim: int,
             rotary_dim: int | None) -> Matrix:  # fmt: skip
        """fp8 ``parts`` as one ``FP8`` / ``FP8B`` part (``fp8_part``)."""
        import pycuda.driver as cuda

        fmt, a, sc = fp8_part(parts, interleave, rope_dim, rotary_dim)
        dst = self.mem.alloc(a.nbytes + sc.nbytes)
        cuda.memcpy_htod(dst, a)
        cuda.memcpy_htod(int(dst) + a.nbytes, sc)
        self.nbytes += a.nbytes + sc.nbytes
        return Matrix((Part(int(dst), fmt, a.shape[0]),), k)


def fp8_part(parts: list[Fp8Tensor], interleave: bool = False, rope_dim: int = 0,
             rotary_dim: int | None = None) -> tuple[str, np.ndarray, np.ndarray]:  # fmt: skip
    """(format, e4m3 bytes [rows, k], fp32 scales) of fp8 ``parts`` stacked along the rows as gemv_q.cu
    reads them: ``FP8`` with a scale a row, ``FP8B`` with a row of ceil(k / 128) scales a row (a
    128 x 128 tile's scale on each of its rows); ``interleave`` / ``rope_dim`` permute the scales' rows
    with the bytes'."""
    check_fp8(parts)
    fmt = FP8 if parts[0].block is None else FP8B
    data = [p.data for p in parts]
    if fmt == FP8:
        scale = [p.scale.reshape(-1, 1) for p in parts]
    else:
        scale = [np.repeat(p.scale, FP8_BLOCK, axis=0)[: p.shape[0]] for p in parts]
    if rope_dim:
        data = [interleave_rope(d, rope_dim, rotary_dim) for d in data]
        scale = [interleave_rope(s, rope_dim, rotary_dim) for s in scale]
    if interleave:
        data, scale = [interleave_gate_up(*data)], [interleave_gate_up(*scale)]
    a = np.ascontiguousarray(np.concatenate(data))
    return fmt, a, np.ascontiguousarray(np.concatenate(scale).reshape(-1), dtype=np.float32)


def fp8_readable(parts) -> bool:
    """Whether gemv_q.cu reads these fp8 matrices as stored (see ``check_fp8``)."""
    try:
        check_fp8(parts)
    except ValueError:
        return False
    return True


def check_fp8(parts) -> None:
    """ValueError unless the fp8 matrices all have per-output-channel scales or all 128 x 128 tile scales,
    and K % 16 == 0 (gemv_q.cu)."""
    for p in parts:
        if p.block not in (None, FP8_BLOCK):
            raise ValueError(f"fp8 weights with {p.block}x{p.block} block scales: the cuda backend reads "
                             f"per-output-channel or {FP8_BLOCK}x{FP8_BLOCK} scales only (set model.weight_format "
                             "bf16 to load them as bf16)")  # fmt: skip
        if p.block != parts[0].block:
            raise ValueError("fp8 weights fused into one matrix with both per-channel and block scales")
        if p.shape[1] % 16:
            raise ValueError(f"fp8 weights of {p.shape[1]} columns: the cuda backend needs a multiple of 16")


def quant_formats(weights) -> tuple[str, ...]:
    """The formats of ``weights``' quantized matrices that gemv_q.cu reads (compiled at load)."""
    found = {w.type_name for w in weights.values() if isinstance(w, QuantizedTensor)}
    kinds = {w.block for w in weights.values() if isinstance(w, Fp8Tensor)}
    fp8 = {FP8} if None in kinds else set()
    fp8 |= {FP8B} if FP8_BLOCK in kinds else set()
    return tuple(sorted(found & set(QUANT_FORMATS) | fp8))


class Dequantized(Mapping):
    """``weights`` with every ``QuantizedTensor`` read as float32 (for code that uploads bf16 only)."""

    def __init__(self, weights) -> None:
        self.weights = weights

    def __getitem__(self, name: str):
        return dequantized(self.weights[name])

    def __iter__(self):
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


def _keeps_blocks(parts: list, interleave: bool) -> bool:
    """Whether a fused matrix of ``parts`` stays in blocks: every part quantized in a format gemv_q.cu
    reads, and for gate|up (``interleave``) one format for both."""
    if not all(isinstance(p, QuantizedTensor) and p.type_name in QUANT_FORMATS for p in parts):
        return False
    return not interleave or len({p.type for p in parts}) == 1


def dequantized(w):
    """A weight as float32 numpy (a ``QuantizedTensor`` through gguf's dequantize, an ``Fp8Tensor`` or
    ``Mxfp4Tensor`` through its own, bf16 kept as stored widened); others as they are."""
    if isinstance(w, (Fp8Tensor, Mxfp4Tensor)):
        return w.dequantize()
    if is_bf16(w):
        return bf16.to_float32(w)
    if not isinstance(w, QuantizedTensor):
        return w
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return np.asarray(dequantize(np.asarray(w.data), GGMLQuantizationType(w.type)), np.float32).reshape(w.shape)


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def interleave_gate_up(gate, up):
    """[I, K] gate and up -> [2I, K] in 8-row groups (gate 8j..8j+7, then up 8j..8j+7), the layout
    ``Kernels.gate_up_act`` and ``swiglu(interleaved=True)`` read. Works on numpy arrays and torch tensors."""
    i, k = gate.shape
    if _is_torch(gate):
        import torch

        return torch.stack([gate.reshape(i // 8, 8, k), up.reshape(i // 8, 8, k)], 1).reshape(2 * i, k)
    return np.stack([gate.reshape(i // 8, 8, k), up.reshape(i // 8, 8, k)], 1).reshape(2 * i, k)


def interleave_rope(w, head_dim: int, rotary_dim: int | None = None):
    """Rows (dim 0) of stacked heads of ``head_dim`` -> each head in the rope-interleaved order
    gemv_tc_rope and ``rope_kv_write(interleaved=True)`` read: over the first R = ``rotary_dim``
    rows (None: all), position 16j + r holds dim 8j + r, position 16j + 8 + r dim R/2 + 8j + r;
    rows R.. stay in place (partial rotary). Works on numpy arrays and torch tensors (weights
    [rows, K] or biases [rows])."""
    n, rest = w.shape[0], tuple(w.shape[1:])
    rd = head_dim if rotary_dim is None else rotary_dim
    if head_dim % 16 or n % head_dim or rd % 16 or not 0 <= rd <= head_dim:
        raise ValueError(f"{n} rows are not whole heads of {head_dim} rotating {rd} (multiples of 16)")
    torch_in = _is_torch(w)
    if rd == 0:
        return w
    if rd < head_dim:
        heads = w.reshape((n // head_dim, head_dim) + rest)
        rot = interleave_rope(heads[:, :rd].reshape((-1,) + rest), rd).reshape((n // head_dim, rd) + rest)
        if torch_in:
            import torch

            return torch.cat([rot, heads[:, rd:]], 1).reshape(w.shape)
        return np.concatenate([rot, heads[:, rd:]], 1).reshape(w.shape)
    v = w.reshape((n // head_dim, 2, head_dim // 16, 8) + rest)
    return (v.transpose(1, 2) if torch_in else v.swapaxes(1, 2)).reshape(w.shape)


def to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even; bf16 kept as stored -> its bits."""
    if is_bf16(a):
        return bf16.bits(a)
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def from_bf16(b: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> float32."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
