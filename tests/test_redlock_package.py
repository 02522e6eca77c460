"""The Redlock backend's package layout (issue 28): every name the project imports from
``distlocks.backends.redlock`` stays importable from it, each module holds one concern
short enough to read whole, and the Lua scripts module does no I/O."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from distlocks.backends import redlock

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "distlocks" / "backends" / "redlock"
SOURCES = ("distlocks", "tests", "bench", "demo_project", "docs")
MODULE = "distlocks.backends.redlock"


def _python_files() -> list[Path]:
    return [
        path
        for top in SOURCES
        for path in sorted((ROOT / top).rglob("*.py"))
        if "__pycache__" not in path.parts
    ]


def _names_used(tree: ast.AST) -> set[str]:
    """Names taken from the package: ``from distlocks.backends.redlock import X``, and
    ``A.X`` where ``A`` is the package imported from ``distlocks.backends``."""
    names: set[str] = set()
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == MODULE:
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "distlocks.backends":
            aliases.update(
                alias.asname or alias.name for alias in node.names if alias.name == "redlock"
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
    assert not (PACKAGE.parent / "redlock.py").exists()


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
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for path in [p for p in texts if p.is_file()]:
        for name in re.findall(r"distlocks\.backends\.redlock\.(\w+)", path.read_text()):
            used.setdefault(name, []).append(str(path.relative_to(ROOT)))
    # The names the tests take today are among them: the search itself works.
    assert {"RedlockBackend", "quorum", "_SCRIPTS", "CONFIRM", "GIVE_BACK"} <= set(used)
    missing = {name: where for name, where in used.items() if not hasattr(redlock, name)}
    assert not missing, f"not importable from {MODULE}: {missing}"


@pytest.mark.parametrize("module", sorted(p.name for p in PACKAGE.glob("*.py")))
def test_each_module_is_short(module: str) -> None:
    lines = (PACKAGE / module).read_text().count("\n")
    assert lines <= 600, f"{module}: {lines} lines; split it by concern"


def test_the_scripts_module_does_no_io() -> None:
    """The Lua and which script is which, apart from the clients that run them (as
    h11 keeps the protocol apart from sockets): it imports no driver, thread or clock."""
    tree = ast.parse((PACKAGE / "scripts.py").read_text())
    imported = {
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    allowed = {"__future__", "distlocks.backends.redis"}
    assert imported <= allowed, f"scripts.py imports {sorted(imported - allowed)}"
