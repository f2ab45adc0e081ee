"""Images through the engine on the numpy backend and the tiny Qwen2.5-VL (tests/models/tiny_vl.py):
the scheduler's chunks, prefix reuse keyed by the image, swaps and recomputes, refusals, the worker.

Every run is greedy, so a request's tokens are a function of its prompt and images: a run under
chunking, reuse, swapping or recompute must give the tokens the same request gets alone on a fresh
engine (whose parity with transformers tests/models/test_qwen2_5_vl.py checks).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from engine.backends.numpy import NumpyBackend
from engine.config import EngineConfig
from engine.kv_manager import KVManager
from engine.loaders import load_artifact
from engine.messages import ENGINE_CHANNEL, AddRequest, RequestFailed, RequestFinished, TokenEvent
from engine.scheduler import Scheduler
from tests.engine.fake_backend import FakeClock
from tests.models.tiny_vl import chat_inputs, image_entries, test_image, tiny_vl_dir

pytest.importorskip("torch")
pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def tiny(default_gguf_path):
    path = tiny_vl_dir(default_gguf_path)
    cfg, weights = load_artifact(path)
    return path, cfg, weights


@pytest.fixture(scope="module")
def prompts(tiny):
    """(prompt ids, AddRequest.images) per name: x and y are two images of one size, z another size."""
    path, cfg, _ = tiny
    x, y, z = test_image(100, 70, seed=0), test_image(100, 70, seed=5), test_image(60, 110, seed=1)
    out = {}
    for name, images, text in (("x", [x], "What is this?"), ("y", [y], "What is this?"), ("xz", [x, z], "Compare.")):
        inputs = chat_inputs(path, images, text)
        out[name] = (inputs["input_ids"][0].tolist(), image_entries(inputs, cfg.vision.image_token_id))
    return out


@pytest.fixture(scope="module")
def hf_tokens(tiny):
    """transformers' greedy 12 tokens for prompt "xz" (its decode rotates at the rope delta)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    path = tiny[0]
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    inputs = chat_inputs(path, [test_image(100, 70, seed=0), test_image(60, 110, seed=1)], "Compare.")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


class Engine:
    """A scheduler over a numpy backend holding the tiny model; counts the tower's encodes."""

    def __init__(self, tiny, *, block_size=4, num_blocks=128, num_host_blocks=64, prefill_chunk=256):
        _, cfg, weights = tiny
        self.backend = NumpyBackend()
        block_bytes = block_size * cfg.kv_bytes_per_token_fp32
        plan = self.backend.load(cfg, weights, block_size=block_size, kv_budget_bytes=num_blocks * block_bytes,
                                 host_kv_budget_bytes=num_host_blocks * block_bytes, max_context=512)  # fmt: skip
        self.encodes = 0
        encode = self.backend.vision.encode

        def counted(*args):
            self.encodes += 1
            return encode(*args)

        self.backend.vision.encode = counted
        ecfg = EngineConfig(decode_lanes=4, prefill_chunk=prefill_chunk, max_context=512, block_size=block_size)
        self.clock = FakeClock()
        kv = KVManager(plan.num_blocks, block_size, plan.num_host_blocks)
        self.sched = Scheduler(ecfg, kv, clock=self.clock, seed_rng=random.Random(0), vision=cfg.vision,
                               max_round_rows=self.backend.max_round_rows)  # fmt: skip
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, RequestFinished] = {}

    def add(self, rid: str, prompt, max_tokens: int = 12, **kw) -> RequestFailed | None:
        ids, images = prompt
        add = AddRequest(rid, "chan", list(ids), max_tokens, sampling={"temperature": 0.0}, images=images, **kw)
        return self.sched.add_request(add)

    def step(self) -> None:
        plan = self.sched.schedule()
        out = self.backend.step(plan)
        self.clock.advance(0.05)  # a fixed step time: runs interleave alike
        for o in self.sched.update_from_output(plan, out):
            if isinstance(o, TokenEvent):
                self.tokens.setdefault(o.request_id, []).extend(o.token_ids)
            elif isinstance(o, RequestFinished):
                self.finished[o.request_id] = o

    def drain(self) -> None:
        for _ in range(2000):
            if not self.sched.has_work:
                return
            self.step()
        raise AssertionError("did not drain")


def alone(tiny, prompt, max_tokens: int = 12) -> list[int]:
    e = Engine(tiny)
    assert e.add("r", prompt, max_tokens) is None
    e.drain()
    return e.tokens["r"]


def test_chunks_cut_inside_images_encode_each_once_and_give_the_same_tokens(tiny, prompts, hf_tokens):
    whole = Engine(tiny)
    whole.add("r", prompts["xz"])
    whole.drain()
    chunked = Engine(tiny, prefill_chunk=5)  # 43 prompt tokens in 9 chunks; images of 8 and 8 tokens
    chunked.add("r", prompts["xz"])
    seq = chunked.sched.seqs["r"]
    spans_inside = 0
    while chunked.sched.has_work:
        plan = chunked.sched.schedule()
        if plan.prefill is not None:
            start, end = plan.prefill.start_pos, plan.prefill.start_pos + len(plan.prefill.token_ids)
            spans_inside += any(img.offset < start < img.end or img.offset < end < img.end for img in seq.images)
        out = chunked.backend.step(plan)
        chunked.clock.advance(0.05)
        for o in chunked.sched.update_from_output(plan, out):
            if isinstance(o, TokenEvent):
                chunked.tokens.setdefault(o.request_id, []).extend(o.token_ids)
        # an image's rows are kept exactly while some of its placeholders are still to compute
        assert all((img.embeds is not None) == (img.offset < seq.num_computed_tokens < img.end) for img in seq.images)
    assert spans_inside >= 2
    assert chunked.tokens["r"] == whole.tokens["r"] == hf_tokens
    assert whole.encodes == chunked.encodes == 2


def test_the_same_image_resumes_from_retained_state_another_image_does_not(tiny, prompts):
    e = Engine(tiny)
    e.add("a", prompts["x"])
    e.drain()
    ids, (entry,) = prompts["x"]
    bs = 4
    e.add("b", prompts["x"])  # the same image and text: everything but the last token's block comes back
    e.drain()
    assert e.finished["b"].cached_tokens == (len(ids) - 1) // bs * bs > entry["offset"] + entry["num_tokens"]
    assert e.tokens["b"] == e.tokens["a"] and e.encodes == 1  # its placeholders were all claimed
    e.add("c", prompts["y"])  # another image, the same text and placeholders: only the blocks before it
    e.drain()
    assert e.finished["c"].cached_tokens == entry["offset"] // bs * bs
    assert e.tokens["c"] == alone(tiny, prompts["y"]) != e.tokens["a"]


def test_a_claim_that_ends_inside_an_image_encodes_it_again(tiny, prompts):
    """The prompt differs from a retained one right after its image: the claim stops at the block
    boundary inside the image, whose remaining rows come from a second encode."""
    ids, images = prompts["x"]
    (entry,) = images
    end = entry["offset"] + entry["num_tokens"]
    bs = next(b for b in (3, 4, 5, 6) if end % b and end // b * b > entry["offset"])
    other = list(ids)
    other[end] = ids[end + 2]  # <|vision_end|> replaced: the text after the image differs
    e = Engine(tiny, block_size=bs)
    e.add("a", prompts["x"])
    e.drain()
    e.add("b", (other, images))
    e.drain()
    assert entry["offset"] < e.finished["b"].cached_tokens == end // bs * bs < end
    assert e.encodes == 2
    fresh = Engine(tiny, block_size=bs)
    fresh.add("b", (other, images))
    fresh.drain()
    assert e.tokens["b"] == fresh.tokens["b"]


@pytest.mark.parametrize("host_blocks", [64, 0], ids=["swapped", "recomputed"])
def test_a_preempted_image_request_resumes_with_the_same_tokens(tiny, prompts, host_blocks):
    """An agent-class image request decoding when an interactive prompt needs its pages: moved to host
    and back (or, with no host tier, recomputed from its prompt and images), its tokens unchanged."""
    e = Engine(tiny, num_blocks=24, num_host_blocks=host_blocks)
    assert e.add("a", prompts["xz"], 40, request_class="agent") is None
    while len(e.tokens.get("a", ())) < 10:
        e.step()
    text = [(j * 7 + 3) % 4000 + 100 for j in range(40)]
    assert e.add("b", (text, None), 8) is None
    e.drain()
    key = "preempted" if host_blocks else "recomputed"
    assert e.sched.counters[key] >= 1 and e.sched.counters["recomputed"] == (0 if host_blocks else 1)
    assert e.tokens["a"] == alone(tiny, prompts["xz"], 40)
    if host_blocks:
        assert e.encodes == 2  # pages came back; nothing is encoded again (a recompute may reclaim its prefix)


def test_a_bad_image_fails_its_request_only(tiny, prompts):
    e = Engine(tiny)
    ids, (entry,) = prompts["x"]
    assert e.add("good", prompts["x"]) is None
    for rid, images in (("short", [{**entry, "pixel_values": entry["pixel_values"][:100]}]),
                        ("off", [{**entry, "offset": entry["offset"] + 1}]), ("junk", "not a list")):  # fmt: skip
        failed = e.add(rid, (ids, images))
        assert isinstance(failed, RequestFailed) and (failed.code, failed.status) == ("invalid_image", 400), rid
    e.drain()
    assert e.tokens["good"] == alone(tiny, prompts["x"]) and e.sched.counters["refused"] == 3


def test_the_worker_serves_an_image_and_refuses_a_bad_one_without_stopping(tiny, prompts):
    """Over the in-memory Channels layer, as the Django side sends them (pixel bytes in the message)."""
    from channels.layers import InMemoryChannelLayer

    from engine.worker import EngineWorker

    path, _, _ = tiny
    ids, (entry,) = prompts["x"]
    layer = InMemoryChannelLayer()
    cfg = EngineConfig(backend="numpy", decode_lanes=4, prefill_chunk=16, max_context=512, block_size=4)
    worker = EngineWorker(layer, cfg, path, "tiny-vl", ram_budget=1 << 30)

    async def outcome(rid: str, images) -> tuple[list[int], dict]:
        reply = await layer.new_channel()
        add = AddRequest(rid, reply, ids, 12, sampling={"temperature": 0.0}, images=images)
        await layer.send(ENGINE_CHANNEL, add.to_message())
        tokens = []
        while (msg := await asyncio.wait_for(layer.receive(reply), 60))["type"] == "engine.tokens":
            tokens += msg["token_ids"]
        return tokens, msg

    async def scenario():
        task = asyncio.create_task(worker.run())
        try:
            bad = await outcome("bad", [{**entry, "grid_thw": [1, 4]}])
            good = await outcome("good", [entry])
        finally:
            task.cancel()
        return bad, good

    (_, bad), (tokens, last) = asyncio.run(scenario())
    assert bad["type"] == "engine.failed" and (bad["code"], bad["status"]) == ("invalid_image", 400)
    assert last["type"] == "engine.finished" and tokens == alone(tiny, prompts["x"])
