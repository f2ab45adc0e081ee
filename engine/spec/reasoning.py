"""The reasoning channel as the engine follows it: inside or not, how long, looping or not.

The engine never parses text. The Django side names, per request
(``AddRequest.reasoning``), the token ids of the model's start and end tags
(each a list of alternative tokenizations: ``</think>`` and `` </think>`` differ),
the ids to force when the thinking must end (the end tag plus what the template
puts after it), whether the prompt already opened the channel, a budget and
whether the loop guard watches. :class:`ReasoningWatch` follows the committed
output token by token and answers when a take-back is due:

* ``loop``: the :class:`~engine.spec.loop_guard.LoopGuard` saw a span repeat back
  to back; keep the output up to the end of its first occurrence;
* ``budget``: ``max_tokens`` reasoning tokens are committed (the tags' own
  tokens inside the channel count; the start tag's, committed outside, do not);
  keep everything.

The scheduler then cuts the output back and appends ``close_ids`` as forced
tokens (``cut_back``: the output, the computed tokens, the pages past the new
length and the drafter's index all follow), and the watch is shut (``closed``). A later start tag opens the channel
again (with a fresh guard); the budget counts every reasoning token so far, so a
reopened channel past it closes at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_manager import KVManager
from engine.sequence import Sequence as Seq
from engine.spec import rounds
from engine.spec.loop_guard import LoopGuard

LOOP, BUDGET = "loop", "budget"


def _ends_with(output: Sequence[int], tags: Sequence[Sequence[int]]) -> bool:
    n = len(output)
    return any(tag and n >= len(tag) and list(output[n - len(tag) :]) == list(tag) for tag in tags)


@dataclass
class ReasoningWatch:
    start_ids: list[list[int]]
    end_ids: list[list[int]]
    close_ids: list[int]
    budget: int | None = None  # reasoning tokens at most (None: no budget)
    guard: LoopGuard | None = None
    inside: bool = False
    begin: int = 0  # output index where the current stretch of reasoning began
    count: int = 0  # reasoning tokens committed, taken-back ones included
    take_backs: list[tuple[str, int]] = field(default_factory=list)  # (reason, tokens taken back)

    @classmethod
    def from_request(cls, spec: dict | None, cfg: EngineConfig) -> ReasoningWatch | None:
        """The watch for ``AddRequest.reasoning`` (None: the request has no reasoning to watch)."""
        if not spec or not spec.get("close_ids"):
            return None
        guard = None
        if spec.get("guard", True) and cfg.loop_guard:
            lo = max(1, cfg.loop_guard_min_span)
            guard = LoopGuard(lo, max(lo, cfg.loop_guard_max_span), max(2, cfg.loop_guard_count))
        budget = spec.get("max_tokens")
        if guard is None and budget is None:
            return None
        return cls(
            start_ids=[list(t) for t in spec.get("start_ids") or []],
            end_ids=[list(t) for t in spec.get("end_ids") or []],
            close_ids=list(spec["close_ids"]),
            budget=budget,
            guard=guard,
            inside=bool(spec.get("open")),
        )

    def due_now(self) -> bool:
        """Before any output: the prompt opened the channel and the budget is already spent (0)."""
        return self.inside and self.budget is not None and self.count >= self.budget

    def commit(self, output: Sequence[int]) -> tuple[str, int, int] | None:
        """``output[-1]`` was just committed: ``(reason, keep, span)`` when a take-back is due
        (keep the first ``keep`` output tokens; ``span``: the loop's, 0 for the budget), else None."""
        if not self.inside:
            if _ends_with(output, self.start_ids):
                self.inside, self.begin = True, len(output)
                if self.guard is not None:
                    self.guard.truncate(0)
                if self.budget is not None and self.count >= self.budget:
                    return BUDGET, len(output), 0
            return None
        self.count += 1
        span = self.guard.push(output[-1]) if self.guard is not None else None
        if _ends_with(output, self.end_ids):
            self.inside = False
            return None
        if span is not None:
            return LOOP, self.begin + self.guard.rewind_to(span), span
        if self.budget is not None and self.count >= self.budget:
            return BUDGET, len(output), 0
        return None

    def closed(self, reason: str, taken_back: int) -> None:
        """The scheduler took back ``taken_back`` tokens and forced ``close_ids``: the channel is shut."""
        self.inside = False
        self.take_backs.append((reason, taken_back))
        if self.guard is not None:
            self.guard.truncate(0)


def cut_back(
    seq: Seq, kv: KVManager, cfg: EngineConfig, reason: str, keep: int, kv_window: int | None
) -> tuple[list[int], int]:
    """Keep ``seq``'s first ``keep`` output tokens and force the end of its thinking after them;
    returns (the forced tokens, how many were taken back). Only positions before the cut keep their
    K/V; the pages past the new length go back and the drafter forgets what was cut. The forced
    tokens wait as known tokens: the lane feeds them as rows of its next rounds (rounds.lane_rows).
    Never behind pages already released behind a sliding window (the new rows would read them)."""
    if kv_window is not None:
        floor = seq.num_released_blocks * kv.block_size + kv_window - seq.num_prompt_tokens
        keep = max(keep, min(floor, len(seq.output_token_ids)))
    dropped = len(seq.output_token_ids) - keep
    del seq.output_token_ids[keep:]
    seq.num_taken_back += dropped
    forced = seq.reasoning.close_ids[: seq.num_remaining_tokens]
    seq.output_token_ids += forced
    seq.reasoning.closed(reason, dropped)
    kv.rewind(seq, seq.num_prompt_tokens + keep)
    rounds.reattach_drafter(seq, cfg)
    return forced, dropped
