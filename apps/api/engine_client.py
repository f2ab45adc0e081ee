"""Moved to apps.core.engine_client (the bottom app); kept so older imports still resolve."""

from apps.core.engine_client import *  # noqa: F403
from apps.core.engine_client import (  # noqa: F401
    ECHO_CHARS,
    engine_status,
    engine_status_ask,
    engine_status_payload,
    request_abort,
    request_submit,
)
