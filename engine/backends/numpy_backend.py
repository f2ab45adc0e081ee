"""The reference backend: float32 numpy on the CPU, paged KV cache.

Layout choices (all for speed on a couple of CPU cores):

* Weights keep the checkpoint's ``[out, in]`` layout, fused (q|k|v, gate|up)
  at load, so each layer is three products plus ``o_proj``, each run once over
  every row of a round. At decode widths a product runs as a stack of column
  blocks (:class:`_Linear`): OpenBLAS then takes its unpacked small-matrix
  kernel for each block instead of a GEMM that copies (packs) every weight
  panel first, so 8 rows read the weights about as fast as 1 row does.
* The KV cache is one array per K and V, ``[layers, num_blocks, block_size,
  kv_heads, head_dim]``; ``k_cache[layer]`` is the per-layer view the step
  interface describes. Token ``pos`` of a sequence lives in slot
  ``block_table[pos // block_size] * block_size + pos % block_size``.
* Attention gathers each row's context by slot. Decode pads the lanes'
  contexts to the longest one and masks the padding, so a round is one batched
  matmul per layer rather than a Python loop per lane.

Numerics follow Hugging Face's llama/qwen2 modeling code (RMSNorm in float32,
``rotate_half`` RoPE with float32 angles, llama3 frequency scaling, GQA by
``repeat_kv``), which is what the parity tests compare against.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine import sampler
from engine.backend import Backend, DecodeLane, PrefillSpan, StepOutput, TokenLogprob
from engine.memory import MemoryPlan
from engine.models.rope import rope_inv_freq

_LANES_FOR_DEFAULT_BUDGET = 8

# OpenBLAS (SMALL_MATRIX_OPT builds, e.g. numpy's SkylakeX kernels) runs an sgemm
# with M*N*K <= 100**3 through an unpacked small-matrix kernel; for the operand
# order numpy gives ``x @ w_block.T`` it also wants M*N <= 1200 (M = block
# columns, N = rows). Anything larger goes through the packed GEMM, which copies
# every weight panel before use: at 2-8 rows that costs 2-3x the 1-row GEMV.
_SMALL_MNK = 1_000_000
_SMALL_MN = 1200
_MIN_BLOCK = 32  # narrower than this (prefill chunks past ~40 rows), the packed GEMM is as fast


def _block_width(rows: int, n_out: int, k_in: int) -> int | None:
    """Columns per block for ``rows`` x [k_in] @ [k_in, n_out], or None for one plain GEMM."""
    if rows == 1:
        return None  # GEMV already reads the weights once
    cap = min(_SMALL_MN // rows, _SMALL_MNK // (rows * k_in))
    cap -= cap % 16
    if cap < _MIN_BLOCK:
        return None
    if n_out <= cap:
        return n_out
    # The widest block (a multiple of 16) that divides n_out; else the widest, plus a tail product.
    return next((b for b in range(cap, _MIN_BLOCK - 1, -16) if n_out % b == 0), cap)


class _Linear:
    """``y = x @ w.T`` for ``w`` [out, in] (the checkpoint's layout, C-contiguous).

    At decode widths the product is one stacked matmul over column blocks
    ``w[j*b:(j+1)*b]`` -- views of ``w``, no copy -- written straight into the
    columns of the output, so each block is one small BLAS call (see
    :func:`_block_width`). Prefill chunks (many rows) run one plain GEMM.
    """

    __slots__ = ("w", "_plans")

    def __init__(self, w: np.ndarray, *, share: bool = False):
        # A view into the loader's buffers (or a mapped file) is copied once, as the old
        # transposed layout was; ``share`` keeps the array itself (the tied embedding).
        w = np.asarray(w, dtype=np.float32)
        if not (share and w.flags.c_contiguous):
            w = np.array(w, order="C", copy=True if w.base is not None else None)
        self.w = w
        self._plans: dict[int, tuple | None] = {}

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def _plan(self, rows: int) -> tuple | None:
        n_out, k_in = self.w.shape
        b = _block_width(rows, n_out, k_in)
        if b is None:
            return None
        nb = n_out // b
        main = self.w[: nb * b].reshape(nb, b, k_in).transpose(0, 2, 1)  # [nb, in, b]
        tail = self.w[nb * b :].T if nb * b < n_out else None
        return b, nb, main, tail

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        rows = x.shape[0]
        try:
            plan = self._plans[rows]
        except KeyError:
            plan = self._plans[rows] = self._plan(rows)
        if plan is None:
            return np.matmul(x, self.w.T, out=out)
        b, nb, main, tail = plan
        if out is None:
            out = np.empty((rows, self.w.shape[0]), dtype=np.float32)
        # out[:, j*b:(j+1)*b] as [nb, rows, b]; BLAS writes each block in place (ldc = out columns).
        if tail is None:
            np.matmul(x, main, out=out.reshape(rows, nb, b).transpose(1, 0, 2))
        else:
            np.matmul(x, main, out=np.lib.stride_tricks.as_strided(out, (nb, rows, b), (b * 4, out.strides[0], 4)))
            np.matmul(x, tail, out=out[:, nb * b :])
        return out


@dataclass
class _Layer:
    ln1: np.ndarray
    ln2: np.ndarray
    w_qkv: _Linear  # [(heads + 2 * kv_heads) * head_dim, hidden]
    b_qkv: np.ndarray | None
    w_o: _Linear  # [hidden, heads * head_dim]
    w_gate_up: _Linear  # [2 * intermediate, hidden]
    w_down: _Linear  # [hidden, intermediate]


def limit_blas_threads() -> None:
    """One BLAS thread, unless the environment names a count (OPENBLAS_NUM_THREADS ...).

    On the 2-core machine the step thread shares the cores with the event loop and,
    often, other processes; OpenBLAS's spinning workers then made a decode round up
    to 14x slower with 2 threads than with 1 (docs/PERFORMANCE.md, numpy backend).
    """
    if any(os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - a requirement; without it BLAS keeps its default
        return
    threadpool_limits(1, user_api="blas")


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    # np.mean's own arithmetic (a float32 sum, then / count) without its Python wrapper.
    var = np.add.reduce(x * x, axis=-1, keepdims=True) / np.float32(x.shape[-1])
    return w * (x / np.sqrt(var + np.float32(eps)))


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``x * cos + rotate_half(x) * sin`` on ``x`` [n, heads, head_dim]; cos/sin [n, 1, head_dim]."""
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


def _softmax_inplace(s: np.ndarray) -> np.ndarray:
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


class NumpyBackend(Backend):
    """float32 CPU backend; the reference every other backend is checked against."""

    name = "numpy"
    supports_prompt_logprobs = True

    def load(self, config, weights, *, block_size, kv_budget_bytes, host_kv_budget_bytes, max_context) -> MemoryPlan:
        cfg = self.config = config
        f32 = np.float32

        def w(name):
            return np.asarray(weights[name], dtype=f32)

        self.embed = np.ascontiguousarray(w("model.embed_tokens.weight"))
        limit_blas_threads()
        # [vocab, hidden] like the embedding: tied embeddings share the array, no second
        # 113 MB (SmolLM2) copy; its column blocks are row ranges of it.
        self.lm_head = _Linear(self.embed, share=True) if cfg.tie_word_embeddings else _Linear(w("lm_head.weight"))
        self.final_norm = w("model.norm.weight")
        self.layers: list[_Layer] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv = [w(p + f"self_attn.{x}_proj.weight") for x in "qkv"]
            bias = None
            if cfg.attention_bias:
                bias = np.concatenate([w(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
            self.layers.append(
                _Layer(
                    ln1=w(p + "input_layernorm.weight"),
                    ln2=w(p + "post_attention_layernorm.weight"),
                    w_qkv=_Linear(np.concatenate(qkv, axis=0)),
                    b_qkv=bias,
                    w_o=_Linear(w(p + "self_attn.o_proj.weight")),
                    w_gate_up=_Linear(
                        np.concatenate([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")], axis=0)
                    ),
                    w_down=_Linear(w(p + "mlp.down_proj.weight")),
                )
            )
        self.inv_freq = rope_inv_freq(cfg)
        self.block_size = block_size
        weights_bytes = self.embed.nbytes + self.final_norm.nbytes
        weights_bytes += (0 if cfg.tie_word_embeddings else self.lm_head.nbytes) + sum(
            a.nbytes for lw in self.layers for a in vars(lw).values() if a is not None
        )

        block_bytes = block_size * cfg.kv_bytes_per_token_fp32
        if kv_budget_bytes is None:
            num_blocks = -(-max_context // block_size) * _LANES_FOR_DEFAULT_BUDGET
        else:
            num_blocks = int(kv_budget_bytes // block_bytes)
        if num_blocks < 1:
            raise ValueError(f"KV budget {kv_budget_bytes} B holds no block of {block_bytes} B")
        num_host_blocks = int(host_kv_budget_bytes // block_bytes)
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # np.zeros maps pages lazily, so an unused pool costs address space, not RAM.
        self.k = np.zeros(shape, f32)
        self.v = np.zeros(shape, f32)
        self.k_cache = [self.k[i] for i in range(cfg.num_layers)]
        self.v_cache = [self.v[i] for i in range(cfg.num_layers)]
        self._k_slots = self.k.reshape(cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        self._v_slots = self.v.reshape(self._k_slots.shape)
        self._k_rows = self.k.reshape(cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads * cfg.head_dim)
        self._v_rows = self.v.reshape(self._k_rows.shape)
        self.num_host_blocks = num_host_blocks
        self.host_k = self.host_v = None  # allocated on the first swap_out
        # Activations of one 8-lane round plus its logits; prefill chunks reuse the same order of memory.
        workspace = _LANES_FOR_DEFAULT_BUDGET * 4 * (cfg.vocab_size + 4 * cfg.intermediate_size + 4 * cfg.hidden_size)
        self.plan = MemoryPlan(
            budget_bytes=weights_bytes + workspace + num_blocks * block_bytes,
            weights_bytes=int(weights_bytes),
            workspace_bytes=int(workspace),
            kv_bytes=num_blocks * block_bytes,
            block_size=block_size,
            num_blocks=num_blocks,
            host_kv_bytes=num_host_blocks * block_bytes,
            num_host_blocks=num_host_blocks,
        )
        return self.plan

    # --- the forward pass ---------------------------------------------------------------

    def _slots(self, block_table: Sequence[int], positions: np.ndarray) -> np.ndarray:
        bt = np.asarray(block_table, dtype=np.int64)
        idx = positions // self.block_size
        if len(positions) and idx.max() >= len(bt):
            raise ValueError(f"block table of {len(bt)} blocks does not reach position {int(positions.max())}")
        return bt[idx] * self.block_size + positions % self.block_size

    def _forward(self, token_ids, positions, write_slots, attend) -> np.ndarray:
        """Run every layer over rows ``token_ids`` at ``positions``; return final-normed hidden [n, H].

        ``attend(layer, q)`` maps q [n, heads, head_dim] to [n, heads * head_dim]
        reading K/V from the cache, which already holds this call's rows.
        """
        cfg = self.config
        n = len(token_ids)
        nq, nkv, hd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
        x = self.embed[np.asarray(token_ids, dtype=np.int64)]
        ang = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]
        ang = np.concatenate([ang, ang], axis=-1)[:, None, :]
        cos, sin = np.cos(ang), np.sin(ang)
        inter, nh = cfg.intermediate_size, cfg.num_heads
        with np.errstate(over="ignore"):  # exp(-g) of a very negative gate: inf, and silu's 0 is right
            for i, lw in enumerate(self.layers):
                h = rms_norm(x, lw.ln1, cfg.rms_norm_eps)
                qkv = lw.w_qkv(h)
                if lw.b_qkv is not None:
                    qkv += lw.b_qkv
                # q and k heads rotate together: [n, heads + kv_heads, hd]
                qk = apply_rope(qkv[:, : nq + nkv].reshape(n, nh + cfg.num_kv_heads, hd), cos, sin)
                self._k_slots[i][write_slots] = qk[:, nh:]
                self._v_slots[i][write_slots] = qkv[:, nq + nkv :].reshape(n, cfg.num_kv_heads, hd)
                x = x + lw.w_o(attend(i, qk[:, :nh]))
                h = rms_norm(x, lw.ln2, cfg.rms_norm_eps)
                gu = lw.w_gate_up(h)
                g = gu[:, :inter]
                act = g / (1.0 + np.exp(-g))
                x = x + lw.w_down(act * gu[:, inter:])
        return rms_norm(x, self.final_norm, cfg.rms_norm_eps)

    def _attend(self, layer: int, q: np.ndarray, ctx_slots: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        """Batched GQA: q [n, heads, hd]; ctx_slots [n, S] (padded); mask [n, T, S] additive, or None.

        Rows of q are grouped as n sequences of T query rows each (prefill: n=1,
        T=chunk; decode: n=lanes, T=1).
        """
        cfg = self.config
        n, s = ctx_slots.shape
        t = q.shape[0] // n
        kvh, g, hd = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        # One [kv_heads * head_dim] row per slot: np.take of whole rows copies faster than 4-D fancy indexing.
        flat = ctx_slots.reshape(-1)
        k = np.take(self._k_rows[layer], flat, axis=0).reshape(n, s, kvh, hd)
        v = np.take(self._v_rows[layer], flat, axis=0).reshape(n, s, kvh, hd)
        # Query rows per kv head: [n, kvh, g*T, hd], head h reading kv head h // g (HF's repeat_kv);
        # the 1/sqrt(hd) scale on q (exact for hd a power of 4) rather than on the [.., S] scores.
        qh = (q * np.float32(1.0 / math.sqrt(hd))).reshape(n, t, kvh, g, hd).transpose(0, 2, 3, 1, 4)
        scores = qh.reshape(n, kvh, g * t, hd) @ k.transpose(0, 2, 3, 1)  # [n, kvh, g*T, S]
        if mask is not None:
            scores = scores.reshape(n, kvh, g, t, s)
            scores += mask[:, None, None, :, :]
        p = _softmax_inplace(scores).reshape(n, kvh, g * t, s)
        o = p @ v.transpose(0, 2, 1, 3)  # [n, kvh, g*T, hd]
        return o.reshape(n, kvh, g, t, hd).transpose(0, 3, 1, 2, 4).reshape(n * t, cfg.num_heads * hd)

    def _logits(self, h: np.ndarray) -> np.ndarray:
        return self.lm_head(h)

    # --- the step interface -------------------------------------------------------------

    def prefill(self, span: PrefillSpan, out: StepOutput) -> None:
        """Run the chunk at ``start_pos``.. over everything earlier in its blocks, causally within."""
        t = len(span.token_ids)
        if t == 0:
            raise ValueError("empty prefill span")
        end = span.start_pos + t
        positions = np.arange(span.start_pos, end, dtype=np.int64)
        ctx_slots = self._slots(span.block_table, np.arange(end, dtype=np.int64))
        write = ctx_slots[span.start_pos :]
        mask = np.where(np.arange(end)[None, :] <= positions[:, None], 0.0, -np.inf).astype(np.float32)[None]
        h = self._forward(span.token_ids, positions, write, lambda i, q: self._attend(i, q, ctx_slots[None], mask))
        if span.want_prompt_logprobs is not None:
            out.prompt_logprobs = self._prompt_logprobs(h, span)
        if span.sample is None and not span.want_logits:
            return
        logits = self._logits(h[-1:])
        if span.want_logits:
            out.prefill_logits = logits[0].copy()
        if span.sample is not None:
            tokens, lps = sampler.sample_rows(logits, [span.sample], [end])
            out.prefill_token, out.prefill_logprob = tokens[0], lps[0]

    def _prompt_logprobs(self, h: np.ndarray, span: PrefillSpan, rows: int = 64) -> list[TokenLogprob]:
        """Row j's log-softmax scores the token after it (see PrefillSpan.want_prompt_logprobs), top-n too."""
        targets = list(span.token_ids[1:]) + ([span.next_prompt_token] if span.next_prompt_token is not None else [])
        out: list[TokenLogprob] = []
        for r0 in range(0, len(targets), rows):  # logits for a block of rows at a time: [rows, vocab]
            logits = self._logits(h[r0 : min(r0 + rows, len(targets))])
            out += [sampler.token_logprob(row, t, span.want_prompt_logprobs) for row, t in zip(logits, targets[r0:])]
        return out

    def decode_round(self, lanes: Sequence[DecodeLane], out: StepOutput) -> None:
        """One forward over all lanes, then one sampling call over all rows."""
        if not lanes:
            return
        logits = self.decode_logits(lanes)
        positions = [ln.position + 1 for ln in lanes]
        out.decode_tokens, out.decode_logprobs = sampler.sample_rows(logits, [ln.sample for ln in lanes], positions)

    def decode_logits(self, lanes: Sequence[DecodeLane]) -> np.ndarray:
        """The forward half of a decode round: write each lane's K/V, return logits [lanes, vocab].

        Each lane is one row; contexts are padded to the longest lane and masked.
        """
        positions = np.array([ln.position for ln in lanes], dtype=np.int64)
        span = np.arange(int(positions.max()) + 1, dtype=np.int64)
        ctx_slots = np.empty((len(lanes), len(span)), dtype=np.int64)
        for r, ln in enumerate(lanes):
            # Padding past a lane's own position repeats its last slot; the mask removes it.
            ctx_slots[r] = self._slots(ln.block_table, np.minimum(span, ln.position))
        mask = None  # lanes of one length pad nothing
        if positions.min() < positions.max():
            mask = np.where(span[None, :] <= positions[:, None], 0.0, -np.inf).astype(np.float32)[:, None, :]
        write = ctx_slots[np.arange(len(lanes)), positions]
        tokens = [ln.token_id for ln in lanes]
        h = self._forward(tokens, positions, write, lambda i, q: self._attend(i, q, ctx_slots, mask))
        return self._logits(h)

    # --- KV pages -------------------------------------------------------------------------

    def _host(self) -> tuple[np.ndarray, np.ndarray]:
        if self.host_k is None:
            if self.num_host_blocks < 1:
                raise RuntimeError("no host KV tier (host_kv_budget_bytes too small)")
            shape = (self.k.shape[0], self.num_host_blocks, *self.k.shape[2:])
            self.host_k, self.host_v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        return self.host_k, self.host_v

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        hk, hv = self._host()
        dev, host = (list(x) for x in zip(*pairs))
        hk[:, host] = self.k[:, dev]
        hv[:, host] = self.v[:, dev]

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        hk, hv = self._host()
        host, dev = (list(x) for x in zip(*pairs))
        self.k[:, dev] = hk[:, host]
        self.v[:, dev] = hv[:, host]

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        src, dst = (list(x) for x in zip(*pairs))
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def unload(self) -> None:
        for attr in (
            "embed",
            "lm_head",
            "final_norm",
            "layers",
            "k",
            "v",
            "k_cache",
            "v_cache",
            "_k_slots",
            "_v_slots",
            "_k_rows",
            "_v_rows",
        ):
            self.__dict__.pop(attr, None)
        self.host_k = self.host_v = None
        self.config = None
        self.plan = None
