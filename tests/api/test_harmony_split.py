"""gpt-oss's harmony output split into reasoning, content and tool calls, on scripted text streams
fed whole, a character at a time (every marker split) and in 3- and 7-character pieces; the
splitter is chosen by the template or the special tokens, reads through the tokenizer with the
markers kept, and harmony's turn ends (not its message end) stop generation."""

from __future__ import annotations

import json

import pytest

from apps.api.harmony_split import MARKERS, HarmonySplitter, splitter_for
from apps.api.output_parsers import DEFAULT, HARMONY, output_parsers_for
from apps.api.output_split import Event, OutputSplitter
from apps.api.responses.events import ResponseEvents, output_text
from apps.api.streaming import TextStream
from apps.api.usage import usage_object
from tests.api.test_responses_events import base, through_sdk
from tests.models.tiny_gpt_oss import HARMONY_TEMPLATE, harmony_tokenizer

ANSWER = (
    "<|channel|>analysis<|message|>The user greets me. Reply briefly; no <think> tags here.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?\nAsk away.<|return|>"
)
CALL = (
    "<|channel|>analysis<|message|>Need the weather: call get_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Paris",  "unit": "c"}<|call|>'
)
PREAMBLE = (  # a commentary message to the user, then the recipient before the channel
    "<|channel|>commentary<|message|>Checking the time.<|end|>"
    '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "UTC"}<|call|>'
)


def chunkings(text: str):
    yield [text]
    yield list(text)
    yield [text[i : i + 3] for i in range(0, len(text), 3)]
    yield [text[i : i + 7] for i in range(0, len(text), 7)]


IDS = ["whole", "chars", "3s", "7s"]


def run(pieces: list[str], **kw) -> tuple[OutputSplitter, list]:
    sp = splitter_for(parsers=HARMONY, **kw)
    events = []
    for p in pieces:
        events += sp.feed(p)
    events += sp.flush()
    return sp, events


def joined(events, kind: str) -> str:
    return "".join(e.text for e in events if e.kind == kind)


@pytest.mark.parametrize("pieces", list(chunkings(ANSWER)), ids=IDS)
def test_analysis_is_reasoning_final_is_content(pieces):
    sp, events = run(pieces)
    assert isinstance(sp, HarmonySplitter)
    assert sp.reasoning == joined(events, "reasoning") == "The user greets me. Reply briefly; no <think> tags here."
    assert sp.content == joined(events, "content") == "Hello! How can I help?\nAsk away."
    assert not sp.tool_calls
    assert not any(m in e.text for e in events for m in MARKERS)  # no marker, nor a piece of one, is shown
    assert [e.kind for e in events if e.kind != events[0].kind][:1] == ["content"]  # reasoning first


def test_reasoning_streams_before_its_message_ends():
    sp = splitter_for(parsers=HARMONY)
    head = "<|channel|>analysis<|message|>Let me think"
    events = [e for ch in head for e in sp.feed(ch)]
    assert joined(events, "reasoning") == "Let me think" and sp.mode == "reasoning"
    assert sp.feed("<|en") == []  # perhaps <|end|>: held
    assert sp.feed("d|><|start|>assistant<|channel|>final<|message|>Hi") == [Event("content", "Hi")]


@pytest.mark.parametrize("pieces", list(chunkings(CALL)), ids=IDS)
def test_commentary_to_a_function_is_a_tool_call(pieces):
    sp, events = run(pieces)
    assert sp.reasoning == "Need the weather: call get_weather." and sp.content == ""
    (call,) = sp.tool_calls
    assert call.name == "get_weather" and call.index == 0 and call.id.startswith("call_")
    assert call.arguments == '{"city": "Paris", "unit": "c"}'  # re-serialised, as the tag path does
    kinds = [e.kind for e in events if e.kind.startswith("tool")]
    assert kinds == ["tool_call_start", "tool_call_args", "tool_call"]
    assert joined(events, "tool_call_args") == call.arguments


@pytest.mark.parametrize("pieces", list(chunkings(PREAMBLE)), ids=IDS)
def test_commentary_without_recipient_is_content_and_recipient_may_lead(pieces):
    sp, events = run(pieces)
    assert sp.content == "Checking the time." and sp.reasoning == ""
    assert [(c.name, json.loads(c.arguments)) for c in sp.tool_calls] == [("get_time", {"tz": "UTC"})]


def test_without_tools_a_call_body_is_content():
    sp, _ = run([CALL], parse_tools=False)
    assert not sp.tool_calls and json.loads(sp.content) == {"city": "Paris", "unit": "c"}


def test_arguments_that_are_not_json_pass_through_verbatim():
    sp, _ = run(["<|channel|>commentary to=functions.run <|constrain|>python<|message|>print(1)<|call|>"])
    assert [(c.name, c.arguments) for c in sp.tool_calls] == [("run", "print(1)")]


@pytest.mark.parametrize(
    "text, reasoning, content, calls",
    [
        ("<|channel|>analysis<|message|>Thinking hard<|en", "Thinking hard", "", 0),  # max_tokens mid-marker
        ("<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|chan", "Done.", "", 0),  # mid-header
        ('<|channel|>commentary to=functions.f<|message|>{"a": 1', "", "", 0),  # arguments cut short: no call
        ('<|channel|>commentary to=functions.f<|message|>{"a": 1}', "", "", 1),  # whole but unclosed: a call
    ],
)
def test_cut_short(text, reasoning, content, calls):
    for pieces in chunkings(text):
        sp, events = run(pieces)
        assert (sp.reasoning, sp.content, len(sp.tool_calls)) == (reasoning, content, calls)
        assert not any("<|" in e.text for e in events)


def test_prompt_that_opened_the_analysis():
    sp, _ = run(
        ["I should answer.<|end|><|start|>assistant<|channel|>final<|message|>Yes.<|return|>"], in_reasoning=True
    )
    assert (sp.reasoning, sp.content) == ("I should answer.", "Yes.")
    assert HARMONY.reasoning.opened_by("<|start|>assistant<|channel|>analysis<|message|>")
    assert not HARMONY.reasoning.opened_by("<|start|>user<|message|>Hi<|end|><|start|>assistant")


@pytest.mark.parametrize("text", ["Hi", "A model that never learned harmony\nwrites plain <|end|>text."])
def test_text_that_is_not_harmony_is_content(text):
    for pieces in chunkings(text):
        sp, _ = run(pieces)
        assert sp.content == text.replace("<|end|>", "") and sp.reasoning == "" and not sp.tool_calls


def test_chosen_by_template_or_special_tokens(default_gguf_path):
    class Tok:
        def __init__(self, template, specials=()):
            self.chat_template, self.special_tokens = template, specials

    assert output_parsers_for(Tok(HARMONY_TEMPLATE)) is HARMONY
    assert output_parsers_for(Tok("{{ messages }}", ("<|start|>", "<|channel|>"))) is HARMONY
    assert output_parsers_for(Tok("<|im_start|>{{ messages }}")) is DEFAULT
    assert type(splitter_for(parsers=DEFAULT)) is OutputSplitter
    assert HARMONY.keep_special_tokens and not DEFAULT.keep_special_tokens


@pytest.fixture(scope="module")
def harmony_dir(default_gguf_path, tmp_path_factory):
    """A tokenizer directory as gpt-oss ships one: harmony's markers special, its template, eos <|return|>."""
    root = tmp_path_factory.mktemp("harmony_tok")
    bundle = harmony_tokenizer(default_gguf_path)
    bundle.tokenizer.save(str(root / "tokenizer.json"))
    cfg = {"chat_template": HARMONY_TEMPLATE, "bos_token": bundle.bos_token, "eos_token": "<|return|>"}
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    return root


@pytest.fixture(scope="module")
def tok(harmony_dir):
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(harmony_dir)


def test_turn_ends_stop_and_message_ends_do_not(tok):
    ids = {t: tok.tokenizer.token_to_id(t) for t in ("<|return|>", "<|call|>", "<|end|>")}
    assert ids["<|return|>"] in tok.eos_token_ids and ids["<|call|>"] in tok.eos_token_ids
    assert ids["<|end|>"] not in tok.eos_token_ids  # the answer follows the reasoning's <|end|>
    assert output_parsers_for(tok) is HARMONY


def test_token_stream_through_the_detokenizer(tok):
    prompt = tok.encode("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    ids = tok.encode(ANSWER)
    assert tok.tokenizer.token_to_id("<|channel|>") in ids  # the markers are single special tokens
    text = TextStream(tok, [], prompt, skip_special_tokens=not HARMONY.keep_special_tokens)
    sp = splitter_for(parsers=output_parsers_for(tok))
    for i in ids:
        sp.feed(text.feed([i]))
    sp.feed(text.flush())
    sp.flush()
    assert sp.reasoning.startswith("The user greets me.") and sp.content == "Hello! How can I help?\nAsk away."
    stripped = TextStream(tok, [], prompt)  # the default decode drops the markers: nothing left to split on
    assert "<|channel|>" not in stripped.feed(ids) + stripped.flush()


def test_responses_items_from_harmony():
    ev = ResponseEvents(base(), tools=True, parsers=HARMONY)
    events = ev.start()
    for i in range(0, len(CALL), 5):
        events += ev.feed(CALL[i : i + 5], 1)
    events += ev.finish(usage_object(10, 5, 4))
    through_sdk(events)
    items = ev.response["output"]
    assert [i["type"] for i in items] == ["reasoning", "function_call"]
    assert items[1]["name"] == "get_weather" and json.loads(items[1]["arguments"]) == {"city": "Paris", "unit": "c"}
    ev = ResponseEvents(base(), tools=True, parsers=HARMONY)
    events = ev.start() + [e for ch in ANSWER for e in ev.feed(ch, 1)] + ev.finish(usage_object(10, 5, 4))
    through_sdk(events)
    assert [i["type"] for i in ev.response["output"]] == ["reasoning", "message"]
    assert output_text(ev.response) == "Hello! How can I help?\nAsk away."
