"""KVManager books: allocation, retention by hash, eviction, swaps, pins."""

from __future__ import annotations

from engine.kv_manager import KVManager
from engine.sampling import SamplingParams
from engine.sequence import Sequence

BS = 4


def make_seq(tokens, seq_id=0, output=()) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        prompt_token_ids=list(tokens),
        max_tokens=8,
        sampling=SamplingParams(),
        seed=0,
        output_token_ids=list(output),
    )


def prefill(kv: KVManager, seq: Sequence) -> int:
    cached = kv.allocate(seq)
    kv.mark_computed(seq, seq.num_tokens)
    return cached


def test_allocate_and_free_return_every_block():
    kv = KVManager(8, BS, 4)
    seq = make_seq(range(10))
    assert prefill(kv, seq) == 0
    assert len(seq.block_table) == 3
    assert kv.usage()["used"] == 3
    kv.free(seq)
    u = kv.usage()
    assert u["used"] == 0 and u["retained"] == 2 and u["free"] == 6  # two full prompt blocks kept by hash
    assert kv.num_available_blocks == 8


def test_prefix_claim_leaves_last_prompt_token():
    kv = KVManager(16, BS, 0)
    a = make_seq(range(12))
    prefill(kv, a)
    kv.free(a)
    same = make_seq(range(12), seq_id=1)
    assert kv.allocate(same) == 8  # 3 full blocks cached, but the last token must be computed
    longer = make_seq(list(range(12)) + [99, 98], seq_id=2)
    assert kv.allocate(longer) == 12
    assert longer.block_table[:3] == same.block_table[:2] + [longer.block_table[2]]
    assert kv.ref_count[same.block_table[0]] == 2
    assert kv.num_prefix_hits == 2 and kv.num_cached_tokens == 20


def test_chained_hash_needs_whole_prefix():
    kv = KVManager(16, BS, 0)
    a = make_seq(range(12))
    prefill(kv, a)
    kv.free(a)
    # Same second block, different first block: no hit at all.
    b = make_seq([50, 51, 52, 53] + list(range(4, 12)) + [1], seq_id=1)
    assert kv.allocate(b) == 0


def test_uncomputed_blocks_are_not_claimable():
    kv = KVManager(16, BS, 0)
    a = make_seq(range(12))
    kv.allocate(a)
    kv.mark_computed(a, 5)  # only the first block is complete
    kv.free(a)
    assert kv.allocate(make_seq(range(13), seq_id=1)) == 4


def test_retained_blocks_evicted_lru_only_when_needed():
    kv = KVManager(6, BS, 0)
    a, b = make_seq(range(9)), make_seq(range(100, 109), seq_id=1)
    prefill(kv, a)
    kv.free(a)
    prefill(kv, b)
    kv.free(b)
    assert kv.usage()["retained"] == 4 and kv.can_allocate(24)
    c = make_seq(range(200, 209), seq_id=2)  # 3 blocks: 2 free + 1 evicted (a's tail first)
    prefill(kv, c)
    assert kv.usage()["retained"] == 3
    assert len(kv._match(list(range(9)), 2)) == 1  # a's head survived
    assert len(kv._match(list(range(100, 109)), 2)) == 2


def test_can_allocate_counts_claimable_blocks():
    kv = KVManager(4, BS, 0)
    a = make_seq(range(13))
    prefill(kv, a)
    assert not kv.can_allocate(0, make_seq(range(14), seq_id=1))  # 4 blocks, none free
    kv.free(a)
    assert kv.can_allocate(0, make_seq(range(14), seq_id=1))


def test_append_slots_grows_and_reports_dry_pool():
    kv = KVManager(3, BS, 0)
    seq = make_seq(range(4))
    prefill(kv, seq)
    assert kv.append_slots(seq, 5) and len(seq.block_table) == 2
    assert kv.append_slots(seq, 8) and len(seq.block_table) == 2
    assert kv.append_slots(seq, 12) and len(seq.block_table) == 3
    assert not kv.append_slots(seq, 13)


def test_swap_out_and_in_round_trip():
    kv = KVManager(6, BS, 4)
    seq = make_seq(range(6), output=[7, 8])
    prefill(kv, seq)
    device = list(seq.block_table)
    pairs = kv.swap_out(seq)
    assert [d for d, _ in pairs] == device and seq.block_table == []
    assert kv.usage()["host_used"] == 2 and kv.usage()["used"] == 0
    other = make_seq(range(50, 74), seq_id=1)  # takes every block, evicting the retained one
    prefill(kv, other)
    assert not kv.can_swap_in(seq)
    kv.free(other)
    assert kv.can_swap_in(seq, seq.num_tokens + 1)
    back = kv.swap_in(seq)
    assert [h for h, _ in back] == [h for _, h in pairs]
    assert len(seq.block_table) == 2 and kv.usage()["host_used"] == 0
    assert kv.num_free_host_blocks == 2  # the pages being read back stay reserved until the plan ran
    kv.end_step()
    assert kv.num_free_host_blocks == 4


def test_swap_in_reclaims_blocks_still_on_device():
    kv = KVManager(8, BS, 4)
    seq = make_seq(range(6), output=[7, 8])
    prefill(kv, seq)
    first = seq.block_table[0]
    pairs = kv.swap_out(seq)
    back = kv.swap_in(seq)  # block 0 was hashed and still retained: claimed, not copied
    assert seq.block_table[0] == first
    assert back == [(pairs[1][1], seq.block_table[1])]


def test_free_of_preempted_returns_host_blocks():
    kv = KVManager(4, BS, 4)
    seq = make_seq(range(6))
    prefill(kv, seq)
    kv.swap_out(seq)
    kv.free(seq)
    assert kv.usage()["host_used"] == 0


def test_pinned_prefix_survives_pressure():
    kv = KVManager(4, BS, 0)
    system = list(range(8))
    a = make_seq(system + [1, 2])
    prefill(kv, a)
    kv.free(a)
    assert kv.pin_prefix(system) == 8
    assert kv.pin_prefix(system) == 8  # idempotent
    # Pinned blocks stay available to a live request; they are only evicted last.
    assert kv.usage()["pinned"] == 2 and kv.num_available_blocks == 4
    filler = make_seq(range(100, 108), seq_id=1)
    prefill(kv, filler)
    kv.free(filler)
    filler2 = make_seq(range(200, 208), seq_id=2)
    prefill(kv, filler2)  # evicts filler, never the pinned system block
    kv.free(filler2)
    assert kv.allocate(make_seq(system + [5], seq_id=3)) == 8
    assert kv.unpin_prefix(system) == 8
    assert kv.usage()["pinned"] == 0


def test_pinned_prefix_goes_last_and_never_blocks_a_live_request():
    kv = KVManager(6, BS, 0)
    system = list(range(8))
    a = make_seq(system + [1])
    prefill(kv, a)
    assert kv.pin_prefix(system) == 8  # pinned while live: retained pinned once freed
    kv.free(a)
    assert kv.usage()["pinned"] == 2
    old = make_seq(range(100, 109), seq_id=1)  # retained after the pinned prefix, so younger in plain LRU
    prefill(kv, old)
    kv.free(old)
    mid = make_seq(range(200, 215), seq_id=2)  # 4 blocks: the free ones, then unpinned retained
    assert kv.allocate(mid) == 0
    assert kv.usage()["pinned"] == 2
    kv.free(mid)
    assert kv.allocate(make_seq(system + [7], seq_id=3)) == 8
    # A request that needs the whole pool gets it: the pinned prefix is evicted, last.
    kv2 = KVManager(6, BS, 0)
    s = make_seq(system + [1])
    prefill(kv2, s)
    kv2.pin_prefix(system)
    kv2.free(s)
    big = make_seq(range(300, 324), seq_id=4)
    assert kv2.can_allocate(0, big) and kv2.allocate(big) == 0
    assert kv2.usage()["pinned"] == 0 and not any(kv2.pins)
    kv2.free(big)
    assert kv2.allocate(make_seq(system + [2], seq_id=5)) == 0


def test_usage_counts_live_blocks_through_every_transition():
    """``usage()["used"]`` is derived from the other states' lists; a random walk through
    allocation, growth, rewinds, pins, swaps and frees keeps it equal to the live reference counts."""
    import random

    rng = random.Random(7)
    kv = KVManager(48, BS, 16)
    live: list[Sequence] = []
    swapped: list[Sequence] = []
    heads = [list(range(100, 108)), list(range(200, 204))]
    seen = {"pinned": 0, "retained": 0, "host_used": 0}

    def check(step):
        u = kv.usage()
        assert u["used"] == sum(1 for r in kv.ref_count if r > 0), step
        assert u["used"] + u["retained"] + u["free"] == kv.num_blocks
        for k in seen:
            seen[k] = max(seen[k], u[k])

    for step in range(600):
        op = rng.random()
        if op < 0.25:
            seq = make_seq(rng.choice(heads) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))], seq_id=step)
            if kv.can_allocate(0, seq):
                prefill(kv, seq)
                live.append(seq)
        elif op < 0.4 and live:
            seq = rng.choice(live)
            seq.output_token_ids.append(rng.randrange(50))
            if not kv.append_slots(seq, seq.num_tokens):
                seq.output_token_ids.pop()
        elif op < 0.5 and live:
            seq = rng.choice(live)
            kv.rewind(seq, max(seq.num_prompt_tokens, seq.num_tokens - rng.randrange(3)))
        elif op < 0.6 and live:
            seq = live.pop(rng.randrange(len(live)))
            if kv.can_swap_out(seq):
                kv.swap_out(seq)
                swapped.append(seq)
            else:
                kv.free(seq)
        elif op < 0.7 and swapped:
            seq = swapped[0]
            if kv.can_swap_in(seq, seq.num_tokens):
                kv.swap_in(seq)
                live.append(swapped.pop(0))
        elif op < 0.8:
            (kv.pin_prefix if rng.random() < 0.7 else kv.unpin_prefix)(rng.choice(heads))
        elif live:
            kv.free(live.pop(rng.randrange(len(live))))
        kv.end_step()
        check(step)
    kv.pin_prefix(heads[0])
    for seq in live:
        kv.free(seq)
    check("drained")
    assert all(seen.values()), seen  # the walk reached every state
