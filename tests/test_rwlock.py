"""rwlock(): many readers or one fenced writer; a waiting writer is not starved."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from distlocks import arwlock, get_backend, lock, rwlock
from distlocks.exceptions import LockLost, LockNotAcquired
from distlocks.lease import AsyncLease, Lease
from tests import workers
from tests.conftest import PERMIT_BACKENDS, alias_fixture
from tests.test_semaphore import most_at_once, run_forked
from tests.waiting import wait_for

alias = alias_fixture("alias", PERMIT_BACKENDS, "Each backend with read-write locks in turn.")
shared_alias = alias_fixture(
    "shared_alias",
    [a for a in PERMIT_BACKENDS if a != "locmem"],
    "Each backend whose read-write locks processes share.",
)


# -- code run in worker processes ------------------------------------------------------


def read_or_write(
    alias: str, name: str, kind: str, rounds: int, hold: float, out: str, start: Any
) -> None:
    """Take the read or the write side ``rounds`` times; record when it was held."""
    workers.setup_django()
    from distlocks import rwlock

    start.wait(120)
    spans = []
    for _ in range(rounds):
        side = rwlock(name, backend=alias)
        with getattr(side, kind)(ttl=10, timeout=120) as lease:
            entered = time.monotonic()
            time.sleep(hold)  # the work done under the lease
            spans.append((kind, entered, time.monotonic(), lease.fencing_token))
    Path(out).write_text(json.dumps(spans))


# -- the contract, on every backend -------------------------------------------------------


def test_readers_share_it(alias: str, name: str) -> None:
    rw = rwlock(name, backend=alias)
    first = rw.read(ttl=10).acquire()
    second = rw.read(ttl=10, timeout=0).acquire()
    try:
        # Both held at the same moment, confirmed by the server.
        assert first.held() and second.held()
        kinds = sorted((h.owner, h.extra["kind"]) for h in rw.holders())
        assert kinds == sorted([(first.owner, "read"), (second.owner, "read")])
        assert first.kind == second.kind == "read"
        assert first.fencing_token == second.fencing_token == 0
    finally:
        first.release()
        second.release()
    assert rw.holders() == []


def test_a_writer_excludes_readers_and_writers(alias: str, name: str) -> None:
    rw = rwlock(name, backend=alias)
    with rw.write(ttl=10) as writer:
        assert isinstance(writer, Lease) and writer.kind == "write"
        with pytest.raises(LockNotAcquired, match="tried once"):
            rw.read(timeout=0).acquire()
        with pytest.raises(LockNotAcquired, match="tried once"):
            rw.write(timeout=0).acquire()
        [info] = rw.holders()
        assert info.owner == writer.owner and info.extra["kind"] == "write"
        assert info.fencing_token == writer.fencing_token
    with rw.read(ttl=10):
        with pytest.raises(LockNotAcquired, match="readers or a writer held it"):
            rw.write(timeout=0).acquire()


def test_timeouts(alias: str, name: str) -> None:
    rw = rwlock(name, backend=alias)
    with rw.write(ttl=10):
        start = time.monotonic()
        with pytest.raises(LockNotAcquired, match=r"throughout the 0\.3s wait"):
            rw.read(timeout=0.3).acquire()
        assert time.monotonic() - start >= 0.3
    # The reader that gave up left nothing behind: a writer gets straight in.
    with rw.read(ttl=10):
        with pytest.raises(LockNotAcquired):
            rw.write(timeout=0.3).acquire()
        # ...and the writer that gave up does not hold up new readers.
        with rw.read(ttl=10, timeout=0):
            pass
    with rw.write(ttl=10, timeout=0):
        pass


def test_write_tokens_strictly_increase(alias: str, name: str) -> None:
    rw = rwlock(name, backend=alias)
    backend = get_backend(alias)
    tokens = []
    for i in range(4):
        with rw.write(ttl=10) as lease:
            tokens.append(lease.fencing_token)
            assert rw.fencing_counter() == lease.fencing_token
        if i == 1:
            backend.permit_force_release("write", name)  # moves the counter on too
        with rw.read(ttl=10) as reader:
            assert reader.fencing_token == 0
    assert tokens == sorted(set(tokens)) and tokens[0] > 0
    assert tokens[2] > tokens[1] + 1  # the force release used a token up
    # A plain lock of the same name is another lock, with its own tokens.
    with lock(name, backend=alias, ttl=10, timeout=0):
        with rw.write(ttl=10, timeout=0):
            pass


def test_a_waiting_writer_is_not_starved_by_arriving_readers(alias: str, name: str) -> None:
    rw = rwlock(name, backend=alias)
    first_reader = rw.read(ttl=10).acquire()
    order: list[str] = []  # who got in, in order, after the first reader

    def enter(kind: str) -> None:
        with getattr(rw, kind)(ttl=10, timeout=60):
            order.append(kind)

    writer = threading.Thread(target=enter, args=("write",))
    writer.start()
    late = [threading.Thread(target=enter, args=("read",)) for _ in range(3)]
    try:
        wait_for(lambda: any((h.waiters or 0) >= 1 for h in rw.holders()), 30, "the writer")
        # Readers keep arriving while it waits: none gets past it, though only
        # readers hold the lock (without that rule they would all get in at once).
        for _ in range(5):
            with pytest.raises(LockNotAcquired, match="writer held it or was waiting"):
                rw.read(timeout=0).acquire()
        for reader in late:
            reader.start()
        assert order == []
        first_reader.release()
        for thread in (writer, *late):
            thread.join(60)
        assert order == ["write", "read", "read", "read"]
    finally:
        first_reader.release()
        for thread in (writer, *late):
            if thread.is_alive():
                thread.join(60)


def test_release_gives_back_only_ones_own_lease(alias: str, name: str) -> None:
    rw = rwlock(name, backend=alias)
    mine, theirs = rw.read(ttl=10).acquire(), rw.read(ttl=10).acquire()
    try:
        assert mine.release() is True
        assert mine.release() is False
        assert [h.owner for h in rw.holders()] == [theirs.owner]
        # A read lease's owner cannot release anything as a writer.
        assert get_backend(alias).permit_release("write", name, theirs.owner) is False
        assert [h.owner for h in rw.holders()] == [theirs.owner]
    finally:
        theirs.release()


def test_an_evicted_writer_is_loud(alias: str, name: str) -> None:
    rw = rwlock(name, backend=alias)
    with pytest.raises(LockLost):
        with rw.write(ttl=10) as lease:
            [info] = rw.holders()
            assert get_backend(alias).force_release_holder(info) is True
            with pytest.raises(LockLost):
                lease.extend()
    assert rw.fencing_counter() > lease.fencing_token


def test_listed_by_iter_locks(alias: str, name: str) -> None:
    backend = get_backend(alias)
    rw = rwlock(name, backend=alias)
    with rw.read(ttl=10) as one, rw.read(ttl=10) as two:
        listed = {i.owner: i for i in backend.iter_locks() if i.name == name}
        assert set(listed) == {one.owner, two.owner}
        assert {i.extra["kind"] for i in listed.values()} == {"read"}
        assert all(i.fencing_token == 0 for i in listed.values())
    with rw.write(ttl=10) as writer:
        listed = {i.owner: i for i in backend.iter_locks() if i.name == name}
        assert set(listed) == {writer.owner}
        assert listed[writer.owner].extra["kind"] == "write"
        assert listed[writer.owner].fencing_token == writer.fencing_token
        assert backend.inspect(name) is None  # no plain lock of that name


def test_decorators_and_explicit_forms(alias: str, name: str) -> None:
    rw = rwlock(name, backend=alias)
    inside: list[str] = []
    most = 0
    guard = threading.Lock()

    def enter(kind: str) -> None:
        nonlocal most
        with guard:
            inside.append(kind)
            most = max(most, len(inside))
            assert "write" not in inside or len(inside) == 1
        time.sleep(0.01)
        with guard:
            inside.remove(kind)

    @rw.read(ttl=10, timeout=30)
    def read() -> None:
        enter("read")

    @rw.write(ttl=10, timeout=30)
    def write() -> None:
        enter("write")

    errors: list[BaseException] = []

    def run(func: Any) -> None:
        try:
            for _ in range(3):
                func()
        except BaseException as exc:  # an assertion in a thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(f,)) for f in (read, read, read, write)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert most >= 1


def test_asyncio_form(alias: str, name: str) -> None:
    async def main() -> None:
        rw = arwlock(name, backend=alias)
        async with rw.read(ttl=10) as one, rw.read(ttl=10, timeout=0) as two:
            assert isinstance(one, AsyncLease) and one.held() and two.held()
            with pytest.raises(LockNotAcquired):
                await rw.write(timeout=0).acquire()
        async with rw.write(ttl=10, timeout=5) as writer:
            assert writer.fencing_token > 0
            with pytest.raises(LockNotAcquired):
                await rw.read(timeout=0.2).acquire()

        @rw.write(ttl=10, timeout=30)
        async def bump() -> int:
            await asyncio.sleep(0)
            return 1

        assert sum(await asyncio.gather(*(bump() for _ in range(4)))) == 4

    asyncio.run(asyncio.wait_for(main(), 60))


def test_bad_arguments_are_refused_at_the_call() -> None:
    with pytest.raises(TypeError, match="name must be a str"):
        rwlock(42, backend="locmem")  # type: ignore[arg-type]
    with pytest.raises(ImproperlyConfigured, match="Unknown distlocks backend alias"):
        rwlock("x", backend="nope")
    with pytest.raises(ValueError, match="ttl"):
        rwlock("x", backend="locmem").read(ttl=-1)
    with pytest.raises(TypeError, match="timeout"):
        rwlock("x", backend="locmem").write(timeout="soon")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="arwlock"):

        @rwlock("x", backend="locmem").write()
        async def not_for_sync() -> None: ...


# -- between processes -------------------------------------------------------------------


@pytest.mark.slow
def test_writers_never_overlap_anyone(shared_alias: str, name: str, tmp_path: Path) -> None:
    kinds = ["write", "write", "read", "read", "read", "read"]
    outs = [tmp_path / f"spans-{i}.json" for i in range(len(kinds))]
    run_forked(
        read_or_write,
        [
            (shared_alias, name, kind, 4, 0.03, str(out))
            for kind, out in zip(kinds, outs, strict=True)
        ],
    )
    spans = [tuple(span) for out in outs for span in json.loads(out.read_text())]
    writes = [(s, e) for kind, s, e, _ in spans if kind == "write"]
    reads = [(s, e) for kind, s, e, _ in spans if kind == "read"]
    assert len(writes) == 8 and len(reads) == 16
    for start_w, end_w in writes:
        others = [(s, e) for s, e in writes + reads if (s, e) != (start_w, end_w)]
        assert not [(s, e) for s, e in others if s < end_w and start_w < e], "a writer overlapped"
    # Readers did share it (so the check above could have failed).
    assert most_at_once(reads) >= 2
    # Write tokens increase in the order the writes happened.
    tokens = [token for _, _, token in sorted((s, e, t) for k, s, e, t in spans if k == "write")]
    assert tokens == sorted(set(tokens))
