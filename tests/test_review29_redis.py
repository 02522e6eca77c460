"""Review 29: what the Redis backend leaves on the server after many lock and permit
cycles, and the release ids of a forked child (a real server, no mocks)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
from django.conf import settings as django_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distlocks.backends.base import READ, SEMAPHORE, WRITE, Holder
from distlocks.backends.redis import RedisBackend
from distlocks.backends.redis.lock import release_id

HOLDER = Holder("host", 1, "thread")


@pytest.fixture(scope="module")
def backend() -> Iterator[RedisBackend]:
    prefix = f"r29-{uuid.uuid4().hex[:8]}"
    made = RedisBackend(
        "r29", {"LOCATION": django_settings.REDIS_URL, "OPTIONS": {"key_prefix": prefix}}
    )
    yield made
    keys = list(made.client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        made.client.delete(*keys)
    made.close()


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    kinds=st.lists(st.sampled_from([SEMAPHORE, READ, WRITE]), min_size=1, max_size=12),
    holders=st.integers(min_value=1, max_value=3),
)
def test_released_permits_leave_nothing_in_the_listing_index(
    backend: RedisBackend, kinds: list[str], holders: int
) -> None:
    """Semaphores and read-write locks of per-call names, each taken and given back:
    once every permit is released, the listing's set of permit names holds none of
    them (it grew by one member per name for ever, until a listing ran)."""
    names = []
    for kind in kinds:
        name = f"p-{uuid.uuid4().hex}"
        names.append(name)
        owners = [f"o{i}" for i in range(1 if kind == WRITE else holders)]
        for owner in owners:
            assert backend.permit_acquire(kind, name, owner, 30, HOLDER, limit=3).acquired
        for owner in owners:
            assert backend.permit_release(kind, name, owner) is True
    members = {m.decode() for m in backend.client.smembers(backend.index_permits_key)}
    left = [m for m in members if any(n in m for n in names)]
    assert left == []


def test_a_forked_childs_release_ids_differ_from_its_parents(backend: RedisBackend) -> None:
    """The child inherits the counter: the process part of its ids must differ."""
    parent = {release_id() for _ in range(3)}
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        ids = ",".join(release_id() for _ in range(3))
        os.write(write, ids.encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(child, 0)
    got = set(os.read(read, 4096).decode().split(","))
    os.close(read)
    parent |= {release_id() for _ in range(3)}  # the parent counts on from the same point
    assert status == 0 and len(got) == 3
    assert not got & parent


@pytest.mark.parametrize("kind", [SEMAPHORE, READ, WRITE])
@pytest.mark.parametrize("by_owner", [True, False])
def test_force_released_permits_leave_nothing_in_the_listing_index(
    backend: RedisBackend, kind: str, by_owner: bool
) -> None:
    """A force release that evicts the last permit of a name takes the name out of the
    listing's set too, as a release does (every permit, or the one owner's)."""
    name = f"f-{uuid.uuid4().hex}"
    assert backend.permit_acquire(kind, name, "o", 30, HOLDER, limit=2).acquired
    assert backend.permit_force_release(kind, name, "o" if by_owner else None) == 1
    members = {m.decode() for m in backend.client.smembers(backend.index_permits_key)}
    assert [m for m in members if name in m] == []


_CHILD = """
import sys
from django.conf import settings
settings.configure()
import django
django.setup()
from distlocks.backends.redis import RedisBackend
backend = RedisBackend("child", {"LOCATION": sys.argv[1], "OPTIONS": {"key_prefix": sys.argv[2]}})
print(int(backend.release(sys.argv[3], sys.argv[4])))
"""


def _release_in_own_pid_namespace(backend: RedisBackend, name: str, owner: str) -> bool:
    """``backend.release(name, owner)`` made by a fresh process that is pid 1 of a PID
    namespace of its own, as every worker container's first process is."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        ["unshare", "--pid", "--fork", sys.executable, "-c", _CHILD,
         django_settings.REDIS_URL, backend.key_prefix, name, owner],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() == "1"


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_a_release_from_another_host_with_the_same_pid_is_not_taken_for_a_retry(
    backend: RedisBackend,
) -> None:
    """Release ids were the pid and a counter: two worker containers (both pid 1 there,
    counters alike) releasing for the same owner (a queue marker's owner is derived
    from the task id, so every delivery of a message shares it) within the tombstone's
    5 s sent the same id, and the second, a release of a lock it no longer held, was
    told it released it."""
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr!r}")
    name = f"ns-{uuid.uuid4().hex}"
    assert backend.acquire(name, "marker-of-task", 30, HOLDER).acquired
    assert _release_in_own_pid_namespace(backend, name, "marker-of-task") is True
    assert backend.acquire(name, "someone-else", 30, HOLDER).acquired
    assert _release_in_own_pid_namespace(backend, name, "marker-of-task") is False
    assert backend.release(name, "someone-else") is True
