"""The Redlock backend's package layout (issue 28): every name the project imports from
``distlocks.backends.redlock`` stays importable from it, each module holds one concern
short enough to read whole, and the Lua scripts module does no I/O."""

from __future__ import annotations

import ast

import pytest

from distlocks.backends import redlock
from tests.package_layout import module_files, module_lines, names_taken, package_dir

PACKAGE = package_dir("redlock")
MODULE = "distlocks.backends.redlock"


def test_the_backend_is_a_package() -> None:
    assert (PACKAGE / "__init__.py").is_file()
    assert not (PACKAGE.parent / "redlock.py").exists()


def test_every_name_imported_from_the_package_is_exported() -> None:
    used = names_taken(PACKAGE, "redlock")
    # The names the tests take today are among them: the search itself works.
    assert {"RedlockBackend", "quorum", "_SCRIPTS", "CONFIRM", "GIVE_BACK"} <= set(used)
    missing = {name: where for name, where in used.items() if not hasattr(redlock, name)}
    assert not missing, f"not importable from {MODULE}: {missing}"


@pytest.mark.parametrize("module", module_files(PACKAGE))
def test_each_module_is_short(module: str) -> None:
    lines = module_lines(PACKAGE, module)
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
