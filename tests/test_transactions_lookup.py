"""How distlocks.transactions finds the calling thread's Django connections on every
release (the release-at-commit check): the same connections as Django's public
``connections.all(initialized_only=True)``, without a lookup per alias."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connections, transaction

from distlocks import transactions

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite"])


def _in_thread(work: Callable[[], Any]) -> Any:
    result: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    if errors:
        raise errors[0]
    return result[0]


def _public() -> list[Any]:
    return list(connections.all(initialized_only=True))


def test_the_installed_django_keeps_connections_where_the_short_cut_reads_them() -> None:
    # A new Django or asgiref that keeps them elsewhere is still correct (the public
    # lookup is used), but slower on every release: this says it happened.
    assert transactions._sync_storage() is not None


def test_the_same_connections_as_django_s_in_every_state_of_a_thread() -> None:
    def states() -> list[tuple[list[Any], list[Any]]]:
        seen = [(list(transactions._connections()), _public())]
        connections["sqlite"]  # initializes this thread's wrapper
        seen.append((list(transactions._connections()), _public()))
        connections["default"]
        seen.append((list(transactions._connections()), _public()))
        return seen

    seen = _in_thread(states)
    assert [len(ours) for ours, _ in seen] == [0, 1, 2]
    for ours, public in seen:
        assert [id(c) for c in ours] == [id(c) for c in public]


def test_an_atomic_block_on_any_alias_of_the_thread_is_found() -> None:
    def inside() -> tuple[list[str], list[str]]:
        assert transactions.open_transactions() == []
        with transaction.atomic(using="sqlite"):
            found = [c.alias for c in transactions.open_transactions()]
            with transaction.atomic(using="default"):
                both = [c.alias for c in transactions.open_transactions()]
        return found, both

    assert _in_thread(inside) == (["sqlite"], ["default", "sqlite"])


def test_in_an_event_loop_the_public_lookup_is_used() -> None:
    async def inside() -> bool:
        return [id(c) for c in transactions._connections()] == [id(c) for c in _public()]

    assert _in_thread(lambda: asyncio.run(inside()))


def test_the_release_path_looks_up_no_alias_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    connections["default"]
    looked: list[str] = []
    real = type(connections).__getitem__

    def counted(self: Any, alias: str) -> Any:
        looked.append(alias)
        return real(self, alias)

    monkeypatch.setattr(type(connections), "__getitem__", counted)
    for _ in range(3):
        transactions.open_transactions()
    assert looked == []
