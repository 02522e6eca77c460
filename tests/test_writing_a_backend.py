"""docs/writing-a-backend.md followed word for word, as a newcomer would.

Every Python block of the page runs as written: each is executed; the blocks that name
their file on their first line (``# myproject/memory_locks.py``) are saved there, in a
fresh project outside this repository, and the kit's test module of the page is run by
pytest against the page's complete backend, in its own process, and must pass.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from distlocks.backends.base import BaseBackend

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "writing-a-backend.md"

#: What the newcomer's own project has anyway (the page says: distlocks in INSTALLED_APPS).
SETTINGS = """
SECRET_KEY = "writing-a-backend"
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "distlocks"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
USE_TZ = True
"""


def _blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.S | re.M)


def _named(blocks: list[str]) -> dict[str, str]:
    """path -> code, for the blocks whose first line is ``# <path>.py``."""
    found = {}
    for block in blocks:
        first = block.splitlines()[0]
        if re.fullmatch(r"# [\w/]+\.py", first):
            found[first[2:]] = block
    return found


def test_every_block_runs_as_written() -> None:
    blocks = _blocks()
    assert len(blocks) >= 6
    for number, block in enumerate(blocks):
        # A module of its own, as the file it would be saved in (dataclasses look it up).
        module = types.ModuleType(f"writing_a_backend_block_{number}")
        sys.modules[module.__name__] = module
        try:
            exec(compile(block, f"{PAGE.name}, block {number}", "exec"), module.__dict__)
        finally:
            del sys.modules[module.__name__]


def test_the_skeleton_and_its_settings_are_accepted() -> None:
    blocks = _blocks()
    skeleton: dict[str, Any] = {"__name__": "myproject.locking"}
    exec(blocks[0], skeleton)
    consul = skeleton["ConsulBackend"]
    assert issubclass(consul, BaseBackend)
    assert consul.__abstractmethods__ == frozenset()  # every required method is there
    settings: dict[str, Any] = {}
    exec(next(b for b in blocks if b.startswith("DISTLOCKS_BACKENDS")), settings)
    entry = settings["DISTLOCKS_BACKENDS"]["default"]
    assert entry["BACKEND"] == "myproject.locking.ConsulBackend"
    assert consul.validate_config("default", entry) == []
    assert consul.validate_config("default", {**entry, "LOCATION": None})


@pytest.mark.timeout(600)
def test_the_kit_passes_against_the_complete_backend_of_the_page(tmp_path: Path) -> None:
    files = _named(_blocks())
    assert {"myproject/memory_locks.py", "tests/test_memory_backend.py"} <= set(files)
    for path, code in files.items():
        target = tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        (target.parent / "__init__.py").touch()
        target.write_text(code)
    (tmp_path / "myproject" / "settings.py").write_text(SETTINGS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nDJANGO_SETTINGS_MODULE = myproject.settings\n")
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    # Its own temporary root: a pytest run resets the shared /tmp/pytest-of-<user> to
    # 0700, which locks out the servers of this session that run as another user.
    (tmp_path / "tmp").mkdir()
    env["TMPDIR"] = str(tmp_path / "tmp")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_memory_backend.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    report = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, report
    assert re.search(r"\b\d+ passed", done.stdout), report
    assert "failed" not in done.stdout and "error" not in done.stdout.lower(), report
