"""One factory for every ``RequestFailed`` the engine sends, keyed by its code.

A code fixes how the Django side renders the refusal (HTTP status, OpenAI
``type``, the ``param`` it names); the message says why for this request. Codes
whose reason never varies carry their message here too, so admission, the
scheduler and the worker cannot drift apart on wording.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.messages import RequestFailed


@dataclass(frozen=True)
class _Kind:
    status: int
    error_type: str
    param: str | None = None
    message: str | None = None  # None: the caller says why


_INVALID = "invalid_request_error"
_SERVER = "server_error"

KINDS: dict[str, _Kind] = {
    # Admission (engine/admission.py, engine/scheduler.py).
    "invalid_prompt": _Kind(400, _INVALID, "messages", "The prompt is empty."),
    "context_length_exceeded": _Kind(400, _INVALID, "messages"),
    "engine_full": _Kind(503, _SERVER),
    "duplicate_request": _Kind(400, _INVALID, None, "Duplicate request id."),
    "unsupported": _Kind(
        400,
        _INVALID,
        "logprobs",
        "Prompt logprobs (echo with logprobs) are not available on this engine's backend.",
    ),
    "invalid_grammar": _Kind(400, _INVALID, "response_format"),
    "invalid_image": _Kind(400, _INVALID, "messages"),  # AddRequest.images (engine.models.vision.check_images)
    # The model host (engine/worker.py): no model to serve the request right now.
    "model_switching": _Kind(503, _SERVER, None, "The server is switching models; retry shortly."),
    "model_load_failed": _Kind(503, _SERVER),
    # A request that was running and could not go on.
    "engine_error": _Kind(500, _SERVER),
}


def refusal(
    code: str, request_id: str, message: str | None = None, *, retry_after: float | None = None
) -> RequestFailed:
    """The ``RequestFailed`` for ``code`` (a key of ``KINDS``); ``message`` overrides its fixed one."""
    kind = KINDS[code]
    text = message if message is not None else kind.message
    assert text is not None, f"refusal {code!r} needs a message"
    return RequestFailed(
        request_id=request_id,
        message=text,
        code=code,
        status=kind.status,
        error_type=kind.error_type,
        param=kind.param,
        retry_after=retry_after,
    )
