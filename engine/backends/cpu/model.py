"""A loaded model as the C kernels see it: block matrices, norms and the ``ig_model`` struct.

Weights arrive from the loader either as stored (``QuantizedTensor``: Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, Q6_K rows, kept as they are: ``KEPT_TYPES``) or
as float32 arrays (safetensors, a GGUF's F16 / BF16 / F32 matrices and its other block
types, Q2_K among them), which are quantized once at load to Q8_0: 34 bytes
a block of 32 (8.5 bits a weight) and the closest to float32 of the kept types, so
a float checkpoint loses the least.

The amx build's tile products read each matrix of a tile type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
Q4_K, Q5_K) from a second copy made at load (``ig_amx_repack``: the weight tiles' int8 bytes in
VNNI order and the scales as floats: 2.0x the stored Q4_0 / Q4_1 bytes, 1.06x Q8_0's, 1.6-2.2x
the others'), while one- and two-row products keep reading the stored bytes; copies are made
while their total fits :func:`repack_budget`, the matrices after that are unpacked at every
product instead (the same bits either way).

Only the llama-family block runs here (llama, mistral, qwen2): RMSNorm, neox
rope (one rope for every layer), attention with optional q/k/v biases and
sliding windows, SwiGLU, an unscaled embedding and a head without softcap.
:func:`check_supported` refuses everything else before a weight is touched.
"""

from __future__ import annotations

import math

import numpy as np

from engine.loaders.gguf import BLOCK_TYPES, STORED_TYPES, QuantizedTensor
from engine.model_config import ModelConfig
from engine.models import definition
from engine.models.ops import Attention, Block, GatedMLP, Head, RMSNorm
from engine.models.rope import rope_tables

from ..numpy import ops

QK = 32
# The block types kernels.c reads (kernels.h's IG_*): GGML type id -> (values a block, bytes a block).
KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
BLOCKS = {BLOCK_TYPES[n][0]: BLOCK_TYPES[n][1:] for n in KEPT_TYPES}
MAX_HEAD_DIM = 256  # kernels.c keeps one scaled query head on the stack


def repack_budget() -> int:
    """Bytes the amx build's repacked copies may take: half the memory available at load."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return 0


def check_supported(cfg: ModelConfig, blocks: list[Block], head: Head) -> None:
    """Refuse, naming what, a model that is not the plain llama-family block."""
    bad: list[str] = []
    for b in blocks:
        a = b.attention
        if not all(isinstance(n, RMSNorm) for n in (b.attn_norm, b.mlp_norm)):
            bad.append("a norm other than RMSNorm")
        if b.attn_post_norm is not None or b.mlp_post_norm is not None:
            bad.append("post-norms")
        if b.residual != "pre_norm":
            bad.append(f"residual {b.residual!r}")
        if not isinstance(a, Attention):
            bad.append(f"attention {a!r}")
            continue
        if a.rope is None or a.rope.style != "neox":
            bad.append(f"rope {a.rope!r}")
        for field in ("qk_norm", "softcap", "o_bias", "sinks"):
            if getattr(a, field):
                bad.append(f"attention {field}")
        if not isinstance(b.mlp, GatedMLP) or b.mlp.act != "silu":
            bad.append(f"mlp {b.mlp!r}")
    if len({b.attention.rope for b in blocks if isinstance(b.attention, Attention)}) > 1:
        bad.append("a rope that differs between layers")
    if not isinstance(head.final_norm, RMSNorm) or head.softcap:
        bad.append(f"head {head!r}")
    if cfg.head_dim > MAX_HEAD_DIM:
        bad.append(f"head_dim {cfg.head_dim} > {MAX_HEAD_DIM}")
    for name in ("hidden_size", "intermediate_size"):
        if getattr(cfg, name) % QK:
            bad.append(f"{name} {getattr(cfg, name)} not a multiple of {QK}")
    if cfg.num_heads * cfg.head_dim % QK:
        bad.append(f"num_heads * head_dim {cfg.num_heads * cfg.head_dim} not a multiple of {QK}")
    if bad:
        raise NotImplementedError(f"cpu backend ({cfg.arch}): no kernel for {', '.join(dict.fromkeys(bad))}")


def as_blocks(w) -> QuantizedTensor:
    """A weight as block rows: as stored if it is, else float32 quantized to Q8_0."""
    if isinstance(w, QuantizedTensor):
        if w.type not in BLOCKS:
            raise ValueError(f"cpu backend: GGML type {w.type} has no kernel")
        return QuantizedTensor(w.type, w.shape, np.ascontiguousarray(w.data))
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % QK:
        raise ValueError(f"cpu backend: a matrix {w.shape} has no rows of whole {QK}-blocks")
    return QuantizedTensor(STORED_TYPES["Q8_0"], w.shape, quantize(w, GGMLQuantizationType.Q8_0))


def f32(w) -> np.ndarray:
    if isinstance(w, QuantizedTensor):
        raise ValueError("cpu backend: a quantized vector (norm or bias) is not supported")
    return np.ascontiguousarray(w, dtype=np.float32)


class CpuModel:
    """Weights held for the kernels, and the ``ig_model`` struct pointing at them."""

    def __init__(self, cfg: ModelConfig, weights: dict, kernels, threads: int):
        model = definition(cfg.arch)
        blocks, head = model.blocks(cfg), model.head(cfg)
        check_supported(cfg, blocks, head)
        self.cfg, self.ffi, self.lib = cfg, kernels.ffi, kernels.lib
        self._keep: list = []  # every buffer a pointer in the struct refers to
        self.repacked_bytes, self._repack_left = 0, repack_budget()
        ffi = self.ffi
        m = self.struct = ffi.new("ig_model *")
        rope = blocks[0].attention.rope
        self.inv_freq, self.rope_factor = rope_tables(cfg, rope)
        attn = blocks[0].attention
        m.num_layers, m.hidden, m.num_heads = cfg.num_layers, cfg.hidden_size, cfg.num_heads
        m.num_kv_heads, m.head_dim, m.intermediate = cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        m.vocab, m.rot_dim, m.threads = cfg.vocab_size, 2 * len(self.inv_freq), threads
        m.eps = cfg.rms_norm_eps
        m.attn_scale = 1.0 / math.sqrt(cfg.head_dim) if attn.scale is None else attn.scale
        m.embed_scale = model.embedding(cfg).scale
        self.embed = as_blocks(weights["model.embed_tokens.weight"])
        self._mat(m.embed, self.embed)
        self.lm_head = self.embed if cfg.tie_word_embeddings else as_blocks(weights["lm_head.weight"])
        self._mat(m.lm_head, self.lm_head, repack=True)
        m.final_norm = self._floats(ops.norm_weight(head.final_norm, f32(weights[head.final_norm.weight + ".weight"])))
        self.layers = ffi.new("ig_layer[]", cfg.num_layers)
        m.layers = self.layers
        self.nbytes = self.embed.nbytes + (0 if self.lm_head is self.embed else self.lm_head.nbytes)
        for i, b in enumerate(blocks):
            self._layer(self.layers[i], b, f"model.layers.{i}.", weights)

    def _floats(self, a: np.ndarray):
        a = np.ascontiguousarray(a, dtype=np.float32)
        self._keep.append(a)
        return self.ffi.cast("const float *", self.ffi.from_buffer(a))

    def _mat(self, dst, w: QuantizedTensor, repack: bool = False) -> None:
        self._keep.append(w.data)
        dst.type, (dst.rows, dst.cols) = w.type, w.shape
        dst.row_bytes = w.data.shape[1] if w.data.ndim == 2 else 0
        values, nbytes = BLOCKS[w.type]
        if w.shape[1] % values or dst.row_bytes != w.shape[1] // values * nbytes:
            raise ValueError(f"cpu backend: rows of {dst.row_bytes} B for a {w.shape} matrix of type {w.type}")
        dst.data = self.ffi.cast("const uint8_t *", self.ffi.from_buffer(w.data))
        dst.tiles = self.ffi.NULL
        ptr = self.ffi.addressof(dst)
        size = self.lib.ig_amx_repack_bytes(ptr) if repack else 0
        if 0 < size <= self._repack_left:  # a product's matrix the tiles read: its copy in their layout
            buf = np.empty(size + 64, dtype=np.uint8)
            start = -buf.ctypes.data % 64
            copy = buf[start : start + size]
            self.lib.ig_amx_repack(ptr, self.ffi.cast("uint8_t *", self.ffi.from_buffer(copy)))
            self._keep.append(buf)
            dst.tiles = self.ffi.cast("const uint8_t *", self.ffi.from_buffer(copy))
            self.repacked_bytes += size
            self._repack_left -= size

    def _layer(self, L, block: Block, p: str, weights: dict) -> None:
        attn = block.attention
        mats = {
            "qkv": [as_blocks(weights[p + f"self_attn.{x}_proj.weight"]) for x in "qkv"],
            "gate_up": [as_blocks(weights[p + f"mlp.{x}_proj.weight"]) for x in ("gate", "up")],
        }
        for field, parts in mats.items():
            for j, w in enumerate(parts):
                self._mat(getattr(L, field)[j], w, repack=True)
                self.nbytes += w.nbytes
        for field, name in (("o", "self_attn.o_proj.weight"), ("down", "mlp.down_proj.weight")):
            w = as_blocks(weights[p + name])
            self._mat(getattr(L, field), w, repack=True)
            self.nbytes += w.nbytes
        L.attn_norm = self._floats(
            ops.norm_weight(block.attn_norm, f32(weights[p + block.attn_norm.weight + ".weight"]))
        )
        L.mlp_norm = self._floats(ops.norm_weight(block.mlp_norm, f32(weights[p + block.mlp_norm.weight + ".weight"])))
        if attn.qkv_bias:
            L.qkv_bias = self._floats(np.concatenate([f32(weights[p + f"self_attn.{x}_proj.bias"]) for x in "qkv"]))
        L.window = attn.sliding_window or 0

    def set_cache(self, k: np.ndarray, v: np.ndarray) -> None:
        """Point the struct at the KV pool ``[layers, blocks, block_size, kv_heads, head_dim]`` (float16)."""
        assert k.dtype == v.dtype == np.float16
        self._cache = (k, v)
        self.struct.k_cache = self.ffi.cast("uint16_t *", self.ffi.from_buffer(k))
        self.struct.v_cache = self.ffi.cast("uint16_t *", self.ffi.from_buffer(v))
        self.struct.layer_stride = k[0].size

    def forward(self, tokens, positions: np.ndarray, write_slots: np.ndarray, ctx_slots: np.ndarray,
                row_off: np.ndarray, row_n: np.ndarray, row_p0: np.ndarray, tiled_rows: int = 0) -> np.ndarray:  # fmt: skip
        """Run every layer over the rows (see ``ig_batch`` in kernels.h); return final-normed hidden [n, H].

        ``tiled_rows``: from this many rows on, the products and the attention use the tiled kernels
        (prefill chunks; 0, decode rounds: never, so a decode row's bits never depend on its round)."""
        ffi, n = self.ffi, len(tokens)
        cos, sin = ops.rope_cos_sin(positions, self.inv_freq, self.rope_factor)
        arrays = {
            "tokens": np.asarray(tokens, dtype=np.int32),
            "positions": np.asarray(positions, dtype=np.int32),
            "cos": np.ascontiguousarray(cos.reshape(n, -1), dtype=np.float32),
            "sin": np.ascontiguousarray(sin.reshape(n, -1), dtype=np.float32),
            "write_slots": np.ascontiguousarray(write_slots, dtype=np.int64),
            "ctx_slots": np.ascontiguousarray(ctx_slots, dtype=np.int64),
            "row_ctx_off": np.ascontiguousarray(row_off, dtype=np.int32),
            "row_ctx_n": np.ascontiguousarray(row_n, dtype=np.int32),
            "row_ctx_p0": np.ascontiguousarray(row_p0, dtype=np.int32),
        }
        b = ffi.new("ig_batch *")
        b.n, b.tiled_rows = n, tiled_rows
        for name, a in arrays.items():
            setattr(b, name, ffi.cast(ffi.typeof(getattr(b, name)), ffi.from_buffer(a)))
        out = np.empty((n, self.cfg.hidden_size), dtype=np.float32)
        if self.lib.ig_forward(self.struct, b, ffi.cast("float *", ffi.from_buffer(out))) != 0:
            raise MemoryError("cpu backend: the forward's workspace could not be allocated")
        return out

    def logits(self, h: np.ndarray) -> np.ndarray:
        """``[n, vocab]`` float32 logits of final-normed rows ``h``."""
        ffi = self.ffi
        h = np.ascontiguousarray(h, dtype=np.float32)
        out = np.empty((h.shape[0], self.lm_head.shape[0]), dtype=np.float32)
        hp, op = ffi.cast("const float *", ffi.from_buffer(h)), ffi.cast("float *", ffi.from_buffer(out))
        if self.lib.ig_logits(self.struct, hp, h.shape[0], op) != 0:
            raise MemoryError("cpu backend: the logits' workspace could not be allocated")
        return out
