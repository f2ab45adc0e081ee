"""The step interface: what the scheduler hands a backend, and what comes back.

One call per model load, per prefill group (one span, or several prompts
prefilled together: ``Backend.prefill_group``), per decode round (never one per
operator). Activations stay inside the backend; what crosses is token ids,
positions, block tables, sampling parameters and sampled tokens (plus logits
only at positions that asked for them).

KV memory is paged: the backend owns ``num_blocks`` device blocks of
``block_size`` token slots each (per layer, K and V) and ``num_host_blocks``
host blocks; the scheduler's KV manager only keeps the books (which block ids
a sequence holds). Token ``pos`` of a sequence lives in slot
``block_table[pos // block_size] * block_size + pos % block_size``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.memory import MemoryPlan
from engine.model_config import ModelConfig
from engine.sampling import SamplingParams

# DecodeLane.token_id of a round planned ahead (Backend.supports_async_rounds): "the token this
# lane drew in the step before", which the host does not know yet when it plans the round.
PENDING = -1


@dataclass
class SampleRequest:
    """What a row needs to draw its next token.

    ``seed`` is always set (the scheduler picks one for unseeded requests); the
    draw for position p uses a generator keyed by (seed, p) only.
    ``prompt_token_ids`` and ``output_token_ids`` feed the penalties
    (presence/frequency count output tokens, repetition counts both).
    """

    params: SamplingParams
    seed: int
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    num_logprobs: int = 0  # top-n alternatives to return (0: only the chosen one's)
    want_logprobs: bool = False
    # engine.constraint.GrammarConstraint: masks disallowed tokens before the draw (None: unconstrained).
    constraint: object | None = None
    # Tokens that cannot be drawn at this position (the stop ids, until params.min_tokens are out).
    suppress_token_ids: Sequence[int] = ()


@dataclass
class PrefillSpan:
    """A chunk of one sequence's prompt: tokens at positions start_pos.."""

    seq_id: int
    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    # Set on the prompt's last chunk: draw the first generated token.
    sample: SampleRequest | None = None
    # Return the raw logits of the last position (for /v1/decide).
    want_logits: bool = False
    # Score the chunk's prompt tokens (AddRequest.prompt_logprobs): None, or the top-n to return.
    # Row j's logits score token_ids[j + 1], the last row's ``next_prompt_token`` (the first
    # token of the next chunk; None on the prompt's last chunk, whose last row samples instead).
    want_prompt_logprobs: int | None = None
    next_prompt_token: int | None = None
    # A vision-language model (engine.models.qwen2_5_vl): the rows' three rope positions
    # (int64 [3, len(token_ids)], ``ops.MRope``; None: ``start_pos`` on, alike in all three), and
    # the prompt's images (``engine.models.vision.Image``) whose placeholders the span reaches:
    # the backend encodes one whose ``embeds`` is None, keeps its rows there (the sequence holds
    # them until its last placeholder is computed) and puts them in place of the placeholders'.
    rope_positions: np.ndarray | None = None
    images: list = field(default_factory=list)


@dataclass
class DecodeLane:
    """One row of a decode round: feed ``token_id`` at ``position`` (PENDING: the token the
    lane's row drew in the step before; the backend fills it in, engine/run_ahead.py).

    A speculating lane is several consecutive rows of one sequence (its last token,
    then its drafts, at consecutive positions): each row writes its K/V and attends
    up to its own position, so a row sees the drafts before it (engine/spec).
    """

    seq_id: int
    token_id: int
    position: int
    block_table: Sequence[int]
    sample: SampleRequest
    rope_delta: int = 0  # rope rotates at position + rope_delta (multimodal rope after images)


@dataclass
class StepPlan:
    """Everything the scheduler decided for one step, in execution order:
    swaps first, then the prefill (one span, or a group: ``prefill`` and
    ``prefill_more``), then one decode round over all lanes."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    prefill: PrefillSpan | None = None
    # Prompts prefilled with ``prefill`` in the same step (a group; engine/prefill_group.py):
    # whole prompts of other sequences, each span with its own positions, blocks and sample request.
    # Empty whenever ``prefill`` is None.
    prefill_more: list[PrefillSpan] = field(default_factory=list)
    decode: list[DecodeLane] = field(default_factory=list)
    # seq_id -> the drafts its rows verify (its rows: 1 + len(drafts) consecutive ones in ``decode``).
    drafts: dict[int, list[int]] = field(default_factory=dict)

    @property
    def prefills(self) -> list[PrefillSpan]:
        """The step's prefill spans in order: ``prefill`` then ``prefill_more`` ([] for none)."""
        return [] if self.prefill is None else [self.prefill, *self.prefill_more]

    @property
    def is_empty(self) -> bool:
        return not (self.swap_out or self.swap_in or self.prefill or self.decode)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class StepOutput:
    """What a step computed. The ``prefill_*`` and ``prompt_logprobs`` fields are ``plan.prefill``'s;
    each span of ``plan.prefill_more`` has its own in a StepOutput of ``prefill_more`` (same order)."""

    prefill_token: int | None = None  # set when the span carried a SampleRequest
    prefill_logprob: TokenLogprob | None = None
    prefill_logits: np.ndarray | None = None  # float32 [vocab] when want_logits
    prompt_logprobs: list[TokenLogprob] | None = None  # want_prompt_logprobs: one per scored token, in order
    decode_tokens: list[int] = field(default_factory=list)  # one per lane, in plan order
    decode_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prefill_seconds: float = 0.0  # the whole group's
    # Of those, until the backend had queued the prefill's last kernel (a device backend that says:
    # Backend.queued_at); the rest is the device finishing. Near prefill_seconds: the host's launches
    # set the pace (the interpreter lock, launch overhead), not the device.
    prefill_queued_seconds: float | None = None
    decode_seconds: float = 0.0
    prefill_more: list[StepOutput] = field(default_factory=list)
    # Set by ``Backend.step(defer=True)`` on a round queued but not yet read back (the backend's own
    # handle): ``decode_*`` are empty until ``Backend.finish`` fills them.
    unfinished: object | None = None

    @property
    def prefill_results(self) -> list[StepOutput]:
        """One result per span of ``plan.prefills``: this output itself, then ``prefill_more``."""
        return [self, *self.prefill_more]


class Backend(abc.ABC):
    """A model on some device. Subclasses: numpy (reference), cuda."""

    name: str = "abstract"
    supports_prompt_logprobs: bool = False  # PrefillSpan.want_prompt_logprobs (else the scheduler refuses)
    # When every layer slides (ModelConfig.all_layers_slide), attention never reads a block-table
    # entry behind the window: the scheduler may then release those pages, leaving -1 there
    # (engine.kv_manager.RELEASED), which this backend must never dereference.
    releases_window_pages: bool = False
    # Most rows one decode round may carry (lanes plus their drafts); a backend that cannot
    # run several rows of one sequence in a round keeps this at 0 (no speculation).
    max_round_rows: int = 0
    # Of those, the most the round's drafts may bring it to (0: max_round_rows); rows of known
    # tokens (a short prompt's tail, forced tokens after a take-back) may fill the rest.
    max_draft_rows: int = 0
    # How far the last step got: "plan" (nothing ran yet; the worker sets it), "swaps" (the
    # page copies ran or raised), "rows" (the swaps are done; the prefill or decode ran).
    step_stage: str = "plan"
    # Rounds planned ahead (engine/run_ahead.py): a row may feed PENDING, the token its lane drew in
    # the step before, which this backend keeps (``last_tokens``; on a GPU it would stay in a device
    # buffer). False: the worker plans every round after the one before has come back.
    supports_async_rounds: bool = False
    # perf_counter() when a device backend had queued its prefill's last kernel (before waiting for
    # it); StepOutput.prefill_queued_seconds. None: the backend does not say.
    queued_at: float | None = None
    # Runs a prefill group in one forward (``prefill_group`` overridden), so a group costs less than
    # its spans one by one. False (the default's loop): the scheduler does not group, since grouping
    # would only hold the first prompts' first tokens back until the last span ran.
    prefills_together: bool = False
    # ``step(plan, defer=True)`` may return a decode round before its tokens are in (``StepOutput.unfinished``;
    # ``finish`` waits for them), so the round queued behind it starts on the device first.
    defers_rounds: bool = False

    def __init__(self) -> None:
        self.config: ModelConfig | None = None
        self.plan: MemoryPlan | None = None
        self.last_tokens: dict[int, int] = {}  # seq_id -> the token its last row drew in the last decode round

    @abc.abstractmethod
    def load(
        self,
        config: ModelConfig,
        weights: dict[str, np.ndarray],
        *,
        block_size: int,
        kv_budget_bytes: int | None,
        host_kv_budget_bytes: int,
        max_context: int,
    ) -> MemoryPlan:
        """Take the weights in, size the KV pool, return the plan."""

    @abc.abstractmethod
    def prefill(self, span: PrefillSpan, out: StepOutput) -> None:
        """Write the span's K/V into its blocks; fill ``out.prefill_*``."""

    def prefill_group(self, spans: Sequence[PrefillSpan], outs: Sequence[StepOutput]) -> None:
        """Several prompts' spans in one step, span i's results into ``outs[i]``. This default runs them
        one by one; a backend that runs them in one forward must give each span exactly what its
        ``prefill`` alone gives (a row's results never depend on the other spans)."""
        for span, out in zip(spans, outs, strict=True):
            self.prefill(span, out)

    @abc.abstractmethod
    def decode_round(self, lanes: Sequence[DecodeLane], out: StepOutput) -> None:
        """One batched forward over all lanes; fill ``out.decode_tokens``."""

    @abc.abstractmethod
    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None: ...

    @abc.abstractmethod
    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None: ...

    @abc.abstractmethod
    def unload(self) -> None:
        """Free everything the load took."""

    def stats(self) -> dict:
        """Counters of the backend's own that status and metrics report ({}: none). Read from the
        engine's receive loop while a step may run: plain numbers only."""
        return {}

    def step(self, plan: StepPlan) -> StepOutput:
        """Run one scheduler plan. Called on the engine's dedicated thread."""
        import time

        out = StepOutput()
        # The tokens a round planned ahead feeds, forgotten at once: should this step raise, the round
        # queued behind it raises too (a KeyError in fill_pending), never feeding older tokens.
        last, self.last_tokens = self.last_tokens, {}
        self.step_stage = "swaps"  # where a step that raises got to (the worker's _isolate reads it)
        if plan.swap_out:
            self.swap_out(plan.swap_out)
        if plan.swap_in:
            self.swap_in(plan.swap_in)
        self.step_stage = "rows"
        if plan.prefill is not None:
            t0 = time.perf_counter()
            self.queued_at = None
            if plan.prefill_more:
                out.prefill_more = [StepOutput() for _ in plan.prefill_more]
                self.prefill_group(plan.prefills, out.prefill_results)
            else:
                self.prefill(plan.prefill, out)
            out.prefill_seconds = time.perf_counter() - t0
            if self.queued_at is not None:
                out.prefill_queued_seconds = self.queued_at - t0
        if plan.decode:
            t0 = time.perf_counter()
            if self.supports_async_rounds:
                self.fill_pending(plan.decode, last)
            self.decode_round(plan.decode, out)
            out.decode_seconds = time.perf_counter() - t0
            if self.supports_async_rounds:  # a lane's last row's draw is what its next row feeds
                self.last_tokens = {ln.seq_id: int(t) for ln, t in zip(plan.decode, out.decode_tokens)}
        return out

    def fill_pending(self, lanes: Sequence[DecodeLane], last: dict[int, int]) -> None:
        """Rows feeding PENDING get the token their lane drew in the step before (``last``), written into
        the lane (the host reads it only to run the row again: the worker's _isolate). A backend that
        keeps the tokens on its device overrides this."""
        for ln in lanes:
            if ln.token_id == PENDING:
                ln.token_id = last[ln.seq_id]

    def finish(self, out: StepOutput) -> StepOutput:
        """``out`` with its decode tokens in (``defers_rounds``: a round ``step(defer=True)`` returned
        queued); this default has nothing to wait for."""
        return out
