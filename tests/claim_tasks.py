"""The task of the claim proof (tests/test_claims.py), run by real prefork workers.

One single-execution task, run twice on one key: once by the holder the test freezes
(SIGSTOP) past its lease, once by its successor. Each step reports to the test, and
waits for its go, through Redis lists named after the run.
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis
from django.conf import settings

from distlocks.contrib.celery import single_execution
from distlocks.exceptions import StaleFencingToken
from tests.claim_celery_app import app
from tests.testapp.models import Counter

#: The run lock's lease: short, renewed every ttl/3 while the process runs.
TTL = 2.0
#: How long a step waits for the test's go (a stuck test must not leave it forever).
GO_WITHIN = 120


def control() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)


@single_execution(app=app, name="claims.increment", key="claims-proof:{run}", ttl=TTL, bind=True)
def increment(self: Any, run: str, role: str, pk: int, by: int, claim: bool) -> str:
    """Read the counter (after claiming it, with ``claim``), report, wait for the go,
    then write read + ``by`` with the token of the lease. The token is taken before
    the wait: the freeze lands between the lease check and the write, the window no
    check in the client can close."""
    client = control()
    lease = self.lease
    row = Counter.objects.get(pk=pk)
    if claim:
        lease.claim(row)  # reloads the row: the value read is the one under the claim
    token, value = lease.fencing_token, row.value
    client.rpush(f"{run}:{role}:read", json.dumps({"pid": os.getpid(), "token": token}))
    client.expire(f"{run}:{role}:read", GO_WITHIN)
    if client.blpop([f"{run}:{role}:go"], timeout=GO_WITHIN) is None:
        return "no go"
    row.value = value + by
    try:
        row.save(fencing_token=token)
        outcome = "ok"
    except StaleFencingToken:
        outcome = "stale"
    client.rpush(f"{run}:{role}:done", outcome)
    client.expire(f"{run}:{role}:done", GO_WITHIN)
    return outcome
