"""The Django side's per-token work (apps/api/streaming.py): detokenizing through tokenizers'
DecodeStream, stop strings, and chat chunks rendered from a pre-serialized head."""

from __future__ import annotations

import pytest

from apps.api.streaming import ChatChunks, TextStream, chat_chunk, sse
from engine.tokenizer import IncrementalDetokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tok(default_gguf_path):
    return load_tokenizer(default_gguf_path)


def _sse_chunk(request_id, model, created, index, delta, finish_reason=None, logprobs=None) -> bytes:
    chunk = chat_chunk(request_id, model, created, delta, finish_reason)
    chunk["choices"][0]["index"] = index
    if logprobs is not None:
        chunk["choices"][0]["logprobs"] = logprobs
    return sse(chunk)


@pytest.mark.parametrize(
    "index, delta, finish_reason, logprobs",
    [
        (0, {"role": "assistant", "content": ""}, None, None),
        (0, {"content": " knight"}, None, None),
        (3, {"content": 'é "quoted"\n\u2028 \\ 🎉'}, None, None),
        (1, {"reasoning_content": "hm", "reasoning": "hm"}, None, None),
        (0, {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}]}, None, None),
        (0, {}, "length", None),
        (2, {"content": "a"}, None, {"content": [{"token": "a", "logprob": -0.5, "bytes": [97]}], "refusal": None}),
    ],
)
def test_chat_chunks_are_the_bytes_a_whole_render_gives(index, delta, finish_reason, logprobs):
    args = ("chatcmpl-1c3fe566b5d44942aa189b7e", "smollm2-135m-instruct", 1796137079)
    got = ChatChunks(*args).render(index, delta, finish_reason, logprobs)
    assert got == _sse_chunk(*args, index, delta, finish_reason, logprobs)


def test_the_chunk_head_escapes_what_it_repeats():
    got = ChatChunks('id"with\\quote', "mödel", 7).render(0, {"content": "x"})
    assert got == _sse_chunk('id"with\\quote', "mödel", 7, 0, {"content": "x"})


def test_detokenizing_token_by_token_gives_the_whole_decode(tok):
    prompt = tok.encode("<|im_start|>assistant\n")
    text = "The knight rode on. 🎉 Ça va? 日本語, and more words here. " * 20
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    pieces = [detok.feed([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text == detok.text
    assert all("\ufffd" not in p for p in pieces)
    # What it keeps is a few ids of context, not the text so far: a token costs the same at the end.
    assert len(detok._ids) <= IncrementalDetokenizer.CONTEXT


def test_a_stream_cut_inside_a_character_flushes_what_it_held(tok):
    ids = tok.encode("ok 🎉")
    cut = next(n for n in range(1, len(ids)) if "\ufffd" in tok.decode(ids[:n]))  # ends mid-emoji
    detok = IncrementalDetokenizer(tok)
    shown = "".join(detok.feed([i]) for i in ids[:cut])
    assert "\ufffd" not in shown
    tail = detok.flush()
    assert shown + tail == tok.decode(ids[:cut]) and tail.endswith("\ufffd")
    assert detok.flush() == ""
    # and the stream goes on after a flush
    assert detok.feed(tok.encode(" done")) == " done"


def test_rounds_of_several_tokens_and_a_stop_string_across_rounds(tok):
    ids = tok.encode("alpha beta STOP gamma")
    ts = TextStream(tok, ["STOP"])
    out = "".join(ts.feed(ids[i : i + 2]) for i in range(0, len(ids), 2))
    assert ts.stopped and out == "alpha beta " and ts.text == out
    assert ts.flush() == ""

    held = TextStream(tok, ["STOPPING"])
    shown = held.feed(tok.encode("alpha STOP"))
    assert shown == "alpha " and not held.stopped  # "STOP" may begin the stop string: held back
    assert held.flush() == "STOP" and held.text == "alpha STOP"


def test_no_stop_strings_emits_at_once(tok):
    ts = TextStream(tok, [])
    ids = tok.encode("one two three")
    assert "".join(ts.feed([i]) for i in ids) + ts.flush() == "one two three" == ts.text
