"""Errors in the OpenAI envelope: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal is an ``IgnisError``; one renderer serves DRF views, consumers
and mid-stream failures, so a client never sees a traceback.
"""

from __future__ import annotations

import logging

from django.http import JsonResponse
from rest_framework import exceptions as drf_exceptions

log = logging.getLogger("ignis.api")


class IgnisError(Exception):
    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        status: int | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if type is not None:
            self.type = type
        if status is not None:
            self.status = status
        self.retry_after = retry_after

    def envelope(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, int(round(self.retry_after))))}


class InvalidRequest(IgnisError):
    code = "invalid_value"


class AuthenticationError(IgnisError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class BodyTooLarge(IgnisError):
    status = 413
    code = "request_too_large"


class NotFound(IgnisError):
    status = 404
    code = "not_found"


class ModelNotFound(IgnisError):
    status = 404
    code = "model_not_found"


class PreviousResponseNotFound(IgnisError):
    status = 404
    code = "previous_response_not_found"


class ModelSwitching(IgnisError):
    """503 while a switch runs; the client retries after Retry-After."""

    status = 503
    type = "server_error"
    code = "model_switching"


class SwitchInProgress(IgnisError):
    status = 409
    code = "switch_in_progress"


class ModelSwitchFailed(IgnisError):
    """503 without Retry-After: a retry would unload and reload the serving model again."""

    status = 503
    type = "server_error"
    code = "model_switch_failed"


def internal_error() -> IgnisError:
    """The one answer to a bug: a 500 that says nothing of it (the traceback goes to the log)."""
    return IgnisError(
        "The server had an error while processing your request.",
        type="server_error",
        code="internal_error",
        status=500,
    )


def engine_error(message: str) -> IgnisError:
    """A 500 for an engine answer that came back without what the route reads from it."""
    return IgnisError(message, type="server_error", code="engine_error", status=500)


def error_response(err: IgnisError) -> JsonResponse:
    """The envelope as an HTTP response, with its Retry-After: the one renderer for DRF
    views, Django views, the middleware and the Playground. Consumers send the same
    ``err.envelope()`` with ``err.status`` and ``err.headers()`` (before a stream began),
    as a final SSE event (after), or as an ``error`` WebSocket frame."""
    resp = JsonResponse(err.envelope(), status=err.status)
    for key, value in err.headers().items():
        resp[key] = value
    return resp


def error_from_engine(msg: dict) -> IgnisError:
    """An engine ``RequestFailed`` message as an IgnisError."""
    return IgnisError(
        msg.get("message", "engine error"),
        param=msg.get("param"),
        code=msg.get("code", "engine_error"),
        type=msg.get("error_type", "server_error"),
        status=int(msg.get("status", 503)),
        retry_after=msg.get("retry_after"),
    )


def drf_exception_handler(exc: Exception, context: dict) -> JsonResponse:
    if isinstance(exc, IgnisError):
        err = exc
    elif isinstance(exc, drf_exceptions.ParseError):
        err = InvalidRequest(f"We could not parse the JSON body of your request: {exc.detail}", code="invalid_json")
    elif isinstance(exc, drf_exceptions.UnsupportedMediaType):
        err = InvalidRequest("Send the body as application/json.", code="unsupported_media_type", status=415)
    elif isinstance(exc, drf_exceptions.MethodNotAllowed):
        err = IgnisError(str(exc.detail), code="method_not_allowed", status=405)
    elif isinstance(exc, drf_exceptions.APIException):
        err = IgnisError(str(exc.detail), code=exc.default_code, status=exc.status_code)
    else:
        log.exception("ignis.api.unhandled", extra={"view": str(context.get("view"))})
        err = internal_error()
    return error_response(err)
