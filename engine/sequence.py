"""A request as the scheduler sees it: its tokens, its pages, its place in line."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from engine.backend import SampleRequest
from engine.sampling import SamplingParams


class SequenceStatus(IntEnum):
    """Ordered: anything after PREEMPTED is finished."""

    WAITING = 0  # admitted, prompt not started
    PREFILLING = 1  # holds the prefill lane
    DECODING = 2  # holds device pages, decodes every round
    PREEMPTED = 3  # pages moved to host; resumes without recomputing
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def is_finished(self) -> bool:
        return self > SequenceStatus.PREEMPTED


FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}

# Lower ranks first: the class decides who is protected, arrival breaks ties.
CLASS_RANK = {"interactive": 0, "agent": 1}


@dataclass(eq=False)
class Sequence:
    seq_id: int  # also the arrival index
    request_id: str  # the scheduler never sees where replies go: the worker keeps that
    prompt_token_ids: list[int]
    max_tokens: int  # effective cap: already clamped to the context
    sampling: SamplingParams
    seed: int
    stop_token_ids: frozenset[int] = frozenset()
    request_class: str = "interactive"
    num_logprobs: int = 0
    want_logprobs: bool = False
    is_decide: bool = False  # prefill only, answer with last-position logits
    arrival_time: float = 0.0
    constraint: object | None = None  # engine.constraint.GrammarConstraint
    shared_prefix_len: int = 0  # leading prompt tokens to pin as a shared prefix once computed
    prompt_logprobs: int | None = None  # score the prompt (top-n), AddRequest.prompt_logprobs
    prompt_lps: list[dict] | None = None  # scored so far; None again once sent
    prompt_lps_sent: bool = False
    decide_token_ids: list[int] | None = None  # AddRequest.decide_token_ids
    first_token_time: float | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # KV books, kept by the KVManager.
    block_table: list[int] = field(default_factory=list)  # device blocks
    host_block_table: list[int] = field(default_factory=list)  # while PREEMPTED
    block_hashes: list[int] = field(default_factory=list)  # of the full prompt blocks computed so far
    num_released_blocks: int = 0  # leading block_table entries released behind the window (KVManager.RELEASED)
    num_computed_tokens: int = 0  # positions whose K/V are written
    num_cached_tokens: int = 0  # prompt tokens claimed from retained state
    prompt_in_round: bool = False  # its prompt's tail is fed as decode rows (Scheduler._admit_short)
    # Speculation (engine/spec): the drafter that proposes this sequence's next tokens (None:
    # it never speculates), its k controller, and the request's prediction tokens drafted /
    # accepted so far (Predicted Outputs' usage).
    drafter: object | None = None
    k_control: object | None = None
    num_drafted: int = 0
    num_accepted: int = 0
    num_spec_drafted: int = 0  # drafts of every drafter verified for this sequence ...
    num_spec_accepted: int = 0  # ... and kept (usage's ``speculation``)
    # The reasoning channel (engine.spec.reasoning.ReasoningWatch; None: not watched) and the output
    # tokens taken back from the books so far (they were generated and streamed: they count).
    reasoning: object | None = None
    num_taken_back: int = 0
    # A vision-language model's request: its images (engine.models.vision.Image, prompt order;
    # each keeps its encoded rows from the chunk that first reaches it until its last
    # placeholder is computed), its prompt rows' three rope positions [3, num_prompt_tokens]
    # (None: a text-only prompt, rows rotate at their position) and the offset every later
    # position rotates at (engine.models.vision.rope_index).
    images: list = field(default_factory=list)
    rope_positions: np.ndarray | None = None
    rope_delta: int = 0

    @property
    def rank(self) -> tuple[int, int]:
        return (CLASS_RANK.get(self.request_class, len(CLASS_RANK)), self.seq_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASON.get(self.status)

    @property
    def num_generated(self) -> int:
        """Tokens generated so far: the output plus those taken back (what max_tokens caps)."""
        return len(self.output_token_ids) + self.num_taken_back

    @property
    def num_remaining_tokens(self) -> int:
        return max(0, self.max_tokens - self.num_generated)

    def token_ids_at(self, start: int, end: int) -> list[int]:
        """The sequence's tokens at positions ``start`` to ``end`` (prompt, then output)."""
        p = self.num_prompt_tokens
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - p)]

    def rope_positions_at(self, start: int, end: int) -> np.ndarray | None:
        """The three rope positions [3, end - start] of positions ``start`` to ``end`` (None: text only)."""
        if self.rope_positions is None:
            return None
        p = self.num_prompt_tokens
        later = np.arange(max(start, p), max(end, p), dtype=np.int64) + self.rope_delta
        return np.concatenate([self.rope_positions[:, start:end], np.broadcast_to(later, (3, len(later)))], axis=1)

    def images_at(self, start: int, end: int) -> list:
        """The images with placeholders among positions ``start`` to ``end``."""
        return [img for img in self.images if img.offset < end and img.end > start]

    def drop_image_rows(self, computed: int) -> None:
        """Forget the encoded rows of images whose placeholders are all below ``computed``
        (every image when 0: a recompute encodes again)."""
        for img in self.images:
            if computed == 0 or img.end <= computed:
                img.embeds = None

    @property
    def holds_lane(self) -> bool:
        """Counts against the decode lanes (a decide request never does)."""
        return not self.is_decide and not self.is_finished

    def sample_request(self, drafts: list[int] | tuple[int, ...] = ()) -> SampleRequest:
        """What the next row samples with; ``drafts``: tokens assumed to follow the output (a verify
        row after them counts them for the penalties and ``min_tokens``)."""
        output = self.output_token_ids + list(drafts) if drafts else self.output_token_ids
        return SampleRequest(
            params=self.sampling,
            seed=self.seed,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=output,
            num_logprobs=self.num_logprobs,
            want_logprobs=self.want_logprobs,
            constraint=self.constraint,
            suppress_token_ids=sorted(self.stop_token_ids) if len(output) < self.sampling.min_tokens else (),
        )
