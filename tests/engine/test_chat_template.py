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


# --- the new architectures' template features, against transformers' renderer ------------


def hf_render(template: str, messages: list[dict], **kwargs) -> str:
    """transformers' own rendering (apply_chat_template's steps, without a tokenizer)."""
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    kwargs.setdefault("add_generation_prompt", True)
    rendered, _ = utils.render_jinja_template(
        conversations=[utils._normalize_chat_messages(messages)], chat_template=template, **kwargs
    )
    return rendered[0]


# Written from Qwen3's documented ChatML-with-thinking format: reasoning shown only after the last user turn.
QWEN3 = """{%- if messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- set ns = namespace(last_user=0) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.reasoning_content and loop.index0 > ns.last_user %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content }}{% if not loop.last or add_generation_prompt %}<|im_end|>
{% endif %}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""


@pytest.mark.parametrize("thinking", [None, True, False])
def test_qwen3_enable_thinking(thinking):
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "old reasoning"},
        {"role": "user", "content": "3+3?"},
    ]
    ours = render_chat(QWEN3, messages, **kwargs)
    assert ours == hf_render(QWEN3, messages, **kwargs)
    assert "old reasoning" not in ours  # before the last user turn
    assert ours.endswith("<think>\n\n</think>\n\n") == (thinking is False)


def test_reasoning_reaches_the_template_under_any_name():
    from engine.chat_template import template_variables

    for field in ("reasoning_content", "reasoning", "thinking"):
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "so", field: "mull", "x": None}]
        ours = render_chat(QWEN3, messages, add_generation_prompt=False)
        assert ours == hf_render(QWEN3, messages, add_generation_prompt=False)
        assert ours.endswith("<|im_start|>assistant\n<think>\nmull\n</think>\n\nso"), field
    assert "messages" in template_variables(QWEN3) and "enable_thinking" in template_variables(QWEN3)


GEMMA2 = """{{ bos_token }}{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}
{%- for m in messages %}
{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}
<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}
{{ m.content | trim }}<end_of_turn>
{% endfor %}
{%- if add_generation_prompt %}<start_of_turn>model
{% endif %}"""
# Gemma 3 folds a system message into the first user turn instead of refusing it.
GEMMA3 = """{{ bos_token }}
{%- if messages[0].role == 'system' %}{% set prefix = messages[0].content + '\n\n' %}{% set turns = messages[1:] %}
{%- else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}
{%- for m in turns %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}
{{ (prefix if loop.first else '') + m.content | trim }}<end_of_turn>
{% endfor %}
{%- if add_generation_prompt %}<start_of_turn>model
{% endif %}"""


def test_gemma_templates():
    chat = CHATS["system"]
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        render_chat(GEMMA2, chat, bos_token="<bos>")
    with pytest.raises(ChatTemplateError, match="must alternate"):
        render_chat(GEMMA2, [{"role": "assistant", "content": "x"}], bos_token="<bos>")
    for template, messages in ((GEMMA2, chat[1:]), (GEMMA3, chat)):
        ours = render_chat(template, messages, bos_token="<bos>")
        assert ours == hf_render(template, messages, bos_token="<bos>")
        assert ours.startswith("<bos><start_of_turn>user\n") and ours.endswith("<start_of_turn>model\n")
    assert "<start_of_turn>user\nYou are terse.\n\nHi!<end_of_turn>" in render_chat(GEMMA3, chat)


# Written from OpenAI's harmony format description (system, developer, channels, tool calls).
HARMONY = """<|start|>system<|message|>{{ model_identity | default('You are ChatGPT, a large language model trained by OpenAI.') }}
Knowledge cutoff: 2024-06
Current date: {{ strftime_now('%Y-%m-%d') }}

Reasoning: {{ reasoning_effort | default('medium') }}
{% if builtin_tools %}
# Tools
{% for t in builtin_tools %}
## {{ t }}
{% endfor %}{% endif %}
# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>
{%- set first = messages[0] if messages[0].role in ('system', 'developer') else none %}
{%- if first or tools %}<|start|>developer<|message|>{% if first %}# Instructions

{{ first.content }}
{% endif %}{% if tools %}
# Tools

namespace functions {
{% for t in tools %}// {{ t.function.description }}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{% endfor %}} // namespace functions
{% endif %}<|end|>{% endif %}
{%- for m in messages if m.role not in ('system', 'developer') %}
{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'assistant' %}
{%- if m.thinking and loop.last %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}
{%- if m.tool_calls %}{% set call = m.tool_calls[0].function %}<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>{{ call.arguments | tojson }}<|call|>
{%- else %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}
{%- elif m.role == 'tool' %}<|start|>functions.{{ m.name }} to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""


def test_gpt_oss_harmony_variables():
    from engine.chat_template import template_variables

    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
    messages = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need the tool.", "tool_calls": [call]},
    ]
    kwargs = {"reasoning_effort": "high", "builtin_tools": ["browser", "python"], "model_identity": "You are Ignis."}
    ours = render_chat(HARMONY, messages, tools=TOOLS, add_generation_prompt=False, **kwargs)
    assert ours == hf_render(HARMONY, messages, tools=TOOLS, add_generation_prompt=False, **kwargs)
    assert ours.startswith("<|start|>system<|message|>You are Ignis.\n") and "Reasoning: high" in ours
    assert "# Tools\n## browser\n## python\n" in ours and "# Instructions\n\nAnswer in French." in ours
    assert "<|channel|>analysis<|message|>Need the tool.<|end|>" in ours  # reasoning_content reached `thinking`
    assert ours.endswith('commentary json<|message|>{"city": "Zürich"}<|call|>')
    plain = render_chat(HARMONY, messages[1:2])
    assert "Reasoning: medium" in plain and plain.endswith("<|end|><|start|>assistant")
    assert {"reasoning_effort", "builtin_tools", "model_identity"} <= template_variables(HARMONY)


def test_generation_tag_and_dict_global():
    template = (
        "{% set d = dict(a=1, b=2) %}{{ d | tojson }}"
        "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    )
    messages = [{"role": "assistant", "content": "x"}]
    assert render_chat(template, messages) == hf_render(template, messages) == '{"a": 1, "b": 2}[x]'


def test_strftime_now_renders_today():
    from datetime import datetime

    before = datetime.now().strftime("%d %b %Y")
    ours = render_chat("Today Date: {{ strftime_now('%d %b %Y') }}", [])
    assert ours in (f"Today Date: {before}", f"Today Date: {datetime.now().strftime('%d %b %Y')}")


MISTRAL = """{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]
{%- elif m.role == 'assistant' %} {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"""


def test_mistral_inst_template_has_one_bos(tmp_path):
    from engine.tokenizer import load_tokenizer
    from tests.engine import test_tokenizer_spm as spm

    vocab = spm._vocab(spm._pieces(), control=["[INST]", "[/INST]"])
    bundle = load_tokenizer(spm._write_gguf(tmp_path / "mistral.gguf", "llama", *vocab, prefix=True, template=MISTRAL))
    assert bundle.chat_template == MISTRAL and bundle.add_bos
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    prompt = render_chat(bundle.chat_template, messages, bos_token=bundle.bos_token, eos_token=bundle.eos_token)
    assert prompt == "<s>[INST] Hi [/INST] Hello.</s>[INST] Bye [/INST]"
    ids = bundle.encode(prompt)  # what the chat service sends: the template wrote <s> itself
    assert ids == bundle.encode(prompt, add_special_tokens=True) == spm._source(*vocab, prefix=True).encode(prompt).ids
    assert ids[0] == bundle.bos_token_id and ids.count(bundle.bos_token_id) == 1
    assert ids.count(bundle.eos_token_id) == 1 and ids[-1] == bundle.tokenizer.token_to_id("[/INST]")
