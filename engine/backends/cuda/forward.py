"""The forward pass, built from the model definition's blocks (one per layer) and head.

Each operation of a block (``engine.models.ops``) maps to kernels; a llama decode round
fuses them into 5 kernels a layer, a prefill chunk runs them one by one (``prefill_rows``: the
rows of one span's chunk, or of several spans prefilled together, their attention span by
span). Layers may differ (gemma3, gpt-oss: sliding and full attention, their own rope):
every layer launches with its own weights and options (``weights.Layer``).

| operation | decode round (1..64 rows; 8 quantized) | prefill chunk |
|---|---|---|
| Embedding (scale) | embed, with the first RMSNorm's inputs | embed |
| RMSNorm (attn_norm; plus_one folded at upload) | folded into its producer (embed, down GEMV or post-norm: ``norm_out``) and the q|k|v GEMV (``ss_in``) | rmsnorm |
| Attention: q|k|v (+ bias), Rope "neox" (partial, factor), KV write | gemv_tc_rope | GEMM + rope_kv_write |
| ... with MRope (three positions a prefill row) | gemv_tc_rope at position + rope delta (all three alike) | GEMM + rope_kv_write (mrope) |
| ... with QKNorm | gemv_tc_store + rope_kv_write (normalises each head) | GEMM + rope_kv_write |
| Attention: softmax(q k^T * scale, soft-cap, window, sinks) v | decode_attn | prefill_attn |
| Attention: o_proj (+ o bias), residual add | gemv_tc_acc | GEMM (accumulate) |
| ... with attn_post_norm | gemv_tc_store + add_rmsnorm | GEMM + add_rmsnorm |
| RMSNorm (mlp_norm) | folded into the o GEMV (or add_rmsnorm) and the gate|up GEMV | rmsnorm |
| GatedMLP "silu" / "gelu_tanh": gate|up, activation | gemv_tc_swiglu / gemv_tc_geglu | GEMM + swiglu |
| GatedMLP: down_proj, residual add (mlp_post_norm as o's) | gemv_tc_acc | GEMM (accumulate) |
| Head: final RMSNorm, LM head, soft-cap | folded into the last down GEMV, gemv_tc_store, softcap | rmsnorm + gemv_tc_store + softcap |

The MLP slot is ``Forward._mlp`` (one method for decode rounds and prefill chunks), where
a sparse MoE layer is routed. ``check_supported`` refuses at load any operation (or
option) without kernels here.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.cu.kernels import GATE_EPILOGUE
from engine.model_config import ModelConfig
from engine.models.ops import Attention, Block, Embedding, GatedMLP, Head, MoE, MRope, QKNorm, RMSNorm, Rope

MAX_LANES = 64  # rows of one decode round (lanes and their verify rows; one graph per width 1..64)
QUANT_LANES = 8  # ... with a quantized matrix (gemv_q.cu) or MoE layers: their decode kernels take 8
PREFILL_CHUNK = 2048  # rows of one prefill chunk (activations are sized for it)


def check_supported(block: Block, head: Head) -> None:
    """Raise ValueError naming the first operation of ``block`` / ``head`` this backend has no kernels for."""

    def refuse(what: str, why: str) -> None:
        raise ValueError(f"the CUDA backend has no kernel for {what} ({why})")

    for where in ("attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm"):
        op = getattr(block, where)
        if op is not None and not isinstance(op, RMSNorm):
            refuse(f"block.{where} = {op!r}", "RMSNorm only")
    if not isinstance(head.final_norm, RMSNorm):
        refuse(f"head.final_norm = {head.final_norm!r}", "RMSNorm only")
    attn = block.attention
    if not isinstance(attn, Attention):
        refuse(f"block.attention = {attn!r}", "Attention only")
    rope = attn.rope
    if rope is not None and (not isinstance(rope, Rope) or rope.style not in ("neox", "mrope")):
        refuse(f"attention rope {rope!r}", "Rope 'neox' or MRope only")
    if isinstance(rope, MRope) and (len(rope.section) != 3 or rope.rotary_dim is not None):
        refuse(f"attention rope {rope!r}", "three mrope runs over the whole head")
    if rope is not None and rope.rotary_dim is not None and (rope.rotary_dim <= 0 or rope.rotary_dim % 16):
        refuse(f"attention rope rotary_dim = {rope.rotary_dim}", "a positive multiple of 16")
    if attn.qk_norm is not None and not isinstance(attn.qk_norm, QKNorm):
        refuse(f"attention qk_norm = {attn.qk_norm!r}", "QKNorm only")
    if attn.sliding_window is not None and attn.sliding_window <= 0:
        refuse(f"attention sliding_window = {attn.sliding_window}", "a positive window")
    mlp = block.mlp
    if isinstance(mlp, MoE):
        from engine.backends.cuda.moe import ACTS

        if mlp.act not in ACTS:
            refuse(f"block.mlp = {mlp!r}", f"MoE act {' / '.join(map(repr, ACTS))} only")
        if block.mlp_post_norm is not None:
            refuse("block.mlp_post_norm after a MoE", "the expert kernels add into the residual stream")
    elif not isinstance(mlp, GatedMLP) or mlp.act not in GATE_EPILOGUE:
        refuse(f"block.mlp = {mlp!r}", f"GatedMLP {' / '.join(map(repr, GATE_EPILOGUE))} or MoE only")
    if block.residual != "pre_norm":
        refuse(f"residual {block.residual!r}", "'pre_norm' only")


def check_model(blocks: list[Block], head: Head, embedding: Embedding) -> None:
    """``check_supported`` for every layer (the message names the layer), and the embedding."""
    if not isinstance(embedding, Embedding):
        raise ValueError(f"the CUDA backend has no kernel for embedding = {embedding!r}")
    for i, b in enumerate(blocks):
        try:
            check_supported(b, head)
        except ValueError as e:
            raise ValueError(f"layer {i}: {e}") from None
    sparse = [isinstance(b.mlp, MoE) for b in blocks]
    if any(sparse) and not all(sparse):
        raise ValueError(
            f"the CUDA backend runs MoE models whose every layer is sparse (layer {sparse.index(not sparse[0])} "
            f"differs from layer 0: mlp_only_layers / decoder_sparse_step)"
        )
    if any(sparse) and len({b.mlp for b in blocks}) > 1:
        raise ValueError("the CUDA backend runs MoE layers alike only (one MoE op for every layer)")


@dataclass
class Workspace:
    """Activations, shared by prefill chunks (up to PREFILL_CHUNK rows) and decode rounds."""

    x: int  # residual stream fp32 [rows, hidden]
    xn: int  # normed activations bf16 [rows, hidden]
    qkv: int  # q|k|v fp32 [rows, (H + 2 KVH) D] (prefill; decode with QKNorm)
    q: int  # rotated q bf16 [rows, H, D]
    attn: int  # attention out bf16 [rows, H D]
    gu: int  # gate|up fp32 [rows, 2I] (prefill)
    act: int  # SwiGLU out bf16 [rows, I]
    ss: int  # decode: per-block sums of h^2 fp32 [MAX_LANES, ceil(hidden / 16)]
    logits: int  # fp32 [MAX_LANES, vocab]
    o_part: int  # decode attention split partials
    ml: int
    y: int = 0  # o / down output fp32 [rows, hidden] before its post-norm (0: no layer has one)

    @classmethod
    def allocate(cls, cfg: ModelConfig, mem, post_norms: bool = False) -> Workspace:
        from engine.cu.kernels import DECODE_SPLITS

        T, hid, inter, H, D = PREFILL_CHUNK, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.head_dim
        n_qkv = (H + 2 * cfg.num_kv_heads) * D
        return cls(
            x=mem.alloc(T * hid * 4), xn=mem.alloc(T * hid * 2), qkv=mem.alloc(T * n_qkv * 4),
            q=mem.alloc(T * H * D * 2), attn=mem.alloc(T * H * D * 2), gu=mem.alloc(T * 2 * inter * 4),
            act=mem.alloc(T * inter * 2), ss=mem.alloc(MAX_LANES * -(-hid // 16) * 4),
            logits=mem.alloc(MAX_LANES * cfg.vocab_size * 4),
            o_part=mem.alloc(MAX_LANES * H * DECODE_SPLITS * D * 4), ml=mem.alloc(MAX_LANES * H * DECODE_SPLITS * 2 * 4),
            y=mem.alloc(T * hid * 4) if post_norms else 0,
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


NO_NORM = (0, 0, 0)


class Forward:
    """Launches a decode round's or a prefill chunk's kernels on ``stream`` (nothing synchronizes here)."""

    def __init__(self, cfg: ModelConfig, kern, stream, w, ws: Workspace, kv: KVLayout, moe=None) -> None:
        self.cfg, self.kern, self.stream, self.w, self.ws, self.kv = cfg, kern, stream, w, ws, kv
        self.moe = moe  # moe.DeviceMoE of a sparse model (every layer's MLP slot), or None
        # Multimodal rope: prefill positions are three ints a row; decode rows rotate at the staged
        # ``rope_positions`` (position + rope delta: the three alike, so plain rope) instead of ``positions``.
        self.mrope = any(L.mrope[0] for L in w.layers)

    def decode(self, rows: int, p: dict[str, int], bt_stride: int) -> None:
        """A decode round's layers and LM head into ``ws.logits``, 5 kernels a llama layer: each residual
        producer (embed, the o and down GEMVs, a post-norm) also writes the next RMSNorm's inputs into
        ``xn`` / ``ss``, and its consumer scales its rows (gemv.cu). ``p``: the round's staging pointers."""
        c, k, s, w, ws, kv = self.cfg, self.kern, self.stream, self.w, self.ws, self.kv
        hid, H, KVH, eps = c.hidden_size, c.num_heads, c.num_kv_heads, c.rms_norm_eps
        norms = [L.ln1 for L in w.layers[1:]] + [w.final_norm]
        first = w.layers[0].ln1 if w.layers else w.final_norm
        nparts = k.embed(s, p["tokens"], w.embed, ws.x, rows, hid, norm_out=(first, ws.xn, ws.ss), scale=w.embed_scale,
                         feed=(p["src"], p["out"]))  # fmt: skip
        for i, L in enumerate(w.layers):
            cache = kv.layer(i)
            self._qkv(i, L, rows, p["rope_positions" if self.mrope else "positions"], p["slots"],
                      ss_in=(ws.ss, nparts), fused=True)  # fmt: skip
            k.decode_attention(s, ws.q, p["positions"], p["block_tables"], bt_stride, cache, kv.block_stride,
                               kv.block_size, KVH, ws.o_part, ws.ml, ws.attn, rows, args=L.attn,
                               lane_first=p["lane_first"])  # fmt: skip
            nparts = self._residual(L.o, L.o_bias, ws.attn, H * c.head_dim, L.attn_post_norm, rows,
                                    (L.ln2, ws.xn, ws.ss))  # fmt: skip
            nparts = self._mlp(i, L, rows, ss_in=(ws.ss, nparts), norm_out=(norms[i], ws.xn, ws.ss))
        k.linear(s, ws.xn, w.lm_head, 0, ws.logits, rows, c.vocab_size, hid, ss_in=(ws.ss, nparts), eps=eps)
        self._head_softcap(rows)

    def prefill_rows(self, rows: int, tokens: int, positions: int, slots: int,
                     spans: list[tuple[int, int, int, int]], embeds=(), span_table: int = 0) -> None:  # fmt: skip
        """Embed ``rows`` tokens and run every layer over them (K and V into their slots); leaves the
        residual stream in ``ws.x``. The rows are those of one or more spans, each consecutive:
        ``spans`` = (first row, rows, block table pointer, position of its first row) of each, in row
        order. Every product, norm and rope runs over all the rows at once (a row's rope position and
        KV slot are its own: ``positions``, three a row with multimodal rope, and ``slots``); the
        attention runs span by span, each span's q over its own pages (its retained prefix whole).
        ``embeds``: (row, float32 host rows) runs that replace the token embeddings there (an image's
        placeholders). ``span_table``: the spans on the device as ``Kernels.prefill_attention_spans`` takes
        them (then a layer's attention may be one launch for all of them), or 0."""
        import pycuda.driver as cuda

        c, k, s, w, ws, kv = self.cfg, self.kern, self.stream, self.w, self.ws, self.kv
        hid, H, KVH, eps = c.hidden_size, c.num_heads, c.num_kv_heads, c.rms_norm_eps
        k.embed(s, tokens, w.embed, ws.x, rows, hid, scale=w.embed_scale)
        for row, rows_in in embeds:
            cuda.memcpy_htod_async(ws.x + row * hid * 4, rows_in, s)
        for i, L in enumerate(w.layers):
            k.rmsnorm(s, ws.x, L.ln1, ws.xn, rows, hid, eps)
            self._qkv(i, L, rows, positions, slots, ss_in=(0, 0), fused=False, mrope=L.mrope)
            k.prefill_attention_spans(s, ws.q, rows, spans, span_table, kv.layer(i), kv.block_stride, kv.block_size,
                                      KVH, ws.attn, args=L.attn)  # fmt: skip
            self._residual(L.o, L.o_bias, ws.attn, H * c.head_dim, L.attn_post_norm, rows, NO_NORM)
            k.rmsnorm(s, ws.x, L.ln2, ws.xn, rows, hid, eps)
            self._mlp(i, L, rows, prefill=True)

    def head(self, rows: int, x_row: int, out_row: int = 0) -> None:
        """Final norm of ``rows`` residual rows from row ``x_row``, then the LM head into ``ws.logits``
        from row ``out_row``."""
        c, ws = self.cfg, self.ws
        x = ws.x + x_row * c.hidden_size * 4
        logits = ws.logits + out_row * c.vocab_size * 4
        self.kern.rmsnorm(self.stream, x, self.w.final_norm, ws.xn, rows, c.hidden_size, c.rms_norm_eps)
        self.kern.linear(self.stream, ws.xn, self.w.lm_head, 0, logits, rows, c.vocab_size, c.hidden_size)
        self._head_softcap(rows, out_row)

    # --- the pieces of a layer ---------------------------------------------------------------

    def _qkv(self, i: int, L, rows: int, positions: int, slots: int, ss_in: tuple[int, int], fused: bool,
             mrope: tuple[int, int] = (0, 0)) -> None:  # fmt: skip
        """q|k|v of ``ws.xn`` (+ bias), QKNorm, rope, K and V into their slots, rotated q into ``ws.q``.
        ``fused`` (decode): rope and the KV write in the GEMV's epilogue, unless QKNorm needs whole heads.
        ``mrope``: ``positions`` holds three a row (prefill of a multimodal-rope layer, rope.cu)."""
        c, k, s, ws, kv = self.cfg, self.kern, self.stream, self.ws, self.kv
        hid, H, KVH, eps = c.hidden_size, c.num_heads, c.num_kv_heads, c.rms_norm_eps
        cache = kv.layer(i)
        if fused and not L.q_norm:
            k.qkv_rope(s, ws.xn, L.qkv, L.qkv_bias, ws.q, rows, H, KVH, hid, positions, slots, L.inv_freq, cache,
                       kv.block_size, kv.block_stride, ss_in=ss_in, eps=eps, rotary_dim=L.rotary_dim,
                       factor=L.rope_factor)  # fmt: skip
            return
        k.linear(s, ws.xn, L.qkv, L.qkv_bias, ws.qkv, rows, (H + 2 * KVH) * c.head_dim, hid, ss_in=ss_in, eps=eps)
        k.rope_kv_write(s, ws.qkv, positions, slots, L.inv_freq, ws.q, cache, rows, H, KVH, kv.block_size,
                        kv.block_stride, interleaved=True, rotary_dim=L.rotary_dim, factor=L.rope_factor,
                        qk_norm=(L.q_norm, L.k_norm), eps=eps, mrope=mrope)  # fmt: skip

    def _residual(self, weight: int, bias: int, src: int, k_dim: int, post_norm: int, rows: int,
                  norm_out: tuple[int, int, int]) -> int:  # fmt: skip
        """``x += src @ weight^T (+ bias)``, through the post-norm when the block has one; ``norm_out``
        (decode) also writes the next RMSNorm's inputs. Returns the ss partials per row written."""
        c, k, s, ws = self.cfg, self.kern, self.stream, self.ws
        hid = c.hidden_size
        if not post_norm:
            return k.linear(s, src, weight, bias, ws.x, rows, hid, k_dim, accumulate=True, norm_out=norm_out)
        k.linear(s, src, weight, bias, ws.y, rows, hid, k_dim)
        return k.add_rmsnorm(s, ws.y, post_norm, ws.x, rows, hid, c.rms_norm_eps, norm_out=norm_out)

    def _mlp(self, i: int, L, rows: int, ss_in: tuple[int, int] = (0, 0), norm_out: tuple[int, int, int] = NO_NORM,
             prefill: bool = False) -> int:  # fmt: skip
        """The MLP slot: reads the normed rows ``ws.xn`` (decode: with ``ss_in``, the fused RMSNorm's
        partials, gemv.cu), adds the block's MLP output (post-normed where set) into ``ws.x``, and with
        ``norm_out`` writes the next RMSNorm's inputs; returns their partials per row. A sparse layer
        runs the grouped expert kernels (moe.DeviceMoE) in its place."""
        c, k, s, w, ws = self.cfg, self.kern, self.stream, self.w, self.ws
        hid, inter, eps, act = c.hidden_size, c.intermediate_size, c.rms_norm_eps, L.block.mlp.act
        if isinstance(L.block.mlp, MoE):
            if prefill:
                self.moe.prefill(s, i, ws.xn, ws.x, rows)
                return 0
            return self.moe.decode(s, i, ws.xn, ws.x, rows, ss_in=ss_in, eps=eps, norm_out=norm_out)
        if w.gate_up_interleaved:
            k.gate_up_act(s, ws.xn, L.gate_up, ws.gu, ws.act, rows, inter, hid, ss_in=ss_in, eps=eps, fn=act)
        else:
            k.linear(s, ws.xn, L.gate_up, 0, ws.gu, rows, 2 * inter, hid, ss_in=ss_in, eps=eps)
            k.swiglu(s, ws.gu, ws.act, inter, rows, act=act)
        return self._residual(L.down, 0, ws.act, inter, L.mlp_post_norm, rows, norm_out)

    def _head_softcap(self, rows: int, out_row: int = 0) -> None:
        if self.w.head_softcap:
            v = self.cfg.vocab_size
            self.kern.softcap(self.stream, self.ws.logits + out_row * v * 4, rows * v, self.w.head_softcap)
