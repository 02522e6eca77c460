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

import pytest

from distlocks.backends.redis import RedisBackend
from distlocks.backends.redis.scripts import ACQUIRE
from distlocks.contrib import celery_redis
from distlocks.contrib.celery import single_execution
from tests.celery_app import app
from tests.celery_lossy import lossy_backend
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
    yield from lossy_backend(lost_reply_proxy, settings, ALIAS, "r6")


ran: list[int] = []


def _noting(n: int) -> int:
    ran.append(n)
    return n


queued_task, qor_task = (
    single_execution(
        app=app, name=f"review6.{mode}", backend=ALIAS, ttl=LONG_TTL, unique_while=mode
    )(_noting)
    for mode in ("queued", "queued_or_running")
)


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
        # A loss not met stays armed for the session's later requests: disarmed.
        lost_reply_proxy.lose_reply_to(b"never sent " + uuid.uuid4().hex.encode())
        if worker.is_alive():  # let it go: the orphaned lease is ended by hand
            lossy.client.delete(lossy.all_keys(name).lock)
            worker.join(DEADLINE)
    assert lost_reply_proxy.lost == before + 2
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"] == n
    assert ran.count(n) == 1
    assert lossy.inspect(name) is None  # released by the run, not left to run out
    assert lossy.inspect(name + ":queued") is None
