"""No part of a LOCATION that could be a credential is ever shown, whatever its shape
(issue 24, item 5).

A Hypothesis search: malformed locations are built around a known random secret
(schemes with one character of ``://`` missing, ``\\``, percent-encoding, unicode,
spaces, several '@', IPv6 hosts, Redlock lists, etcd/ZooKeeper host lists, auth in
OPTIONS, a DATABASES entry), configured on every backend class, and every surface
an operator or a log reader sees is searched for the secret: the exception from
``get_backend()`` and ``lock()`` (message, repr and formatted traceback of the whole
chain), the live-locks list and a lock page as view-only staff, ``manage.py distlocks
list|inspect``, ``manage.py check`` and every log record at DEBUG.

Nothing listens where the locations point (port 1 of the loopback, names that do not
resolve) and every backend is given small timeouts, so each example is quick.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import string
import traceback
import warnings
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
from django.core.management import call_command
from django.db import connections
from django.test import Client, override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distlocks import get_backend, lock
from distlocks.handler import backends
from tests.test_livelocks_admin import _staff

REDIS = "distlocks.backends.redis.RedisBackend"
REDLOCK = "distlocks.backends.redlock.RedlockBackend"
ETCD = "distlocks.backends.etcd.EtcdBackend"
ZK = "distlocks.backends.zookeeper.ZooKeeperBackend"
PG = "distlocks.backends.postgres.PostgresBackend"
LOCMEM = "distlocks.backends.locmem.LocMemBackend"

#: The secret's core: letters and digits only, so that it reads the same escaped for
#: HTML, JSON, a repr or a URL; its "9z" tail keeps it from being a word a page holds
#: anyway ("changelist"). The search looks for the core without its first letter,
#: which a location may percent-encode.
cores = st.text(string.ascii_letters + string.digits, min_size=8, max_size=12).map(
    lambda s: f"Q{s}9z"
)
#: What a careless password holds around its core: URL delimiters, an encoded one,
#: unicode, spaces, backslashes, quotes, control characters.
decorations = st.one_of(
    st.sampled_from(
        [
            *("", "", "@", ":", "/", "%40", "%2F", " ", "\u00e9", "\u00a0", "\\", "#", "?", "["),
            *("x@y", ",", "\n", "'", '"', "+", "%", ";", "="),
        ]
    ),
    st.text(max_size=2),
)
schemes = st.sampled_from(
    [
        "redis",
        "rediss",
        "unix",
        "redis+sentinel",
        "redis+cluster",
        "reddis",
        "zk",
        "digest",
        "http",
        "https",
        "etcd",
        "postgres",
        "",
        "\u0159edis",
    ]
)
#: Separators: ``://`` itself and every way of missing one of its characters, and more.
separators = st.sampled_from(
    ["://", "//", ":/", ":", "/", "\\\\", ":\\\\", ":\\", ":///", "", " //", "://:", ":%2F%2F"]
)
userinfo_shapes = st.sampled_from(
    ["{s}", ":{s}", "user:{s}", "{s}:", "user:{s}:more", "u@x:{s}", "{s}@", ":{s}@@", "a b:{s}"]
)
hosts = st.sampled_from(
    [
        "127.0.0.1:1",
        "127.0.0.1",
        "[::1]:1",
        "localhost:1",
        "nohost.invalid:1",
        "127.0.0.1:1,127.0.0.1:2",
        "",
    ]
)
tails = st.sampled_from(["", "/0", "/0?db=0", "/svc/0", "?socket_timeout=0.5", "/chroot"])


@st.composite
def secret_locations(draw: st.DrawFn) -> tuple[str, str]:
    """(core, location): a malformed location whose user information holds the core."""
    core = draw(cores)
    secret = draw(decorations) + core + draw(decorations)
    if draw(st.booleans()):
        # Percent-encoded: the first letter always, the rest as urllib would.
        secret = "%51" + quote(secret[1:], safe="") if secret.startswith("Q") else quote(secret)
    userinfo = draw(userinfo_shapes).format(s=secret)
    location = f"{draw(schemes)}{draw(separators)}{userinfo}@{draw(hosts)}{draw(tails)}"
    if draw(st.booleans()):
        location = draw(st.sampled_from([" ", "\t", "x "])) + location
    return core, location


#: Timeouts small enough that nothing waits long on an address where nobody listens.
FAST_REDIS = {"socket_timeout": 0.5, "socket_connect_timeout": 0.5}
FAST_ETCD = {"connect_timeout": 0.5, "socket_timeout": 0.5}
FAST_ZK = {"connect_timeout": 0.5}


@st.composite
def configs(draw: st.DrawFn, kind: str) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
    """(core, backend config, extra DATABASES entry or None) for a backend ``kind``."""
    core, location = draw(secret_locations())
    database = None
    if kind == "redis":
        config: dict[str, Any] = {"BACKEND": REDIS, "LOCATION": location}
        if draw(st.booleans()):
            config["OPTIONS"] = dict(FAST_REDIS)
    elif kind == "redlock":
        others = draw(st.lists(st.sampled_from(["redis://127.0.0.1:1/0", 5, ""]), max_size=2))
        urls = [*others, location]
        draw(st.randoms()).shuffle(urls)
        shape = draw(st.sampled_from(["list", "tuple", "string", "joined"]))
        value: Any = {
            "list": urls,
            "tuple": tuple(urls),
            "string": location,
            "joined": ",".join(map(str, urls)),
        }[shape]
        config = {"BACKEND": REDLOCK, "LOCATION": value, "OPTIONS": dict(FAST_REDIS)}
    elif kind == "etcd":
        shape = draw(st.sampled_from(["string", "list", "dict", "joined"]))
        value = {
            "string": location,
            "list": ["http://127.0.0.1:1", location],
            "dict": {"hosts": location},
            "joined": f"http://127.0.0.1:1,{location}",
        }[shape]
        options: dict[str, Any] = dict(FAST_ETCD)
        if draw(st.booleans()):
            options.update(user="root", password=location)
        config = {"BACKEND": ETCD, "LOCATION": value, "OPTIONS": options}
    elif kind == "zk":
        shape = draw(st.sampled_from(["string", "list", "dict", "joined", "auth"]))
        value = {
            "string": location,
            "list": ["127.0.0.1:1", location],
            "dict": {"hosts": location},
            "joined": f"127.0.0.1:1,{location}",
            "auth": "127.0.0.1:1",
        }[shape]
        options = dict(FAST_ZK)
        if shape == "auth":
            options["auth"] = [("digest", location)]
        config = {"BACKEND": ZK, "LOCATION": value, "OPTIONS": options}
    elif kind == "pg":
        field = draw(st.sampled_from(["HOST", "NAME", "PASSWORD", "USER"]))
        database = {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": "distlocks",
            "USER": "postgres",
            "PASSWORD": "",
            "HOST": "127.0.0.1",
            "PORT": 1,
            "OPTIONS": {"connect_timeout": 2},
        }
        database[field] = location
        config = {"BACKEND": PG, "DATABASE": "secretdb"}
    else:
        config = {"BACKEND": LOCMEM, "LOCATION": location}
    return core, config, database


@contextlib.contextmanager
def configured(config: dict[str, Any], database: dict[str, Any] | None) -> Iterator[None]:
    """The alias "bad" set to ``config`` (beside a LocMem "default"), and the DATABASES
    alias "secretdb" to ``database`` if given, for the duration."""
    from django.conf import settings as django_settings

    overrides: dict[str, Any] = {
        "DISTLOCKS_BACKENDS": {"default": {"BACKEND": LOCMEM}, "bad": config}
    }
    if database is not None:
        overrides["DATABASES"] = {**django_settings.DATABASES, "secretdb": database}
    stack = contextlib.ExitStack()
    with warnings.catch_warnings():
        # Overriding DATABASES is warned about, and Django's connection handler read it
        # once: the alias is added to the handler's settings (defaults filled in).
        warnings.simplefilter("ignore", UserWarning)
        stack.enter_context(override_settings(**overrides))
    if database is not None:
        connections.settings["secretdb"] = connections.configure_settings(
            {"default": {}, "secretdb": dict(database)}
        )["secretdb"]
    with stack:
        backends.reset()
        try:
            yield
        finally:
            backends.reset()
            if database is not None:
                with contextlib.suppress(Exception):
                    connections["secretdb"].close()
                with contextlib.suppress(AttributeError):
                    delattr(connections._connections, "secretdb")
                del connections.settings["secretdb"]


def texts_of(exc: BaseException | None) -> str:
    """What a reader can see of an exception: its chain's messages and reprs, and the
    traceback Python prints."""
    if exc is None:
        return ""
    seen, link = [], exc
    while link is not None and len(seen) < 40:
        seen += [repr(link), str(link)]
        link = link.__cause__ or link.__context__
    return "\n".join([*seen, *traceback.format_exception(exc)])


def surfaces(client: Client) -> Iterator[tuple[str, str]]:
    """(surface name, text shown) for every surface, with "bad" configured."""
    for name, call in (
        ("get_backend()", lambda: get_backend("bad")),
        ("lock()", lambda: lock("secret-search", backend="bad", timeout=0).acquire().release()),
    ):
        try:
            call()
        except Exception as exc:  # any error is a surface to search
            yield name, texts_of(exc)
    page = client.get("/admin/distlocks/livelock/", {"refresh": "0"})
    yield "live-locks list", f"{page.status_code} {page.content.decode()}"
    # A lock that is not there sends back to the list, with a message saying why.
    detail = client.get(
        "/admin/distlocks/livelock/lock/", {"backend": "bad", "name": "x"}, follow=True
    )
    yield "lock page", f"{detail.status_code} {detail.content.decode()}"
    for args in (
        ["distlocks", "list"],
        ["distlocks", "list", "--json"],
        ["distlocks", "inspect", "x"],
        ["distlocks", "inspect", "x", "--backend", "bad"],
        ["check"],
    ):
        out, err = io.StringIO(), io.StringIO()
        failure: BaseException | None = None
        try:
            call_command(*args, stdout=out, stderr=err)
        except (Exception, SystemExit) as exc:
            failure = exc
        yield " ".join(args), out.getvalue() + err.getvalue() + texts_of(failure)


def leaks(core: str, text: str) -> bool:
    return core in text or core[1:] in text


@pytest.fixture
def viewer(django_user_model: Any) -> Client:
    client = Client()
    client.force_login(_staff(django_user_model, "viewer", "view_livelock"))
    return client


#: Examples per backend class; DISTLOCKS_SECRET_SEARCH_EXAMPLES=500 searches deeper.
EXAMPLES = int(os.environ.get("DISTLOCKS_SECRET_SEARCH_EXAMPLES", "25"))


def search(kind: str, viewer: Client, caplog: pytest.LogCaptureFixture) -> Any:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(configs(kind))
    def run(case: tuple[str, dict[str, Any], dict[str, Any] | None]) -> None:
        core, config, database = case
        caplog.clear()
        with configured(config, database), caplog.at_level(logging.DEBUG):
            for surface, text in surfaces(viewer):
                assert not leaks(core, text), f"{surface} shows the secret of {config!r}"
            log = caplog.text
            assert not leaks(core, log), f"the DEBUG log shows the secret of {config!r}"

    return run


@pytest.mark.django_db
@pytest.mark.parametrize("kind", ["redis", "redlock", "etcd", "zk", "pg", "locmem"])
def test_no_surface_shows_a_secret_from_a_malformed_location(
    kind: str, viewer: Client, caplog: pytest.LogCaptureFixture
) -> None:
    search(kind, viewer, caplog)()
