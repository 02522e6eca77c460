"""What the Redis Cluster and Sentinel test modules share: a representative part of
the contract suite, collected again in each of them, and the fixtures that point it
at their alias.

A module that does ``from tests.redis_contract import *`` and defines a
``topology_alias`` fixture runs these tests on that alias.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.conf import settings
from django.test import override_settings

from distlocks import get_backend
from distlocks.backends.redis import RedisBackend
from tests.test_alock import (
    test_async_with_holds_and_releases,
    test_fair_async_waiters,
    test_tasks_exclude_each_other,
    test_waiting_does_not_block_the_event_loop,
)
from tests.test_lifecycle import (
    test_a_fair_waiter_that_gives_up_does_not_block_the_next,
    test_every_release_wakes_a_waiter,
    test_fair_waiters_are_served_in_arrival_order,
)
from tests.test_locks import (
    test_acquire_is_retry_safe_for_the_same_owner,
    test_extend_pushes_expiry,
    test_fencing_tokens_increase_across_force_release,
    test_inspect_records_the_holder,
    test_lock_many_takes_all,
    test_release_is_idempotent,
    test_second_holder_is_refused_while_held,
    test_waiter_gets_the_lock_after_release,
    test_with_block_holds_then_releases,
)

__all__ = [
    "alias",
    "shared_alias",
    "test_a_fair_waiter_that_gives_up_does_not_block_the_next",
    "test_acquire_is_retry_safe_for_the_same_owner",
    "test_async_with_holds_and_releases",
    "test_every_release_wakes_a_waiter",
    "test_extend_pushes_expiry",
    "test_fair_async_waiters",
    "test_fair_waiters_are_served_in_arrival_order",
    "test_fencing_tokens_increase_across_force_release",
    "test_inspect_records_the_holder",
    "test_lock_many_takes_all",
    "test_release_is_idempotent",
    "test_second_holder_is_refused_while_held",
    "test_tasks_exclude_each_other",
    "test_waiter_gets_the_lock_after_release",
    "test_waiting_does_not_block_the_event_loop",
    "test_with_block_holds_then_releases",
    "waking_alias",
]

BACKEND = "distlocks.backends.redis.RedisBackend"


@contextmanager
def redis_alias(alias: str, location: str) -> Iterator[str]:
    """``alias``, a RedisBackend at ``location``, added to the settings meanwhile."""
    config = {**settings.DISTLOCKS_BACKENDS, alias: {"BACKEND": BACKEND, "LOCATION": location}}
    with override_settings(DISTLOCKS_BACKENDS=config):
        yield alias


def redis_backend(alias: str) -> RedisBackend:
    backend = get_backend(alias)
    assert isinstance(backend, RedisBackend)
    return backend


# The contract tests above take their backend from these.
@pytest.fixture
def alias(topology_alias: str) -> str:
    return topology_alias


@pytest.fixture
def shared_alias(topology_alias: str) -> str:
    return topology_alias


@pytest.fixture
def waking_alias(topology_alias: str) -> str:
    return topology_alias
