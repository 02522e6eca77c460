"""A misspelt OPTIONS key is caught, not absorbed: every backend refuses a key it does not
read, in the system check (distlocks.E004, with a "did you mean" hint) and at first use
(ImproperlyConfigured from lock()), before anything is written."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from distlocks import lock
from distlocks.backends.base import unknown_options
from distlocks.checks import check_settings
from distlocks.handler import backend_class

# (alias in the test settings, a misspelt key, what it should have been)
TYPOS = [
    ("redis", "socket_timout", "socket_timeout"),
    ("redis", "key_prefx", "key_prefix"),
    ("pg", "mod", "mode"),
    ("pgx", "pool_sise", "pool_size"),
    ("locmem", "timeout", None),
    ("redlock", "drift_factr", "drift_factor"),
    ("etcd", "conect_timeout", "connect_timeout"),
    ("zk", "sesion_timeout", "session_timeout"),
]


#: Aliases the test settings may lack: a config that is valid without a server.
EXTRA = {
    "etcd": {"BACKEND": "distlocks.backends.etcd.EtcdBackend", "LOCATION": "http://127.0.0.1:9"}
}


def _with_option(alias: str, key: str) -> dict[str, Any]:
    backends = {name: dict(config) for name, config in settings.DISTLOCKS_BACKENDS.items()}
    if alias not in backends:
        backends[alias] = dict(EXTRA[alias])
    config = backends[alias]
    config["OPTIONS"] = {**(config.get("OPTIONS") or {}), key: "on"}
    return backends


@pytest.mark.parametrize(("alias", "key", "meant"), TYPOS)
def test_a_misspelt_option_fails_the_system_check(alias: str, key: str, meant: str | None) -> None:
    with override_settings(DISTLOCKS_BACKENDS=_with_option(alias, key)):
        messages = [m for m in check_settings() if alias in (m.hint or "")]
    assert [m.id for m in messages if key in (m.hint or "")] == ["distlocks.E004"], messages
    hint = next(m.hint for m in messages if key in (m.hint or ""))
    if meant is not None and alias not in ("etcd", "zk", "redlock"):
        assert f"did you mean {meant!r}" in hint


@pytest.mark.parametrize(("alias", "key", "meant"), TYPOS)
def test_a_misspelt_option_refuses_the_first_lock(alias: str, key: str, meant: str | None) -> None:
    with override_settings(DISTLOCKS_BACKENDS=_with_option(alias, key)):
        with pytest.raises(ImproperlyConfigured, match=key):
            lock("option-typo", backend=alias, ttl=5, timeout=0).acquire()


@pytest.mark.parametrize("alias", ["redis", "pg", "locmem"])
def test_every_documented_option_is_accepted(alias: str) -> None:
    cls = backend_class(alias, settings.DISTLOCKS_BACKENDS[alias])
    assert cls.option_keys is not None
    config = settings.DISTLOCKS_BACKENDS[alias]
    assert not [p for p in cls.validate_config(alias, config) if "unknown OPTIONS" in p]


@given(
    known=st.frozensets(st.from_regex(r"[a-z_]{1,12}", fullmatch=True), max_size=8),
    given_keys=st.lists(st.one_of(st.text(max_size=12), st.integers()), max_size=6),
)
@hsettings(max_examples=200, deadline=None)
def test_unknown_options_names_exactly_the_keys_not_read(
    known: frozenset[str], given_keys: list[Any]
) -> None:
    options = dict.fromkeys(given_keys, 1)
    problems = unknown_options("SomeBackend", options, known)
    assert len(problems) == len(set(options) - known)
    for problem in problems:
        assert "SomeBackend reads" in problem
