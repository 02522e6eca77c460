"""The PostgreSQL mint's two paths (migration 0004's ``distlocks_mint``; docs/safety.md,
"PostgreSQL tokens").

The common case of an acquisition is one UPDATE of the key's registry row, bounded by
the row's own ``ceiling`` column: a value the ceiling G had on disk when the row's
last slow mint read or raised it. It reads neither G nor the marker M. Every other
case (a new key, a token past the row's ceiling, M missing) is the slow mint, which
reads G and M, raises G durably when the token passes it, and sets the row's ceiling.

The invariant that makes the fast path safe, checked here after every step of random
sequences that keep crossing the boundary between the two paths (G and the rows'
ceilings set down close to the tokens, as far ahead of the clock as the crash tests
put them, so that the clock cannot hide a mistake): every token issued and every
row's ceiling is at most G, the G every other session can see (visible means on disk:
it is committed durably). Crashes in between check what the invariant is for: every
token after a crash is above every token before it.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from distlocks.backends.postgres import TABLE, PostgresBackend
from distlocks.backends.postgres.sql import EPOCH, FENCE, RESERVE_US
from distlocks.exceptions import LockError
from distlocks.testing.servers import PostgresServer
from tests.test_postgres_durable import (  # noqa: F401 - the fixtures
    ALIAS,
    durable,
    durable_template,
)
from tests.test_postgres_token_crash import (
    HOLDER,
    _ahead_of_the_clock,
    _crash,
    _cycle,
    _sql,
    run_crash_machine,
)

_owners = itertools.count()


def _backend(**options: Any) -> PostgresBackend:
    return PostgresBackend("pg_mint", {"DATABASE": ALIAS, "OPTIONS": options})


def _ceilings_close(server: PostgresServer, headroom: int) -> int | None:
    """At a quiet point, G set down to ``headroom`` above the highest token issued in
    this server's lifetime (the rows, and F - 1 for those before the last crash), and
    every row's ceiling down to at most ``headroom`` above its own token (so at most G),
    durably: what the invariant allows, and the next mints of every known name meet
    their row's ceiling within ``headroom + 1`` acquisitions. Returns the new G (None:
    nothing issued yet, G left alone)."""
    rows = _sql(
        server,
        f"""WITH top AS (
            SELECT greatest((SELECT max(fencing_token) FROM {TABLE}),
                            (SELECT floor - 1 FROM {EPOCH} WHERE id = 1)) + %s AS g
        )
        UPDATE {FENCE} SET ceiling = (SELECT g FROM top)
        WHERE id = 1 AND (SELECT g FROM top) IS NOT NULL RETURNING ceiling""",
        (headroom,),
    )
    if not rows:
        return None
    ceiling = int(rows[0][0])
    _sql(server, f"UPDATE {TABLE} SET ceiling = least(ceiling, fencing_token + %s)", (headroom,))
    _sql(server, "CHECKPOINT")
    return ceiling


def _crash_until_ready(server: PostgresServer) -> None:
    """An immediate shutdown and restart, then wait until the server takes sessions: on
    a loaded machine a connection right after the restart was once refused with "the
    database system is starting up"."""
    _crash(server)
    deadline = time.monotonic() + 60
    while True:
        try:
            _sql(server, "SELECT 1")
            return
        except psycopg.OperationalError:
            assert time.monotonic() < deadline, "the server did not come back within 60 s"
            time.sleep(0.1)


class _Boundary(RuleBasedStateMachine):
    """Known and new names, held locks, force releases, G and the rows' ceilings set
    down close to the tokens, and crashes, in any order."""

    NAMES = ("a", "b", "c")

    def __init__(self, server: PostgresServer, synchronous_commit: str) -> None:
        super().__init__()
        self.server, self.sync = server, synchronous_commit
        self.run = uuid.uuid4().hex[:8]
        self.names = {n: f"mint:{self.run}:{n}" for n in self.NAMES}
        self.backend = _backend(synchronous_commit=synchronous_commit)
        self.issued: dict[str, list[int]] = {n: [] for n in self.NAMES}
        self.held: dict[str, str] = {}
        self.every: list[int] = []  # every token issued, for any name
        self.before_crash = 0
        self.fresh = itertools.count()
        _ahead_of_the_clock(server)

    def _issued(self, which: str | None, token: int) -> None:
        assert token > self.before_crash, f"{token} issued again after a crash"
        if which is not None:
            earlier = self.issued[which]
            assert not earlier or token > max(earlier), f"{token} after {earlier}"
            earlier.append(token)
        self.every.append(token)

    @rule(which=st.sampled_from(NAMES), times=st.integers(1, 4), hold=st.booleans())
    def acquire(self, which: str, times: int, hold: bool) -> None:
        """``times`` acquisitions of one name; the last one kept if ``hold``."""
        if which in self.held:
            return
        for last in [False] * (times - 1) + [True]:
            name, owner = self.names[which], f"owner-{next(_owners)}"
            result = self.backend.acquire(name, owner, 30.0, HOLDER)
            assert result.acquired
            self._issued(which, result.fencing_token)
            if hold and last:
                self.held[which] = owner
            else:
                assert self.backend.release(name, owner)

    @rule()
    def acquire_a_new_name(self) -> None:
        self._issued(None, _cycle(self.backend, f"mint:{self.run}:new:{next(self.fresh)}"))

    @rule(which=st.sampled_from(NAMES))
    def force_release(self, which: str) -> None:
        freed = self.backend.force_release(self.names[which])
        assert freed == (which in self.held)
        self.held.pop(which, None)

    @rule(headroom=st.integers(min_value=0, max_value=2), cross=st.booleans())
    def ceilings_close(self, headroom: int, cross: bool) -> None:
        """G and the rows' ceilings set down; if ``cross``, every known name then
        locked until its tokens have passed its row's ceiling (and the highest, G)."""
        # No mint runs now (one thread): a quiet point, held locks or not.
        _ceilings_close(self.server, headroom)
        if cross:
            for which, tokens in self.issued.items():
                if tokens and which not in self.held:
                    self.acquire(which, headroom + 2, hold=False)

    @rule()
    def crash(self) -> None:
        _crash_until_ready(self.server)
        self.backend.close()
        self.backend = _backend(synchronous_commit=self.sync)
        self.held.clear()
        self.before_crash = max(self.every, default=0)

    @invariant()
    def tokens_and_row_ceilings_are_under_the_visible_ceiling(self) -> None:
        (ceiling,) = _sql(self.server, f"SELECT ceiling FROM {FENCE} WHERE id = 1")[0]
        assert max(self.every, default=0) <= ceiling, "a token above G"
        (highest,) = _sql(self.server, f"SELECT max(ceiling) FROM {TABLE}")[0]
        assert highest is None or highest <= ceiling, "a row's ceiling above G"

    def teardown(self) -> None:
        self.backend.close()


@pytest.mark.parametrize("synchronous_commit", ["off", "on"])
def test_the_fast_path_stays_under_the_ceiling_on_disk(
    durable: PostgresServer,  # noqa: F811 - the fixture
    django_db_blocker: Any,
    synchronous_commit: str,
) -> None:
    with django_db_blocker.unblock():
        run_crash_machine(lambda: _Boundary(durable, synchronous_commit), examples=10, steps=15)


def test_a_known_name_is_minted_without_reading_the_ceiling_or_the_marker(
    durable: PostgresServer,  # noqa: F811 - the fixture
    django_db_blocker: Any,
) -> None:
    """With the tables of G and M locked against every access by an open transaction
    (as a schema change of them would), a known name's acquisitions go on: its mint
    touches its row only. A new name's must wait for them (its slow mint reads G), and
    gets its token once they are free."""
    name = f"mint:known:{uuid.uuid4().hex[:8]}"
    waiting = (
        "SELECT count(*) FROM pg_locks WHERE NOT granted"
        f" AND relation IN ('{FENCE}'::regclass, '{EPOCH}'::regclass)"
    )
    with django_db_blocker.unblock():
        backend, other = _backend(socket_timeout=3.0), _backend()
        try:
            first = _cycle(backend, name)  # the slow mint: the row and its ceiling
            with psycopg.connect(durable.url, autocommit=False) as blocker:
                blocker.execute(f"LOCK TABLE {FENCE}, {EPOCH} IN ACCESS EXCLUSIVE MODE")
                tokens = [_cycle(backend, name) for _ in range(3)]
                assert tokens == sorted(tokens) and tokens[0] > first
                assert len(set(tokens)) == 3
                new: list[int] = []
                waiter = threading.Thread(
                    target=lambda: new.append(_cycle(other, f"{name}:new")), daemon=True
                )
                waiter.start()
                deadline = time.monotonic() + 30
                while _sql(durable, waiting) == [(0,)]:
                    assert time.monotonic() < deadline, "the new name's mint never waited for G"
                    time.sleep(0.05)
                assert not new
                blocker.rollback()
            waiter.join(30)
            assert not waiter.is_alive() and new
        finally:
            backend.close()
            other.close()


def test_a_known_name_takes_the_slow_mint_at_its_row_ceiling(
    durable: PostgresServer,  # noqa: F811 - the fixture
    django_db_blocker: Any,
) -> None:
    """Step by step across the boundary, with tokens far ahead of the clock: the token
    that reaches the row's ceiling is minted fast (G untouched), the next one passes it
    and is minted slow, raising G durably and the row's ceiling with it."""
    name = f"mint:boundary:{uuid.uuid4().hex[:8]}"
    with django_db_blocker.unblock():
        backend = _backend()
        try:
            key = backend.key(name)
            _ahead_of_the_clock(durable)
            first = _cycle(backend, name)
            ceiling = _ceilings_close(durable, 1)
            assert ceiling == first + 1

            def state() -> tuple[int, str, int]:
                (g, writer) = _sql(durable, f"SELECT ceiling, xmin::text FROM {FENCE}")[0]
                (row,) = _sql(durable, f"SELECT ceiling FROM {TABLE} WHERE key = %s", (key,))[0]
                return int(g), writer, int(row)

            before = state()
            assert before[0] == before[2] == ceiling
            assert _cycle(backend, name) == ceiling  # fast: at the row's ceiling
            assert state() == before, "the fast mint wrote G or the row's ceiling"
            passed = _cycle(backend, name)
            assert passed == ceiling + 1
            g, writer, row = state()
            assert writer != before[1], "a token passed G without raising it"
            assert g == row == passed + RESERVE_US
        finally:
            backend.close()


def test_a_database_without_the_mint_function_says_to_migrate(
    durable: PostgresServer,  # noqa: F811 - the fixture
    django_db_blocker: Any,
) -> None:
    """A database migrated only up to 0003 (code newer than its schema): the first lock
    fails with a LockError that names the missing migration step, not the bare
    driver error."""
    with django_db_blocker.unblock():
        call_command("migrate", "distlocks", "0003", database=ALIAS, verbosity=0)
        backend = _backend()
        try:
            with pytest.raises(LockError, match=r"distlocks_mint.*manage\.py migrate distlocks"):
                backend.acquire("mint:unmigrated", "owner", 30.0, HOLDER)
        finally:
            backend.close()
        call_command("migrate", "distlocks", database=ALIAS, verbosity=0)
        backend = _backend()
        try:
            assert _cycle(backend, "mint:unmigrated") > 0  # and migrating fixes it
        finally:
            backend.close()
