"""KV pages released behind the window: the scheduler and KV manager on a windowed fake backend,
then one real numpy-backend run (greedy tokens equal with release on and off).

The fake reads only the window (its next token hashes the last ``window`` tokens it reads back
from their slots) and refuses to read a released entry, so a page released too early, a claim of
a block whose content is gone, or a lost swap changes the tokens or fails the read.
"""

from __future__ import annotations

import random

import numpy as np

from engine.backend import Backend
from engine.config import EngineConfig
from engine.kv_manager import RELEASED, KVManager, release_window
from engine.messages import AddRequest
from engine.model_config import ModelConfig
from engine.scheduler import Scheduler
from tests.engine.fake_backend import FakeBackend, FakeClock, finished_of, tokens_of
from tests.engine.fake_backend import step as run_step


class WindowedFake(FakeBackend):
    releases_window_pages = True
    window = 64

    def _read(self, table, n):
        lo = max(0, n - self.window)
        assert all(table[p // self.block_size] != RELEASED for p in range(lo, n)), "read a released block"
        return [self.device[table[p // self.block_size]][p % self.block_size] for p in range(lo, n)]


def expected(req: AddRequest, n: int, window: int) -> list[int]:
    ctx = list(req.prompt_token_ids)
    for _ in range(n):
        ctx.append(FakeBackend.next_token(ctx[-window:]))
    return ctx[len(req.prompt_token_ids) :]


def windowed(window: int, *, num_blocks: int, block_size: int = 16, num_host_blocks: int = 32, lanes: int = 4,
             prefill_chunk: int = 64):  # fmt: skip
    cfg = EngineConfig(decode_lanes=lanes, prefill_chunk=prefill_chunk, decode_share=0.25, max_context=4096,
                       block_size=block_size, default_max_tokens=16)  # fmt: skip
    clock = FakeClock()
    kv = KVManager(num_blocks, block_size, num_host_blocks)
    sched = Scheduler(cfg, kv, clock=clock, seed_rng=random.Random(0), kv_window=window)
    backend = WindowedFake(num_blocks, block_size, num_host_blocks)
    backend.window = window
    return sched, backend, clock


def request(i: int, prompt: list[int] | int, max_tokens: int, request_class: str = "interactive") -> AddRequest:
    ids = prompt if isinstance(prompt, list) else [(i * 31 + j * 7) % 997 for j in range(prompt)]
    return AddRequest(f"req-{i}", f"chan-{i}", list(ids), max_tokens, request_class=request_class)


def drive(sched, backend, clock, watch=None, max_steps=5000) -> dict:
    outputs: dict = {}
    for _ in range(max_steps):
        if not sched.has_work:
            return outputs
        for out in run_step(sched, backend, clock):
            outputs.setdefault(out.request_id, []).append(out)
        if watch is not None:
            watch(sched)
        if backend.plans[-1].is_empty:
            clock.advance(0.01)
    raise AssertionError("did not drain")


def assert_drained(sched) -> None:
    sched.kv.end_step()
    u = sched.kv.usage()
    assert u["used"] == 0 and u["host_used"] == 0 and sched.kv.num_available_blocks == u["total"]


def test_release_window_needs_every_layer_sliding_and_the_backend():
    cfg = ModelConfig(arch="mistral", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2,
                      num_kv_heads=2, head_dim=4, sliding_window=64)  # fmt: skip
    assert release_window(cfg, True) == 64
    assert release_window(cfg, False) is None
    mixed = ModelConfig(**{**cfg.__dict__, "layer_types": ("sliding_attention", "full_attention")})
    assert release_window(mixed, True) is None
    assert Backend.releases_window_pages is False


def test_a_long_generation_holds_at_most_the_window_in_blocks():
    """1,000 tokens with window 64 and blocks of 16: never more than ceil(64/16) + 1 = 5 blocks."""
    sched, backend, clock = windowed(64, num_blocks=64)
    req = request(0, 10, 1000)
    sched.add_request(req)
    held = []
    msgs = drive(sched, backend, clock, watch=lambda s: held.append(s.kv.usage()["used"]))
    assert max(held) <= 5 and max(held) == 5
    assert tokens_of(msgs[req.request_id]) == expected(req, 1000, 64)
    assert finished_of(msgs[req.request_id]).completion_tokens == 1000
    assert_drained(sched)


def test_released_pages_go_to_another_sequence():
    """Two generations that together outgrow the pool without release run side by side with it:
    the second's pages include ones the first released, and nobody is preempted."""
    sched, backend, clock = windowed(32, num_blocks=64)
    a, b = request(0, 20, 900), request(1, 200, 300)
    sched.add_request(a)
    tables: dict[int, set[int]] = {0: set(), 1: set()}

    def watch(s):
        for seq in s.running:
            tables[seq.seq_id] |= {x for x in seq.block_table if x != RELEASED}

    early = []
    for _ in range(400):  # a decodes well past its window before b arrives
        early += run_step(sched, backend, clock)
        watch(sched)
    sched.add_request(b)
    msgs = drive(sched, backend, clock, watch=watch)
    assert tables[0] & tables[1], "no page of a went on to b"
    assert sched.make_stats().preempted == 0
    assert tokens_of(msgs[b.request_id]) == expected(b, 300, 32)
    assert tokens_of(early + msgs[a.request_id]) == expected(a, 900, 32)
    assert_drained(sched)


def test_prefix_reuse_never_claims_a_released_page():
    """A's 3-block prompt is released while A decodes: retained by hash, it is claimed (valid K/V)
    by B1 with the same prompt. Once the middle block of that prefix is evicted, B2 with the same
    prompt claims only the block before the gap, not the retained one after it; every sequence's
    tokens are the undisturbed ones (the fake reads back what the claimed blocks hold)."""
    bs = 16
    sched, backend, clock = windowed(16, num_blocks=12, block_size=bs, lanes=4, prefill_chunk=256)
    prompt = [(j * 13) % 997 for j in range(3 * bs + 5)]
    a, b1, b2 = request(0, prompt, 120), request(1, prompt, 20), request(3, prompt, 20)
    assert sched.add_request(a) is None
    msgs: dict = {}

    def run(until):
        while until():
            for out in run_step(sched, backend, clock):
                msgs.setdefault(out.request_id, []).append(out)

    run(lambda: sched.seqs[a.request_id].num_tokens < 100)
    seq_a, kv = sched.seqs[a.request_id], sched.kv
    assert seq_a.block_table[:3] == [RELEASED] * 3
    hashes = seq_a.block_hashes[:3]
    head = [kv.hash_to_block[h] for h in hashes]  # retained, no longer live
    assert all(kv.ref_count[x] == 0 for x in head)
    assert [x for x in kv.evictable if x in head] == head[::-1]  # the LRU evicts the tail first
    assert sched.add_request(b1) is None
    run(lambda: sched.has_work)
    assert finished_of(msgs[b1.request_id]).cached_tokens == 3 * bs  # claimed while A had released them
    kv.evictable.move_to_end(head[1], last=False)  # whatever the LRU order, say the middle goes first
    filler = request(2, (len(kv.free_blocks) + 1) * bs - 1, 1)  # every free block and one retained
    assert sched.add_request(filler) is None
    run(lambda: sched.has_work)
    assert [kv.hash_to_block.get(h) == x for h, x in zip(hashes, head)] == [True, False, True]
    assert sched.add_request(b2) is None
    run(lambda: sched.has_work)
    assert finished_of(msgs[b2.request_id]).cached_tokens == bs  # block 0 only: the gap stops the claim
    for r in (a, b1, b2):
        assert tokens_of(msgs[r.request_id]) == expected(r, r.max_tokens, 16), r.request_id
    assert_drained(sched)


def test_a_windowed_sequence_swaps_out_and_back_without_its_released_pages():
    """An agent lane that has released blocks is preempted by an interactive prompt: only its
    live pages are copied out, its host table keeps the released entries as RELEASED, and it
    comes back (nothing copied for them) to finish with the undisturbed tokens."""
    sched, backend, clock = windowed(8, num_blocks=12, block_size=4, num_host_blocks=16, prefill_chunk=32)
    sched.cfg.prefill_group = False  # b starts a step after a: at step 30 it holds the block that makes c preempt it
    a, b = request(0, 6, 40), request(1, 6, 40, request_class="agent")
    sched.add_request(a)
    sched.add_request(b)
    early = []
    for _ in range(30):
        early += run_step(sched, backend, clock)
    seq_b = sched.seqs[b.request_id]
    released = seq_b.num_released_blocks
    live = len(seq_b.block_table) - released
    assert released > 0
    c = request(2, 30, 4)  # interactive, 8 blocks: the agent lane moves to host
    sched.add_request(c)
    seen = {}

    def watch(s):
        for seq in s.preempted:
            seen.setdefault(seq.seq_id, list(seq.host_block_table))

    early += run_step(sched, backend, clock)
    watch(sched)
    swap_out = backend.plans[-1].swap_out
    assert seq_b.status.name == "PREEMPTED" and len(swap_out) == live
    assert seen[1][:released] == [RELEASED] * released and RELEASED not in seen[1][released:]
    msgs = drive(sched, backend, clock, watch=watch)
    swap_in = [p for p in backend.plans if p.swap_in]
    assert swap_in and sum(len(p.swap_in) for p in swap_in) <= live
    for r in (a, b, c):
        mine = [m for m in early if m.request_id == r.request_id] + msgs.get(r.request_id, [])
        assert tokens_of(mine) == expected(r, r.max_tokens, 8), r.request_id
    assert_drained(sched)


# --- the numpy backend --------------------------------------------------------------------


def _tiny_mistral(window: int) -> tuple[ModelConfig, dict]:
    from engine.models import definition

    cfg = ModelConfig(arch="mistral", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position=256, sliding_window=window)  # fmt: skip
    rng = np.random.default_rng(0)
    weights = {}
    for name, shape in definition("mistral").tensors(cfg).items():
        base = 1.0 if name.endswith("norm.weight") else 0.0
        weights[name] = (base + 0.3 * rng.standard_normal(shape)).astype(np.float32)
    return cfg, weights


def _numpy_run(release: bool) -> tuple[dict[str, list[int]], int]:
    """Three greedy requests over the tiny windowed model, lanes at different positions; returns
    their tokens and the most unreleased blocks a decode lane held."""
    from engine.backends.numpy import NumpyBackend

    cfg, weights = _tiny_mistral(8)
    bs = 4
    backend = NumpyBackend()
    block_bytes = bs * cfg.kv_bytes_per_token_fp32
    plan = backend.load(cfg, weights, block_size=bs, kv_budget_bytes=64 * block_bytes,
                        host_kv_budget_bytes=16 * block_bytes, max_context=256)  # fmt: skip
    window = release_window(cfg, backend.releases_window_pages) if release else None
    ecfg = EngineConfig(decode_lanes=4, prefill_chunk=16, max_context=256, block_size=bs)
    clock = FakeClock()
    sched = Scheduler(ecfg, KVManager(plan.num_blocks, bs, plan.num_host_blocks), clock=clock,
                      seed_rng=random.Random(0), kv_window=window)  # fmt: skip
    for i, n in enumerate((11, 23, 17)):
        r = request(i, [(i * 17 + j * 5) % 97 for j in range(n)], 40)
        r.sampling = {"temperature": 0.0}
        assert sched.add_request(r) is None
    tokens: dict[str, list[int]] = {}
    most = 0
    while sched.has_work:
        step_plan = sched.schedule()
        ran = backend.step(step_plan)
        clock.advance(0.05)  # a fixed step time: both runs interleave their prompts and lanes alike
        for out in sched.update_from_output(step_plan, ran):
            tokens.setdefault(out.request_id, []).extend(getattr(out, "token_ids", []))
        # What a round's lanes hold (a prompt's own early blocks go back at its first round).
        most = max([most] + [sum(b != RELEASED for b in lane.block_table) for lane in step_plan.decode])
    assert sorted(len(t) for t in tokens.values()) == [40, 40, 40]
    return tokens, most


def test_numpy_greedy_tokens_do_not_depend_on_release():
    """The numpy backend with window 8 and blocks of 4: release on holds ceil(8/4) + 1 = 3 blocks a
    lane (and would raise reading a released one); the greedy tokens equal those with release off."""
    released, most = _numpy_run(True)
    kept, most_kept = _numpy_run(False)
    assert most == 3 and most_kept == 16  # 23 + 40 tokens
    assert released == kept
