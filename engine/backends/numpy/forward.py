"""The layer loop, built from a model definition's ``Block`` and ``Head``.

``NumpyModel`` reads the operations ``definition(cfg.arch).block(cfg, layer)``
names for every layer and runs each with its reference in ``ops.py``; an
architecture that only recombines existing operations (another norm weight,
biases or not, no rope, a registered activation) runs without a change here.
An operation with no reference is refused at load, naming it.

Layout (for speed on a couple of CPU cores): weights keep the checkpoint's
``[out, in]`` layout, fused q|k|v and gate|up at load, so each layer is three
products plus ``o_proj``, each run once over every row of a round
(``linear.Linear``). The KV cache is read and written by token slot
(:class:`KVViews`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.model_config import ModelConfig
from engine.models import definition
from engine.models.ops import Attention, Block, GatedMLP, Head, MoE, MRope, RMSNorm
from engine.models.rope import rope_tables

from . import ops
from .linear import Linear


@dataclass
class KVViews:
    """One K/V pool ``[layers, num_blocks, block_size, kv_heads, head_dim]`` seen per token slot."""

    k_slots: np.ndarray  # [layers, slots, kv_heads, head_dim]: where a round writes its rows
    v_slots: np.ndarray
    k_rows: np.ndarray  # [layers, slots, kv_heads * head_dim]: what attention gathers
    v_rows: np.ndarray

    @classmethod
    def of(cls, k: np.ndarray, v: np.ndarray) -> KVViews:
        layers, blocks, size, kvh, hd = k.shape
        return cls(
            k.reshape(layers, blocks * size, kvh, hd), v.reshape(layers, blocks * size, kvh, hd),
            k.reshape(layers, blocks * size, kvh * hd), v.reshape(layers, blocks * size, kvh * hd),
        )  # fmt: skip


@dataclass
class _Experts:
    """One sparse MoE layer: the router and every expert's fused gate|up and down."""

    op: MoE
    router: Linear  # [experts, hidden]
    router_bias: np.ndarray | None
    gate_up: list[Linear]  # per expert [2 * moe_intermediate, hidden]
    gate_up_bias: list[np.ndarray | None]
    down: list[Linear]  # per expert [hidden, moe_intermediate]
    down_bias: list[np.ndarray | None]


@dataclass
class _Layer:
    block: Block
    attn_norm: np.ndarray
    mlp_norm: np.ndarray
    attn_post_norm: np.ndarray | None
    mlp_post_norm: np.ndarray | None
    q_norm: np.ndarray | None  # [head_dim]
    k_norm: np.ndarray | None
    w_qkv: Linear  # [(heads + 2 * kv_heads) * head_dim, hidden]
    b_qkv: np.ndarray | None
    w_o: Linear  # [hidden, heads * head_dim]
    b_o: np.ndarray | None
    sinks: np.ndarray | None  # [heads]
    w_gate_up: Linear | None  # dense MLP: [2 * intermediate, hidden]
    w_down: Linear | None  # [hidden, intermediate]
    experts: _Experts | None  # sparse MLP


def check_supported(blocks: list[Block], head: Head) -> None:
    """Refuse, naming it, any operation (or option) this backend has no reference for."""
    unsupported: list = []
    for block in blocks:
        norms = (block.attn_norm, block.mlp_norm, block.attn_post_norm, block.mlp_post_norm)
        unsupported += [op for op in norms if op is not None and not isinstance(op, RMSNorm)]
        attn = block.attention
        if not isinstance(attn, Attention) or (attn.rope is not None and attn.rope.style not in ops.ROPE):
            unsupported.append(attn)
        mlp = block.mlp
        if isinstance(mlp, GatedMLP):
            if mlp.act not in ops.ACTIVATIONS:
                unsupported.append(mlp)
        elif not isinstance(mlp, MoE) or mlp.act not in ops.EXPERT_ACTIVATIONS:
            unsupported.append(mlp)
        if block.residual != "pre_norm":
            unsupported.append(f"residual {block.residual!r}")
    if not isinstance(head.final_norm, RMSNorm):
        unsupported.append(head.final_norm)
    if unsupported:
        names = ", ".join(dict.fromkeys(map(repr, unsupported)))
        raise NotImplementedError(f"numpy backend: no reference implementation for {names}")


class NumpyModel:
    """A loaded model's weights and its forward pass; the KV cache stays the backend's."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray]):
        model = definition(cfg.arch)
        blocks, self.head = model.blocks(cfg), model.head(cfg)
        check_supported(blocks, self.head)
        self.cfg = cfg
        self.embed_scale = np.float32(model.embedding(cfg).scale)

        def w(name: str) -> np.ndarray:
            return np.asarray(weights[name], dtype=np.float32)

        self.embed = np.ascontiguousarray(w("model.embed_tokens.weight"))
        # [vocab, hidden] like the embedding: tied embeddings share the array, no second
        # 113 MB (SmolLM2) copy; its column blocks are row ranges of it.
        self.lm_head = Linear(self.embed, share=True) if cfg.tie_word_embeddings else Linear(w("lm_head.weight"))
        self.final_norm = ops.norm_weight(self.head.final_norm, w(self.head.final_norm.weight + ".weight"))
        self.layers = [self._layer(cfg, block, f"model.layers.{i}.", w) for i, block in enumerate(blocks)]
        # One (inv_freq, attention factor) per distinct rope (gemma3: local and global).
        self.ropes = {b.attention.rope: rope_tables(cfg, b.attention.rope) for b in blocks if b.attention.rope}

    @staticmethod
    def _layer(cfg: ModelConfig, block: Block, p: str, w) -> _Layer:
        attn = block.attention

        def norm(op: RMSNorm | None, name: str | None = None) -> np.ndarray | None:
            return None if op is None else ops.norm_weight(op, w(p + (name or op.weight) + ".weight"))

        def opt(name: str, present: bool) -> np.ndarray | None:
            return w(p + name) if present else None

        qkv = np.concatenate([w(p + f"self_attn.{x}_proj.weight") for x in "qkv"], axis=0)
        bias = None
        if attn.qkv_bias:
            bias = np.concatenate([w(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
        qk = attn.qk_norm
        layer = _Layer(
            block=block,
            attn_norm=norm(block.attn_norm),
            mlp_norm=norm(block.mlp_norm),
            attn_post_norm=norm(block.attn_post_norm),
            mlp_post_norm=norm(block.mlp_post_norm),
            q_norm=None if qk is None else norm(RMSNorm(qk.q_weight, qk.plus_one)),
            k_norm=None if qk is None else norm(RMSNorm(qk.k_weight, qk.plus_one)),
            w_qkv=Linear(qkv),
            b_qkv=bias,
            w_o=Linear(w(p + "self_attn.o_proj.weight")),
            b_o=opt("self_attn.o_proj.bias", attn.o_bias),
            sinks=opt("self_attn.sinks", attn.sinks),
            w_gate_up=None,
            w_down=None,
            experts=None,
        )
        mlp = block.mlp
        if isinstance(mlp, GatedMLP):
            layer.w_gate_up = Linear(np.concatenate([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]))
            layer.w_down = Linear(w(p + "mlp.down_proj.weight"))
            return layer
        e = [f"{p}mlp.experts.{j}." for j in range(mlp.num_experts)]
        layer.experts = _Experts(
            op=mlp,
            router=Linear(w(p + "mlp.gate.weight")),
            router_bias=opt("mlp.gate.bias", mlp.router_bias),
            gate_up=[Linear(np.concatenate([w(x + "gate_proj.weight"), w(x + "up_proj.weight")])) for x in e],
            gate_up_bias=[
                np.concatenate([w(x + "gate_proj.bias"), w(x + "up_proj.bias")]) if mlp.expert_bias else None for x in e
            ],
            down=[Linear(w(x + "down_proj.weight")) for x in e],
            down_bias=[w(x + "down_proj.bias") if mlp.expert_bias else None for x in e],
        )
        return layer

    @property
    def nbytes(self) -> int:
        """Bytes of the weights held (a tied head shares the embedding and counts once)."""
        n = self.embed.nbytes + self.final_norm.nbytes + (0 if self.cfg.tie_word_embeddings else self.lm_head.nbytes)
        for lw in self.layers:
            for name, a in vars(lw).items():
                if name == "experts" and a is not None:
                    n += a.router.nbytes + sum(x.nbytes for x in (*a.gate_up, *a.down))
                    n += sum(b.nbytes for b in (*a.gate_up_bias, *a.down_bias) if b is not None)
                elif isinstance(a, np.ndarray | Linear):
                    n += a.nbytes
        return n

    def forward(self, token_ids, positions: np.ndarray, write_slots: np.ndarray, ctx_slots: np.ndarray,
                ctx_positions: np.ndarray, kv: KVViews, *, rope_positions: np.ndarray | None = None,
                embeds: list[tuple[int, np.ndarray]] = (),
                parts: list[tuple[int, int, np.ndarray, np.ndarray]] | None = None) -> np.ndarray:  # fmt: skip
        """Run every layer over rows ``token_ids`` at ``positions``; return final-normed hidden [n, H].

        Rows are ``ctx_slots.shape[0]`` sequences of equal row counts (prefill: one;
        decode: one row per lane). Each layer writes its rows' K/V at
        ``write_slots`` first, then each sequence attends over ``ctx_slots``
        [seqs, S], the slots of positions ``ctx_positions`` [seqs, S], which
        include its own rows; a context position after a row's own (padding) or
        outside its layer's window is masked.

        ``parts``: rows of several prefill spans at once (a group): (first row, end row, ctx_slots,
        ctx_positions) each, attending apart as above (``ctx_slots`` and ``ctx_positions`` are
        then unused); the products run once over every row.

        ``rope_positions``: where the rows rotate when that is not ``positions`` ([n], or
        [3, n] for ``MRope``; a 1-D one is alike in all three). ``embeds``: (first row, rows)
        runs that replace the token embeddings there (an image's placeholder rows).
        """
        cfg = self.cfg
        n = len(token_ids)
        nh, nkvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        nq, nkv = nh * hd, nkvh * hd
        x = self.embed[np.asarray(token_ids, dtype=np.int64)]
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        for row, rows in embeds:
            x[row : row + len(rows)] = rows
        tables = self._rope_tables(positions if rope_positions is None else rope_positions)
        parts = [(0, n, ctx_slots, ctx_positions)] if parts is None else parts
        q_pos = [positions[r0:r1].reshape(c.shape[0], -1) for r0, r1, c, _ in parts]
        masks: dict[int | None, list[np.ndarray | None]] = {}
        eps = cfg.rms_norm_eps
        with np.errstate(over="ignore"):  # exp(-g) of a very negative gate: inf, and silu's 0 is right
            for i, lw in enumerate(self.layers):
                attn = lw.block.attention
                if attn.sliding_window not in masks:
                    masks[attn.sliding_window] = [
                        ops.attention_mask(q, p[3], attn.sliding_window) for q, p in zip(q_pos, parts)
                    ]
                h = ops.rms_norm(x, lw.attn_norm, eps)
                qkv = lw.w_qkv(h)
                if lw.b_qkv is not None:
                    qkv += lw.b_qkv
                # q and k heads rotate together: [n, heads + kv_heads, hd]
                qk = qkv[:, : nq + nkv].reshape(n, nh + nkvh, hd)
                if lw.q_norm is not None:
                    qk = np.concatenate(
                        [ops.rms_norm(qk[:, :nh], lw.q_norm, eps), ops.rms_norm(qk[:, nh:], lw.k_norm, eps)], axis=1
                    )
                if attn.rope is not None:
                    qk = ops.ROPE[attn.rope.style](qk, *tables[attn.rope])
                kv.k_slots[i][write_slots] = qk[:, nh:]
                kv.v_slots[i][write_slots] = qkv[:, nq + nkv :].reshape(n, nkvh, hd)
                out = []
                for (r0, r1, slots, _), mask in zip(parts, masks[attn.sliding_window]):
                    out.append(ops.paged_attention(qk[r0:r1, :nh], kv.k_rows[i], kv.v_rows[i], slots, mask, nkvh,
                                                   scale=attn.scale, softcap=attn.softcap, sinks=lw.sinks))  # fmt: skip
                out = out[0] if len(out) == 1 else np.concatenate(out)
                out = lw.w_o(out)
                if lw.b_o is not None:
                    out += lw.b_o
                if lw.attn_post_norm is not None:
                    out = ops.rms_norm(out, lw.attn_post_norm, eps)
                x = x + out
                h = ops.rms_norm(x, lw.mlp_norm, eps)
                if lw.experts is not None:
                    out = ops.moe(h, lw.experts)
                else:
                    out = lw.w_down(ops.ACTIVATIONS[lw.block.mlp.act](lw.w_gate_up(h), cfg.intermediate_size))
                if lw.mlp_post_norm is not None:
                    out = ops.rms_norm(out, lw.mlp_post_norm, eps)
                x = x + out
        return ops.rms_norm(x, self.final_norm, eps)

    def _rope_tables(self, positions: np.ndarray) -> dict:
        tables = {}
        for rope, (inv, factor) in self.ropes.items():
            if isinstance(rope, MRope):
                three = np.broadcast_to(positions, (3, positions.shape[-1]))
                tables[rope] = ops.mrope_cos_sin(three, inv, rope.section, factor)
            else:
                tables[rope] = ops.rope_cos_sin(positions, inv, factor)
        return tables

    def logits(self, h: np.ndarray) -> np.ndarray:
        logits = self.lm_head(h)
        if self.head.softcap:
            logits = ops.tanh_softcap(logits, self.head.softcap)
        return logits
