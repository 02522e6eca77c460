"""The reference pages say what the code does: a newcomer copies names from them.

Every setting the docs name is one distlocks reads, and each has its section; every
check ID has its section in docs/checks.md and no section names a retired one; the
OPTIONS tables of docs/configuration.md list the keys each backend reads, in rows of
the table's width; the signatures the quickstart prints are the functions' own; every
``distlocks.``-dotted name a page spells out (a class, a module, a check id, a permission)
exists, and so does every test a page cites as proof.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

import distlocks
import distlocks.checks
from distlocks.backends.postgres import PostgresBackend
from distlocks.backends.redis import RedisBackend
from distlocks.backends.redlock.config import W_EVEN_MASTERS
from distlocks.conf import DEFAULTS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
#: Environment variables of the test suite and the benchmarks, not settings.
NOT_SETTINGS = ("DISTLOCKS_TEST_", "DISTLOCKS_BENCH_")
#: The misspelling the pages of distlocks.W005 show on purpose.
MISSPELT_EXAMPLE = "DISTLOCKS_DEFAULT_TIMOUT"
SETTINGS = {*DEFAULTS, "DISTLOCKS_BACKENDS"}


def pages() -> dict[str, str]:
    found = {path.name: path.read_text() for path in DOCS.glob("*.md")}
    found["README.md"] = (ROOT / "README.md").read_text()
    return found


def test_every_setting_the_docs_name_is_one_distlocks_reads() -> None:
    named = {
        (page, name)
        for page, text in pages().items()
        for name in re.findall(r"\bDISTLOCKS_[A-Z0-9_]*[A-Z0-9]", text)
        if not name.startswith(NOT_SETTINGS) and name != MISSPELT_EXAMPLE
    }
    assert {(page, name) for page, name in named if name not in SETTINGS} == set()


def test_every_setting_has_a_section_of_its_own() -> None:
    headings = set(
        re.findall(
            r"^##+ `(DISTLOCKS_[A-Z_]+)`",
            (DOCS / "configuration.md").read_text() + (DOCS / "operations.md").read_text(),
            re.M,
        )
    )
    assert headings >= SETTINGS


def test_every_check_id_has_a_section_and_no_section_is_stale() -> None:
    defined = {
        f"distlocks.{name}"
        for name in dir(distlocks.checks)
        if name[:1] in "EW" and name[1:].isdigit()
    } | {W_EVEN_MASTERS}
    documented = set(
        re.findall(r"^### `(distlocks\.[EW]\d{3})`", (DOCS / "checks.md").read_text(), re.M)
    )
    assert documented == defined


def options_table(anchor: str) -> list[list[str]]:
    """The rows of the table under the heading ``{ #anchor }`` of configuration.md."""
    text = (DOCS / "configuration.md").read_text()
    section = text.split(f"{{ #{anchor} }}", 1)[1]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("|") and not set(line) <= set("|- "):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


@pytest.mark.parametrize(
    ("anchor", "backend"), [("redis-options", RedisBackend), ("postgres-options", PostgresBackend)]
)
def test_the_options_tables_list_the_keys_the_backend_reads(anchor: str, backend: type) -> None:
    header, *rows = options_table(anchor)
    assert all(len(row) == len(header) for row in rows), [r for r in rows if len(r) != len(header)]
    keys = {row[0].strip("`") for row in rows}
    assert keys == set(backend.option_keys)


@pytest.mark.parametrize("function", ["lock", "lock_many"])
def test_the_quickstart_signatures_are_the_real_ones(function: str) -> None:
    text = (DOCS / "quickstart.md").read_text()
    block = re.search(rf"```python\n({function}\((?:names|name), \*,.*?)\n```", text, re.S)
    assert block is not None, f"no signature block for {function}() in quickstart.md"
    arguments = block.group(1).split("(", 1)[1].rsplit(")", 1)[0].split(",")
    documented = [a.split("=")[0].strip() for a in arguments if a.strip() not in ("*", "")]
    real = list(inspect.signature(getattr(distlocks, function)).parameters)
    assert documented == real


def test_the_quickstart_argument_table_lists_every_argument_of_lock() -> None:
    text = (DOCS / "quickstart.md").read_text()
    table = text.split("| Argument", 1)[1].split("\n\n", 1)[0]
    documented = re.findall(r"^\| `(\w+)`", table, re.M)
    assert documented == list(inspect.signature(distlocks.lock).parameters)


#: A dotted name in backticks that starts with ``distlocks.``: a module, or a name in one
#: (``distlocks.E…``, a family of names, is not one).
DOTTED = re.compile(r"`(distlocks(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?!…)")
#: ``distlocks.E010``, ``distlocks.W006``: system check ids.
CHECK_ID = re.compile(r"^distlocks\.[EW]\d{3}$")


def _defined_check_ids() -> set[str]:
    return {
        f"distlocks.{name}"
        for name in dir(distlocks.checks)
        if name[:1] in "EW" and name[1:].isdigit()
    } | {W_EVEN_MASTERS}


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module of distlocks or an attribute path inside one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                found = getattr(found, attribute)
        except AttributeError:
            return False
        return True
    return False


def test_every_distlocks_name_the_docs_spell_out_exists() -> None:
    """``distlocks.models.FencedManager``, ``distlocks.E010``, the permission
    ``distlocks.force_release_livelock``: a newcomer copies these into code and settings."""
    from distlocks.models import LiveLock

    permissions = {f"distlocks.{codename}" for codename, _ in LiveLock._meta.permissions} | {
        f"distlocks.{action}_livelock" for action in LiveLock._meta.default_permissions
    }
    missing = set()
    for page, text in pages().items():
        for dotted in set(DOTTED.findall(text)):
            if CHECK_ID.match(dotted):
                ok = dotted in _defined_check_ids()
            elif dotted in permissions:
                ok = True
            else:
                ok = _resolves(dotted)
            if not ok:
                missing.add((page, dotted))
    assert missing == set()


def test_every_test_the_docs_cite_exists() -> None:
    """``tests/test_x.py`` and ``tests/test_x.py::test_y`` cited as proof are real."""
    cited = re.compile(r"`(tests/[\w/]+\.py)(?:::([\w:\[\]-]+))?`")
    missing = set()
    for page, text in pages().items():
        for path, node in cited.findall(text):
            source = ROOT / path
            if not source.is_file():
                missing.add((page, path))
                continue
            last = node.split("::")[-1].split("[")[0] if node else ""
            if last and not re.search(
                rf"^\s*(?:async )?(?:def|class) {last}\b", source.read_text(), re.M
            ):
                missing.add((page, f"{path}::{node}"))
    assert missing == set()


def test_every_signal_has_an_entry_with_its_arguments() -> None:
    """operations.md's Signals section gives each signal of ``distlocks.signals`` an entry
    ``name(arguments)``, with the arguments the module says it sends: a receiver is
    written from that line."""
    from django.dispatch import Signal

    import distlocks.signals

    section = (DOCS / "operations.md").read_text().split("\n## Signals\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    documented = dict(re.findall(r"^`(\w+)\(([^)]*)\)`$", section, re.M))
    told = dict(re.findall(r"``(\w+)\(([^)]*)\)``", distlocks.signals.__doc__ or ""))
    defined = {n for n, v in vars(distlocks.signals).items() if isinstance(v, Signal)}
    assert set(told) == defined  # the module's own list is whole
    assert documented == told


def test_each_check_section_quotes_the_message_the_check_prints() -> None:
    """Under ``### `distlocks.E004` `` the quoted line is the check's own message, word
    for word: an operator searches the page for the line ``manage.py check`` printed."""
    text = (DOCS / "checks.md").read_text()
    quoted = {
        check_id: " ".join(line[2:].strip() for line in quote.splitlines())
        for check_id, quote in re.findall(
            r"^### `distlocks\.([EW]\d{3})`\n\n((?:^> .*\n)+)", text, re.M
        )
    }
    messages = {
        name: getattr(distlocks.checks, name)
        for name in dir(distlocks.checks)
        if name[:1] in "EW" and name[1:].isdigit()
    }
    assert set(quoted) >= set(messages)
    wrong = {
        name: (quoted[name], message)
        for name, message in messages.items()
        if quoted[name] != message
    }
    assert wrong == {}
