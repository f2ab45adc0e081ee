"""The layer loop, built from a model definition's ``Block`` and ``Head``.

``NumpyModel`` reads the operations ``definition(cfg.arch).block(cfg)`` names and
runs each with its reference in ``ops.py``; an architecture that only
recombines existing operations (another norm weight, biases or not, no rope, a
registered activation) runs without a change here. An operation with no
reference is refused at load, naming it.

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
from engine.models.ops import Attention, Block, GatedMLP, Head, RMSNorm
from engine.models.rope import rope_inv_freq

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
class _Layer:
    attn_norm: np.ndarray
    mlp_norm: np.ndarray
    w_qkv: Linear  # [(heads + 2 * kv_heads) * head_dim, hidden]
    b_qkv: np.ndarray | None
    w_o: Linear  # [hidden, heads * head_dim]
    w_gate_up: Linear  # [2 * intermediate, hidden]
    w_down: Linear  # [hidden, intermediate]


def check_supported(block: Block, head: Head) -> None:
    """Refuse, naming it, any operation (or option) this backend has no reference for."""
    unsupported = [
        op for op in (block.attn_norm, block.mlp_norm, head.final_norm) if not isinstance(op, RMSNorm)
    ]  # fmt: skip
    attn = block.attention
    if not isinstance(attn, Attention) or (attn.rope is not None and attn.rope.style not in ops.ROPE):
        unsupported.append(attn)
    if not isinstance(block.mlp, GatedMLP) or block.mlp.act not in ops.ACTIVATIONS:
        unsupported.append(block.mlp)
    if block.residual != "pre_norm":
        unsupported.append(f"residual {block.residual!r}")
    if unsupported:
        raise NotImplementedError(f"numpy backend: no reference implementation for {', '.join(map(repr, unsupported))}")


class NumpyModel:
    """A loaded model's weights and its forward pass; the KV cache stays the backend's."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray]):
        model = definition(cfg.arch)
        block, head = model.block(cfg), model.head(cfg)
        check_supported(block, head)
        self.cfg = cfg

        def w(name: str) -> np.ndarray:
            return np.asarray(weights[name], dtype=np.float32)

        self.embed = np.ascontiguousarray(w("model.embed_tokens.weight"))
        # [vocab, hidden] like the embedding: tied embeddings share the array, no second
        # 113 MB (SmolLM2) copy; its column blocks are row ranges of it.
        self.lm_head = Linear(self.embed, share=True) if cfg.tie_word_embeddings else Linear(w("lm_head.weight"))
        self.final_norm = ops.norm_weight(head.final_norm, w(head.final_norm.weight + ".weight"))
        self.layers = [self._layer(block, f"model.layers.{i}.", w) for i in range(cfg.num_layers)]
        self.rope = ops.ROPE[block.attention.rope.style] if block.attention.rope is not None else None
        self.act = ops.ACTIVATIONS[block.mlp.act]
        self.inv_freq = rope_inv_freq(cfg)

    @staticmethod
    def _layer(block: Block, p: str, w) -> _Layer:
        qkv = np.concatenate([w(p + f"self_attn.{x}_proj.weight") for x in "qkv"], axis=0)
        bias = None
        if block.attention.qkv_bias:
            bias = np.concatenate([w(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
        gate_up = np.concatenate([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")], axis=0)
        return _Layer(
            attn_norm=ops.norm_weight(block.attn_norm, w(p + block.attn_norm.weight + ".weight")),
            mlp_norm=ops.norm_weight(block.mlp_norm, w(p + block.mlp_norm.weight + ".weight")),
            w_qkv=Linear(qkv),
            b_qkv=bias,
            w_o=Linear(w(p + "self_attn.o_proj.weight")),
            w_gate_up=Linear(gate_up),
            w_down=Linear(w(p + "mlp.down_proj.weight")),
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the weights held (a tied head shares the embedding and counts once)."""
        n = self.embed.nbytes + self.final_norm.nbytes + (0 if self.cfg.tie_word_embeddings else self.lm_head.nbytes)
        return n + sum(a.nbytes for lw in self.layers for a in vars(lw).values() if a is not None)

    def forward(self, token_ids, positions: np.ndarray, write_slots: np.ndarray, ctx_slots: np.ndarray,
                mask: np.ndarray | None, kv: KVViews) -> np.ndarray:  # fmt: skip
        """Run every layer over rows ``token_ids`` at ``positions``; return final-normed hidden [n, H].

        Each layer writes its rows' K/V at ``write_slots`` first, then attends over
        ``ctx_slots`` / ``mask`` (see ``ops.paged_attention``), which include them.
        """
        cfg = self.cfg
        n = len(token_ids)
        nh, nkvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        nq, nkv = nh * hd, nkvh * hd
        x = self.embed[np.asarray(token_ids, dtype=np.int64)]
        if self.rope is not None:
            cos, sin = ops.rope_cos_sin(positions, self.inv_freq)
        with np.errstate(over="ignore"):  # exp(-g) of a very negative gate: inf, and silu's 0 is right
            for i, lw in enumerate(self.layers):
                h = ops.rms_norm(x, lw.attn_norm, cfg.rms_norm_eps)
                qkv = lw.w_qkv(h)
                if lw.b_qkv is not None:
                    qkv += lw.b_qkv
                # q and k heads rotate together: [n, heads + kv_heads, hd]
                qk = qkv[:, : nq + nkv].reshape(n, nh + nkvh, hd)
                if self.rope is not None:
                    qk = self.rope(qk, cos, sin)
                kv.k_slots[i][write_slots] = qk[:, nh:]
                kv.v_slots[i][write_slots] = qkv[:, nq + nkv :].reshape(n, nkvh, hd)
                attn = ops.paged_attention(qk[:, :nh], kv.k_rows[i], kv.v_rows[i], ctx_slots, mask, nkvh)
                x = x + lw.w_o(attn)
                h = ops.rms_norm(x, lw.mlp_norm, cfg.rms_norm_eps)
                x = x + lw.w_down(self.act(lw.w_gate_up(h), cfg.intermediate_size))
        return ops.rms_norm(x, self.final_norm, cfg.rms_norm_eps)

    def logits(self, h: np.ndarray) -> np.ndarray:
        return self.lm_head(h)
