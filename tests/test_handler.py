from __future__ import annotations

from django.test import override_settings

from distlocks import get_backend
from distlocks.backends.locmem import LocMemBackend
from distlocks.backends.redis import RedisBackend


def test_backends_are_created_once_per_alias() -> None:
    assert get_backend("redis") is get_backend("redis")
    assert get_backend("redis") is not get_backend("default")


def test_setting_change_rebuilds_backends() -> None:
    assert isinstance(get_backend(), RedisBackend)
    before = get_backend()
    config = {"default": {"BACKEND": "distlocks.backends.locmem.LocMemBackend"}}
    with override_settings(DISTLOCKS_BACKENDS=config):
        assert isinstance(get_backend(), LocMemBackend)
    after = get_backend()
    assert isinstance(after, RedisBackend)
    assert after is not before


def test_key_prefix_change_rebuilds_backends() -> None:
    with override_settings(DISTLOCKS_KEY_PREFIX="other"):
        backend = get_backend("redis")
        assert isinstance(backend, RedisBackend)
        assert backend.keys("x")[0] == "other:{x}:lock"
