"""docs/PERFORMANCE.md: each benchmark owns one ``## `` section and rewrites only that.

``report`` is every benchmark's tail: the table headed by the machine, the date and the
command (so a figure can be traced and re-run), printed, and written with ``--write``.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATH = ROOT / "docs" / "PERFORMANCE.md"


def command_line(python: str) -> str:
    """The command that ran this benchmark, from the repo root (``python``: how it was invoked)."""
    return python + " " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])


def report(section: str, *, machine: str, command: str, body: list[str], write: bool) -> list[str]:
    """Print ``Machine`` / ``Date`` / ``Command`` lines then ``body``; with ``write``, replace
    ``section`` of docs/PERFORMANCE.md with them. Returns the lines."""
    lines = [
        f"Machine: {machine}",
        f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}",
        f"Command: `{command}`",
        *body,
    ]
    print("\n".join(lines))
    if write:
        write_section(section, lines)
    return lines


def write_section(section: str, lines: list[str]) -> None:
    """Replace the section headed ``section`` (up to the next ``## ``) with ``lines``, or append it."""
    text = PATH.read_text() if PATH.exists() else "# Performance\n"
    body = section + "\n\n" + "\n".join(lines) + "\n"
    if section in text:
        head, rest = text.split(section, 1)
        nxt = rest.find("\n## ")
        text = head + body + (rest[nxt:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    PATH.parent.mkdir(exist_ok=True)
    PATH.write_text(text)
