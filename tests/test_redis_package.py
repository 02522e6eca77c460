"""The Redis backend's package layout (issue 28): every name the project imports from
``distlocks.backends.redis`` (and from the old ``distlocks.backends.redis_primitives``,
now part of the package) stays importable from it, the Redlock backend's included,
and each module holds one concern, short enough to read whole."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from distlocks.backends import redis

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "distlocks" / "backends" / "redis"
OLD_MODULES = ("distlocks.backends.redis", "distlocks.backends.redis_primitives")
NAMES = ("redis", "redis_primitives")
MENTION = re.compile(r"distlocks\.backends\.redis(?:_primitives)?\.(\w+)")
SOURCES = ("distlocks", "tests", "bench", "demo_project", "docs")


def _python_files() -> list[Path]:
    return [
        path
        for top in SOURCES
        for path in sorted((ROOT / top).rglob("*.py"))
        if "__pycache__" not in path.parts
    ]


def _names_used(tree: ast.AST) -> set[str]:
    """Names taken from the package: ``from distlocks.backends.redis import X``, and
    ``A.X`` where ``A`` is the package imported from ``distlocks.backends``."""
    names: set[str] = set()
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in OLD_MODULES:
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "distlocks.backends":
            aliases.update(
                alias.asname or alias.name for alias in node.names if alias.name in NAMES
            )
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
        ):
            names.add(node.attr)
    return names


def test_the_backend_is_a_package() -> None:
    assert (PACKAGE / "__init__.py").is_file()
    assert not (PACKAGE.parent / "redis.py").exists()
    assert not (PACKAGE.parent / "redis_primitives.py").exists()


def test_every_name_imported_from_the_package_is_exported() -> None:
    used: dict[str, list[str]] = {}
    for path in _python_files():
        if PACKAGE in path.parents:
            continue  # the package's own modules import from their siblings
        try:
            tree = ast.parse(path.read_text(), str(path))
        except SyntaxError:
            continue  # a file being written, or broken: its own tests say so
        for name in _names_used(tree):
            used.setdefault(name, []).append(str(path.relative_to(ROOT)))
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for name in re.findall(
            r"distlocks\.backends\.redis(?:_primitives)?\.(\w+)", path.read_text()
        ):
            used.setdefault(name, []).append(str(path.relative_to(ROOT)))
    # The names the brief listed are among them: the search itself works.
    assert {"RedisBackend", "ACQUIRE", "RELEASE", "_NEXT_TOKEN", "FENCE_GRACE_MS"} <= set(used)
    missing = {name: where for name, where in used.items() if not hasattr(redis, name)}
    assert not missing, f"not importable from distlocks.backends.redis: {missing}"


@pytest.mark.parametrize("module", sorted(p.name for p in PACKAGE.glob("*.py")))
def test_each_module_is_short(module: str) -> None:
    lines = (PACKAGE / module).read_text().count("\n")
    assert lines <= 600, f"{module}: {lines} lines; split it by concern"
