"""What the backend package layout tests share (tests/test_*_package.py): where the
project takes names from a backend package, and the modules of a package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("distlocks", "tests", "bench", "demo_project", "docs")


def package_dir(name: str) -> Path:
    return ROOT / "distlocks" / "backends" / name


def module_files(package: Path) -> list[str]:
    """The package's modules, for ``parametrize`` ("-" when there is none yet)."""
    return sorted(p.name for p in package.glob("*.py")) or ["-"]


def _names_used(tree: ast.AST, names: tuple[str, ...]) -> set[str]:
    """Names taken from ``distlocks.backends.<n>`` for each ``n`` in ``names``:
    ``from distlocks.backends.<n> import X``, and ``A.X`` where ``A`` is the module
    imported from ``distlocks.backends``."""
    modules = {f"distlocks.backends.{n}" for n in names}
    found: set[str] = set()
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in modules:
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "distlocks.backends":
            aliases.update(
                alias.asname or alias.name for alias in node.names if alias.name in names
            )
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
        ):
            found.add(node.attr)
    return found


def names_taken(package: Path, *names: str) -> dict[str, list[str]]:
    """Every name the project's code and docs take from ``distlocks.backends.<n>``
    (``names``: the package's name, and any old module it replaced) -> where."""
    used: dict[str, list[str]] = {}
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" in path.parts or package in path.parents:
                continue  # the package's own modules import from their siblings
            try:
                tree = ast.parse(path.read_text(), str(path))
            except SyntaxError:
                continue  # a file being written, or broken: its own tests say so
            for name in _names_used(tree, names):
                used.setdefault(name, []).append(str(path.relative_to(ROOT)))
    mention = re.compile(
        r"distlocks\.backends\.(?:" + "|".join(map(re.escape, names)) + r")\.(\w+)"
    )
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        if path.is_file():
            for name in mention.findall(path.read_text()):
                used.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return used


def module_lines(package: Path, module: str) -> int:
    return (package / module).read_text().count("\n")
