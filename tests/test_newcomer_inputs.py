"""The strangest inputs a newcomer passes through the public API, on every backend.

Any name the docs allow (a non-empty str of at most 200 characters without control
characters) works on every backend: it is taken, shown under the same name by
``inspect()``, and freed. Anything else is refused at the call with a clear error, and
leaves nothing on the server.
"""

from __future__ import annotations

import math
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distlocks import get_backend, lock, lock_many
from distlocks.exceptions import LockNotAcquired

#: Characters that mean something to some server: path separators and dots for
#: ZooKeeper's znodes and etcd's keys, Redis Cluster's hash-tag braces, glob characters
#: for SCAN patterns, SQL quoting, percent-escapes, and text beyond ASCII.
AWKWARD = st.sampled_from(
    ["/", ".", "..", "{", "}", "*", "?", "[", "]", "'", '"', "\\", "%", ":", " ", "\u2028",
     "\u200b", "\u202e", "é", "🔒", "zookeeper", "\ufeff", "\U0010fffd"]
)  # fmt: skip
PIECES = st.one_of(AWKWARD, st.text(st.characters(codec="utf-8", categories=["L", "N", "P", "S"])))


@st.composite
def names(draw: st.DrawFn) -> str:
    """A valid name, prefixed so that no other test or example shares it."""
    body = "".join(draw(st.lists(PIECES, min_size=1, max_size=8)))
    name = f"{uuid.uuid4().hex[:10]}{body}"[:200]
    return name


def _free(alias: str, name: str) -> bool:
    lease = lock(name, backend=alias, timeout=0).acquire()
    lease.release()
    return True


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(name=names())
def test_any_valid_name_is_taken_shown_and_freed(alias: str, name: str) -> None:
    backend = get_backend(alias)
    with lock(name, backend=alias, ttl=30, timeout=5) as lease:
        assert lease.name == name and lease.fencing_token > 0
        with pytest.raises(LockNotAcquired):
            lock(name, backend=alias, timeout=0).acquire()
        info = backend.inspect(name)
        assert info is not None and info.name == name
        assert info.fencing_token == lease.fencing_token
    assert backend.inspect(name) is None
    assert _free(alias, name)


def test_the_longest_name_and_a_name_one_longer(alias: str) -> None:
    longest = uuid.uuid4().hex + "🔒" * (200 - 32)
    with lock(longest, backend=alias, timeout=5) as lease:
        assert get_backend(alias).inspect(longest).name == longest  # type: ignore[union-attr]
        assert lease.fencing_token > 0
    with pytest.raises(ValueError, match="limit is 200"):
        lock(longest + "x", backend=alias)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"ttl": 0}, ValueError),
        ({"ttl": -1}, ValueError),
        ({"ttl": 1e12}, ValueError),
        ({"ttl": math.nan}, ValueError),
        ({"ttl": True}, TypeError),
        ({"timeout": -1}, ValueError),
        ({"timeout": math.inf}, ValueError),
        ({"timeout": True}, TypeError),
        ({"max_hold": 0}, ValueError),
        ({"on_lost": 1}, TypeError),
    ],
)
def test_a_bad_argument_is_refused_before_anything_is_written(
    alias: str, kwargs: dict, error: type[Exception]
) -> None:
    name = f"newcomer-bad:{uuid.uuid4().hex}"
    with pytest.raises(error):
        with lock(name, backend=alias, **kwargs):
            pytest.fail("the block ran")
    assert get_backend(alias).inspect(name) is None


@pytest.mark.parametrize(
    ("bad", "error"),
    [("", ValueError), ("a\x00b", ValueError), ("a\nb", ValueError), ("x" * 201, ValueError)],
)
def test_lock_many_with_one_bad_name_takes_none_of_them(
    alias: str, bad: str, error: type[Exception]
) -> None:
    good = f"newcomer-many:{uuid.uuid4().hex}"
    with pytest.raises(error):
        lock_many([good, bad], backend=alias, timeout=1)
    assert get_backend(alias).inspect(good) is None
    assert _free(alias, good)


def test_lock_many_takes_duplicates_once(alias: str) -> None:
    a, b = (f"newcomer-dup:{uuid.uuid4().hex}:{n}" for n in "ab")
    with lock_many([b, a, b, a], backend=alias, timeout=5) as leases:
        assert sorted(leases) == sorted([a, b])
        assert leases[a].fencing_token > 0 and leases[b].fencing_token > 0
    assert _free(alias, a) and _free(alias, b)
