"""A give-back takes back what its own acquire request was granted, and nothing else.

Owners are reused (a Celery queue marker's owner is the task id; a run start reuses
one owner across its attempts), and the acquire script answers a request of the owner
that holds the lock already as granted. So the give-back of an acquire left unanswered
must not release by owner: a later acquire of the same owner was told it holds the
lock. Each grant records its request's id; a give-back names its request, and the
lock (or permit) goes only once no request it was granted by is left.

The state machines below run the scripts on the real server in every order a client
can produce: acquires of the same owner answered (the caller counts on them) or left
unanswered (given back later, always after their acquire: sent behind it on its
connection, and maybe once more on another), requests sent again with their id (a
reply lost), late acquires after the release, another owner in between. After every
step the server must agree with a model of "held while a request it was granted by is
not given back"; a caller that counts on its grant must find the lock held.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from distlocks.backends.base import READ, SEMAPHORE, WRITE, Holder
from distlocks.backends.redis import RedisBackend
from distlocks.backends.redis.clients import _undo_command
from distlocks.backends.redis.scripts import ATTEMPTS_KEPT, SCRIPTS
from tests.test_redis_halfwritten import own_prefix

pytestmark = pytest.mark.django_db(transaction=False)

HOLDER = Holder(host="test", pid=1, thread="t", extra={})
OWNERS = ("x", "y")
_names = itertools.count()


@pytest.fixture
def backend(settings: Any) -> Iterator[RedisBackend]:
    with own_prefix(settings, "scope") as found:
        yield found


class _Server:
    """One name's acquire, give-back and release on the server, for a lock or a permit
    (a semaphore of one, or a read-write lock's read or write side)."""

    def __init__(self, backend: RedisBackend, family: str, name: str) -> None:
        self.backend, self.family, self.name = backend, family, name

    def acquire(self, owner: str) -> tuple[bool, Any]:
        """Send one acquire: whether it was granted, and its give-back."""
        b = self.backend
        if self.family == "lock":
            keys, args = b._indexed_acquire_call(self.name, owner, 60, HOLDER, 0.0, False)
            lua = SCRIPTS["acquire"]
            undo: Any = b._acquire_undo(self.name, owner, args)
        else:
            script, keys, args, undo = b._permit_acquire_call(
                self.family, self.name, owner, 60, HOLDER, 1, 0.0
            )
            lua = script.lua
        self.last = (keys, args, lua)
        return self.again(self.last), undo

    def again(self, request: tuple[list[str], list[Any], str]) -> bool:
        """Send ``request`` (once more): whether it was granted."""
        keys, args, lua = request
        return bool(self.backend.client.eval(lua, len(keys), *keys, *args)[0])

    def give_back(self, undo: Any) -> None:
        self.backend.client.execute_command(*_undo_command(undo))

    def release(self, owner: str) -> None:
        if self.family == "lock":
            self.backend.release(self.name, owner)
        else:
            self.backend.permit_release(self.family, self.name, owner)

    def holders(self) -> set[str]:
        b = self.backend
        if self.family == "lock":
            info = b.inspect(self.name)
            return set() if info is None else {info.owner}
        return {info.owner for info in b.permit_holders(self.family, self.name)}


class GiveBacks(RuleBasedStateMachine):
    """The model: who holds the name (readers share it), and for each holder, the
    requests it was granted by that are not given back yet."""

    server: _Server

    def __init__(self) -> None:
        super().__init__()
        #: Holder -> the requests it was granted by, not given back.
        self.held: dict[str, set[int]] = {}
        #: Holders granted more than ATTEMPTS_KEPT times: no give-back frees them.
        self.overflow: set[str] = set()
        #: Requests whose callers count on their grant (no release since).
        self.counted: set[int] = set()
        #: Requests left unanswered, not given back yet: id -> (give-back, owner).
        self.doubtful: dict[int, tuple[Any, str]] = {}
        #: Requests that ran, with what to send again: id -> (request, owner).
        self.sent: dict[int, tuple[Any, str]] = {}
        self.ids = itertools.count()

    def _granted(self, rid: int, owner: str, granted: bool) -> None:
        shared = self.server.family == READ
        expect = shared or not (set(self.held) - {owner})
        assert granted == expect, f"request {rid} of {owner}: granted {granted}"
        if granted:
            if owner not in self.held:
                self.overflow.discard(owner)
            self.held.setdefault(owner, set()).add(rid)
            if len(self.held[owner]) > ATTEMPTS_KEPT:
                self.overflow.add(owner)

    def _acquire(self, owner: str) -> tuple[int, bool, Any]:
        rid = next(self.ids)
        granted, undo = self.server.acquire(owner)
        self.sent[rid] = (self.server.last, owner)
        self._granted(rid, owner, granted)
        return rid, granted, undo

    @rule(owner=st.sampled_from(OWNERS))
    def acquire_answered(self, owner: str) -> None:
        rid, granted, _ = self._acquire(owner)
        if granted and owner == "x":
            self.counted.add(rid)

    @rule(owner=st.sampled_from(OWNERS))
    def acquire_unanswered(self, owner: str) -> None:
        rid, _, undo = self._acquire(owner)
        self.doubtful[rid] = (undo, owner)

    @precondition(lambda self: bool(self.sent))
    @rule(data=st.data())
    def sent_again(self, data: st.DataObject) -> None:
        """A request sent again with its id (its first reply lost): granted if the
        name is its owner's (it is one of the requests that grant it)."""
        rid = data.draw(st.sampled_from(sorted(self.sent)), label="request")
        request, owner = self.sent[rid]
        granted = self.server.again(request)
        self._granted(rid, owner, granted)

    @precondition(lambda self: bool(self.doubtful))
    @rule(data=st.data(), twice=st.booleans())
    def give_back(self, data: st.DataObject, twice: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.doubtful)), label="give back")
        undo, owner = self.doubtful.pop(rid)
        for _ in range(2 if twice else 1):  # behind the request, and on another connection
            self.server.give_back(undo)
        left = self.held.get(owner)
        if left is not None and rid in left:
            left.discard(rid)
            if not left and owner not in self.overflow:
                del self.held[owner]

    @rule(owner=st.sampled_from(OWNERS))
    def release(self, owner: str) -> None:
        self.server.release(owner)
        self.held.pop(owner, None)
        if owner == "x":
            self.counted = set()

    @invariant()
    def server_agrees(self) -> None:
        if not hasattr(self, "server"):
            return
        held = self.server.holders()
        assert held == set(self.held), (held, self.held)
        if self.counted:
            assert "x" in held, "a grant the caller counts on was given back"


@pytest.mark.parametrize("family", ["lock", SEMAPHORE, READ, WRITE])
def test_a_give_back_takes_back_only_its_own_request(backend: RedisBackend, family: str) -> None:
    class Machine(GiveBacks):
        def __init__(self) -> None:
            super().__init__()
            self.server = _Server(backend, family, f"scope:{next(_names)}")

    run_state_machine_as_test(
        Machine,
        settings=hsettings(
            max_examples=40,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        ),
    )


def test_the_requests_kept_are_bounded(backend: RedisBackend, redis_client: redis.Redis) -> None:
    """An owner acquiring again and again keeps at most ATTEMPTS_KEPT ids on the lock;
    past them, no give-back frees it (its ttl or a release does)."""
    server = _Server(backend, "lock", f"scope:{next(_names)}")
    undos = [server.acquire("x")[1] for _ in range(ATTEMPTS_KEPT * 3)]
    ids = redis_client.hget(backend.all_keys(server.name).lock, "attempts")
    assert ids is not None and len(ids.split()) <= ATTEMPTS_KEPT
    for undo in undos:
        server.give_back(undo)
    assert server.holders() == {"x"}
    server.release("x")
    assert server.holders() == set()
