"""The ZooKeeper backend's package layout (issue 28): every name the project imports
from ``distlocks.backends.zookeeper`` stays importable from it, and each module holds
one concern, short enough to read whole."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "distlocks" / "backends" / "zookeeper"
MODULE = "distlocks.backends.zookeeper"
SOURCES = ("distlocks", "tests", "bench", "demo_project", "docs")


def _python_files() -> list[Path]:
    return [
        path
        for top in SOURCES
        for path in sorted((ROOT / top).rglob("*.py"))
        if "__pycache__" not in path.parts
    ]


def _names_used(tree: ast.AST) -> set[str]:
    """Names taken from the package: ``from distlocks.backends.zookeeper import X``, and
    ``A.X`` where ``A`` is the package imported from ``distlocks.backends``."""
    names: set[str] = set()
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == MODULE:
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "distlocks.backends":
            aliases.update(
                alias.asname or alias.name for alias in node.names if alias.name == "zookeeper"
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
    assert not (PACKAGE.parent / "zookeeper.py").exists()


def test_every_name_imported_from_the_package_is_exported() -> None:
    pytest.importorskip("kazoo")
    package = importlib.import_module(MODULE)
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
        for name in re.findall(r"distlocks\.backends\.zookeeper\.(\w+)", path.read_text()):
            used.setdefault(name, []).append(str(path.relative_to(ROOT)))
    # The names the tests take are among them: the search itself works.
    assert {"ZooKeeperBackend", "_permit_kind", "_permit_nodes", "_permit_owner"} <= set(used)
    missing = {name: where for name, where in used.items() if not hasattr(package, name)}
    assert not missing, f"not importable from {MODULE}: {missing}"


def test_the_logger_keeps_its_name() -> None:
    """Operators route the backend's warnings by the logger's name, which stays the
    old module's whatever module of the package logs."""
    for path in sorted(PACKAGE.glob("*.py")):
        for call in re.findall(r"^logger = logging\.getLogger\(([^)]*)\)", path.read_text(), re.M):
            assert call == f'"{MODULE}"', f"{path.name}: getLogger({call})"


@pytest.mark.parametrize("module", sorted(p.name for p in PACKAGE.glob("*.py")) or ["-"])
def test_each_module_is_short(module: str) -> None:
    lines = (PACKAGE / module).read_text().count("\n")
    assert lines <= 600, f"{module}: {lines} lines; split it by concern"
