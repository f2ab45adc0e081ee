"""Moved to apps.core.errors (the bottom app); kept so older imports still resolve."""

from apps.core.errors import *  # noqa: F403
from apps.core.errors import drf_exception_handler, error_from_engine, error_response, internal_error  # noqa: F401
