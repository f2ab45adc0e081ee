"""The decode-share gate: when the held prompt's next prefill chunk may start.

While lanes decode, prefill chunks and decode rounds take turns so the lanes
keep ``cfg.decode_share`` (s) of the time: after a chunk that took t seconds
the next waits ``t * s / (1 - s)``, during which only the lanes run (the next
chunk of the same prompt or the first of the next one). A prompt longer than
one chunk that takes the prefill lane while lanes decode first waits the same
for its first chunk's estimated time, so the share holds over a two-chunk
prompt too. A prompt (or a group of them) that is whole in its first chunk
does not: its chunk stalls the lanes as long whether it runs now or after a
wait, and waiting would only add to its first token (a burst of short
prompts, issue 15). The estimate is the per-token rate of the last chunk of
at least half ``cfg.prefill_chunk`` tokens: a few-token chunk costs mostly its
launches, and its rate would put a 2,048-token chunk at tens of times its
real cost. With no lane decoding nothing waits.

Rounds are discrete, so a chunk usually starts a little after the gate opens;
that overshoot (at most one round) is owed back on the next wait, so the share
holds over a long prompt instead of rounding up at every chunk.

Only a chunk that ran while lanes decoded leaves a debt: one that ran with no
lane decoding took no lane's time, so the lanes its prompts start (and any that
join after) are owed nothing for it, and the next group of whole prompts runs
at once beside them: a burst whose first arrivals started a step before the
rest does not hold the rest a round for a debt nobody is owed (issue 15).
"""

from __future__ import annotations

from engine.config import EngineConfig


class PrefillPacer:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg  # read at every chunk: decode_share is a live setting
        self.ready_at = 0.0  # while lanes decode, the next chunk not before this
        self.late = 0.0  # how far past ready_at the last chunk started
        self.seconds_per_token: float | None = None  # of the last full-size chunk: estimates a first chunk
        self.round_seconds: float | None = None  # EWMA of decode rounds

    def share_wait(self, chunk_seconds: float) -> float:
        """How long the lanes run alone after a chunk of ``chunk_seconds``."""
        s = min(max(self.cfg.decode_share, 0.0), 0.95)
        return chunk_seconds * s / (1.0 - s)

    def may_run_chunk(self, now: float, lanes_decoding: bool) -> bool:
        """Whether the held prompt's next chunk runs in the step being planned at ``now``."""
        if lanes_decoding and now < self.ready_at:
            return False
        late = max(0.0, now - self.ready_at) if lanes_decoding else 0.0
        self.late = min(late, self.round_seconds or 0.0)  # only a round's overshoot
        return True

    def prompt_started(self, now: float, first_chunk_tokens: int, lanes_decoding: bool, whole: bool = False) -> None:
        """A prompt took the prefill lane: while lanes decode, their turn comes first, as it
        does before every later chunk (a debt the last prompt left counts toward it), unless
        the first chunk is ``whole`` prompts (then only that debt holds it)."""
        if lanes_decoding and self.seconds_per_token and not whole:
            first = now + self.share_wait(first_chunk_tokens * self.seconds_per_token)
            self.ready_at = max(self.ready_at, first)
            self.late = 0.0

    def chunk_ran(
        self, now: float, num_tokens: int, prefill_seconds: float, decode_seconds: float, lanes_decoding: bool = True
    ) -> None:
        """A step ran a chunk of ``num_tokens`` (then a round of ``decode_seconds``), ending at ``now``;
        ``lanes_decoding``: lanes were decoding while it ran (a chunk that stalled no lane owes none)."""
        wait = self.share_wait(prefill_seconds)
        if prefill_seconds > 0 and 2 * num_tokens >= self.cfg.prefill_chunk:
            self.seconds_per_token = prefill_seconds / num_tokens
        if not lanes_decoding:
            self.ready_at, self.late = now, 0.0
            return
        # The step ran the chunk, then a decode round: that round already counts as waiting.
        self.ready_at = now - decode_seconds + max(0.0, wait - self.late)

    def round_ran(self, decode_seconds: float) -> None:
        if decode_seconds > 0:
            r = self.round_seconds
            self.round_seconds = decode_seconds if r is None else 0.8 * r + 0.2 * decode_seconds
