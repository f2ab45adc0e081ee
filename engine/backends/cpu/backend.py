"""The cpu backend: compiled kernels over quantized weights, the step interface around them.

The model (``model.CpuModel``) runs a whole round -- every layer, attention over
the paged cache included -- in one C call, then one more for the logits rows
that are wanted; sampling stays in Python (``engine.sampler``). This module
holds what the step interface adds, with the numpy backend's semantics:

* The KV cache is float16 ``[layers, num_blocks, block_size, kv_heads,
  head_dim]``, the numpy backend's layout (token ``pos`` in slot
  ``block_table[pos // block_size] * block_size + pos % block_size``) at half
  its bytes: SmolLM2-135M keeps 46 KB of float32 K/V a token, so 8 lanes of
  300 tokens would read 110 MB of cache a round, more than the weights
  (97 MB). The cost, on one prompt of the default model: last logits 9.4e-5
  relative of numpy's against 8.3e-5 with a float32 cache; the speed-up was not measured
  apart on this shared machine.
* A round hands the kernels each row's context as slots: one flat list per
  sequence (a prefill chunk's rows share theirs, each seeing its own causal
  prefix), so lanes of different lengths need no padding.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from engine import sampler
from engine.backend import Backend, DecodeLane, PrefillSpan, StepOutput, TokenLogprob
from engine.backends import host_tier
from engine.memory import MemoryPlan, kv_block_bytes, workspace_bytes

from .model import CpuModel

# Prefill chunks of at least this many rows run their products and attention through the tiled
# kernels (kernels.c, "prefill"); decode rounds never do, so a lane's bits do not depend on the round.
TILED_ROWS = 16
_LANES_FOR_DEFAULT_BUDGET = 8  # as numpy: without a KV budget the pool holds 8 max-context sequences


def cpu_count() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class CpuBackend(Backend):
    """Quantized weights, C kernels, float16 paged KV; numerics within quantization of numpy's."""

    name = "cpu"
    supports_prompt_logprobs = True
    # The GGUF block types the loader keeps as stored (engine.loaders.gguf.QuantizedTensor).
    weights_as_stored = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})
    # A lane's verify rows are rows of the round, each attending up to its own position
    # (tests/engine/test_spec_model.py: tokens identical to speculation off).
    max_round_rows = 16
    supports_async_rounds = True  # rounds planned ahead: Backend.step fills PENDING rows (engine/run_ahead.py)
    prefills_together = True  # prefill_group: one C forward over the group's rows

    def __init__(self, *, threads: int = 0, isa: str | None = None, cache_dir: str | None = None) -> None:
        """Compile (or find in the cache) the kernels now, so a factory can fall back before a load."""
        super().__init__()
        from . import build

        # Unnamed: the best build this processor runs that this compiler builds (an older
        # compiler without -mavxvnni still gets avx2); the last failure is raised when none does.
        names = [isa] if isa else build.runnable_isas()
        for name in names:
            try:
                self.kernels = build.load_kernels(name, cache_dir or None)
                break
            except Exception:
                if name == names[-1]:
                    raise
        self.isa = name
        self.threads = threads if threads > 0 else cpu_count()

    def load(self, config, weights, *, block_size, kv_budget_bytes, host_kv_budget_bytes, max_context) -> MemoryPlan:
        cfg = config
        model = CpuModel(cfg, weights, self.kernels, self.threads)
        block_bytes = kv_block_bytes(cfg, block_size, bytes_per_value=2)
        if kv_budget_bytes is None:
            num_blocks = -(-max_context // block_size) * _LANES_FOR_DEFAULT_BUDGET
        else:
            num_blocks = int(kv_budget_bytes // block_bytes)
        if num_blocks < 1:
            raise ValueError(f"KV budget {kv_budget_bytes} B holds no block of {block_bytes} B")
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k, self.v = np.zeros(shape, np.float16), np.zeros(shape, np.float16)  # pages mapped lazily
        model.set_cache(self.k, self.v)
        self.model, self.config, self.block_size = model, cfg, block_size
        self.num_host_blocks = int(host_kv_budget_bytes // block_bytes)
        self.host_k = self.host_v = None
        workspace = workspace_bytes(cfg)
        self.plan = MemoryPlan(
            budget_bytes=model.nbytes + model.repacked_bytes + workspace + num_blocks * block_bytes,
            weights_bytes=int(model.nbytes),
            workspace_bytes=int(workspace),
            kv_bytes=num_blocks * block_bytes,
            block_size=block_size,
            num_blocks=num_blocks,
            host_kv_bytes=self.num_host_blocks * block_bytes,
            num_host_blocks=self.num_host_blocks,
        )
        return self.plan

    # --- the step interface -------------------------------------------------------------

    def _slots(self, block_table: Sequence[int], positions: np.ndarray) -> np.ndarray:
        bt = np.asarray(block_table, dtype=np.int64)
        idx = positions // self.block_size
        if len(positions) and idx.max() >= len(bt):
            raise ValueError(f"block table of {len(bt)} blocks does not reach position {int(positions.max())}")
        return bt[idx] * self.block_size + positions % self.block_size

    def _window_start(self, position: int) -> int:
        """As numpy's: behind every layer's window nothing is read (mistral's all-sliding layers)."""
        cfg = self.config
        if not cfg.all_layers_slide:
            return 0
        return max(0, position - max(cfg.layer_window(i) for i in range(cfg.num_layers)) + 1)

    def prefill(self, span: PrefillSpan, out: StepOutput) -> None:
        """Run the chunk at ``start_pos``.. over everything earlier in its blocks, causally within."""
        t = len(span.token_ids)
        if t == 0:
            raise ValueError("empty prefill span")
        end = span.start_pos + t
        positions = np.arange(span.start_pos, end, dtype=np.int64)
        p0 = self._window_start(span.start_pos)
        ctx_slots = self._slots(span.block_table, np.arange(p0, end, dtype=np.int64))
        write = ctx_slots[span.start_pos - p0 :]
        h = self.model.forward(span.token_ids, positions, write, ctx_slots, np.zeros(t, np.int32),
                               positions - p0 + 1, np.full(t, p0, np.int32), tiled_rows=TILED_ROWS)  # fmt: skip
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

    def prefill_group(self, spans: Sequence[PrefillSpan], outs: Sequence[StepOutput]) -> None:
        """Several prompts' spans (a group), each with its own context list, in one forward per kernel
        path: spans of at least TILED_ROWS rows together through the tiled kernels, shorter ones
        together through the decode kernels, as each runs alone (a row's bits are its own on either
        path, never the other spans'); then the wanted logits rows in one call, and the draws."""
        for tiled in (True, False):
            group = [(s, o) for s, o in zip(spans, outs, strict=True) if (len(s.token_ids) >= TILED_ROWS) == tiled]
            if not group:
                continue
            tokens, positions, writes, slots, off, n_ctx, p0s, rows = [], [], [], [], [], [], [], []
            n_slots = 0
            for span, _ in group:
                t, end = len(span.token_ids), span.start_pos + len(span.token_ids)
                if t == 0:
                    raise ValueError("empty prefill span")
                pos = np.arange(span.start_pos, end, dtype=np.int64)
                p0 = self._window_start(span.start_pos)
                ctx_slots = self._slots(span.block_table, np.arange(p0, end, dtype=np.int64))
                rows.append(len(tokens))
                tokens += span.token_ids
                positions.append(pos)
                writes.append(ctx_slots[span.start_pos - p0 :])
                slots.append(ctx_slots)
                off.append(np.full(t, n_slots, np.int32))
                n_ctx.append(pos - p0 + 1)
                p0s.append(np.full(t, p0, np.int32))
                n_slots += len(ctx_slots)
            rows.append(len(tokens))
            h = self.model.forward(tokens, np.concatenate(positions), np.concatenate(writes), np.concatenate(slots),
                                   np.concatenate(off), np.concatenate(n_ctx), np.concatenate(p0s),
                                   tiled_rows=TILED_ROWS if tiled else 0)  # fmt: skip
            wanted = [j for j, (s, _) in enumerate(group) if s.sample is not None or s.want_logits]
            logits = self.model.logits(h[[rows[j + 1] - 1 for j in wanted]]) if wanted else None
            for j, (span, out) in enumerate(group):
                if span.want_prompt_logprobs is not None:
                    out.prompt_logprobs = self._prompt_logprobs(h[rows[j] : rows[j + 1]], span)
            for row, j in zip(logits if wanted else (), wanted):
                span, out = group[j]
                if span.want_logits:
                    out.prefill_logits = row.copy()
                if span.sample is not None:
                    drawn, lps = sampler.sample_rows(row[None], [span.sample], [span.start_pos + len(span.token_ids)])
                    out.prefill_token, out.prefill_logprob = drawn[0], lps[0]

    def _prompt_logprobs(self, h: np.ndarray, span: PrefillSpan, rows: int = 64) -> list[TokenLogprob]:
        """Row j's log-softmax scores the token after it (see PrefillSpan.want_prompt_logprobs)."""
        targets = list(span.token_ids[1:]) + ([span.next_prompt_token] if span.next_prompt_token is not None else [])
        out: list[TokenLogprob] = []
        for r0 in range(0, len(targets), rows):
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
        """Write each lane's K/V and return logits [lanes, vocab]; each lane reads only its own context."""
        positions = np.array([ln.position for ln in lanes], dtype=np.int64)
        slide = self.config.all_layers_slide  # a walk over the layers: once a round, not once a lane
        p0 = np.array([self._window_start(int(p)) if slide else 0 for p in positions], dtype=np.int64)
        slots = [self._lane_slots(ln.block_table, int(s), int(p) + 1) for ln, s, p in zip(lanes, p0, positions)]
        n_ctx = positions - p0 + 1
        offsets = np.concatenate([[0], np.cumsum(n_ctx)[:-1]])
        write = np.array([s[-1] for s in slots], dtype=np.int64)
        h = self.model.forward([ln.token_id for ln in lanes], positions, write, np.concatenate(slots), offsets,
                               n_ctx, p0)  # fmt: skip
        return self.model.logits(h)

    def _lane_slots(self, block_table: Sequence[int], start: int, end: int) -> np.ndarray:
        """:meth:`_slots` of the positions ``start .. end - 1``: every slot of the lane's blocks, sliced."""
        bs = self.block_size
        first, last = start // bs, -(-end // bs)
        if last > len(block_table):
            raise ValueError(f"block table of {len(block_table)} blocks does not reach position {end - 1}")
        bt = np.asarray(block_table[first:last], dtype=np.int64)
        return (bt[:, None] * bs + np.arange(bs)).ravel()[start - first * bs : end - first * bs]

    # --- KV pages -------------------------------------------------------------------------

    def _host(self) -> tuple[np.ndarray, np.ndarray]:
        return host_tier.host_pages(self)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(device block, host block) pairs: pool pages to the host tier."""
        host_tier.swap_out(self, pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(host block, device block) pairs: host pages back into the pool."""
        host_tier.swap_in(self, pairs)

    def unload(self) -> None:
        for attr in ("model", "k", "v"):
            self.__dict__.pop(attr, None)
        self.host_k = self.host_v = None
        self.config = None
        self.plan = None
