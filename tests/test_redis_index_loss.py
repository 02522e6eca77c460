"""The Redis listing index lost while its marker stays: found out, rebuilt, said.

The index hash (``{prefix}:listing``) can go away on its own: a ``DEL``, a
``FLUSHDB`` of one key by an operator, or eviction under an ``allkeys-*`` policy,
while the ``built`` marker and the locks stay. Before, the live-locks page then showed
0 of the locks held, with no error. Now the index carries its own epoch (a field
inside the hash, so a lost hash loses it too; a member of the permits set likewise):
a listing that finds it missing, or changed between two of its chunks, lists the
locks by a walk over the keys (rebuilding the index on the way) and says so.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from distlocks import livelocks
from distlocks.backends.base import SEMAPHORE
from distlocks.backends.redis import RedisBackend
from tests import test_redis_index
from tests.test_redis_index import LONG, holder, listed

#: ``indexed`` (the listing index on) and ``scanned`` (off) on a prefix of their own.
pair = test_redis_index.pair


def _until_a_lock(items: Any) -> list[Any]:
    """What ``items`` yields up to its first lock summary (a note may come first)."""
    taken = []
    for item in items:
        taken.append(item)
        if type(item) is tuple:
            return taken
    raise AssertionError("no lock listed")


def _names(items: list[Any]) -> list[str]:
    return sorted(item[0] for item in items if type(item) is tuple)


def test_a_lost_index_hash_is_found_out(pair: tuple[RedisBackend, RedisBackend]) -> None:
    """The issue's case: 4 locks held, the index hash deleted, the marker kept."""
    indexed, _ = pair
    for name in ["a", "b", "c", "d"]:
        assert indexed.acquire(name, f"o-{name}", LONG, holder()).acquired
    assert [n for n, *_ in listed("indexed")] == ["a", "b", "c", "d"]
    indexed.client.delete(indexed.index_key)
    assert indexed.client.exists(indexed.index_marker_key)
    snapshot = livelocks.collect(["indexed"])
    assert sorted(item.name for item in snapshot.locks) == ["a", "b", "c", "d"]
    assert not snapshot.errors
    (note,) = snapshot.notes["indexed"]
    assert "listing index" in note and "rebuilt" in note
    # Rebuilt: the next listing reads it again, and has nothing to say.
    assert indexed.client.hlen(indexed.index_key) == 5  # four entries and the epoch
    again = livelocks.collect(["indexed"])
    assert sorted(item.name for item in again.locks) == ["a", "b", "c", "d"]
    assert not again.notes


def test_a_lost_permits_set_is_found_out(pair: tuple[RedisBackend, RedisBackend]) -> None:
    indexed, _ = pair
    assert indexed.permit_acquire(SEMAPHORE, "s", "p1", LONG, holder(), limit=2).acquired
    listed("indexed")
    indexed.client.delete(indexed.index_permits_key)
    # A grant after the loss brings the set back, with its own member only.
    assert indexed.permit_acquire(SEMAPHORE, "t", "p2", LONG, holder(), limit=2).acquired
    snapshot = livelocks.collect(["indexed"])
    assert sorted((i.name, i.info.owner) for i in snapshot.locks) == [("s", "p1"), ("t", "p2")]
    assert snapshot.notes["indexed"]
    assert listed("indexed") == listed("scanned")


@pytest.mark.parametrize("comes_back", [False, True])
def test_the_index_lost_between_two_chunks(
    pair: tuple[RedisBackend, RedisBackend], comes_back: bool
) -> None:
    """The hash deleted while a listing is between two of its HSCAN chunks (and, or
    not, made again by an acquire before the next chunk): every lock is still listed
    once, and the listing says what happened."""
    indexed, _ = pair
    indexed.INDEX_CHUNK = 20  # many chunks (the hash is past its compact encoding)
    names = [f"n{i:03d}" for i in range(300)]
    for name in names:
        assert indexed.acquire(name, f"o-{name}", LONG, holder()).acquired
    listed("indexed")  # built
    items = indexed.iter_lock_summaries()
    first = _until_a_lock(items)
    indexed.client.delete(indexed.index_key)
    if comes_back:
        assert indexed.acquire("late", "o-late", LONG, holder()).acquired
    rest = list(items)
    got = _names(first + rest)
    expected = sorted(names + (["late"] if comes_back else []))
    assert len(got) == len(set(got)), "no lock listed twice"
    assert set(got) >= set(names) and set(got) <= set(expected)
    notes = [item for item in rest if type(item) is str]
    assert len(notes) == 1 and "changed during the listing" in notes[0], notes
    # The index was rebuilt on the way: the next listing reads it whole.
    snapshot = livelocks.collect(["indexed"])
    assert sorted(item.name for item in snapshot.locks) == expected
    assert not snapshot.notes


def test_a_rebuild_that_loses_its_index_again_still_lists_every_lock(
    pair: tuple[RedisBackend, RedisBackend],
) -> None:
    """The hash deleted again while the rebuild walks the keys: the rebuild cannot
    finish (its epoch is gone), the listing is whole all the same (it read the keys),
    and the next listing rebuilds."""
    indexed, _ = pair
    indexed.SCAN_COUNT = 50
    names = [f"r{i:03d}" for i in range(200)]
    for name in names:
        assert indexed.acquire(name, f"o-{name}", LONG, holder()).acquired
    indexed.client.delete(indexed.index_marker_key)
    items = indexed.iter_lock_summaries()
    first = _until_a_lock(items)
    indexed.client.delete(indexed.index_key)
    rest = list(items)
    assert _names(first + rest) == names
    notes = [item for item in first + rest if type(item) is str]
    assert notes and "could not be finished" in notes[-1], notes
    assert not indexed.client.exists(indexed.index_marker_key)
    snapshot = livelocks.collect(["indexed"])
    assert sorted(item.name for item in snapshot.locks) == names
    # Nothing of the index was left to tell a loss from a first build: rebuilt quietly.
    assert indexed.client.exists(indexed.index_marker_key)
    assert not livelocks.collect(["indexed"]).notes


def test_rebuild_listing_index_sets_the_epoch(pair: tuple[RedisBackend, RedisBackend]) -> None:
    indexed, _ = pair
    assert indexed.acquire("a", "me", LONG, holder()).acquired
    indexed.rebuild_listing_index()
    epoch = indexed.client.hget(indexed.index_key, indexed.INDEX_EPOCH_FIELD)
    assert epoch and not epoch.startswith(b"~")
    members = indexed.client.smembers(indexed.index_permits_key)
    assert indexed.INDEX_EPOCH_FIELD.encode() + b":" + epoch in members
    assert indexed.client.exists(indexed.index_marker_key)
    assert uuid.UUID(epoch.decode())


@pytest.mark.django_db
def test_the_live_locks_page_says_the_index_was_lost(
    pair: tuple[RedisBackend, RedisBackend], admin_client: Any
) -> None:
    """The page lists the locks of a lost index, and says what happened to it."""
    indexed, _ = pair
    for name in ["a", "b", "c", "d"]:
        assert indexed.acquire(name, f"o-{name}", LONG, holder()).acquired
    listed("indexed")
    indexed.client.delete(indexed.index_key)
    livelocks.snapshots.clear()
    page = admin_client.get("/admin/distlocks/livelock/", {"backend": "indexed", "refresh": 1})
    text = page.content.decode()
    assert page.status_code == 200
    assert all(f"o-{name}" in text or f">{name}<" in text for name in "abcd")
    assert "The listing index of backend" in text and "rebuilt the index" in text
    livelocks.snapshots.clear()
    again = admin_client.get("/admin/distlocks/livelock/", {"backend": "indexed", "refresh": 1})
    assert "The listing index of backend" not in again.content.decode()


def test_the_list_command_says_the_index_was_lost(
    pair: tuple[RedisBackend, RedisBackend],
) -> None:
    import io

    from django.core.management import call_command

    indexed, _ = pair
    assert indexed.acquire("a", "o-a", LONG, holder()).acquired
    listed("indexed")
    indexed.client.delete(indexed.index_key)
    out, err = io.StringIO(), io.StringIO()
    call_command("distlocks", "list", "--backend", "indexed", stdout=out, stderr=err)
    assert "\na     lock  indexed" in out.getvalue()
    assert "The listing index of backend 'indexed'" in err.getvalue()
