"""Review 6: the start of a single-execution run on Redis when the first attempt at the
run lock went out with the marker's call (one script with ``unique_while="queued"``,
two pipelined acquires with ``"queued_or_running"``) and its reply was lost twice: the
resend after the first loss was lost too (a link that breaks again, a server killed
after it ran the script and restarted from its append-only file).

The server took the run lock for the owner that first attempt named. The plain calls
that follow must be made as that same owner, so that the grant is answered as this
run's own; a new owner finds the lock busy, held by "an earlier delivery of this very
message", and waits out the lease (the whole ttl) for a lock nobody renews.
"""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.conf import settings as django_settings
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from distlocks import get_backend
from distlocks.backends.redis import RedisBackend
from distlocks.backends.redis.scripts import ACQUIRE, FENCE_GRACE_MS
from distlocks.contrib import celery_redis
from distlocks.contrib.celery import single_execution
from tests.celery_app import app
from tests.lost_reply_proxy import LostReplyProxy

pytestmark = pytest.mark.django_db

ALIAS = "review6-lossy"
#: Long enough that a run waiting out its own orphaned lease cannot pass the deadline.
LONG_TTL = 600.0
#: A generous bound for a run that starts at once (it takes milliseconds).
DEADLINE = 60.0


@pytest.fixture
def lossy(lost_reply_proxy: LostReplyProxy, settings: Any) -> Iterator[RedisBackend]:
    """A backend alias whose connections go through the lost-reply proxy."""
    db = int(urlsplit(django_settings.REDIS_URL).path.strip("/") or 0)
    prefix = f"r6-{uuid.uuid4().hex[:8]}"
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        ALIAS: {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": lost_reply_proxy.url(db),
            "OPTIONS": {"key_prefix": prefix},
        },
    }
    backend = get_backend(ALIAS)
    assert isinstance(backend, RedisBackend) and celery_redis.usable(backend)
    yield backend
    keys = list(backend.client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        backend.client.delete(*keys)


ran: list[int] = []


@single_execution(
    app=app, name="review6.queued", backend=ALIAS, ttl=LONG_TTL, unique_while="queued"
)  # fmt: skip
def queued_task(n: int) -> int:
    ran.append(n)
    return n


@single_execution(
    app=app, name="review6.qor", backend=ALIAS, ttl=LONG_TTL, unique_while="queued_or_running"
)  # fmt: skip
def qor_task(n: int) -> int:
    ran.append(n)
    return n


def _script_sha(backend: RedisBackend, text: str) -> bytes:
    """The script's SHA-1 with the script in the server's cache (so that the request
    whose reply is lost is the script's run, not one answered NOSCRIPT)."""
    sha = str(backend.client.script_load(text))
    assert sha == hashlib.sha1(text.encode()).hexdigest()
    return sha.encode()


@pytest.mark.parametrize("task", [queued_task, qor_task], ids=["queued", "queued_or_running"])
def test_a_run_start_whose_reply_is_lost_twice_takes_its_own_grant(
    task: Any, lost_reply_proxy: LostReplyProxy, lossy: RedisBackend
) -> None:
    n = uuid.uuid4().int % 10**12
    name = task.lock_name((n,))
    if task is queued_task:
        sha = _script_sha(lossy, celery_redis.RUN_START.script)
    else:  # the marker's and the run lock's acquire, pipelined
        sha = _script_sha(lossy, ACQUIRE)

    def again() -> None:  # the resend's reply is lost too
        lost_reply_proxy.lose_reply_to(sha)

    before = lost_reply_proxy.lost
    lost_reply_proxy.lose_reply_to(sha, before_reset=again)
    outcome: dict[str, Any] = {}

    def run() -> None:
        app.conf.task_store_eager_result = True
        try:
            outcome["result"] = task.apply((n,), task_id=str(uuid.uuid4())).get()
        except BaseException as exc:  # reported by the test thread
            outcome["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(DEADLINE)
    try:
        assert not worker.is_alive(), (
            "the run waited for the run lock its own first attempt took (the grant "
            "was not taken as its own)"
        )
    finally:
        app.conf.task_store_eager_result = False
        if worker.is_alive():  # let it go: the orphaned lease is ended by hand
            lossy.client.delete(lossy.all_keys(name).lock)
            worker.join(DEADLINE)
    assert lost_reply_proxy.lost == before + 2
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"] == n
    assert ran.count(n) == 1
    assert lossy.inspect(name) is None  # released by the run, not left to run out
    assert lossy.inspect(name + ":queued") is None


# -- the run start script against the backend's two, in more states ---------------------
#
# tests/test_celery_run_start.py compares the run start script with ACQUIRE then RELEASE
# in sixteen states, with the listing index on and a marker that can be released. Here
# the same comparison goes further: the index off (no fifth key: the marker's index
# entry must not be looked for), a marker of another type or with a counter of another
# type (its release fails, before or after its first write: whatever the backend's
# RELEASE leaves half done, the run start leaves too, and reports the failure), a marker
# that ran out with its counter kept, a run lock whose waiters include this owner (a
# grant drops its registration). Every key of both names is compared, as raw data.

OWNER = "run-owner"
MARKER_OWNER = "celery-task:the-task"
_RUN_STATES = ("free", "other", "same-owner", "expired-with-counter", "other-own-waiter")
_MARKER_STATES = (
    "free",
    "own",
    "other",
    "own-with-waiter",
    "own-expired-with-counter",
    "wrong-type",
    "own-with-wrong-type-counter",
)


def _holder() -> Any:
    from distlocks.locks import current_holder

    holder = current_holder()
    return type(holder)(holder.host, holder.pid, holder.thread, {"celery_task_id": "the-task"})


def _prepare(backend: RedisBackend, client: Any, name: str, run: str, marker: str) -> None:
    holder = _holder()
    keys, marker_keys = backend.all_keys(name), backend.all_keys(name + ":queued")
    if run in ("other", "other-own-waiter"):
        assert backend.acquire(name, "someone-else", 30, holder).acquired
    elif run == "same-owner":
        assert backend.acquire(name, OWNER, 30, holder).acquired
    elif run == "expired-with-counter":
        assert backend.acquire(name, "gone", 30, holder).acquired
        client.delete(keys.lock)
    if run == "other-own-waiter":
        client.zadd(keys.waiters, {OWNER: 2**50})
    if marker in ("own", "own-with-waiter", "own-with-wrong-type-counter"):
        assert backend.acquire(name + ":queued", MARKER_OWNER, 30, holder).acquired
    elif marker == "other":
        assert backend.acquire(name + ":queued", "celery-task:another", 30, holder).acquired
    elif marker == "own-expired-with-counter":
        assert backend.acquire(name + ":queued", MARKER_OWNER, 30, holder).acquired
        client.delete(marker_keys.lock)
    elif marker == "wrong-type":
        client.set(marker_keys.lock, "not a hash")
    if marker == "own-with-waiter":
        client.zadd(marker_keys.waiters, {"waiter": 2**50})
    if marker == "own-with-wrong-type-counter":
        client.delete(marker_keys.fence)
        client.hset(marker_keys.fence, "not", "a counter")


# Fields whose values differ between two grants made a moment apart: compared by
# presence only.
_VARYING = {b"token", b"acquired_at"}


def _raw(backend: RedisBackend, client: Any, name: str) -> dict[str, Any]:
    """Every key of ``name`` and of its marker (by its part after the hash tag), as raw
    data with what varies between twin names left out, and the index entries."""
    found: dict[str, Any] = {}
    for suffix in ("", ":queued"):
        keys = backend.all_keys(name + suffix)
        base = keys.lock.removesuffix("lock")
        for key in client.scan_iter(match=base.replace("[", "\\[") + "*", count=1000):
            kind = client.type(key).decode()
            if kind == "hash":
                data: Any = {
                    field: (field in _VARYING) or value.replace(name.encode(), b"<name>")
                    for field, value in client.hgetall(key).items()
                }
            elif kind == "string":
                data = True if key.decode() == keys.fence else client.get(key)
            elif kind == "zset":
                data = client.zrange(key, 0, -1)
            elif kind == "list":
                data = client.lrange(key, 0, -1)
            else:
                data = kind
            ttl = client.pttl(key)
            found[suffix + "|" + key.decode().removeprefix(base)] = (
                kind,
                data,
                # Only what tells the states apart: none, within the grace, past it.
                ttl < 0 or (ttl > FENCE_GRACE_MS and "past"),
            )
        for index in backend._index:
            entry = client.hget(index, name + suffix)
            found[suffix + "|index"] = None if entry is None else entry.split(b"\0")[0]
    return found


@pytest.fixture
def twin_backends(settings: Any) -> Iterator[dict[bool, RedisBackend]]:
    """Two aliases on the session's Redis: the listing index on, and off."""
    prefix = f"r6t-{uuid.uuid4().hex[:8]}"
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        **{
            f"review6-index-{on}": {
                "BACKEND": "distlocks.backends.redis.RedisBackend",
                "LOCATION": django_settings.REDIS_URL,
                "OPTIONS": {"key_prefix": f"{prefix}-{on}", "listing_index": on},
            }
            for on in (True, False)
        },
    }
    made = {on: get_backend(f"review6-index-{on}") for on in (True, False)}
    assert all(isinstance(b, RedisBackend) and celery_redis.usable(b) for b in made.values())
    assert made[True]._index and not made[False]._index
    yield made  # type: ignore[misc]
    for on, backend in made.items():
        keys = list(backend.client.scan_iter(match=f"{prefix}-{on}:*", count=1000))
        if keys:
            backend.client.delete(*keys)


@hsettings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    run=st.sampled_from(_RUN_STATES),
    marker=st.sampled_from(_MARKER_STATES),
    index=st.booleans(),
)
def test_the_run_start_matches_acquire_then_release_in_every_state(
    run: str, marker: str, index: bool, twin_backends: dict[bool, RedisBackend]
) -> None:
    backend = twin_backends[index]
    client = backend.client
    ours, theirs = f"rs6-{uuid.uuid4().hex}", f"rs6-{uuid.uuid4().hex}"
    for name in (ours, theirs):
        _prepare(backend, client, name, run, marker)
    holder = _holder()
    two = celery_redis.send_together(
        backend,
        [
            celery_redis.acquire_call(backend, theirs, OWNER, 30, holder),
            celery_redis.release_call(backend, theirs + ":queued", MARKER_OWNER),
        ],
    )
    one = celery_redis.send_together(
        backend,
        [
            celery_redis.run_start_call(
                backend, ours, OWNER, 30, holder, ours + ":queued", MARKER_OWNER
            )
        ],
    )
    assert two is not None and one is not None
    reply, marker_error = celery_redis.run_started(one[0])
    expected, released = two
    # The marker's failure reported as the backend's release reports it, and only then.
    assert bool(marker_error) == isinstance(released, Exception)
    if marker_error:
        assert "WRONGTYPE" in marker_error
    assert reply[0] == expected[0]
    assert (reply[2] > 0) == (expected[2] > 0)
    mine, model = _raw(backend, client, ours), _raw(backend, client, theirs)
    # The one difference allowed: the release's tombstone, which nobody reads.
    model = {key: value for key, value in model.items() if "|released:" not in key}
    assert mine == model
