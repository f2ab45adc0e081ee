"""The reference backend: float32 numpy on the CPU, paged KV cache.

The model itself (weights and the layer loop built from its definition) is
``forward.NumpyModel``; this module holds what the step interface adds: the
memory plan, the KV pool and its host tier, and turning prefill spans and
decode lanes into slots and masks.

* The KV cache is one array per K and V, ``[layers, num_blocks, block_size,
  kv_heads, head_dim]``; ``k_cache[layer]`` is the per-layer view the step
  interface describes. Token ``pos`` of a sequence lives in slot
  ``block_table[pos // block_size] * block_size + pos % block_size``.
* Attention gathers each row's context by slot. Decode pads the lanes'
  contexts to the longest one and masks the padding, so a round is one batched
  matmul per layer rather than a Python loop per lane.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine import sampler
from engine.backend import Backend, DecodeLane, PrefillSpan, StepOutput, TokenLogprob
from engine.backends import host_tier
from engine.memory import MemoryPlan, kv_block_bytes, workspace_bytes

from .forward import KVViews, NumpyModel
from .linear import gemm_rows_independent, plain_gemm
from .vision import VisionTower

# Without a KV budget the pool holds this many max-context sequences.
_LANES_FOR_DEFAULT_BUDGET = 8


def limit_blas_threads(threads: int) -> None:
    """Cap BLAS at ``threads`` (0: leave it as it is, e.g. to the OPENBLAS_NUM_THREADS it started with).

    On the 2-core machine the step thread shares the cores with the event loop and,
    often, other processes; OpenBLAS's spinning workers then made a decode round up
    to 14x slower with 2 threads than with 1 (docs/PERFORMANCE.md, numpy backend).
    """
    if threads <= 0:
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - a requirement; without it BLAS keeps its default
        return
    threadpool_limits(threads, user_api="blas")


class NumpyBackend(Backend):
    """float32 CPU backend; the reference every other backend is checked against."""

    name = "numpy"
    supports_prompt_logprobs = True
    releases_window_pages = True  # no row gathers a slot behind its own window (_window_start)
    max_round_rows = 16  # each row is a product row on the CPU: more costs time (docs/SPECULATION.md)
    supports_async_rounds = True  # a row may feed PENDING: Backend.step fills it from last_tokens
    prefills_together = True  # prefill_group: one forward for the spans that group exactly

    def __init__(self, *, blas_threads: int = 1) -> None:
        super().__init__()
        self.blas_threads = blas_threads  # EngineConfig.blas_threads

    def load(self, config, weights, *, block_size, kv_budget_bytes, host_kv_budget_bytes, max_context) -> MemoryPlan:
        cfg = self.config = config
        limit_blas_threads(self.blas_threads)
        self.model = NumpyModel(cfg, weights)
        # A group shares one forward only where the BLAS keeps a row's bits whatever its row count.
        self.prefills_together = gemm_rows_independent(
            cfg.hidden_size, (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size)
        )
        self.vision = VisionTower(cfg.vision, weights) if cfg.vision is not None else None
        self.block_size = block_size
        block_bytes = kv_block_bytes(cfg, block_size)
        if kv_budget_bytes is None:
            num_blocks = -(-max_context // block_size) * _LANES_FOR_DEFAULT_BUDGET
        else:
            num_blocks = int(kv_budget_bytes // block_bytes)
        if num_blocks < 1:
            raise ValueError(f"KV budget {kv_budget_bytes} B holds no block of {block_bytes} B")
        num_host_blocks = int(host_kv_budget_bytes // block_bytes)
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # np.zeros maps pages lazily, so an unused pool costs address space, not RAM.
        self.k = np.zeros(shape, np.float32)
        self.v = np.zeros(shape, np.float32)
        self.k_cache = [self.k[i] for i in range(cfg.num_layers)]
        self.v_cache = [self.v[i] for i in range(cfg.num_layers)]
        self.kv = KVViews.of(self.k, self.v)
        self.num_host_blocks = num_host_blocks
        self.host_k = self.host_v = None  # allocated on the first swap_out
        weight_bytes = self.model.nbytes + (self.vision.nbytes if self.vision is not None else 0)
        workspace = workspace_bytes(cfg)  # one 8-lane round plus its logits; prefill chunks reuse it
        self.plan = MemoryPlan(
            budget_bytes=weight_bytes + workspace + num_blocks * block_bytes,
            weights_bytes=int(weight_bytes),
            workspace_bytes=int(workspace),
            kv_bytes=num_blocks * block_bytes,
            block_size=block_size,
            num_blocks=num_blocks,
            host_kv_bytes=num_host_blocks * block_bytes,
            num_host_blocks=num_host_blocks,
        )
        return self.plan

    # --- the step interface -------------------------------------------------------------

    def _slots(self, block_table: Sequence[int], positions: np.ndarray) -> np.ndarray:
        bt = np.asarray(block_table, dtype=np.int64)
        idx = positions // self.block_size
        if len(positions) and idx.max() >= len(bt):
            raise ValueError(f"block table of {len(bt)} blocks does not reach position {int(positions.max())}")
        blocks = bt[idx]
        if len(blocks) and blocks.min() < 0:
            raise ValueError(f"position {int(positions[blocks.argmin()])} lies in a block released behind the window")
        return blocks * self.block_size + positions % self.block_size

    def prefill(self, span: PrefillSpan, out: StepOutput) -> None:
        """Run the chunk at ``start_pos``.. over everything earlier in its blocks, causally within."""
        t = len(span.token_ids)
        if t == 0:
            raise ValueError("empty prefill span")
        end = span.start_pos + t
        positions = np.arange(span.start_pos, end, dtype=np.int64)
        ctx = np.arange(self._window_start(span.start_pos), end, dtype=np.int64)
        ctx_slots = self._slots(span.block_table, ctx)
        write = ctx_slots[span.start_pos - int(ctx[0]) :]
        h = self.model.forward(span.token_ids, positions, write, ctx_slots[None], ctx[None], self.kv,
                               rope_positions=span.rope_positions, embeds=self._image_rows(span))  # fmt: skip
        self._span_results(h, span, out)

    def prefill_group(self, spans: Sequence[PrefillSpan], outs: Sequence[StepOutput]) -> None:
        """Several prompts' spans in one forward: the products over every row at once, attention span
        by span (``NumpyModel.forward``'s ``parts``), each span's logits and draw as its ``prefill``
        alone takes them. Only spans whose products run as plain GEMMs alone (``plain_gemm``: then a
        row's bits do not depend on the rows beside it) join that forward; the others, and spans with
        images or rope positions of their own, run one by one."""
        # (prefills_together: load's probe, gemm_rows_independent)
        together = [(s, o) for s, o in zip(spans, outs, strict=True) if plain_gemm(len(s.token_ids))]
        together = together if self.prefills_together and len(together) >= 2 else []
        together = [] if any(s.images or s.rope_positions is not None for s, _ in together) else together
        for span, out in zip(spans, outs):
            if all(span is not s for s, _ in together):
                self.prefill(span, out)
        if not together:
            return
        tokens, positions, writes, parts = [], [], [], []
        for span, _ in together:
            t, r0 = len(span.token_ids), len(tokens)
            if t == 0:
                raise ValueError("empty prefill span")
            end = span.start_pos + t
            ctx = np.arange(self._window_start(span.start_pos), end, dtype=np.int64)
            ctx_slots = self._slots(span.block_table, ctx)
            tokens += span.token_ids
            positions.append(np.arange(span.start_pos, end, dtype=np.int64))
            writes.append(ctx_slots[span.start_pos - int(ctx[0]) :])
            parts.append((r0, r0 + t, ctx_slots[None], ctx[None]))
        h = self.model.forward(tokens, np.concatenate(positions), np.concatenate(writes), None, None, self.kv,
                               parts=parts)  # fmt: skip
        for (span, out), (r0, r1, *_) in zip(together, parts, strict=True):
            self._span_results(h[r0:r1], span, out)

    def _span_results(self, h: np.ndarray, span: PrefillSpan, out: StepOutput) -> None:
        """A span's results from its rows' final hidden states ``h``: prompt scores, logits, the draw."""
        end = span.start_pos + len(span.token_ids)
        if span.want_prompt_logprobs is not None:
            out.prompt_logprobs = self._prompt_logprobs(h, span)
        if span.sample is None and not span.want_logits:
            return
        logits = self.model.logits(h[-1:])
        if span.want_logits:
            out.prefill_logits = logits[0].copy()
        if span.sample is not None:
            tokens, lps = sampler.sample_rows(logits, [span.sample], [end])
            out.prefill_token, out.prefill_logprob = tokens[0], lps[0]

    def _image_rows(self, span: PrefillSpan) -> list[tuple[int, np.ndarray]]:
        """(span row, rows) of every image the span reaches, encoding an image the first time."""
        if not span.images:
            return []
        if self.vision is None:
            raise ValueError("a prefill span with images on a model without a vision tower")
        out, end = [], span.start_pos + len(span.token_ids)
        for img in span.images:
            if img.embeds is None:
                img.embeds = self.vision.encode(img.pixel_values, img.grid_thw)
            lo, hi = max(img.offset, span.start_pos), min(img.end, end)
            if lo < hi:
                out.append((lo - span.start_pos, img.embeds[lo - img.offset : hi - img.offset]))
        return out

    def _prompt_logprobs(self, h: np.ndarray, span: PrefillSpan, rows: int = 64) -> list[TokenLogprob]:
        """Row j's log-softmax scores the token after it (see PrefillSpan.want_prompt_logprobs), top-n too."""
        targets = list(span.token_ids[1:]) + ([span.next_prompt_token] if span.next_prompt_token is not None else [])
        out: list[TokenLogprob] = []
        for r0 in range(0, len(targets), rows):  # logits for a block of rows at a time: [rows, vocab]
            logits = self.model.logits(h[r0 : min(r0 + rows, len(targets))])
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
        span = np.arange(self._window_start(int(positions.min())), int(positions.max()) + 1, dtype=np.int64)
        ctx_slots = np.empty((len(lanes), len(span)), dtype=np.int64)
        for r, ln in enumerate(lanes):
            # Padding past a lane's own position repeats its last slot, and positions behind its
            # own window (within another lane's) its first one: the mask removes both, and a
            # page released behind the lane's window is never read.
            ctx_slots[r] = self._slots(ln.block_table, np.clip(span, self._window_start(ln.position), ln.position))
        write = ctx_slots[np.arange(len(lanes)), positions - int(span[0])]
        tokens = [ln.token_id for ln in lanes]
        ctx = np.broadcast_to(span, ctx_slots.shape)
        deltas = np.array([ln.rope_delta for ln in lanes], dtype=np.int64)
        rope = positions + deltas if deltas.any() else None
        return self.model.logits(self.model.forward(tokens, positions, write, ctx_slots, ctx, self.kv,
                                                    rope_positions=rope))  # fmt: skip

    def _window_start(self, position: int) -> int:
        """The first position any layer of a query at ``position`` reads: behind every
        layer's window (mistral's all-sliding layers) nothing is gathered, so pages
        released there are never read."""
        cfg = self.config
        if not cfg.all_layers_slide:
            return 0
        window = max(cfg.layer_window(i) for i in range(cfg.num_layers))
        return max(0, position - window + 1)

    # --- KV pages -------------------------------------------------------------------------

    def _host(self) -> tuple[np.ndarray, np.ndarray]:
        return host_tier.host_pages(self)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(device block, host block) pairs: device pages to the host tier."""
        host_tier.swap_out(self, pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(host block, device block) pairs: host pages back into the pool."""
        host_tier.swap_in(self, pairs)

    def unload(self) -> None:
        for attr in ("model", "vision", "k", "v", "k_cache", "v_cache", "kv"):
            self.__dict__.pop(attr, None)
        self.host_k = self.host_v = None
        self.config = None
        self.plan = None
