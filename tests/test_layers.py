"""The layering of the Django side, read from the source (every import, function-local ones too).

* ``apps.core`` is the bottom app: it imports no other app and nothing of ``ignis_site``.
* ``apps.models`` sits on core; ``apps.api`` and ``apps.playground`` on core and models.
  No app imports an app above it or beside it, and what an app takes from another is
  that app's public surface (``PUBLIC``), never its internals.
* ``ignis_site`` (settings and wiring) may import any app; no app imports it but for
  its configuration schema (``ignis_site.config``); management commands, which wire the
  server, may.
* No import circle among the project's modules, counting function-local imports
  (which otherwise hide one until it bites at run time).
* Every module imports.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("apps", "ignis_site")
# Which app may import which: the layers, bottom first.
MAY_IMPORT = {
    "apps.core": set(),
    "apps.models": {"apps.core"},
    "apps.api": {"apps.core", "apps.models"},
    "apps.playground": {"apps.core", "apps.models"},
}
# The modules of an app that others may import: its services, selectors and models.
PUBLIC = {
    "apps.core": None,  # all of it: the bottom app exists to be imported
    "apps.models": {
        "apps.models.services",
        "apps.models.selectors",
        "apps.models.switching",
        "apps.models.catalog",
        "apps.models.config_service",
        "apps.models.models",
    },
}
SITE_FOR_APPS = {"ignis_site.config"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project modules ``name`` imports (``from pkg import mod`` counts ``pkg.mod``)."""
    found = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names} & MODULES.keys()
            found.update(subs or {base})
    return {m for m in found if m in MODULES}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _app(module: str) -> str | None:
    return next((app for app in MAY_IMPORT if module == app or module.startswith(app + ".")), None)


def test_every_module_imports():
    for name in sorted(MODULES):
        if name.endswith(".celery") or ".management.commands." in name or name == "ignis_site.asgi":
            continue  # a command or the ASGI entry imports its world: covered by test_manage and e2e
        importlib.import_module(name)


def test_apps_import_downwards_and_only_public_modules():
    wrong = []
    for name, targets in GRAPH.items():
        app = _app(name)
        if app is None:
            continue
        for target in targets:
            if target.startswith("ignis_site"):
                if target not in SITE_FOR_APPS and ".management.commands." not in name:
                    wrong.append(f"{name} -> {target} (ignis_site is wiring)")
                continue
            other = _app(target)
            if other is None or other == app:
                continue
            if other not in MAY_IMPORT[app]:
                wrong.append(f"{name} -> {target} ({app} may not import {other})")
            elif PUBLIC[other] is not None and target not in PUBLIC[other] and target != other:
                wrong.append(f"{name} -> {target} (not {other}'s public surface)")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circles():
    # Package __init__ modules that re-export a submodule are not edges back into the package.
    graph = {n: {t for t in ts if not n.startswith(t + ".")} for n, ts in GRAPH.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name)):
            pytest.fail("import circle: " + " -> ".join(cycle))


def test_the_checker_sees_function_local_imports():
    src = "def f():\n    from apps.core.errors import IgnisError\n"
    tree = ast.parse(src)
    assert any(isinstance(n, ast.ImportFrom) and n.module == "apps.core.errors" for n in ast.walk(tree))
    assert "apps.core.errors" in GRAPH["apps.models.catalog"]
