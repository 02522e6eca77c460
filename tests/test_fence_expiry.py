"""Fencing counters of the Redis backends expire once no token they could hand out
next can be at or below one already issued: no sooner than the longest live lease
on the name ends, and no sooner than the server clock (µs) passes the counter.

So per-call lock names (a Celery task keyed by a user id) leave no keys behind,
and tokens still strictly increase per name across the counter's expiry: a new
counter starts from the clock, which is then past every token issued before.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from django.conf import settings
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from distlocks import get_backend, lock
from distlocks.backends.base import WRITE, Holder
from distlocks.backends.redis import FENCE_GRACE_MS
from distlocks.contrib.celery import single_execution
from tests.celery_app import app
from tests.waiting import wait_for

HOLDER = Holder(host="test", pid=1, thread="main")
# Generous: expiry is checked by the server, not timed here.
GONE_WITHIN = 60.0
#: The lease of the grant that follows a counter pushed ahead of the clock (seconds).
AHEAD_LEASE = 0.5


def server_now_us(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


class Target:
    """One kind of fenced lease on one name: its keys and its calls."""

    def __init__(self, kind: str, name: str) -> None:
        self.kind, self.name = kind, name
        alias = "redlock" if kind == "redlock" else "redis"
        self.backend: Any = get_backend(alias)
        if kind == "redlock":
            self.clients = [m.client for m in self.backend.masters]
            keys = self.backend.masters[0].all_keys(name)
            self.lease_key, self.fence_key = keys.lock, keys.fence
        elif kind == "rwlock":
            self.clients = [self.backend.client]
            keys = self.backend._permit_keys(WRITE, name)
            self.lease_key, self.fence_key = keys[0], keys[7]
        else:
            self.clients = [self.backend.client]
            self.lease_key, self.fence_key = self.backend.keys(name)

    def acquire(self, owner: str, ttl: float) -> int | None:
        if self.kind == "rwlock":
            result = self.backend.permit_acquire(WRITE, self.name, owner, ttl, HOLDER)
        else:
            result = self.backend.acquire(self.name, owner, ttl, HOLDER)
        return result.fencing_token if result.acquired else None

    def release(self, owner: str) -> None:
        if self.kind == "rwlock":
            self.backend.permit_release(WRITE, self.name, owner)
        else:
            self.backend.release(self.name, owner)

    def extend(self, owner: str, ttl: float) -> None:
        if self.kind == "rwlock":
            self.backend.permit_extend(WRITE, self.name, owner, ttl)
        else:
            self.backend.extend(self.name, owner, ttl)

    def force_release(self) -> None:
        if self.kind == "rwlock":
            self.backend.permit_force_release(WRITE, self.name)
        else:
            self.backend.force_release(self.name)

    def check(self) -> None:
        """On every server: a counter always has an expiry, no sooner than the lease
        on the name ends (when there is one), nor than the clock passes its value."""
        for client in self.clients:
            pipe = client.pipeline(transaction=True)
            pipe.time().get(self.fence_key).pttl(self.fence_key).pttl(self.lease_key)
            (seconds, micros), counter, fence_ms, lease_ms = pipe.execute()
            if counter is None:
                continue
            now_us = int(seconds) * 1_000_000 + int(micros)
            assert fence_ms != -1, f"the counter {self.fence_key} never expires"
            assert fence_ms >= 0
            if lease_ms >= 0:
                assert fence_ms >= lease_ms, "the counter would expire before the lease"
            assert fence_ms * 1000 >= int(counter) - now_us, (
                "the counter would expire before the clock passes it"
            )

    def gone(self) -> bool:
        return all(c.exists(self.fence_key, self.lease_key) == 0 for c in self.clients)

    def expire_early(self) -> None:
        """Make every counter expire at the earliest moment the rule allows (the
        scripts keep it FENCE_GRACE_MS longer), and wait until every key is gone."""
        for client in self.clients:
            pipe = client.pipeline(transaction=True)
            pipe.time().get(self.fence_key).pttl(self.lease_key)
            (seconds, micros), counter, lease_ms = pipe.execute()
            if counter is None:
                continue
            now_us = int(seconds) * 1_000_000 + int(micros)
            ahead_ms = -(-(int(counter) - now_us) // 1000)  # rounded up
            client.pexpire(self.fence_key, max(1, lease_ms, ahead_ms + 1))
        wait_for(self.gone, limit=GONE_WITHIN, what="the counter to expire")


ops = st.lists(
    st.one_of(
        st.tuples(st.just("acquire"), st.integers(30, 400)),
        st.tuples(st.just("extend"), st.integers(30, 600)),
        st.tuples(st.just("release"), st.just(0)),
        st.tuples(st.just("force"), st.just(0)),
        # Past the longest lease of these steps, far below FENCE_GRACE_MS (5 s): each
        # ms here is a ms an "expire" step waits for the clock to pass the counter.
        st.tuples(st.just("ahead"), st.integers(0, 800)),
        st.tuples(st.just("expire"), st.just(0)),
    ),
    min_size=1,
    max_size=12,
)


@pytest.mark.parametrize("kind", ["redis", "redlock", "rwlock"])
@hsettings(max_examples=20, deadline=None)
@given(steps=ops)
def test_tokens_strictly_increase_across_counter_expiry(
    kind: str, steps: list[tuple[str, int]]
) -> None:
    target = Target(kind, f"fence-expiry:{uuid.uuid4().hex}")
    issued: list[int] = []
    owner: str | None = None
    for op, value in steps:
        if op == "acquire":
            candidate = uuid.uuid4().hex
            token = target.acquire(candidate, value / 1000)
            if token is not None:
                assert not issued or token > issued[-1], (issued, token)
                issued.append(token)
                owner = candidate
        elif op == "extend" and owner:
            target.extend(owner, value / 1000)
        elif op == "release" and owner:
            target.release(owner)
            owner = None
        elif op == "force":
            target.force_release()
        elif op == "ahead":
            # The counter runs ahead of the clock (a burst of grants within one µs, or a
            # Redlock grant confirmed from a master whose clock is ahead): raised here on
            # every server, then the next grant sets its expiry.
            for client in target.clients:
                ahead = server_now_us(client) + value * 1000
                current = int(client.get(target.fence_key) or 0)
                client.set(target.fence_key, max(current, ahead))
            target.force_release()
            # Left to expire (an "expire" step waits for it): long enough for a Redlock
            # grant on a loaded machine, no longer.
            token = target.acquire(uuid.uuid4().hex, AHEAD_LEASE)
            assert token is not None and (not issued or token > issued[-1]), (issued, token)
            issued.append(token)
            owner = None
        elif op == "expire":
            target.expire_early()  # leases are short: they expire too
            owner = None
        target.check()
    # One last grant after everything has expired is still above every token.
    target.expire_early()
    token = target.acquire(uuid.uuid4().hex, 1.0)
    assert token is not None and (not issued or token > issued[-1])


def test_a_counter_of_an_old_version_gets_an_expiry_at_the_next_grant(
    redis_client: redis.Redis,
) -> None:
    """Counters written before they expired have no expiry: the next grant sets one."""
    backend = get_backend("redis")
    name = f"fence-expiry:{uuid.uuid4().hex}"
    _lock_key, fence_key = backend.keys(name)
    redis_client.set(fence_key, server_now_us(redis_client) - 10**9)
    assert redis_client.pttl(fence_key) == -1
    with lock(name, backend="redis", ttl=0.2) as lease:
        assert redis_client.pttl(fence_key) > 0
        assert lease.fencing_token > 0
    wait_for(lambda: redis_client.exists(fence_key) == 0, limit=GONE_WITHIN, what="expiry")


def test_renewal_pushes_the_counters_expiry_with_the_lease(redis_client: redis.Redis) -> None:
    name = f"fence-expiry:{uuid.uuid4().hex}"
    lock_key, fence_key = get_backend("redis").keys(name)
    with lock(name, backend="redis", ttl=0.3, auto_renew=False) as lease:
        lease.extend(30)
        assert redis_client.pttl(fence_key) >= redis_client.pttl(lock_key) > 20_000


# -- per-call names ------------------------------------------------------------------


@single_execution(app=app, name="fence_expiry.per_call", ttl=1)
def per_call(user_id: int) -> int:
    return user_id


@single_execution(app=app, name="fence_expiry.per_call_queued", ttl=1, unique_while="queued")
def per_call_queued(user_id: int) -> int:
    return user_id


#: A queue no worker consumes: the published messages are dropped afterwards.
IDLE_QUEUE = "distlocks-fence-expiry-idle"


def _keys(client: redis.Redis, pattern: str) -> dict[bytes, int]:
    return {key: client.pttl(key) for key in client.scan_iter(match=pattern, count=1000)}


def test_a_thousand_distinct_calls_leave_no_keys_behind(redis_client: redis.Redis) -> None:
    """A task keyed by its argument (the default key) called with 1,000 user ids; the
    same with a queue marker (unique_while="queued": published, then run under its
    id, which drops the marker); 1,000 distinct lock() names. Every key left has an
    expiry, and all are gone once the last lease and counter expired."""
    run = uuid.uuid4().hex
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    try:
        for user_id in range(1000):
            assert per_call.apply(args=(user_id,)).get() == user_id
            queued = per_call_queued.apply_async((user_id,), queue=IDLE_QUEUE)
            assert per_call_queued.apply((user_id,), task_id=queued.id).get() == user_id
    finally:
        broker.delete(IDLE_QUEUE)
        broker.close()
    for index in range(1000):
        with lock(f"per-call:{run}:{index}", backend="redis", ttl=1):
            pass
    patterns = [
        "*celery:fence_expiry.per_call:*",
        "*celery:fence_expiry.per_call_queued:*",
        f"*per-call:{run}:*",
    ]
    left = {key: ttl for p in patterns for key, ttl in _keys(redis_client, p).items()}
    forever = sorted(key for key, ttl in left.items() if ttl == -1)
    assert not forever, f"{len(forever)} keys never expire, e.g. {forever[:3]}"
    # None is kept longer than its lease (1 s) or the counters' grace after the grant:
    # the counters are no further ahead of the clock.
    assert all(ttl <= max(1000, FENCE_GRACE_MS) for ttl in left.values()), max(left.values())

    def none_left() -> bool:
        return not any(_keys(redis_client, p) for p in patterns)

    took = wait_for(none_left, limit=GONE_WITHIN, what="every key of 3,000 calls to expire")
    print(f"3,000 per-call names and 1,000 markers: every key gone {took:.2f}s after the last")


@pytest.mark.parametrize("kind", ["redis", "redlock", "rwlock"])
def test_a_release_lets_the_counter_go_before_the_lease_would_have_ended(kind: str) -> None:
    """No lease is live after a release: the counter is kept only for the clock and the
    grace, not for the rest of a long ttl (a queue marker's hour, say)."""
    target = Target(kind, f"fence-expiry:{uuid.uuid4().hex}")
    owner = uuid.uuid4().hex
    assert target.acquire(owner, 600) is not None
    for client in target.clients:
        assert client.pttl(target.fence_key) > 500_000
    target.release(owner)
    target.check()
    for client in target.clients:
        assert 0 < client.pttl(target.fence_key) <= FENCE_GRACE_MS
