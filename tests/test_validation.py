"""Bad input fails at the call with a message that says what to change, and writes nothing."""

from __future__ import annotations

import pytest
import redis
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from distlocks import get_backend, lock, lock_many
from distlocks.validation import MAX_NAME_LENGTH


@pytest.fixture
def no_keys_written(redis_client: redis.Redis):  # type: ignore[no-untyped-def]
    before = set(redis_client.scan_iter(match="distlocks-test:*", count=1000))
    yield
    after = set(redis_client.scan_iter(match="distlocks-test:*", count=1000))
    assert after == before, "rejected input must not write anything"


@pytest.mark.usefixtures("no_keys_written")
class TestBadArguments:
    def test_empty_name(self) -> None:
        with pytest.raises(ValueError, match="must not be empty"):
            lock("")

    @pytest.mark.parametrize("bad", [None, 42, b"bytes", ["x"]])
    def test_non_str_name(self, bad: object) -> None:
        with pytest.raises(TypeError, match="must be a str"):
            lock(bad)  # type: ignore[arg-type]

    def test_over_long_name(self) -> None:
        with pytest.raises(ValueError, match=f"the limit is {MAX_NAME_LENGTH}"):
            lock("x" * (MAX_NAME_LENGTH + 1))
        assert lock("x" * MAX_NAME_LENGTH).name  # the limit itself is fine

    def test_control_characters(self) -> None:
        with pytest.raises(ValueError, match="control characters"):
            lock("a\nb")

    @pytest.mark.parametrize("ttl", [0, -1, -0.5])
    def test_ttl_not_positive(self, ttl: float) -> None:
        with pytest.raises(ValueError, match="ttl must be > 0"):
            lock("x", ttl=ttl)

    @pytest.mark.parametrize("ttl", ["30", True])
    def test_ttl_not_a_number(self, ttl: object) -> None:
        with pytest.raises(TypeError, match="ttl must be a number"):
            lock("x", ttl=ttl)  # type: ignore[arg-type]

    def test_ttl_nan(self) -> None:
        with pytest.raises(ValueError, match="finite"):
            lock("x", ttl=float("nan"))

    def test_negative_timeout(self) -> None:
        with pytest.raises(ValueError, match="timeout must be >= 0"):
            lock("x", timeout=-1)

    def test_negative_timeout_at_acquire(self) -> None:
        with pytest.raises(ValueError, match="timeout must be >= 0"):
            lock("x").acquire(timeout=-1)

    def test_unknown_backend_alias(self) -> None:
        # The aliases are listed (sorted); which ones depends on the servers the session
        # has started so far (etcd's alias appears once its server runs).
        with pytest.raises(ImproperlyConfigured, match=r"'nope'.*defines 'default', .*'locmem'"):
            lock("x", backend="nope")
        with pytest.raises(ImproperlyConfigured, match="Unknown distlocks backend alias"):
            get_backend("nope")

    def test_lock_many_with_a_str(self) -> None:
        with pytest.raises(TypeError, match="list of names"), lock_many("abc"):
            pass

    def test_lock_many_empty(self) -> None:
        with pytest.raises(ValueError, match="at least one name"), lock_many([]):
            pass


def test_extend_with_bad_ttl_keeps_the_lease(name: str) -> None:
    lease = lock(name, ttl=10).acquire()
    try:
        with pytest.raises(ValueError, match="ttl must be > 0"):
            lease.extend(0)
        assert lease.held() and lease.ttl == 10
    finally:
        lease.release()


class TestMalformedSettings:
    def test_backends_missing(self) -> None:
        with override_settings(), pytest.raises(ImproperlyConfigured, match="is not set"):
            from django.conf import settings

            del settings.DISTLOCKS_BACKENDS
            lock("x")

    def test_backends_not_a_dict(self) -> None:
        with override_settings(DISTLOCKS_BACKENDS=["redis://"]):
            with pytest.raises(ImproperlyConfigured, match="must be a dict"):
                lock("x")

    def test_entry_without_backend(self) -> None:
        with override_settings(DISTLOCKS_BACKENDS={"default": {"LOCATION": "redis://x"}}):
            with pytest.raises(ImproperlyConfigured, match="has no 'BACKEND'"):
                get_backend()

    def test_backend_not_importable(self) -> None:
        with override_settings(DISTLOCKS_BACKENDS={"default": {"BACKEND": "nope.Nope"}}):
            with pytest.raises(ImproperlyConfigured, match="could not be imported"):
                get_backend()

    def test_backend_not_a_backend(self) -> None:
        with override_settings(DISTLOCKS_BACKENDS={"default": {"BACKEND": "os.path.join"}}):
            with pytest.raises(ImproperlyConfigured, match="not a subclass"):
                get_backend()

    @pytest.mark.parametrize(
        ("config", "message"),
        [
            ({}, "exactly one of LOCATION"),
            ({"LOCATION": "redis://a", "CACHE": "redis"}, "exactly one of LOCATION"),
            ({"LOCATION": "http://127.0.0.1"}, "must start with redis://"),
            ({"CACHE": "missing"}, "not an alias defined in CACHES"),
            ({"CACHE": "default"}, "must be a django-redis cache"),
            ({"LOCATION": "redis://a", "OPTIONS": {"socket_timeout": 0}}, "socket_timeout"),
            ({"LOCATION": "redis://a", "OPTIONS": {"key_prefix": "a{b"}}, "without braces"),
            ({"LOCATION": "redis://a", "OPTIONS": []}, "OPTIONS must be a dict"),
            ({"LOCATION": "redis://a", "TYPO": 1}, "unknown key"),
        ],
    )
    def test_redis_config(self, config: dict[str, object], message: str) -> None:
        entry = {"BACKEND": "distlocks.backends.redis.RedisBackend", **config}
        with override_settings(DISTLOCKS_BACKENDS={"default": entry}):
            with pytest.raises(ImproperlyConfigured, match=message):
                get_backend()
