"""Moved to apps.core.metrics; kept so older imports still resolve."""

from apps.core.metrics import *  # noqa: F403
from apps.core.metrics import engine_families, engine_samples, is_loopback, parse_bind, start_listener  # noqa: F401
