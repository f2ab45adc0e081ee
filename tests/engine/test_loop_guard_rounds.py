"""The loop guard and the thinking budget through the scheduler: a scripted model that loops inside
its reasoning, taken back between rounds, the end of the thinking forced and fed, exact books."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from engine.config import EngineConfig
from engine.kv_manager import KVManager
from engine.messages import AddRequest, RequestFinished, TokenEvent
from engine.scheduler import Scheduler
from tests.engine.fake_backend import FakeBackend, FakeClock

START, END, CLOSE = [3, 4], [5, 6], [5, 6, 7]  # <think>, </think>, "</think>\n\n"
STOP = 2
PREAMBLE = [40, 41, 42, 43, 44]
LOOP = list(range(10, 20))  # a 10-token span the model repeats forever
ANSWER = [30, 31, 32, 33]


def _find(context: Sequence[int], tag: list[int]) -> int:
    """Where the last occurrence of ``tag`` in ``context`` ends (-1: none)."""
    for i in range(len(context) - len(tag), -1, -1):
        if list(context[i : i + len(tag)]) == tag:
            return i + len(tag)
    return -1


class ThinkingBackend(FakeBackend):
    """The fake's KV books (every token read back from the slots its table names) with a scripted
    model: inside ``<think>`` a preamble, then LOOP forever (or, ``distinct``, never repeating); after
    the close, the answer and a stop. Outside any reasoning it loops too."""

    distinct = False

    def next_token(self, context: Sequence[int]) -> int:
        closed, opened = _find(context, CLOSE), _find(context, START)
        if closed > opened >= 0:
            n = len(context) - closed
            return ANSWER[n] if n < len(ANSWER) else STOP
        n = len(context) - max(opened, 0)
        if self.distinct:
            return 100 + n
        return PREAMBLE[n] if n < len(PREAMBLE) else LOOP[(n - len(PREAMBLE)) % len(LOOP)]


def reasoning(open_: bool = True, budget: int | None = None, guard: bool = True) -> dict:
    return {"start_ids": [START], "end_ids": [END], "close_ids": CLOSE, "open": open_, "max_tokens": budget,
            "guard": guard}  # fmt: skip


def run(reqs: list[AddRequest], *, rows: int = 0, distinct: bool = False, num_blocks: int = 64, check=None, **cfg):
    cfg = EngineConfig(decode_lanes=4, prefill_chunk=16, max_context=512, block_size=4, **cfg)
    kv = KVManager(num_blocks, 4, 64)
    sched = Scheduler(cfg, kv, clock=FakeClock(), seed_rng=random.Random(0), max_round_rows=rows)
    backend = ThinkingBackend(num_blocks, 4, 64)
    backend.distinct = distinct
    backend.load(None, {}, block_size=4, kv_budget_bytes=None, host_kv_budget_bytes=0, max_context=512)
    for r in reqs:
        assert sched.add_request(r) is None
    events: dict[str, list] = {r.request_id: [] for r in reqs}
    while sched.has_work:
        plan = sched.schedule()
        assert len(plan.decode) <= max(rows, len(sched.running))
        for out in sched.update_from_output(plan, backend.step(plan)):
            events[out.request_id].append(out)
        for seq in sched.running:  # the books: no page past the tokens held, none missing behind the K/V
            assert kv.blocks_for(seq.num_computed_tokens) <= len(seq.block_table) <= kv.blocks_for(seq.num_tokens)
            assert seq.num_computed_tokens <= seq.num_tokens - 1
        if check:
            check(sched, backend)
    assert kv.usage()["used"] == 0 and kv.num_available_blocks == num_blocks
    return events, sched, backend


def request(rid: str = "r0", *, max_tokens: int = 80, prompt: list[int] | None = None, **kw) -> AddRequest:
    prompt = prompt if prompt is not None else [1, 50, 51, 52, *START]
    return AddRequest(rid, "c", prompt, max_tokens, sampling={"temperature": 0}, stop_token_ids=[STOP], **kw)


def streamed(events: list) -> list[int]:
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]


def finished(events: list) -> RequestFinished:
    (done,) = [e for e in events if isinstance(e, RequestFinished)]
    return done


@pytest.mark.parametrize("rows", [0, 16])
def test_a_loop_is_taken_back_and_the_answer_follows(rows):
    (events,), sched, backend = (lambda e, s, b: (list(e.values()), s, b))(
        *run([request(reasoning=reasoning())], rows=rows)
    )
    # The guard fires when the span has occurred three times: 5 + 30 reasoning tokens streamed.
    fired = [i for i, e in enumerate(events) if isinstance(e, TokenEvent) and e.taken_back_reason]
    assert len(fired) == 1
    marker = events[fired[0]]
    assert (marker.taken_back, marker.taken_back_reason, marker.token_ids) == (20, "loop", CLOSE)
    before = streamed(events[: fired[0]])
    assert before == PREAMBLE + LOOP * 3
    # The forced close was fed (the model saw it in its KV slots), so the answer follows, then the stop.
    assert streamed(events[fired[0] + 1 :]) == ANSWER
    done = finished(events)
    assert done.finish_reason == "stop"
    assert done.completion_tokens == 35 + len(CLOSE) + len(ANSWER) + 1  # every generated token, the stop too
    assert done.taken_back_tokens == 20
    stats = sched.make_stats()
    assert stats.loop_guard_fired == {"loop": 1} and stats.loop_guard_taken_back == 20
    # The slots of the last round hold the kept reasoning, then the forced close where the loop was.
    table = backend.plans[-1].decode[0].block_table
    kept = [1, 50, 51, 52, *START, *PREAMBLE, *LOOP, *CLOSE, *ANSWER]
    assert backend._read(table, len(kept)) == kept


def test_books_right_after_the_take_back():
    seen = []

    def check(sched, backend):
        for seq in sched.running:
            if seq.num_taken_back and not seen:
                seen.append((list(seq.output_token_ids), seq.num_computed_tokens, len(seq.block_table)))

    run([request(reasoning=reasoning())], check=check)
    output, computed, blocks = seen[0]
    assert output == PREAMBLE + LOOP + CLOSE
    assert computed == 6 + 15  # the prompt and the kept reasoning: the forced tokens are still to feed
    assert blocks == -(-(6 + 15 + 3) // 4)  # pages for exactly the new length


def test_forced_rows_and_drafts_stay_within_the_round():
    counts = []
    reqs = [request(f"r{i}", reasoning=reasoning()) for i in range(4)]
    run(reqs, rows=5, check=lambda s, b: counts.append(len(b.plans[-1].decode)))
    assert max(counts) <= 5


@pytest.mark.parametrize("rows", [0, 16])
@pytest.mark.parametrize("budget", [1, 7, 12])
def test_the_budget_closes_the_thinking_at_exactly_n_tokens(budget, rows):
    events, sched, _ = run([request(reasoning=reasoning(budget=budget))], distinct=True, rows=rows)
    events = events["r0"]
    (i,) = [i for i, e in enumerate(events) if isinstance(e, TokenEvent) and e.taken_back_reason]
    assert (events[i].taken_back, events[i].taken_back_reason) == (0, "budget")
    assert streamed(events[:i]) == [100 + n for n in range(budget)]
    assert streamed(events[i:]) == CLOSE + ANSWER
    assert finished(events).completion_tokens == budget + len(CLOSE) + len(ANSWER) + 1
    assert sched.make_stats().loop_guard_fired == {"budget": 1}


def test_a_budget_of_zero_closes_before_the_first_token():
    events = run([request(reasoning=reasoning(budget=0))], distinct=True)[0]["r0"]
    assert streamed(events) == CLOSE + ANSWER
    assert events[0].taken_back_reason == "budget" and events[0].ttft is not None


def test_no_take_back_outside_the_reasoning():
    # No start tag in the prompt, and the model's loop is its answer: nothing is taken back.
    events, sched, _ = run([request(prompt=[1, 50, 51, 52], max_tokens=60, reasoning=reasoning(open_=False))])
    assert all(not e.taken_back_reason for e in events["r0"] if isinstance(e, TokenEvent))
    assert len(streamed(events["r0"])) == 60 and finished(events["r0"]).finish_reason == "length"
    assert sched.make_stats().loop_guard_fired == {}


def test_the_watch_opens_on_a_start_tag_in_the_output_and_shuts_on_the_end_tag():
    from engine.spec.reasoning import ReasoningWatch

    watch = ReasoningWatch.from_request(reasoning(open_=False), EngineConfig())
    output: list[int] = []

    def commit(tokens):
        due = None
        for t in tokens:
            output.append(t)
            due = due or watch.commit(output)
        return due

    assert commit(LOOP * 3) is None  # outside the channel a loop is the answer's business
    assert commit(START) is None and watch.inside and watch.begin == len(output)
    assert commit([60, 61, *END]) is None and not watch.inside and watch.count == 4  # closed by the model
    assert commit(LOOP * 3) is None
    assert commit([*START, *PREAMBLE]) is None
    reason, keep, span = commit(LOOP * 3)
    assert (reason, span) == ("loop", 10) and output[:keep] == output[: watch.begin] + PREAMBLE + LOOP


def test_turned_off_the_guard_lets_the_loop_run_to_the_length_cap():
    events, sched, _ = run([request(max_tokens=50, reasoning=reasoning())], loop_guard=False)
    assert len(streamed(events["r0"])) == 50 and finished(events["r0"]).finish_reason == "length"
    assert sched.make_stats().loop_guard_fired == {}


@pytest.mark.parametrize("max_tokens", [35, 36, 37, 38, 40])
def test_the_length_cap_counts_every_generated_token(max_tokens):
    events = run([request(max_tokens=max_tokens, reasoning=reasoning())], rows=16)[0]["r0"]
    done = finished(events)
    assert done.finish_reason == "length" and done.completion_tokens == max_tokens
    assert len(streamed(events)) == max_tokens


def test_a_stop_token_in_the_answer_ends_it_exactly():
    events = run([request(reasoning=reasoning())], rows=16)[0]["r0"]
    assert finished(events).finish_reason == "stop" and streamed(events)[-len(ANSWER) :] == ANSWER


def test_preempted_lanes_still_feed_their_forced_tokens():
    reqs = [request(f"r{i}", reasoning=reasoning()) for i in range(4)]
    alone = streamed(run([request(reasoning=reasoning())])[0]["r0"])
    events, sched, _ = run(reqs, num_blocks=24, rows=16)
    assert sched.counters["preempted"] > 0
    assert all(streamed(e) == alone for e in events.values())


# -- a real backend: the forced rows write the K/V a plain prefill would -------------------------------


@pytest.mark.parametrize("rows", [0, 16])
@pytest.mark.parametrize("cut", ["loop", "budget"])
def test_numpy_backend_continues_as_if_the_kept_output_and_the_forced_close_were_the_prompt(rows, cut):
    """After a take-back the numpy backend's next tokens are the ones a fresh prefill of prompt + kept
    output + forced close gives: the forced rows wrote the right K/V over the loop's."""
    from engine.backend import DecodeLane, PrefillSpan, StepOutput
    from tests.engine.test_hf_parity import BLOCK, GREEDY, load_backend, random_model

    model = random_model()
    backend = load_backend(*model)
    cfg = EngineConfig(decode_lanes=2, prefill_chunk=16, max_context=256, block_size=BLOCK, loop_guard_min_span=64)
    sched = Scheduler(cfg, KVManager(48, BLOCK, 8), seed_rng=random.Random(0), max_round_rows=rows)
    prompt, close = [5, 9, 17, 33, 2, 71, 3, 4], [120, 121, 122]
    spec = {"start_ids": [[3, 4]], "end_ids": [[120, 121]], "close_ids": close, "open": True,
            "max_tokens": 20 if cut == "budget" else None}  # fmt: skip
    assert sched.add_request(AddRequest("r", "c", prompt, 40, sampling={"temperature": 0}, reasoning=spec)) is None
    seq = sched.seqs["r"]
    context, answer = None, []
    while sched.has_work:
        plan = sched.schedule()
        outs = sched.update_from_output(plan, backend.step(plan))
        if cut == "loop" and context is None and len(seq.output_token_ids) >= 24:  # between rounds, as on a loop
            sched._take_back(seq, "loop", 11, 6, 0.0, outs)
        for o in outs:
            if isinstance(o, TokenEvent) and context is not None:
                answer += o.token_ids
            if isinstance(o, TokenEvent) and o.taken_back_reason:
                context = prompt + list(seq.output_token_ids)
                assert o.token_ids == close and seq.num_computed_tokens < len(context) - 1
    assert context[-len(close) :] == close and len(answer) >= 6
    assert len(context) - len(prompt) - len(close) == (11 if cut == "loop" else 20)
    # The reference: a fresh cache, prompt + the kept output + the forced close prefilled, then greedy.
    ref = load_backend(*model)
    out = StepOutput()
    ref.prefill(PrefillSpan(0, context, 0, list(range(8)), sample=GREEDY), out)
    expected = [out.prefill_token]
    while len(expected) < 6:
        step_out = StepOutput()
        lane = DecodeLane(0, expected[-1], len(context) + len(expected) - 1, list(range(8)), GREEDY)
        ref.decode_round([lane], step_out)
        expected.append(step_out.decode_tokens[0])
    assert answer[:6] == expected


def _cuda_take_back_stream(be, plan, rows: int) -> tuple[list[int], list[int]]:
    """One reasoning request on ``be``: taken back between rounds after 40 tokens, to 13 kept."""
    cfg = EngineConfig(decode_lanes=2, prefill_chunk=256, max_context=1024, block_size=16, loop_guard_min_span=64)
    sched = Scheduler(cfg, KVManager(plan.num_blocks, 16, 0), seed_rng=random.Random(0), max_round_rows=rows)
    prompt = [5, 9, 17, 33, 2, 71, 30, 40] * 3
    spec = {"start_ids": [[3, 4]], "end_ids": [[300, 301]], "close_ids": [300, 301, 302], "open": True}
    assert sched.add_request(AddRequest("r", "c", prompt, 80, sampling={"temperature": 0}, reasoning=spec)) is None
    seq, stream, context = sched.seqs["r"], [], None
    while sched.has_work:
        step = sched.schedule()
        assert len(step.decode) <= max(rows, len(sched.running))
        outs = sched.update_from_output(step, be.step(step))
        if context is None and seq.status.name == "DECODING" and len(seq.output_token_ids) >= 40:
            sched._take_back(seq, "loop", 13, 9, 0.0, outs)
            context = prompt + list(seq.output_token_ids)
        stream += [t for o in outs if isinstance(o, TokenEvent) for t in o.token_ids]
    return stream, context


@pytest.mark.slow
@pytest.mark.gpu
def test_cuda_backend_feeds_the_forced_rows_as_a_fresh_prefill_would():
    """The CUDA backend after a take-back: the same stream whether the forced tokens go one a round or
    as rows of one round, and the answer a fresh prefill of the kept output and the close gives."""
    from tests.kernels.gpu import cuda_available

    if not cuda_available():
        pytest.skip("needs PyCUDA and a CUDA device")
    from engine.backends import create_backend
    from engine.model_config import ModelConfig
    from engine.models import definition
    from tests.kernels.test_cuda_archs import random_weights

    cfg = ModelConfig(arch="llama", vocab_size=384, hidden_size=256, intermediate_size=512, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=64, max_position=2048, tie_word_embeddings=True)  # fmt: skip
    be = create_backend("cuda")
    plan = be.load(cfg, random_weights(definition("llama"), cfg, seed=3), block_size=16, kv_budget_bytes=64 << 20,
                   host_kv_budget_bytes=0, max_context=1024)  # fmt: skip
    try:
        one, context = _cuda_take_back_stream(be, plan, 0)
        many, _ = _cuda_take_back_stream(be, plan, be.max_round_rows)
        assert many == one and len(one) == 80  # max_tokens counts the taken-back tokens too
        answer = one[40 + 3 :]  # after the 40 streamed and the forced close
        # The reference: the kept context as a prompt, prefilled, then greedy.
        ref_cfg = EngineConfig(decode_lanes=2, prefill_chunk=256, max_context=1024, block_size=16, loop_guard=False)
        sched = Scheduler(ref_cfg, KVManager(plan.num_blocks, 16, 0), seed_rng=random.Random(0))
        assert sched.add_request(AddRequest("ref", "c", context, 8, sampling={"temperature": 0})) is None
        ref = []
        while sched.has_work:
            step = sched.schedule()
            ref += [t for o in sched.update_from_output(step, be.step(step)) if isinstance(o, TokenEvent) for t in o.token_ids]  # fmt: skip
        assert answer[:8] == ref
    finally:
        be.unload()


def test_under_a_released_window_the_cut_never_goes_behind_the_released_pages():
    from engine.kv_manager import RELEASED

    class Windowed(ThinkingBackend):
        releases_window_pages = True
        window = 12

        def _read(self, table, n):
            lo = max(0, n - self.window)
            assert all(table[p // self.block_size] != RELEASED for p in range(lo, n)), "read a released block"
            return [self.device[table[p // self.block_size]][p % self.block_size] for p in range(lo, n)]

    cfg = EngineConfig(decode_lanes=2, prefill_chunk=16, max_context=512, block_size=4, loop_guard_min_span=4)
    kv = KVManager(64, 4, 16)
    sched = Scheduler(cfg, kv, clock=FakeClock(), seed_rng=random.Random(0), kv_window=12, max_round_rows=8)
    backend = Windowed(64, 4, 16)
    assert sched.add_request(request(max_tokens=60, reasoning=reasoning())) is None
    seq, events, released_at_cut = sched.seqs["r0"], [], []
    while sched.has_work:
        plan = sched.schedule()
        before = seq.num_released_blocks
        for out in sched.update_from_output(plan, backend.step(plan)):
            events.append(out)
            if isinstance(out, TokenEvent) and out.taken_back_reason:
                released_at_cut.append((before, seq.num_prompt_tokens + len(seq.output_token_ids) - len(CLOSE)))
    (marker,) = [e for e in events if isinstance(e, TokenEvent) and e.taken_back_reason]
    assert marker.taken_back > 0
    released, kept_end = released_at_cut[0]
    assert kept_end >= released * 4 + 12  # the forced rows read only pages still held
    done = finished(events)
    assert done.completion_tokens == len([t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]) + (
        done.finish_reason == "stop"
    )
    assert kv.usage()["used"] == 0
