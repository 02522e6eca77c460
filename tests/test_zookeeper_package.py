"""The ZooKeeper backend's package layout (issue 28): every name the project imports
from ``distlocks.backends.zookeeper`` stays importable from it, and each module holds
one concern, short enough to read whole."""

from __future__ import annotations

import importlib
import re

import pytest

from tests.package_layout import module_files, module_lines, names_taken, package_dir

PACKAGE = package_dir("zookeeper")
MODULE = "distlocks.backends.zookeeper"


def test_the_backend_is_a_package() -> None:
    assert (PACKAGE / "__init__.py").is_file()
    assert not (PACKAGE.parent / "zookeeper.py").exists()


def test_every_name_imported_from_the_package_is_exported() -> None:
    pytest.importorskip("kazoo")
    package = importlib.import_module(MODULE)
    used = names_taken(PACKAGE, "zookeeper")
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


@pytest.mark.parametrize("module", module_files(PACKAGE))
def test_each_module_is_short(module: str) -> None:
    lines = module_lines(PACKAGE, module)
    assert lines <= 600, f"{module}: {lines} lines; split it by concern"
