"""The PostgreSQL backend's package layout (issue 28): every name the project imports
from ``distlocks.backends.postgres`` stays importable from it, and each module holds
one concern, short enough to read whole."""

from __future__ import annotations

import pytest

from distlocks.backends import postgres
from tests.package_layout import module_files, module_lines, names_taken, package_dir

PACKAGE = package_dir("postgres")


def test_the_backend_is_a_package() -> None:
    assert (PACKAGE / "__init__.py").is_file()
    assert not (PACKAGE.parent / "postgres.py").exists()


def test_every_name_imported_from_the_package_is_exported() -> None:
    used = names_taken(PACKAGE, "postgres")
    # The names the brief listed are among them: the search itself works.
    assert {"PostgresBackend", "TABLE", "lock_key", "key_parts", "NoAnswer"} <= set(used)
    missing = {name: where for name, where in used.items() if not hasattr(postgres, name)}
    assert not missing, f"not importable from distlocks.backends.postgres: {missing}"


@pytest.mark.parametrize("module", module_files(PACKAGE))
def test_each_module_is_short(module: str) -> None:
    lines = module_lines(PACKAGE, module)
    assert lines <= 600, f"{module}: {lines} lines; split it by concern"
