"""The forward pass, built from the model definition's block and head.

Each operation of the block (``engine.models.ops``) maps to kernels; a decode round
fuses them into 5 kernels a layer, a prefill chunk runs them one by one:

| operation | decode round (1..8 rows) | prefill chunk |
|---|---|---|
| RMSNorm (attn_norm) | folded into its producer (embed, down GEMV: ``norm_out``) and the q|k|v GEMV (``ss_in``) | rmsnorm |
| Attention: q|k|v (+ bias), Rope "neox", KV write | gemv_tc_rope | GEMM + rope_kv_write |
| Attention: softmax(q k^T) v | decode_attn | prefill_attn |
| Attention: o_proj, residual add | gemv_tc_acc | GEMM (accumulate) |
| RMSNorm (mlp_norm) | folded into the o GEMV and the gate|up GEMV | rmsnorm |
| GatedMLP "silu": gate|up, SwiGLU | gemv_tc_swiglu | GEMM + swiglu |
| GatedMLP: down_proj, residual add | gemv_tc_acc | GEMM (accumulate) |
| Head: final RMSNorm, LM head | folded into the last down GEMV, gemv_tc_store | rmsnorm + gemv_tc_store |

``check_supported`` refuses at load any operation (or option) without kernels here.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import ModelConfig
from engine.models.ops import Attention, Block, Embedding, GatedMLP, Head, RMSNorm, Rope

MAX_LANES = 8  # rows of one decode round (one graph per width 1..8)
PREFILL_CHUNK = 2048  # rows of one prefill chunk (activations are sized for it)


def check_supported(block: Block, head: Head) -> None:
    """Raise ValueError naming the first operation of ``block`` / ``head`` this backend has no kernels for."""

    def norm(where: str, op: RMSNorm) -> None:
        if not isinstance(op, RMSNorm) or op.plus_one:
            raise ValueError(f"the CUDA backend has no kernel for {where} = {op!r} (RMSNorm without plus_one only)")

    norm("block.attn_norm", block.attn_norm)
    norm("block.mlp_norm", block.mlp_norm)
    norm("head.final_norm", head.final_norm)
    rope = getattr(block.attention, "rope", None)
    if not isinstance(rope, Rope) or rope != Rope("neox"):
        raise ValueError(f"the CUDA backend has no kernel for attention rope {rope!r} (Rope 'neox' only)")
    attn = block.attention
    if attn != Attention(rope=rope, qkv_bias=attn.qkv_bias):
        raise ValueError(f"the CUDA backend has no kernel for block.attention = {attn!r} (plain attention only)")
    if not isinstance(block.mlp, GatedMLP) or block.mlp.act != "silu":
        raise ValueError(f"the CUDA backend has no kernel for block.mlp = {block.mlp!r} (GatedMLP 'silu' only)")
    if block.attn_post_norm is not None or block.mlp_post_norm is not None:
        raise ValueError("the CUDA backend has no kernel for post-norms (block.attn_post_norm, block.mlp_post_norm)")
    if block.residual != "pre_norm":
        raise ValueError(f"the CUDA backend has no kernel for residual {block.residual!r} ('pre_norm' only)")
    if head.softcap is not None:
        raise ValueError(f"the CUDA backend has no kernel for head.softcap = {head.softcap}")


def uniform_block(blocks: list[Block], head: Head, embedding: Embedding) -> Block:
    """The one block every layer runs (refused, naming it, where layers differ or an op has no kernel)."""
    for i, b in enumerate(blocks):
        if b != blocks[0]:
            raise ValueError(f"the CUDA backend runs layers alike only (layer {i} differs from layer 0)")
    if embedding != Embedding():
        raise ValueError(f"the CUDA backend has no kernel for embedding = {embedding!r} (unscaled only)")
    check_supported(blocks[0], head)
    return blocks[0]


@dataclass
class Workspace:
    """Activations, shared by prefill chunks (up to PREFILL_CHUNK rows) and decode rounds."""

    x: int  # residual stream fp32 [rows, hidden]
    xn: int  # normed activations bf16 [rows, hidden]
    qkv: int  # q|k|v fp32 [rows, (H + 2 KVH) D] (prefill)
    q: int  # rotated q bf16 [rows, H, D]
    attn: int  # attention out bf16 [rows, H D]
    gu: int  # gate|up fp32 [rows, 2I] (prefill)
    act: int  # SwiGLU out bf16 [rows, I]
    ss: int  # decode: per-block sums of h^2 fp32 [MAX_LANES, ceil(hidden / 16)]
    logits: int  # fp32 [MAX_LANES, vocab]
    o_part: int  # decode attention split partials
    ml: int

    @classmethod
    def allocate(cls, cfg: ModelConfig, mem) -> Workspace:
        from engine.cu.kernels import DECODE_SPLITS

        T, hid, inter, H, D = PREFILL_CHUNK, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.head_dim
        n_qkv = (H + 2 * cfg.num_kv_heads) * D
        return cls(
            x=mem.alloc(T * hid * 4), xn=mem.alloc(T * hid * 2), qkv=mem.alloc(T * n_qkv * 4),
            q=mem.alloc(T * H * D * 2), attn=mem.alloc(T * H * D * 2), gu=mem.alloc(T * 2 * inter * 4),
            act=mem.alloc(T * inter * 2), ss=mem.alloc(MAX_LANES * -(-hid // 16) * 4),
            logits=mem.alloc(MAX_LANES * cfg.vocab_size * 4),
            o_part=mem.alloc(MAX_LANES * H * DECODE_SPLITS * D * 4), ml=mem.alloc(MAX_LANES * H * DECODE_SPLITS * 2 * 4),
        )  # fmt: skip


@dataclass
class KVLayout:
    """Where a layer's K and V live in the pool ``[num_blocks][num_layers][2][block_size][KVH][D]`` bf16."""

    base: int
    block_size: int
    layer_stride: int  # elements between layers inside a block
    block_stride: int  # elements between blocks

    def layer(self, i: int) -> int:
        return self.base + i * self.layer_stride * 2


class Forward:
    """Launches a decode round's or a prefill chunk's kernels on ``stream`` (nothing synchronizes here)."""

    def __init__(self, cfg: ModelConfig, kern, stream, w, ws: Workspace, kv: KVLayout) -> None:
        self.cfg, self.kern, self.stream, self.w, self.ws, self.kv = cfg, kern, stream, w, ws, kv

    def decode(self, rows: int, p: dict[str, int], bt_stride: int) -> None:
        """A decode round's layers and LM head into ``ws.logits``, 5 kernels a layer: each residual
        producer (embed, the o and down GEMVs) also writes the next RMSNorm's inputs into ``xn`` /
        ``ss``, and its consumer scales its rows (gemv.cu). ``p``: the round's staging pointers."""
        c, k, s, w, ws, kv = self.cfg, self.kern, self.stream, self.w, self.ws, self.kv
        hid, inter, H, KVH, D, eps = (c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                      c.rms_norm_eps)  # fmt: skip
        norms = [L.ln1 for L in w.layers[1:]] + [w.final_norm]
        first = w.layers[0].ln1 if w.layers else w.final_norm
        nparts = k.embed(s, p["tokens"], w.embed, ws.x, rows, hid, norm_out=(first, ws.xn, ws.ss))
        for i, L in enumerate(w.layers):
            cache = kv.layer(i)
            k.qkv_rope(s, ws.xn, L.qkv, L.qkv_bias, ws.q, rows, H, KVH, hid, p["positions"], p["slots"], w.inv_freq,
                       cache, kv.block_size, kv.block_stride, ss_in=(ws.ss, nparts), eps=eps)  # fmt: skip
            k.decode_attention(s, ws.q, p["positions"], p["block_tables"], bt_stride, cache, kv.block_stride,
                               kv.block_size, KVH, ws.o_part, ws.ml, ws.attn, rows)  # fmt: skip
            nparts = k.linear(s, ws.attn, L.o, 0, ws.x, rows, hid, H * D, accumulate=True,
                              norm_out=(L.ln2, ws.xn, ws.ss))  # fmt: skip
            if w.gate_up_interleaved:
                k.gate_up_act(s, ws.xn, L.gate_up, ws.gu, ws.act, rows, inter, hid, ss_in=(ws.ss, nparts), eps=eps)
            else:
                k.linear(s, ws.xn, L.gate_up, 0, ws.gu, rows, 2 * inter, hid, ss_in=(ws.ss, nparts), eps=eps)
                k.swiglu(s, ws.gu, ws.act, inter, rows)
            nparts = k.linear(s, ws.act, L.down, 0, ws.x, rows, hid, inter, accumulate=True,
                              norm_out=(norms[i], ws.xn, ws.ss))  # fmt: skip
        k.linear(s, ws.xn, w.lm_head, 0, ws.logits, rows, c.vocab_size, hid, ss_in=(ws.ss, nparts), eps=eps)

    def prefill_chunk(self, rows: int, tokens: int, positions: int, slots: int, block_table: int, start: int) -> None:
        """Embed ``rows`` tokens at positions ``start..`` and run every layer (K and V into their slots);
        leaves the residual stream in ``ws.x``."""
        c, k, s, w, ws, kv = self.cfg, self.kern, self.stream, self.w, self.ws, self.kv
        hid, inter, H, KVH, D = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
        n_qkv = (H + 2 * KVH) * D
        k.embed(s, tokens, w.embed, ws.x, rows, hid)
        for i, L in enumerate(w.layers):
            cache = kv.layer(i)
            k.rmsnorm(s, ws.x, L.ln1, ws.xn, rows, hid, c.rms_norm_eps)
            k.linear(s, ws.xn, L.qkv, L.qkv_bias, ws.qkv, rows, n_qkv, hid)
            k.rope_kv_write(s, ws.qkv, positions, slots, w.inv_freq, ws.q, cache, rows, H, KVH, kv.block_size,
                            kv.block_stride, interleaved=True)  # fmt: skip
            k.prefill_attention(s, ws.q, block_table, cache, kv.block_stride, kv.block_size, KVH, rows, start,
                                ws.attn)  # fmt: skip
            k.linear(s, ws.attn, L.o, 0, ws.x, rows, hid, H * D, accumulate=True)
            k.rmsnorm(s, ws.x, L.ln2, ws.xn, rows, hid, c.rms_norm_eps)
            if w.gate_up_interleaved:
                k.gate_up_act(s, ws.xn, L.gate_up, ws.gu, ws.act, rows, inter, hid)
            else:
                k.linear(s, ws.xn, L.gate_up, 0, ws.gu, rows, 2 * inter, hid)
                k.swiglu(s, ws.gu, ws.act, inter, rows)
            k.linear(s, ws.act, L.down, 0, ws.x, rows, hid, inter, accumulate=True)

    def head(self, rows: int, x_row: int) -> None:
        """Final norm of ``rows`` residual rows from row ``x_row``, then the LM head into ``ws.logits``."""
        c, ws = self.cfg, self.ws
        x = ws.x + x_row * c.hidden_size * 4
        self.kern.rmsnorm(self.stream, x, self.w.final_norm, ws.xn, rows, c.hidden_size, c.rms_norm_eps)
        self.kern.linear(self.stream, ws.xn, self.w.lm_head, 0, ws.logits, rows, c.vocab_size, c.hidden_size)
