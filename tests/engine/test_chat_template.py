"""Chat templates render as transformers renders them, inside a sandbox."""

from __future__ import annotations

import pytest

from engine.chat_template import ChatTemplateError, render_chat

TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these tools:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
<|im_start|>{{ message.role }}
{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}
{% else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city <b>now</b> & later, in °C",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CHATS = {
    "no_system": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Count to 3 — en français 🇫🇷"},
    ],
}


@pytest.fixture(scope="module")
def hf_tokenizer(default_gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(default_gguf_path.parent), gguf_file=default_gguf_path.name)


@pytest.fixture(scope="module")
def bundle(default_gguf_path):
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(default_gguf_path)


@pytest.mark.slow
@pytest.mark.parametrize("chat", sorted(CHATS))
def test_gguf_template_matches_transformers(chat, bundle, hf_tokenizer):
    messages = CHATS[chat]
    ours = render_chat(bundle.chat_template, messages, bos_token=bundle.bos_token, eos_token=bundle.eos_token)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_tools_template_matches_transformers(bundle, hf_tokenizer):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
    messages = [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": '{"temp": 21}'},
    ]
    ours = render_chat(TOOLS_TEMPLATE, messages, tools=TOOLS, bos_token=bundle.bos_token, eos_token=bundle.eos_token)
    theirs = hf_tokenizer.apply_chat_template(
        messages, tools=TOOLS, chat_template=TOOLS_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert "<b>now</b> & later, in °C" in ours  # tojson neither HTML-escapes nor ASCII-escapes


def test_raise_exception_becomes_chat_template_error():
    template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="must start with user"):
        render_chat(template, [{"role": "system", "content": "x"}])
    assert issubclass(ChatTemplateError, ValueError)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{% set ns = namespace(_x=1) %}{{ ns._x }}",
        "{{ messages.append(1) }}",
        "{% for %}",
    ],
)
def test_sandbox_and_syntax_errors_are_chat_template_errors(template):
    with pytest.raises(ChatTemplateError):
        render_chat(template, [{"role": "user", "content": "x"}])


def test_sandbox_hides_dunder_attributes():
    assert render_chat("[{{ ''.__class__ }}]", []) == "[]"


def test_template_kwargs_and_strftime_reach_the_template():
    template = "{{ bos_token }}{% if enable_thinking %}think{% endif %}{{ strftime_now('%Y') | length }}"
    assert render_chat(template, [], bos_token="<s>", enable_thinking=True) == "<s>think4"
