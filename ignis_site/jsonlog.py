"""One structured log stream: each record is an event name plus fields.

``server.log_format`` picks how it is written on stderr: ``json`` (one object a
line, the default, for machines) or ``text`` (one readable line an event, for
people). Celery's worker and Python's warnings go through the same handlers
(``ignis_site/celery.py``, ``capture_warnings``).
"""

import json
import logging
import time
import warnings

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _fields(record: logging.LogRecord) -> dict:
    return {k: v for k, v in vars(record).items() if k not in _RESERVED}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
            "logger": record.name,
        }
        entry.update(_fields(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """``09:31:24 info    ignis.model.loaded  model=smollm2-135m-instruct seconds=4.37``."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = " ".join(f"{k}={_short(v)}" for k, v in _fields(record).items())
        line = f"{stamp} {record.levelname.lower():<7} {record.getMessage()}" + (f"  {fields}" if fields else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _short(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return json.dumps(text) if (" " in text or not text) and isinstance(value, str) else text


FORMATTERS = {"json": JsonFormatter, "text": TextFormatter}


def capture_warnings() -> None:
    """``warnings.warn`` becomes one ``ignis.python.warning`` record (category, text, where),
    not the multi-line text ``logging.captureWarnings`` would log."""
    log = logging.getLogger("ignis.python")

    def show(message, category, filename, lineno, file=None, line=None):
        log.warning(
            "ignis.python.warning",
            extra={
                "category": category.__name__,
                "text": " ".join(str(message).split()),
                "where": f"{filename}:{lineno}",
            },
        )

    warnings.showwarning = show


class DropDeliberate503(logging.Filter):
    """Django logs every 5xx at ERROR; our 503s (loading, switching, engine_full) are
    answers, not faults, and the request log already carries them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "status_code", None) != 503
