"""docs/PERFORMANCE.md: each benchmark owns one ``## `` section and rewrites only that."""

from __future__ import annotations

from pathlib import Path

PATH = Path(__file__).resolve().parent.parent / "docs" / "PERFORMANCE.md"


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
