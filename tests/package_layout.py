"""What the backend package layout tests share (tests/test_*_package.py): where the
project takes names from a backend package, and the modules of a package."""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("distlocks", "tests", "bench", "demo_project", "docs")


def package_dir(name: str) -> Path:
    return ROOT / "distlocks" / "backends" / name


def module_files(package: Path) -> list[str]:
    """The package's modules, for ``parametrize`` ("-" when there is none yet)."""
    return sorted(p.name for p in package.glob("*.py")) or ["-"]


@dataclass(frozen=True)
class _Imports:
    """What one source file imports, as far as the search below needs it."""

    #: (module, name, bound name) of every ``from module import name [as bound]``.
    froms: tuple[tuple[str, str, str], ...]
    #: (name, attribute) of every ``name.attribute`` in the file.
    attributes: frozenset[tuple[str, str]]


@functools.cache
def _imports(path: Path, mtime_ns: int) -> _Imports | None:
    """The file parsed once per version (``mtime_ns``): the four package tests search
    the same few hundred files, and parsing them is most of their time."""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except SyntaxError:
        return None  # a file being written, or broken: its own tests say so
    froms: list[tuple[str, str, str]] = []
    attributes: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            froms += [(node.module, a.name, a.asname or a.name) for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            attributes.add((node.value.id, node.attr))
    return _Imports(tuple(froms), frozenset(attributes))


def _names_used(imports: _Imports, names: tuple[str, ...]) -> set[str]:
    """Names taken from ``distlocks.backends.<n>`` for each ``n`` in ``names``:
    ``from distlocks.backends.<n> import X``, and ``A.X`` where ``A`` is the module
    imported from ``distlocks.backends``."""
    modules = {f"distlocks.backends.{n}" for n in names}
    found = {name for module, name, _ in imports.froms if module in modules}
    aliases = {
        bound
        for module, name, bound in imports.froms
        if module == "distlocks.backends" and name in names
    }
    found.update(attr for value, attr in imports.attributes if value in aliases)
    return found


def names_taken(package: Path, *names: str) -> dict[str, list[str]]:
    """Every name the project's code and docs take from ``distlocks.backends.<n>``
    (``names``: the package's name, and any old module it replaced) -> where."""
    used: dict[str, list[str]] = {}
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" in path.parts or package in path.parents:
                continue  # the package's own modules import from their siblings
            imports = _imports(path, path.stat().st_mtime_ns)
            if imports is None:
                continue
            for name in _names_used(imports, names):
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
