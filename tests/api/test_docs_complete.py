"""docs/CONFIG.md names every configuration key; docs/API.md's error table names every error code raised."""

from __future__ import annotations

import re
from pathlib import Path

from ignis_site.config import FIELDS

ROOT = Path(__file__).resolve().parents[2]


def test_config_md_lists_every_key():
    text = (ROOT / "docs" / "CONFIG.md").read_text()
    table = {m.group(1) for m in re.finditer(r"^\| `([a-z_]+\.[a-z0-9_]+)` \|", text, re.M)}
    assert set(FIELDS) <= table, sorted(set(FIELDS) - table)


def test_api_md_error_table_lists_every_code():
    codes = set()
    for path in [*(ROOT / "apps").rglob("*.py"), *(ROOT / "engine").rglob("*.py")]:
        codes |= set(re.findall(r'(?:code=|code = |"code": )"([a-z_]+)"', path.read_text()))
    api = (ROOT / "docs" / "API.md").read_text()
    table = api[api.index("| Status | type | code |") : api.index("After a stream has started")]
    missing = sorted(c for c in codes if not re.search(rf"\b{c}\b", table))
    assert not missing, missing
