"""PostgreSQL tokens across crashes, with the server clock taken out of the proof.

The registry (the per-name counter) is UNLOGGED: a crash of the server truncates it.
What keeps tokens increasing is the one logged ceiling G, written durably whenever a
token passes it, and the unlogged marker M of the server's lifetime, which a crash
truncates too: with M missing a key without a row gets G + 1, with M present its
floor F (docs/safety.md, "PostgreSQL tokens").

Tokens are also floored by the server clock, which would hide a broken scheme: a
token minted after the restart is a clock value, above every earlier clock-made token.
So every test here first moves the tokens far ahead of the clock (G set 10**12 us,
about eleven days, ahead, and M removed: what an upgraded registry or a token_floor-like
start gives), so that only G and M can keep the next token above the earlier ones.
A scheme that hands a token out twice fails them: without the raise of G, with the
raise committed asynchronously (lost in the crash like the registry's rows), or with
a marker that outlives a crash (logged) or is not consulted, the first token after the
crash repeats one issued before it.

The server is ``PostgresServer(durable=True)`` (fsync on) with a WAL writer that waits
10 s, so that what was committed asynchronously just before a crash is surely lost;
the crash is an immediate shutdown (SIGQUIT to the postmaster: no checkpoint).
"""

from __future__ import annotations

import itertools
import signal
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.db import connections
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from distlocks.backends.base import WRITE, Holder
from distlocks.backends.postgres import TABLE, PostgresBackend
from distlocks.backends.postgres.sql import EPOCH, FENCE, RESERVE_US
from distlocks.testing.servers import PostgresServer
from tests.test_postgres_durable import (  # noqa: F401 - the fixtures
    ALIAS,
    durable,
    durable_template,
)

HOLDER = Holder(host="test", pid=1, thread="main")
AHEAD = 10**12  # tokens this far ahead of the clock: the clock floor cannot help
_owners = itertools.count()


def _sql(server: PostgresServer, statement: str, params: Any = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(server.url, autocommit=True) as conn:
        cursor = conn.execute(statement, params)
        return cursor.fetchall() if cursor.description else []


def _ahead_of_the_clock(server: PostgresServer) -> int:
    """Set the ceiling G far ahead of the server clock, durably, and remove the marker
    (as a crash would): the next key without a row gets G + 1. Returns G."""
    _sql(server, f"DELETE FROM {EPOCH}")
    (ceiling,) = _sql(
        server,
        f"INSERT INTO {FENCE} AS f (id, ceiling)"
        " SELECT 1, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint + %s"
        " ON CONFLICT (id) DO UPDATE SET ceiling = greatest(f.ceiling, EXCLUDED.ceiling)"
        " RETURNING ceiling",
        (AHEAD,),
    )[0]
    _sql(server, "CHECKPOINT")
    return int(ceiling)


def _ceiling(server: PostgresServer) -> tuple[int, int]:
    """G, and the transaction id that last wrote its row."""
    (ceiling, xmin) = _sql(server, f"SELECT ceiling, xmin::text::bigint FROM {FENCE}")[0]
    return int(ceiling), int(xmin)


def _crash(server: PostgresServer) -> None:
    """Immediate shutdown: committed work not yet flushed is lost, unlogged tables are
    truncated at the next start (crash recovery)."""
    assert server.process is not None
    server.process.send_signal(signal.SIGQUIT)
    server.process.wait(30)
    server.start(port=server.port)
    connections[ALIAS].close()  # Django's connection to it died with it


def _restart(server: PostgresServer) -> None:
    """A clean restart (shutdown checkpoint): unlogged tables keep their rows."""
    server.stop()
    server.start(port=server.port)
    connections[ALIAS].close()


def _registry_rows(server: PostgresServer, key: int) -> int:
    return int(_sql(server, f"SELECT count(*) FROM {TABLE} WHERE key = %s", (key,))[0][0])


def _backend(synchronous_commit: str | None) -> PostgresBackend:
    return PostgresBackend(
        "pg_crash", {"DATABASE": ALIAS, "OPTIONS": {"synchronous_commit": synchronous_commit}}
    )


def _cycle(backend: PostgresBackend, name: str, *, hold: bool = False) -> int:
    owner = f"owner-{next(_owners)}"
    result = backend.acquire(name, owner, 30.0, HOLDER)
    assert result.acquired
    if not hold:
        assert backend.release(name, owner)
    return result.fencing_token


@pytest.mark.parametrize("synchronous_commit", ["off", "on"])
def test_no_token_is_issued_twice_across_a_crash_ahead_of_the_clock(
    durable: PostgresServer,  # noqa: F811 - the fixture
    django_db_blocker: Any,
    synchronous_commit: str,
) -> None:
    name, other = f"crash:ahead:{synchronous_commit}", f"crash:other:{synchronous_commit}"
    with django_db_blocker.unblock():
        backend = _backend(synchronous_commit)
        try:
            key = backend.key(name)
            ceiling = _ahead_of_the_clock(durable)
            tokens = [_cycle(backend, name) for _ in range(5)]
            tokens.append(_cycle(backend, name, hold=True))  # the crash ends this one
            # The first token took G's next value: the clock played no part.
            assert tokens == list(range(ceiling + 1, ceiling + 7))
            assert backend.fencing_counter(name) == tokens[-1]
            # Another name, new while the marker exists: its floor, no new raise.
            tokens.append(_cycle(backend, other))
            assert tokens[-1] == ceiling + 1
        finally:
            backend.close()

        _crash(durable)

        # The crash emptied the registry: the counter itself is gone (read as 0, as on
        # a Redis restart without persistence)...
        assert _registry_rows(durable, key) == 0
        assert _sql(durable, f"SELECT count(*) FROM {EPOCH}") == [(0,)]  # ...and M
        backend = _backend(synchronous_commit)
        try:
            assert backend.fencing_counter(name) == 0
            # ...the first name locked after it, new or not, is above every token
            # issued before the crash, for any name,
            first = _cycle(backend, f"crash:fresh:{synchronous_commit}")
            assert first > max(tokens), f"token {first} issued again after the crash"
            after = _cycle(backend, name)
            assert after > max(tokens), f"token {after} issued again after the crash"
            assert _cycle(backend, name) == after + 1
            assert _cycle(backend, other) > max(tokens)
        finally:
            backend.close()


def test_the_write_side_of_a_read_write_lock_across_a_crash(
    durable: PostgresServer,  # noqa: F811 - the fixture
    django_db_blocker: Any,
) -> None:
    """After a crash a reader recreates the read-write lock's row first; the writer's
    next token must still be above the write tokens issued before."""
    name = "crash:rw"
    with django_db_blocker.unblock():
        backend = _backend("off")
        try:
            _ahead_of_the_clock(durable)
            tokens = []
            for i in range(4):
                result = backend.permit_acquire(WRITE, name, f"w{i}", 30.0, HOLDER)
                assert result.acquired
                tokens.append(result.fencing_token)
                assert backend.permit_release(WRITE, name, f"w{i}")
        finally:
            backend.close()

        _crash(durable)

        backend = _backend("off")
        try:
            assert backend.permit_acquire("read", name, "r", 30.0, HOLDER).acquired
            assert backend.permit_release("read", name, "r")
            bound = backend.permit_counter(name)
            result = backend.permit_acquire(WRITE, name, "w-after", 30.0, HOLDER)
            assert result.acquired
            assert result.fencing_token > max(tokens), "a write token issued again"
            assert bound >= max(tokens)
            assert backend.permit_release(WRITE, name, "w-after")
        finally:
            backend.close()


def test_a_clean_restart_keeps_the_registry_and_its_counter(
    durable: PostgresServer,  # noqa: F811 - the fixture
    django_db_blocker: Any,
) -> None:
    name = "restart:clean"
    with django_db_blocker.unblock():
        backend = _backend("off")
        try:
            key = backend.key(name)
            _ahead_of_the_clock(durable)
            tokens = [_cycle(backend, name) for _ in range(3)]
        finally:
            backend.close()
        _restart(durable)
        assert _registry_rows(durable, key) == 1  # unlogged, yet kept by a clean stop
        backend = _backend("off")
        try:
            assert backend.fencing_counter(name) == tokens[-1]  # exact, not a bound
            assert _cycle(backend, name) == tokens[-1] + 1
        finally:
            backend.close()


def test_a_row_deleted_by_hand_falls_back_to_the_floor_unless_the_marker_goes_too(
    durable: PostgresServer,  # noqa: F811 - the fixture
    django_db_blocker: Any,
) -> None:
    """What docs/safety.md says of a registry row deleted by hand (no crash): the next
    token is max(F, clock), which does not cover tokens ahead of the clock (here it
    repeats one); deleting the marker in the same transaction makes it G + 1 again."""
    name = "deleted:by-hand"
    with django_db_blocker.unblock():
        backend = _backend("off")
        try:
            key = backend.key(name)
            ceiling = _ahead_of_the_clock(durable)
            tokens = [_cycle(backend, name) for _ in range(3)]
            assert tokens == [ceiling + 1, ceiling + 2, ceiling + 3]
            _sql(durable, f"DELETE FROM {TABLE} WHERE key = %s", (key,))
            assert _cycle(backend, name) == ceiling + 1  # F: the documented limit
            with psycopg.connect(durable.url) as conn:  # one transaction
                conn.execute(f"DELETE FROM {TABLE} WHERE key = %s", (key,))
                conn.execute(f"DELETE FROM {EPOCH}")
            (highest, _) = _ceiling(durable)
            assert _cycle(backend, name) == highest + 1
        finally:
            backend.close()


def _wal_insert_lsn(server: PostgresServer) -> str:
    return str(_sql(server, "SELECT pg_current_wal_insert_lsn()::text")[0][0])


def _wal_since(server: PostgresServer, lsn: str) -> int:
    return int(
        _sql(server, "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)", (lsn,))[0][0]
    )


def test_a_burst_of_new_names_makes_no_durable_write(
    durable: PostgresServer,  # noqa: F811 - the fixture
    django_db_blocker: Any,
) -> None:
    """Locks per entity ("payment:{id}"): every name new. While the marker exists a
    new name's token is the marker's floor (or the clock), under G: nothing logged is
    written, and nothing waits for a flush. Counted on the server, not timed: G's row
    is not written again (same value, same xmin), and the WAL of ``new`` new names is that
    of as many cycles of one name (a logged write per name, a ceiling row say, would
    add well over 100 bytes each). G is set far ahead first, so that the clock cannot
    pass it during the burst however slow the machine."""
    new = 300
    _sql(durable, "ALTER SYSTEM SET autovacuum = off")  # no WAL but ours
    _sql(durable, "SELECT pg_reload_conf()")
    with django_db_blocker.unblock():
        backend = _backend("off")
        try:
            ceiling = _ahead_of_the_clock(durable)
            # The marker is missing: this first token is G + 1, G is raised durably, and
            # the marker written with floor G + 1.
            assert _cycle(backend, "burst:first") == ceiling + 1
            raised = _ceiling(durable)
            assert raised[0] == ceiling + 1 + RESERVE_US
            assert _sql(durable, f"SELECT floor FROM {EPOCH}") == [(ceiling + 1,)]

            start = _wal_insert_lsn(durable)
            tokens = [_cycle(backend, f"burst:{i}") for i in range(new)]
            new_names_wal = _wal_since(durable, start)
            start = _wal_insert_lsn(durable)
            same = [_cycle(backend, "burst:first") for _ in range(new)]
            one_name_wal = _wal_since(durable, start)

            assert tokens == [ceiling + 1] * new  # the floor, each for a name of its own
            assert same == list(range(ceiling + 2, ceiling + 2 + new))
            assert _ceiling(durable) == raised, "G was written during the burst"
            assert new_names_wal <= one_name_wal + 8192, (new_names_wal, one_name_wal)
        finally:
            backend.close()


class _Crashes(RuleBasedStateMachine):
    """Acquisitions of known and of new names, held locks, force releases, crashes and
    clean restarts of the server, in any order, with tokens far ahead of the clock:
    every token of a name is above all its earlier ones, and every token issued after
    a crash is above every token issued before it, for any name."""

    NAMES = ("a", "b")

    def __init__(self, server: PostgresServer, synchronous_commit: str) -> None:
        super().__init__()
        self.server, self.sync = server, synchronous_commit
        self.run = uuid.uuid4().hex[:8]
        self.names = {n: f"machine:{self.run}:{n}" for n in self.NAMES}
        self.backend = _backend(self.sync)
        self.issued: dict[str, list[int]] = {n: [] for n in self.NAMES}
        self.held: dict[str, str] = {}
        self.lost: set[str] = set()  # names whose row a crash truncated
        self.before_crash = 0  # the highest token issued before the last crash
        self.highest = 0
        self.fresh = itertools.count()
        _ahead_of_the_clock(server)

    def _new_backend(self) -> None:
        self.backend.close()
        self.backend = _backend(self.sync)
        self.held.clear()  # the server's sessions ended, and their locks with them

    def _issued(self, token: int) -> None:
        assert token > self.before_crash, f"{token} issued again after a crash"
        self.highest = max(self.highest, token)

    @rule(which=st.sampled_from(NAMES), hold=st.booleans())
    def acquire(self, which: str, hold: bool) -> None:
        name = self.names[which]
        if which in self.held:
            return  # held: another acquire would just be refused
        owner = f"owner-{next(_owners)}"
        result = self.backend.acquire(name, owner, 30.0, HOLDER)
        assert result.acquired
        earlier = self.issued[which]
        assert not earlier or result.fencing_token > max(earlier), (
            f"{result.fencing_token} after {earlier}"
        )
        earlier.append(result.fencing_token)
        self._issued(result.fencing_token)
        self.lost.discard(which)
        if hold:
            self.held[which] = owner
        else:
            assert self.backend.release(name, owner)

    @rule()
    def acquire_a_new_name(self) -> None:
        self._issued(_cycle(self.backend, f"machine:{self.run}:new:{next(self.fresh)}"))

    @rule(which=st.sampled_from(NAMES))
    def force_release(self, which: str) -> None:
        name = self.names[which]
        freed = self.backend.force_release(name)
        assert freed == (which in self.held)
        owner = self.held.pop(which, None)
        if owner is not None:
            assert not self.backend.release(name, owner)  # its session was ended

    @rule()
    def crash(self) -> None:
        _crash(self.server)
        self._new_backend()
        self.before_crash = self.highest
        self.lost = {which for which, tokens in self.issued.items() if tokens}

    @rule()
    def clean_restart(self) -> None:
        _restart(self.server)
        self._new_backend()

    @invariant()
    def counter_bounds_the_tokens(self) -> None:
        for which, tokens in self.issued.items():
            counter = self.backend.fencing_counter(self.names[which])
            if which in self.lost or not tokens:
                assert counter == 0  # no row: lost in a crash, or never locked
            else:
                assert counter >= max(tokens)

    def teardown(self) -> None:
        self.backend.close()


def run_crash_machine(make: Callable[[], Any], *, examples: int, steps: int) -> None:
    """Run a state machine whose steps crash servers: few examples, no deadline (a
    crash and restart takes seconds), nothing kept between runs."""
    run_state_machine_as_test(
        make,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


@pytest.mark.parametrize("synchronous_commit", ["off", "on"])
def test_tokens_strictly_increase_through_any_sequence_of_crashes(
    durable: PostgresServer,  # noqa: F811 - the fixture
    django_db_blocker: Any,
    synchronous_commit: str,
) -> None:
    with django_db_blocker.unblock():
        run_crash_machine(lambda: _Crashes(durable, synchronous_commit), examples=6, steps=10)


def test_an_upgrade_seeds_the_ceilings_from_the_registry_and_survives_a_crash(
    durable: PostgresServer,  # noqa: F811 - the fixture
    django_db_blocker: Any,
) -> None:
    """Migration 0003 on a registry that holds tokens (far ahead of the clock): the
    ceiling starts above them, the registry and the marker's table become unlogged, and
    a crash right after the upgrade issues no token again. Reversing it makes the
    registry logged again."""
    name = "upgrade:tokens"
    with django_db_blocker.unblock():
        backend = _backend("off")
        key = backend.key(name)
        call_command("migrate", "distlocks", "0002", database=ALIAS, verbosity=0)
        persistence = f"SELECT relpersistence FROM pg_class WHERE relname = '{TABLE}'"
        assert _sql(durable, persistence) == [("p",)]
        (before,) = _sql(
            durable,
            f"INSERT INTO {TABLE} (key, name, fencing_token, owner, host, thread, renewals,"
            " extra) SELECT %s, %s, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
            " + %s, '', '', '', 0, '{}' RETURNING fencing_token",
            (key, name, AHEAD),
        )[0]
        call_command("migrate", "distlocks", database=ALIAS, verbosity=0)
        connections[ALIAS].close()
        assert _sql(durable, persistence) == [("u",)]
        assert _sql(durable, f"SELECT id, ceiling FROM {FENCE}") == [(1, before + RESERVE_US)]
        assert _sql(durable, f"SELECT count(*) FROM {EPOCH}") == [(0,)]
        assert _sql(durable, persistence.replace(TABLE, EPOCH)) == [("u",)]
        try:
            tokens = [_cycle(backend, name) for _ in range(3)]
            assert tokens == [before + 1, before + 2, before + 3]  # the row goes on
        finally:
            backend.close()

        _crash(durable)

        backend = _backend("off")
        try:
            assert _cycle(backend, name) > max(tokens)
        finally:
            backend.close()
