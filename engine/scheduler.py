"""The scheduler: who prefills, who decodes, whose pages move, between steps.

The loop (nano-vllm's shape): ``schedule()`` returns a StepPlan,
``backend.step(plan)`` returns a StepOutput, ``update_from_output(plan, out)``
turns it into outgoing (reply_channel, message) pairs.

Invariants:

* one prompt prefills at a time, at most ``cfg.prefill_chunk`` tokens a step;
* after a chunk that took t seconds the next chunk waits ``t * s / (1 - s)``
  (s = ``cfg.decode_share``) while lanes decode; a prompt that takes the prefill
  lane while lanes decode first waits the same for its first
  chunk's estimated time, so the share holds over a two-chunk prompt too; with no
  lane decoding nothing waits;
* every decoding sequence is a row of the step's one decode round;
* when pages run short, the lowest-ranked decoding sequence moves to host
  (PREEMPTED) and later resumes without recomputing; if the host tier is full
  it is recomputed instead (back to WAITING, its output kept);
* ranks: class (interactive above agent), then arrival.
"""

from __future__ import annotations

import bisect
import random
import time
from collections.abc import Callable

from engine import admission
from engine.backend import DecodeLane, PrefillSpan, StepOutput, StepPlan, TokenLogprob
from engine.config import EngineConfig
from engine.kv_manager import KVManager
from engine.messages import AddRequest, RequestFailed, RequestFinished, TokenEvent
from engine.sampler import log_softmax
from engine.sequence import Sequence, SequenceStatus

Outgoing = list[tuple[str, dict]]
S = SequenceStatus


def _insort(queue: list[Sequence], seq: Sequence) -> None:
    bisect.insort(queue, seq, key=lambda s: s.rank)


class Scheduler:
    def __init__(
        self,
        cfg: EngineConfig,
        kv: KVManager,
        clock: Callable[[], float] = time.monotonic,
        seed_rng: random.Random | None = None,
    ) -> None:
        self.cfg = cfg
        self.kv = kv
        self.clock = clock
        self.seed_rng = seed_rng or random.Random()
        self.seqs: dict[str, Sequence] = {}  # live, by request_id
        self.by_seq_id: dict[int, Sequence] = {}
        self.waiting: list[Sequence] = []  # rank order
        self.prefilling: Sequence | None = None
        self.running: list[Sequence] = []  # DECODING, rank order
        self.preempted: list[Sequence] = []  # rank order
        self.next_seq_id = 0
        self.prefill_ready_at = 0.0  # decode share: the next chunk not before this
        self.prefill_late = 0.0  # how far past prefill_ready_at the last chunk started
        self.prefill_seconds_per_token: float | None = None  # of the last chunk: estimates a first chunk
        self.round_seconds: float | None = None  # EWMA of decode rounds
        self.constraints = None  # engine.constraint.ConstraintFactory, set by the worker at load
        self.supports_prompt_logprobs = True  # the backend's (Backend.supports_prompt_logprobs), set at load
        self.counters = dict.fromkeys(
            (
                "admitted",
                "refused",
                "finished",
                "aborted",
                "preempted",
                "recomputed",
                "decoded_tokens",
                "prefilled_tokens",
                "decode_rounds",
                "prefill_chunks",
            ),
            0,
        )

    # -- admission -----------------------------------------------------------

    def add_request(self, msg: AddRequest) -> RequestFailed | None:
        holders = [s for s in self.seqs.values() if s.holds_lane]
        if msg.request_id in self.seqs:
            self.counters["refused"] += 1
            return RequestFailed(
                request_id=msg.request_id,
                message="Duplicate request id.",
                code="duplicate_request",
                status=400,
                error_type="invalid_request_error",
            )
        if msg.prompt_logprobs is not None and not self.supports_prompt_logprobs:
            self.counters["refused"] += 1
            return RequestFailed(
                request_id=msg.request_id,
                message="Prompt logprobs (echo with logprobs) are not available on this engine's backend.",
                code="unsupported",
                status=400,
                error_type="invalid_request_error",
                param="logprobs",
            )
        seq = admission.admit(
            msg,
            self.cfg,
            num_blocks=self.kv.num_blocks,
            block_size=self.kv.block_size,
            lanes_busy=len(holders),
            round_seconds=self.round_seconds,
            lane_holders=holders,
            seq_id=self.next_seq_id,
            now=self.clock(),
            seed_rng=self.seed_rng,
        )
        if isinstance(seq, RequestFailed):
            self.counters["refused"] += 1
            return seq
        if msg.grammar:
            refused = self._attach_constraint(seq, msg)
            if refused is not None:
                self.counters["refused"] += 1
                return refused
        self.next_seq_id += 1
        self.seqs[seq.request_id] = self.by_seq_id[seq.seq_id] = seq
        _insort(self.waiting, seq)
        self.counters["admitted"] += 1
        return None

    def _attach_constraint(self, seq: Sequence, msg: AddRequest) -> RequestFailed | None:
        """Give ``seq`` its grammar (engine.constraint), or the refusal saying why it cannot have one."""
        from engine.constraint import ConstraintError

        if self.constraints is None:
            problem = "Constrained decoding is not available on this engine."
        else:
            try:
                seq.constraint = self.constraints.build(msg.grammar, sorted(seq.stop_token_ids))
                return None
            except (ConstraintError, ImportError, ValueError) as exc:
                problem = f"The output grammar does not compile: {exc}"
        return RequestFailed(
            request_id=msg.request_id,
            message=problem,
            code="invalid_grammar",
            status=400,
            error_type="invalid_request_error",
            param="response_format",
        )

    def abort_request(self, request_id: str) -> Outgoing:
        seq = self.seqs.get(request_id)
        if seq is None:
            return []
        self.counters["aborted"] += 1
        return [self._finish(seq, S.FINISHED_ABORTED)]

    # -- schedule ------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step. The previous plan must have run (update_from_output or not)."""
        self.kv.end_step()
        plan = StepPlan()
        self._grow_running(plan)
        swapped_in = self._swap_in(plan)
        if self.prefilling is None:
            self._start_prefill(plan, protected=swapped_in)
        now = self.clock()
        if self.prefilling is not None and (not self.running or now >= self.prefill_ready_at):
            # Rounds are discrete: a chunk that starts late owes the lanes less next time,
            # so the share holds over a long prompt rather than rounding up every chunk.
            late = max(0.0, now - self.prefill_ready_at) if self.running else 0.0
            self.prefill_late = min(late, self.round_seconds or 0.0)  # only a round's overshoot
            plan.prefill = self._next_chunk(self.prefilling)
        plan.decode = [
            DecodeLane(seq.seq_id, seq.last_token_id, seq.num_tokens - 1, list(seq.block_table), seq.sample_request())
            for seq in self.running
        ]
        return plan

    def _grow_running(self, plan: StepPlan) -> None:
        """Give every decoding lane a slot for the token it feeds; preempt the
        lowest-ranked lanes while the pool is dry."""
        for seq in list(self.running):
            while seq.status == S.DECODING and not self.kv.append_slots(seq, seq.num_tokens):
                self._preempt(self.running[-1], plan)

    def _swap_in(self, plan: StepPlan) -> set[int]:
        done = set()
        while self.preempted and self.kv.can_swap_in(self.preempted[0], self.preempted[0].num_tokens):
            seq = self.preempted.pop(0)
            plan.swap_in += self.kv.swap_in(seq)
            self.kv.append_slots(seq, seq.num_tokens)
            seq.status = S.DECODING
            _insort(self.running, seq)
            done.add(seq.seq_id)
        return done

    def _start_prefill(self, plan: StepPlan, protected: set[int]) -> None:
        if not self.waiting:
            return
        seq = self.waiting[0]
        if self.preempted and self.preempted[0].rank < seq.rank:
            return  # pages go back to the better-ranked preempted lane first
        while not self.kv.can_allocate(0, seq):
            victims = [s for s in self.running if s.rank > seq.rank and s.seq_id not in protected]
            if not victims:
                return  # wait for pages
            self._preempt(victims[-1], plan)
        self.waiting.pop(0)
        self.kv.allocate(seq)
        seq.status = S.PREFILLING
        self.prefilling = seq
        if self.running and self.prefill_seconds_per_token:
            # The lanes' turn comes first, as it does before every later chunk (a debt
            # the last prompt left counts toward it).
            chunk = min(self.cfg.prefill_chunk, seq.num_tokens - seq.num_computed_tokens)
            first = self.clock() + self._share_wait(chunk * self.prefill_seconds_per_token)
            self.prefill_ready_at = max(self.prefill_ready_at, first)
            self.prefill_late = 0.0

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self.counters["preempted"] += 1
        if self.kv.can_swap_out(seq):
            plan.swap_out += self.kv.swap_out(seq)
            seq.status = S.PREEMPTED
            _insort(self.preempted, seq)
        else:  # host tier full: recompute later, output kept
            self.counters["recomputed"] += 1
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.status = S.WAITING
            _insort(self.waiting, seq)

    def _next_chunk(self, seq: Sequence) -> PrefillSpan:
        start = seq.num_computed_tokens
        end = min(start + self.cfg.prefill_chunk, seq.num_tokens)
        tokens = (seq.prompt_token_ids + seq.output_token_ids)[start:end]
        last = end == seq.num_tokens
        score = seq.prompt_logprobs is not None and not seq.prompt_lps_sent  # (a recompute has sent them)
        return PrefillSpan(
            seq_id=seq.seq_id,
            token_ids=tokens,
            start_pos=start,
            block_table=list(seq.block_table),
            sample=seq.sample_request() if last and not seq.is_decide else None,
            want_logits=last and seq.is_decide,
            want_prompt_logprobs=seq.prompt_logprobs if score else None,
            next_prompt_token=seq.prompt_token_ids[end] if score and end < seq.num_prompt_tokens else None,
        )

    # -- results -------------------------------------------------------------

    def update_from_output(self, plan: StepPlan, out: StepOutput) -> Outgoing:
        now = self.clock()
        msgs: Outgoing = []
        if plan.prefill is not None:
            self._prefill_done(plan.prefill, out, now, msgs)
        if plan.decode:
            self.counters["decode_rounds"] += 1
            if out.decode_seconds > 0:
                r = self.round_seconds
                self.round_seconds = out.decode_seconds if r is None else 0.8 * r + 0.2 * out.decode_seconds
        logprobs = out.decode_logprobs or [None] * len(out.decode_tokens)
        for lane, token, lp in zip(plan.decode, out.decode_tokens, logprobs):
            seq = self.by_seq_id.get(lane.seq_id)
            if seq is None or seq.status != S.DECODING:
                continue  # aborted while the round ran
            self.kv.mark_computed(seq, lane.position + 1)
            self._append_token(seq, token, lp, now, msgs)
        return msgs

    def _share_wait(self, chunk_seconds: float) -> float:
        s = min(max(self.cfg.decode_share, 0.0), 0.95)
        return chunk_seconds * s / (1.0 - s)

    def _prefill_done(self, span: PrefillSpan, out: StepOutput, now: float, msgs: Outgoing) -> None:
        self.counters["prefill_chunks"] += 1
        self.counters["prefilled_tokens"] += len(span.token_ids)
        wait = self._share_wait(out.prefill_seconds)
        if out.prefill_seconds > 0:
            self.prefill_seconds_per_token = out.prefill_seconds / len(span.token_ids)
        # The step ran the chunk, then a decode round: that round already counts as waiting.
        self.prefill_ready_at = now - out.decode_seconds + max(0.0, wait - self.prefill_late)
        seq = self.by_seq_id.get(span.seq_id)
        if seq is None or seq.status != S.PREFILLING:
            return  # aborted while the chunk ran
        self.kv.mark_computed(seq, span.start_pos + len(span.token_ids))
        if span.want_prompt_logprobs is not None and out.prompt_logprobs is not None:
            seq.prompt_lps = (seq.prompt_lps or []) + [
                {"token_id": lp.token_id, "logprob": lp.logprob, "top": [[t, v] for t, v in lp.top]}
                for lp in out.prompt_logprobs
            ]
        if seq.num_computed_tokens < seq.num_tokens:
            return
        self.prefilling = None
        if seq.shared_prefix_len:  # its system block outlives plain retention (idempotent)
            self.kv.pin_prefix(seq.prompt_token_ids[: seq.shared_prefix_len])
        if seq.is_decide:
            logits = decide_lps = None
            if out.prefill_logits is not None and seq.decide_token_ids is not None:
                lp, vocab = log_softmax(out.prefill_logits), len(out.prefill_logits)
                decide_lps = [float(lp[t]) if 0 <= t < vocab else None for t in seq.decide_token_ids]
            elif out.prefill_logits is not None:
                logits = [float(x) for x in out.prefill_logits]
            seq.first_token_time = now
            reply, done = self._finish(seq, S.FINISHED_STOPPED, logits=logits)
            done["decide_logprobs"] = decide_lps
            msgs.append((reply, done))
            return
        seq.status = S.DECODING
        _insort(self.running, seq)
        assert out.prefill_token is not None, "the last prefill chunk carried a SampleRequest"
        self._append_token(seq, out.prefill_token, out.prefill_logprob, now, msgs)

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprob | None, now: float, msgs: Outgoing) -> None:
        seq.output_token_ids.append(int(token))
        if seq.constraint is not None:
            seq.constraint.consume(token)
        self.counters["decoded_tokens"] += 1
        ttft = None
        if seq.first_token_time is None:
            seq.first_token_time = now
            ttft = now - seq.arrival_time
        stopped = token in seq.stop_token_ids
        if not stopped:  # the stop token itself is not streamed (it still counts in usage)
            lps = None
            if seq.want_logprobs and lp is not None:
                lps = [{"token_id": lp.token_id, "logprob": lp.logprob, "top": [[t, v] for t, v in lp.top]}]
            event = TokenEvent(seq.request_id, [int(token)], lps, seq.num_cached_tokens, ttft)
            event.prompt_logprobs = self._take_prompt_logprobs(seq)
            msgs.append((seq.reply_channel, event.to_message()))
        if stopped:
            msgs.append(self._finish(seq, S.FINISHED_STOPPED))
        elif len(seq.output_token_ids) >= seq.max_tokens:
            msgs.append(self._finish(seq, S.FINISHED_LENGTH))

    def _finish(self, seq: Sequence, status: SequenceStatus, logits: list[float] | None = None) -> tuple[str, dict]:
        for queue in (self.waiting, self.running, self.preempted):
            if seq in queue:
                queue.remove(seq)
        if self.prefilling is seq:
            self.prefilling = None
        self.kv.free(seq)
        seq.status = status
        self.seqs.pop(seq.request_id, None)
        self.by_seq_id.pop(seq.seq_id, None)
        self.counters["finished"] += 1
        done = RequestFinished(
            seq.request_id,
            seq.finish_reason or "stop",
            seq.num_prompt_tokens,
            len(seq.output_token_ids),
            seq.num_cached_tokens,
            logits,
            self._take_prompt_logprobs(seq),
        )
        return (seq.reply_channel, done.to_message())

    @staticmethod
    def _take_prompt_logprobs(seq: Sequence) -> list[dict] | None:
        """The prompt's scores, once: on the first message the request gets after its prefill."""
        if seq.prompt_logprobs is None or seq.prompt_lps_sent or seq.first_token_time is None:
            return None
        seq.prompt_lps_sent = True
        lps, seq.prompt_lps = seq.prompt_lps or [], None
        return lps

    # -- state ---------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.preempted)

    def seconds_until_ready(self) -> float | None:
        """None with no work, else how long until a step would do something: 0,
        since only a prefill chunk ever waits (on the decode share) and only
        while lanes decode, which is itself work to run now."""
        return 0.0 if self.has_work else None

    def sequence(self, seq_id: int) -> Sequence | None:
        """The live sequence a plan's ``seq_id`` names (None once finished)."""
        return self.by_seq_id.get(seq_id)

    def pin_prefix(self, token_ids: list[int]) -> int:
        """Keep the retained blocks prefixing ``token_ids`` (e.g. a system block) resident."""
        return self.kv.pin_prefix(token_ids)

    def stats(self) -> dict:
        by_state: dict[str, int] = {}
        by_class: dict[str, int] = {}
        for seq in self.seqs.values():
            by_state[seq.status.name.lower()] = by_state.get(seq.status.name.lower(), 0) + 1
            by_class[seq.request_class] = by_class.get(seq.request_class, 0) + 1
        return {
            "requests_by_state": by_state,
            "requests_by_class": by_class,
            "lanes_total": self.cfg.decode_lanes,
            "lanes_busy": sum(1 for s in self.seqs.values() if s.holds_lane),
            "lanes_decoding": len(self.running),
            "kv_pages": self.kv.usage(),
            "prefix_hits": self.kv.num_prefix_hits,
            "cached_tokens": self.kv.num_cached_tokens,
            "round_seconds": self.round_seconds,
            **self.counters,
        }
