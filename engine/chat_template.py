"""Rendering a model's Jinja chat template the way transformers does.

Templates come from model artifacts, i.e. from strangers: they run in
``jinja2.sandbox.ImmutableSandboxedEnvironment`` (no ``''.__class__`` escapes,
no mutation of what we pass in), with the environment options and globals HF's
``apply_chat_template`` offers (``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``, the ``{% generation %}`` tag, a non-HTML-escaping ``tojson``,
``raise_exception``, ``strftime_now``, ``dict``), and the messages prepared as
it prepares them (keys holding None dropped; a message's reasoning, given as
``reasoning_content``, ``thinking`` or ``reasoning``, under both
``reasoning_content``, which qwen3 reads, and ``thinking``, which gpt-oss reads), so a template renders to the same prompt
here as there. Model-specific variables (qwen3's ``enable_thinking``, gpt-oss's
``reasoning_effort`` / ``builtin_tools`` / ``model_identity``) are plain
template kwargs; :func:`template_variables` says which ones a template reads.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning may come under; each template reads one of them.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The template failed to compile or render (its own ``raise_exception`` included)."""


class _TemplateRaised(jinja2.exceptions.TemplateError):
    pass


def _raise_exception(message):
    raise _TemplateRaised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's built-in tojson HTML-escapes (<, >, &, '); templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names, closing a route to CPython internals."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _Dict:
    """``dict(...)`` for templates, without handing them the ``dict`` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _Dict()
    return env


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """Compile once per distinct template text (a model has one; switching brings another)."""
    try:
        return _environment().from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error (line {e.lineno}): {e.message}") from None


@lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The variables ``template`` reads that it does not set itself (e.g. ``enable_thinking``, ``reasoning_effort``)."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error (line {e.lineno}): {e.message}") from None


def prepare_messages(messages: list[dict]) -> list[dict]:
    """Copies of ``messages`` as templates expect them: no None values, reasoning under both names templates read."""
    prepared = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None} if isinstance(message, dict) else message
        if isinstance(m, dict):
            reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
            if reasoning is not None:
                m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        prepared.append(m)
    return prepared


def render_chat(
    template: str,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    bos_token: str | None = "",
    eos_token: str | None = "",
    **template_kwargs,
) -> str:
    """The prompt text for ``messages`` (OpenAI-shaped dicts) under ``template``.

    ``template_kwargs`` reach the template as variables (e.g. ``enable_thinking``,
    ``documents``). Every failure -- syntax, a sandbox violation, the template's
    own ``raise_exception`` -- raises :class:`ChatTemplateError` with a short message.
    """
    compiled = compile_template(template)
    try:
        return compiled.render(
            messages=prepare_messages(messages),
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            **template_kwargs,
        )
    except _TemplateRaised as e:
        raise ChatTemplateError(str(e.message or e)) from None
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"chat template blocked by the sandbox: {e}") from None
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from None
    except (TypeError, KeyError, IndexError, AttributeError, ValueError) as e:
        raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from None
