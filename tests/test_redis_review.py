"""Defects found by review of the Redis backend, each with the case that showed it."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from distlocks import get_backend, lock
from distlocks.backends.redis import parse_location

SECRET = "s3cr/et?x"


@pytest.mark.parametrize(
    "location",
    [
        f"redis+cluster://admin:{SECRET}@host1:7000",
        f"redis+sentinel://u:{SECRET}@host1:26379/svc",
    ],
)
def test_no_piece_of_a_password_is_quoted_as_a_node(location: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_location(location)
    for piece in ("s3cr", "et?x", "et", "x"):
        assert f"'{piece}'" not in str(raised.value) and f":{piece}" not in str(raised.value)
    config = {"BACKEND": "distlocks.backends.redis.RedisBackend", "LOCATION": location}
    with override_settings(DISTLOCKS_BACKENDS={"default": config}):
        with pytest.raises(ImproperlyConfigured) as refused:
            lock("x", timeout=0).acquire()
    assert "s3cr" not in str(refused.value)


def test_force_release_without_a_token_is_safe_to_send_twice(name: str) -> None:
    """Sent again after its reply was lost, a force release must not evict the holder
    that the first one let in."""
    backend = get_backend("redis")
    first = lock(name, backend="redis", ttl=30).acquire()
    assert backend.force_release(name) is True
    second = lock(name, backend="redis", ttl=30, timeout=0).acquire()
    try:
        # The same request again (what a retry after a lost reply sends): by token now.
        assert backend.force_release(name, first.fencing_token) is False
        info = backend.inspect(name)
        assert info is not None and info.owner == second.owner
    finally:
        second.release()


def test_a_last_attempt_with_no_time_left_leaves_no_registration(name: str) -> None:
    backend = get_backend("redis")
    from distlocks.backends.base import Holder

    holder = Holder("h", 1, "t")
    waiter = "waiter-owner"
    # An earlier attempt registered as a waiter...
    assert backend.acquire(name, "holder-owner", 30, holder).acquired
    assert not backend.acquire(name, waiter, 30, holder, wait=5.0).acquired
    backend.release(name, "holder-owner")
    # ...and its last attempt, with no time left, wins.
    assert backend.acquire(name, waiter, 30, holder, wait=0.0).acquired
    try:
        keys = backend.all_keys(name)
        assert backend.client.zscore(keys.waiters, waiter) is None
    finally:
        backend.release(name, waiter)
