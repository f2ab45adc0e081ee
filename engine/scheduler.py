"""The scheduler: who prefills, who decodes, whose pages move, between steps.

The loop (nano-vllm's shape, vLLM v1's interface): ``schedule()`` returns a
StepPlan, ``backend.step(plan)`` returns a StepOutput, ``update_from_output(plan,
out)`` turns it into per-request outputs (TokenEvent, RequestFinished) that the
worker addresses and sends. ``finish_requests(ids, status)`` ends requests from
outside a step (an abort); ``make_stats()`` reports.

Invariants:

* one prompt prefills at a time, at most ``cfg.prefill_chunk`` tokens a step,
  and while lanes decode its chunks wait on the decode-share gate
  (engine/pacing.py); when its first chunk is the whole of it and leaves room,
  the waiting prompts next in rank order that fit whole in the rest of the chunk
  join it (``engine/prefill_group.py``, ``cfg.prefill_group``): one step prefills them all,
  each span with its own positions and pages, and the gate counts the group's
  tokens; a prompt whose uncached tail is at most
  ``cfg.short_prefill`` tokens skips the prefill pass instead: it joins the
  lanes at once and its tail is fed as known rows of the decode round
  (``_admit_short``), so a burst of short prompts starts in one round;
* every decoding sequence is a row of the step's one decode round;
* when pages run short, the lowest-ranked decoding sequence moves to host
  (PREEMPTED) and later resumes without recomputing; if the host tier is full
  it is recomputed instead (back to WAITING, its output kept);
* ranks: class (interactive above agent), then arrival;
* with ``kv_window`` (engine.kv_manager.release_window: every layer slides and
  the backend never reads behind the window), each round first gives back a
  decoding sequence's blocks wholly behind the window of the position it
  feeds, so its pages stay bounded by the window however long it generates;
* a request's reasoning (AddRequest.reasoning) is watched as it commits
  (engine/spec/reasoning.py): when the loop guard fires or the thinking budget
  is spent, the output is cut back between rounds (``_take_back``: output,
  computed tokens and pages), the end of the thinking is appended as forced
  tokens, and the lane feeds them as rows of its next rounds
  (engine/spec/rounds.lane_rows) before it samples again.
"""

from __future__ import annotations

import bisect
import logging
import random
import time
from collections.abc import Callable, Iterable

import numpy as np

from engine import admission, prefill_group
from engine.backend import PrefillSpan, StepOutput, StepPlan, TokenLogprob
from engine.config import EngineConfig
from engine.kv_manager import KVManager
from engine.messages import AddRequest, RequestFailed, RequestFinished
from engine.model_config import VisionConfig
from engine.models.vision import ImageError, check_images, rope_index
from engine.outputs import EngineOutput, logprob_item, request_finished, take_back_event, token_event
from engine.pacing import PrefillPacer
from engine.refusals import refusal
from engine.sequence import Sequence, SequenceStatus
from engine.spec import rounds as spec
from engine.spec.cost import RoundCost, plan_drafts
from engine.spec.reasoning import ReasoningWatch, cut_back
from engine.status import SchedulerStats

S = SequenceStatus
log = logging.getLogger("ignis.engine")


def _insort(queue: list[Sequence], seq: Sequence) -> None:
    bisect.insort(queue, seq, key=lambda s: s.rank)


class Scheduler:
    """The queues of one loaded model.

    ``constraints`` is the load's engine.constraint.ConstraintFactory (None:
    a request naming a grammar is refused); ``supports_prompt_logprobs`` is the
    backend's (Backend.supports_prompt_logprobs; False: prompt scoring is refused);
    ``kv_window``: release pages behind this window during decode (None: never);
    ``vision``: the model's vision tower (ModelConfig.vision; None: a request with images is
    refused, invalid_image, as is one whose images do not match its prompt).
    """

    def __init__(
        self,
        cfg: EngineConfig,
        kv: KVManager,
        clock: Callable[[], float] = time.monotonic,
        seed_rng: random.Random | None = None,
        *,
        constraints=None,
        supports_prompt_logprobs: bool = True,
        kv_window: int | None = None,
        max_round_rows: int = 0,
        max_draft_rows: int = 0,
        groups_prefill: bool = True,
        draft_model=None,
        vision: VisionConfig | None = None,
    ) -> None:
        self.cfg = cfg
        self.kv = kv
        self.clock = clock
        self.seed_rng = seed_rng or random.Random()
        self.constraints = constraints
        self.supports_prompt_logprobs = supports_prompt_logprobs
        self.kv_window = kv_window
        self.max_round_rows = max_round_rows  # Backend.max_round_rows: 0 = no speculation
        self._draft_rows = max_draft_rows  # Backend.max_draft_rows (0: max_round_rows)
        self.groups_prefill = groups_prefill  # Backend.prefills_together (and cfg.prefill_group): prefill groups
        self.draft_model = draft_model  # engine.spec.draft_model.DraftModel (spec.draft_model), or None
        self.vision = vision  # ModelConfig.vision: the tower AddRequest.images are checked against (None: no images)
        self.seqs: dict[str, Sequence] = {}  # live, by request_id
        self.by_seq_id: dict[int, Sequence] = {}
        self.waiting: list[Sequence] = []  # rank order
        self.prefilling: Sequence | None = None  # the prompt holding the prefill lane
        # Whole prompts prefilled with ``prefilling``'s next chunk (a group: engine/prefill_group.py); never
        # non-empty while ``prefilling`` is None.
        self.joined: list[Sequence] = []
        self.running: list[Sequence] = []  # DECODING, rank order
        self.preempted: list[Sequence] = []  # rank order
        self.next_seq_id = 0
        self.pacer = PrefillPacer(cfg)
        self.round_cost = RoundCost()  # a decode round's seconds by its rows (spec.cost_aware)
        names = ("admitted", "refused", "finished", "aborted", "preempted", "recomputed")
        names += ("decoded_tokens", "prefilled_tokens", "decode_rounds", "prefill_chunks", "spec_trimmed")
        self.counters = dict.fromkeys(names, 0)
        # Speculation, by drafter name: drafts proposed and accepted; verify rounds and their tokens.
        self.spec_drafted: dict[str, int] = {}
        self.spec_accepted: dict[str, int] = {}
        # The loop guard and the thinking budget: take-backs by reason, and the tokens taken back.
        self.loop_guard_fired: dict[str, int] = {}
        self.loop_guard_taken_back = 0

    # -- requests in and out -------------------------------------------------

    def add_request(self, msg: AddRequest, compiled=None) -> RequestFailed | None:
        """Queue ``msg`` (None), or return the refusal that says why it cannot run.
        ``compiled``: its grammar, built off the loop (engine.admission.compile_grammar)."""
        if msg.request_id in self.seqs:
            seq = refusal("duplicate_request", msg.request_id)
        else:
            seq = admission.admit(
                msg,
                self.cfg,
                num_blocks=self.kv.num_blocks,
                block_size=self.kv.block_size,
                lane_holders=[s for s in self.seqs.values() if s.holds_lane],
                round_seconds=self.pacer.round_seconds,
                seq_id=self.next_seq_id,
                now=self.clock(),
                seed_rng=self.seed_rng,
                supports_prompt_logprobs=self.supports_prompt_logprobs,
                constraints=self.constraints,
                compiled=compiled,
            )
        if not isinstance(seq, RequestFailed):
            seq = self._attach_images(seq, msg)
        if isinstance(seq, RequestFailed):
            self.counters["refused"] += 1
            return seq
        spec.attach_drafter(seq, self.cfg, msg.prediction_token_ids)
        if seq.constraint is None and not seq.is_decide:  # a grammar's state cannot be cut back
            seq.reasoning = ReasoningWatch.from_request(msg.reasoning, self.cfg)
        self.next_seq_id += 1
        self.seqs[seq.request_id] = self.by_seq_id[seq.seq_id] = seq
        _insort(self.waiting, seq)
        self.counters["admitted"] += 1
        return None

    def _attach_images(self, seq: Sequence, msg: AddRequest) -> Sequence | RequestFailed:
        """``seq`` with its images and their rope positions, or the invalid_image refusal."""
        try:
            seq.images = check_images(msg.images, seq.prompt_token_ids, self.vision)
        except ImageError as exc:
            return refusal("invalid_image", msg.request_id, str(exc))
        if seq.images:
            merge = self.vision.spatial_merge_size
            seq.rope_positions, seq.rope_delta = rope_index(seq.num_prompt_tokens, seq.images, merge)
        return seq

    def finish_requests(self, request_ids: str | Iterable[str], status: SequenceStatus) -> list[RequestFinished]:
        """End live requests from outside a step (an abort, a step that raised, a
        switch's drain): their lanes and pages free at once; ids no longer live are
        skipped. A plan already handed out may still name them: update_from_output
        ignores what it computed for them."""
        assert status.is_finished
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        done = []
        for rid in ids:
            seq = self.seqs.get(rid)
            if seq is None:
                continue
            if status == S.FINISHED_ABORTED:
                self.counters["aborted"] += 1
            done.append(self._finish(seq, status))
        return done

    # -- schedule ------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step. The previous plan must have run (update_from_output or not)."""
        self.kv.end_step()
        plan = StepPlan()
        self._grow_running(plan)
        swapped_in = self._swap_in(plan)
        self._admit_short()
        if self.prefilling is None:
            self._start_prefill(plan, protected=swapped_in)
        if self.prefilling is not None and self.pacer.may_run_chunk(self.clock(), bool(self.running)):
            plan.prefill = self._next_chunk(self.prefilling)
            plan.prefill_more = [self._next_chunk(seq, whole=True) for seq in self.joined]
        self._plan_rows(plan)
        return plan

    def _keep_paying_drafts(self, chosen: list, by_model: dict[int, int], base_rows: int) -> None:
        """``spec.cost_aware``: trim the lanes' drafts (in place: ``chosen``'s lists, ``by_model``'s
        counts) to the count worth their rows' time (engine/spec/cost.py)."""
        lanes = [(s, d) for s, d, known in chosen if known == 1 and (d if d is not None else s.seq_id in by_model)]
        if not lanes:
            return
        desired = [by_model[s.seq_id] if d is None else len(d) for s, d in lanes]
        if self.round_cost.probe(base_rows):
            keep = [0] * len(lanes)
        else:
            keep = plan_drafts([s.k_control.rate for s, _ in lanes], desired, base_rows, self.round_cost)
        self.counters["spec_trimmed"] += sum(desired) - sum(keep)
        for (s, d), k in zip(lanes, keep):
            if d is not None:
                del d[k:]
            elif k:
                by_model[s.seq_id] = k
            else:
                del by_model[s.seq_id]

    @property
    def max_draft_rows(self) -> int:
        """Rows a round may reach with drafts (Backend.max_draft_rows, at most max_round_rows); rows of
        known tokens (a short prompt's tail, forced tokens) may take it on to max_round_rows."""
        return min(self._draft_rows, self.max_round_rows) if self._draft_rows else self.max_round_rows

    def _plan_rows(self, plan: StepPlan) -> None:
        """Every decoding lane's rows: one, plus (better-ranked lanes first, while the round has rows
        to spare) the forced tokens it is behind on after a take-back, or else its drafts when the
        pool has pages for them without preempting. The draft model (spec.draft_model) drafts for
        all the lanes it serves in one batched set of rounds. A backend of one row a lane feeds
        forced tokens one a round."""
        spare = max(0, self.max_round_rows - len(self.running))
        # Known tokens first (a prompt's tail, forced tokens), better-ranked lanes first: they are
        # owed, drafts are a bet (and bring the round to max_draft_rows at most).
        known_rows: dict[int, int] = {}
        for seq in self.running:
            if behind := spec.num_behind(seq):
                known_rows[seq.seq_id] = 1 + min(behind, spare)
                spare -= known_rows[seq.seq_id] - 1
        used = len(self.running) + sum(known_rows.values()) - len(known_rows)  # a row a lane, the known ones
        spare = min(spare, max(0, self.max_draft_rows - used))
        chosen: list[tuple[Sequence, list[int] | None, int]] = []  # (seq, drafts | None: the draft model's, known)
        by_model: dict[int, int] = {}  # seq_id -> drafts the draft model is asked for
        for seq in self.running:
            if seq.seq_id in known_rows:
                chosen.append((seq, [], known_rows[seq.seq_id]))
                continue
            budget = min(spare, self.cfg.spec_max_draft) if self.cfg.spec_enabled else 0
            if self.draft_model is not None and seq.drafter is not None and seq.drafter.name == "draft_model":
                k = spec.k_for(seq, budget)
                if k:
                    by_model[seq.seq_id] = k
                chosen.append((seq, None, 1))
                spare -= k
                continue
            drafts = spec.drafts_for(seq, budget)
            chosen.append((seq, drafts, 1))
            spare -= len(drafts)
        if self.cfg.spec_cost_aware:
            self._keep_paying_drafts(chosen, by_model, used)
        proposed: dict[int, list[int]] = {}
        if by_model:
            seqs = [s for s, *_ in chosen if s.seq_id in by_model]
            got = self.draft_model.propose(seqs, [by_model[s.seq_id] for s in seqs])
            proposed = {s.seq_id: d for s, d in zip(seqs, got)}
        for seq, drafts, known in chosen:
            drafts = proposed.get(seq.seq_id, []) if drafts is None else drafts
            if drafts and not self.kv.append_slots(seq, seq.num_tokens + len(drafts)):
                drafts = []
            if drafts:
                plan.drafts[seq.seq_id] = drafts
            rows = spec.lane_rows(seq, drafts, known)
            for row in rows if seq.rope_delta else ():
                row.rope_delta = seq.rope_delta
            plan.decode += rows

    def _grow_running(self, plan: StepPlan) -> None:
        """Give every decoding lane a slot for the token it feeds; preempt the
        lowest-ranked lanes while the pool is dry. Pages behind the window go back
        first, so the round's growth can reuse them."""
        if self.kv_window is not None:
            for seq in self.running:  # feeding position p (its first without K/V) reads from p + 1 - window on
                self.kv.release_behind(seq, seq.num_computed_tokens + 1 - self.kv_window)
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

    def _admit_short(self) -> None:
        """Waiting prompts whose uncached tail is at most ``cfg.short_prefill`` tokens skip the
        prefill pass: they take their pages (claiming the retained prefix) and join the running
        lanes at once, and their tails are fed as known rows of the decode round (``_plan_rows``),
        the last row sampling the first token. A burst of short prompts (agents' follow-up turns
        over a retained prefix) then starts in one round, not one prefill pass each, and the
        weights stream once for all. Whether a prompt goes this way depends on the request and the
        retained state alone, never on what shares the round (the rows of a lane compute as they
        would in any round). Never for images, prompt scoring, decide requests, or while a
        better-ranked preempted lane waits for pages; never preempting for pages."""
        limit = self.cfg.short_prefill if self.max_round_rows > 1 else 0
        if limit <= 0:
            return
        for seq in list(self.waiting):
            if self.preempted and self.preempted[0].rank < seq.rank:
                return
            if seq.images or seq.prompt_logprobs is not None or seq.is_decide:
                continue
            if seq.num_tokens - self.kv.num_claimable_tokens(seq) > limit or not self.kv.can_allocate(0, seq):
                continue
            self.waiting.remove(seq)
            self.kv.allocate(seq)
            seq.status, seq.prompt_in_round = S.DECODING, True
            _insort(self.running, seq)

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
        first_chunk = min(self.cfg.prefill_chunk, seq.num_tokens - seq.num_computed_tokens)
        whole = first_chunk == seq.num_tokens - seq.num_computed_tokens
        first_chunk += prefill_group.join(self, first_chunk)
        self.pacer.prompt_started(self.clock(), first_chunk, bool(self.running), whole)

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
            seq.drop_image_rows(0)
            seq.status = S.WAITING
            _insort(self.waiting, seq)

    def _next_chunk(self, seq: Sequence, whole: bool = False) -> PrefillSpan:
        """``seq``'s next span: up to a chunk (``whole``: the rest of it, a group member's, whose
        place in the chunk was counted when it joined)."""
        start = seq.num_computed_tokens
        end = seq.num_tokens if whole else min(start + self.cfg.prefill_chunk, seq.num_tokens)
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
            rope_positions=seq.rope_positions_at(start, end),
            images=seq.images_at(start, end),
        )

    # -- results -------------------------------------------------------------

    def update_from_output(self, plan: StepPlan, out: StepOutput) -> list[EngineOutput]:
        """What ``plan``'s step produced, per request, in order; books and queues follow."""
        now = self.clock()
        outputs: list[EngineOutput] = []
        if plan.prefill is not None:
            spans = plan.prefills
            tokens = sum(len(span.token_ids) for span in spans)
            # self.running: the lanes that decoded while it ran (its own prompts join them below)
            self.pacer.chunk_ran(now, tokens, out.prefill_seconds, out.decode_seconds, bool(self.running))
            for span, result in zip(spans, out.prefill_results):
                self._prefill_done(span, result, now, outputs)
        if plan.decode:
            self.counters["decode_rounds"] += 1
            self.pacer.round_ran(out.decode_seconds)
            self.round_cost.observe(len(plan.decode), out.decode_seconds)
        logprobs = out.decode_logprobs or [None] * len(out.decode_tokens)
        i = 0
        while i < len(plan.decode):
            lane, i_start = plan.decode[i], i
            end = i + 1  # a lane's rows are consecutive
            while end < len(plan.decode) and plan.decode[end].seq_id == lane.seq_id:
                end += 1
            drafts = plan.drafts.get(lane.seq_id, [])
            last_known = lane.position + (end - i) - len(drafts) - 1  # the last row feeding a known token
            rows = slice(end - len(drafts) - 1, end)
            i = end
            seq = self.by_seq_id.get(lane.seq_id)
            if seq is None or seq.status != S.DECODING:
                continue  # finished while the round ran
            if seq.prompt_in_round:
                self.counters["prefilled_tokens"] += end - i_start
            if last_known < seq.num_tokens - 1:  # still behind on known tokens: nothing to sample yet
                self.kv.mark_computed(seq, last_known + 1)
                continue
            lane = plan.decode[rows.start]
            if seq.prompt_in_round:  # its prompt's last row sampled: what a finished prefill does
                seq.prompt_in_round = False
                self.kv.mark_computed(seq, seq.num_tokens)
                if not self._prompt_done(seq, now, outputs):
                    continue
            kept = spec.accepted(seq, drafts, out.decode_tokens[rows])
            if drafts:
                name = spec.source(seq)
                self.spec_drafted[name] = self.spec_drafted.get(name, 0) + len(drafts)
                self.spec_accepted[name] = self.spec_accepted.get(name, 0) + len(kept) - 1
            # Rows whose input was committed hold valid K/V: the lane's token and the kept drafts.
            self.kv.mark_computed(seq, lane.position + len(kept))
            for token, lp in zip(kept, logprobs[rows]):
                if self._append_token(seq, token, lp, now, outputs):
                    break  # a stop, the length cap or a take-back inside the kept run: the rest is dropped
            if drafts and seq.status == S.DECODING:
                self.kv.trim(seq, seq.num_tokens)  # pages taken only for rejected drafts go back
        return outputs

    def _prefill_done(self, span: PrefillSpan, out: StepOutput, now: float, outputs: list[EngineOutput]) -> None:
        """One span of the step's prefill ran (``out``: its results)."""
        self.counters["prefill_chunks"] += 1
        self.counters["prefilled_tokens"] += len(span.token_ids)
        seq = self.by_seq_id.get(span.seq_id)
        if seq is None or seq.status != S.PREFILLING:
            return  # finished while the chunk ran
        self.kv.mark_computed(seq, span.start_pos + len(span.token_ids))
        seq.drop_image_rows(seq.num_computed_tokens)
        if span.want_prompt_logprobs is not None and out.prompt_logprobs is not None:
            seq.prompt_lps = (seq.prompt_lps or []) + [logprob_item(lp) for lp in out.prompt_logprobs]
        if seq.num_computed_tokens < seq.num_tokens:
            return
        self._leave_prefill(seq)
        if seq.is_decide:
            self._prompt_done(seq, now, outputs)
            outputs.append(self._finish(seq, S.FINISHED_STOPPED, logits=out.prefill_logits))
            return
        seq.status = S.DECODING
        _insort(self.running, seq)
        assert out.prefill_token is not None, "the last prefill chunk carried a SampleRequest"
        if self._prompt_done(seq, now, outputs):
            self._append_token(seq, out.prefill_token, out.prefill_logprob, now, outputs)

    def _leave_prefill(self, seq: Sequence) -> None:
        """``seq`` no longer prefills (computed, or finished): out of the lane or the group; should it
        have held the lane, the group's next member takes it (its span may already be planned)."""
        if seq in self.joined:
            self.joined.remove(seq)
        elif self.prefilling is seq:
            self.prefilling = self.joined.pop(0) if self.joined else None

    def _prompt_done(self, seq: Sequence, now: float, outputs: list[EngineOutput]) -> bool:
        """``seq``'s prompt is computed (by prefill, or as decode rows): pin its shared prefix; False
        when its first sample must not be used (a thinking budget of 0 takes the thinking back)."""
        if seq.shared_prefix_len:  # its system block outlives plain retention (idempotent)
            self.kv.pin_prefix(seq.prompt_token_ids[: seq.shared_prefix_len], seq.images)
        if seq.is_decide:
            seq.first_token_time = now
            return False
        if seq.reasoning is not None and not seq.output_token_ids and seq.reasoning.due_now():
            self._take_back(seq, "budget", 0, 0, now, outputs)  # a budget of 0: the sample is not used
            return False
        return True

    def _append_token(
        self, seq: Sequence, token: int, lp: TokenLogprob | None, now: float, outputs: list[EngineOutput]
    ) -> bool:
        """Commit ``token``; True when the lane's round ends here (it finished, or took back)."""
        seq.output_token_ids.append(int(token))
        if seq.constraint is not None:
            seq.constraint.consume(token)
        if seq.drafter is not None:
            seq.drafter.commit((int(token),))
        self.counters["decoded_tokens"] += 1
        ttft = None
        if seq.first_token_time is None:
            seq.first_token_time = now
            ttft = now - seq.arrival_time
        stopped = token in seq.stop_token_ids
        if not stopped:  # the stop token itself is not streamed (it still counts in usage)
            outputs.append(token_event(seq, token, lp, ttft))
        if stopped:
            outputs.append(self._finish(seq, S.FINISHED_STOPPED))
        elif seq.num_generated >= seq.max_tokens:
            outputs.append(self._finish(seq, S.FINISHED_LENGTH))
        elif seq.reasoning is not None and (due := seq.reasoning.commit(seq.output_token_ids)) is not None:
            self._take_back(seq, *due, now, outputs)
            return True
        return seq.status != S.DECODING

    def _take_back(self, seq: Sequence, reason: str, keep: int, span: int, now: float, outputs: list) -> None:
        """Cut ``seq``'s output back to ``keep`` tokens and force the end of its thinking
        (engine.spec.reasoning.cut_back); count, log and tell the client."""
        forced, dropped = cut_back(seq, self.kv, self.cfg, reason, keep, self.kv_window)
        self.loop_guard_fired[reason] = self.loop_guard_fired.get(reason, 0) + 1
        self.loop_guard_taken_back += dropped
        extra = {"request_id": seq.request_id, "reason": reason, "span": span, "taken_back": dropped}
        log.info("ignis.loop_guard.taken_back", extra=extra)
        ttft = None
        if seq.first_token_time is None:
            seq.first_token_time = now
            ttft = now - seq.arrival_time
        outputs.append(take_back_event(seq, forced, dropped, reason, ttft))
        if seq.num_generated >= seq.max_tokens:
            outputs.append(self._finish(seq, S.FINISHED_LENGTH))

    def _finish(self, seq: Sequence, status: SequenceStatus, logits: np.ndarray | None = None) -> RequestFinished:
        for queue in (self.waiting, self.running, self.preempted):
            if seq in queue:
                queue.remove(seq)
        self._leave_prefill(seq)
        self.kv.free(seq)
        if self.draft_model is not None:
            self.draft_model.release(seq.seq_id)
        seq.status = status
        self.seqs.pop(seq.request_id, None)
        self.by_seq_id.pop(seq.seq_id, None)
        self.counters["finished"] += 1
        return request_finished(seq, logits)

    # -- state ---------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.joined or self.running or self.preempted)

    def prefill_wait(self) -> float | None:
        """Seconds until the decode-share gate lets the held prompt's next chunk run;
        None when no prompt waits on it (then only a message changes what a step does)."""
        if self.prefilling is None or not self.running:
            return None
        return max(0.0, self.pacer.ready_at - self.clock())

    def sequence(self, seq_id: int) -> Sequence | None:
        """The live sequence a plan's ``seq_id`` names (None once finished)."""
        return self.by_seq_id.get(seq_id)

    def make_stats(self) -> SchedulerStats:
        by_state: dict[str, int] = {}
        by_class: dict[str, int] = {}
        for seq in self.seqs.values():
            by_state[seq.status.name.lower()] = by_state.get(seq.status.name.lower(), 0) + 1
            by_class[seq.request_class] = by_class.get(seq.request_class, 0) + 1
        return SchedulerStats(
            requests_by_state=by_state,
            requests_by_class=by_class,
            lanes_total=self.cfg.decode_lanes,
            lanes_busy=sum(1 for s in self.seqs.values() if s.holds_lane),
            lanes_decoding=len(self.running),
            kv_pages=self.kv.usage(),
            prefix_hits=self.kv.num_prefix_hits,
            cached_tokens=self.kv.num_cached_tokens,
            round_seconds=self.pacer.round_seconds,
            spec_drafted=dict(self.spec_drafted),
            spec_accepted=dict(self.spec_accepted),
            loop_guard_fired=dict(self.loop_guard_fired),
            loop_guard_taken_back=self.loop_guard_taken_back,
            **self.counters,
        )
