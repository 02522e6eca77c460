"""The etcd backend's asyncio path on a real etcd: native (no worker thread, hundreds of
tasks on one loop), a cancelled acquire leaves nothing on the server, a kept-alive
connection that died while idle is replaced transparently, a server that is down or
silent fails fast, loss is loud, a forked child keeps off the parent's connections,
and sync and asyncio callers of the same names agree (a Hypothesis property)."""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distlocks import alock, get_backend, lock
from distlocks.backends.base import BaseBackend
from distlocks.backends.etcd import EtcdBackend, _b64, _prefix_end
from distlocks.exceptions import LockBackendUnavailable, LockLost
from distlocks.locks import current_holder
from distlocks.testing.etcd_server import EtcdServer, etcd_missing
from distlocks.testing.servers import _free_port
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(bool(etcd_missing()), reason=f"no etcd: {etcd_missing()}")

CONFIG = {"BACKEND": "distlocks.backends.etcd.EtcdBackend"}


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.fixture
def etcd(etcd_ready: str) -> EtcdBackend:
    backend = get_backend("etcd")
    assert isinstance(backend, EtcdBackend)
    return backend


@pytest.fixture
def no_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any use of the backends' worker threads fails the test."""

    def refuse(self: BaseBackend, waiting: bool) -> Any:
        raise AssertionError("the asyncio path used a worker thread")

    monkeypatch.setattr(BaseBackend, "_executor", refuse)


@pytest.fixture(scope="module")
def own_etcd() -> Iterator[EtcdServer]:
    """A server of this module's own, to restart or to list every lease of."""
    server = EtcdServer().start()
    yield server
    server.close()


def backend_for(location: str, **options: Any) -> EtcdBackend:
    return EtcdBackend("own", {**CONFIG, "LOCATION": location, "OPTIONS": options})


def leases(backend: EtcdBackend) -> set[int]:
    answer = backend._call("/v3/lease/leases", {}, "test", "")
    return {int(item["ID"]) for item in answer.get("leases") or []}


def keys_under(backend: EtcdBackend, prefix: str) -> list[str]:
    answer = backend._call(
        "/v3/kv/range",
        {"key": _b64(prefix), "range_end": _prefix_end(prefix), "keys_only": True},
        "test",
        "",
    )
    return [base64.b64decode(kv["key"]).decode() for kv in answer.get("kvs") or []]


# -- native --------------------------------------------------------------------------


def _started_since(before: set[int | None]) -> list[str]:
    """Threads started since ``before`` that the etcd asyncio path could have started.

    Not a count of all threads: another test's background threads (a Redis give-back,
    a renewal call thread of another alias) may start or end meanwhile in this process.
    """
    return [
        thread.name
        for thread in threading.enumerate()
        if thread.ident not in before
        and ("etcd" in thread.name or thread.name.startswith(("asyncio", "ThreadPoolExecutor")))
    ]


def test_alock_uses_no_worker_thread(etcd: EtcdBackend, name: str, no_threads: None) -> None:
    before = {thread.ident for thread in threading.enumerate()}

    async def main() -> None:
        async with alock(name, backend="etcd", ttl=10) as first:
            waiter = asyncio.create_task(alock(name, backend="etcd", ttl=10, timeout=20).acquire())
            while etcd.queue(name) == []:
                await asyncio.sleep(0.01)
            await first.extend(20)
            assert _started_since(before) == []
        second = await waiter  # woken by the release, through a watch
        assert second.fencing_token > first.fencing_token
        await second.release()
        lease = await alock(name, backend="etcd", ttl=10, timeout=0.2).acquire()
        assert await lease.release()

    run(main())
    assert _started_since(before) == []
    assert "_quick_executor" not in etcd.__dict__
    assert "_wait_executor" not in etcd.__dict__
    assert etcd.inspect(name) is None and etcd.queue(name) == []


def test_250_tasks_hold_distinct_locks_at_once_on_one_loop(
    etcd: EtcdBackend, name: str, no_threads: None
) -> None:
    count = 250
    inside = 0
    tokens: set[int] = set()

    async def hold(i: int, everyone_in: asyncio.Event) -> None:
        nonlocal inside
        async with alock(f"{name}:{i}", backend="etcd", ttl=20, timeout=30) as lease:
            tokens.add(lease.fencing_token)
            inside += 1
            if inside == count:
                everyone_in.set()
            await asyncio.wait_for(everyone_in.wait(), 40)

    async def main() -> None:
        everyone_in = asyncio.Event()
        await asyncio.gather(*(hold(i, everyone_in) for i in range(count)))
        side = etcd._loops[asyncio.get_running_loop()]
        # Connections are kept alive and bounded: never more than the loop's limit.
        assert 0 < len(side.idle) <= EtcdBackend.ASYNC_CALLS

    run(main())
    assert inside == count and len(tokens) == count
    assert [i for i in etcd.iter_locks() if i.name.startswith(f"{name}:")] == []


# -- cancellation --------------------------------------------------------------------


def test_a_cancelled_waiter_leaves_no_wait_key_and_no_lease(etcd: EtcdBackend, name: str) -> None:
    holder = lock(name, backend="etcd", ttl=30).acquire()

    async def main() -> int:
        task = asyncio.create_task(alock(name, backend="etcd", ttl=30, timeout=30).acquire())
        while not keys_under(etcd, etcd.wait_prefix(name)):
            await asyncio.sleep(0.01)
        answer = etcd._call(
            "/v3/kv/range",
            {"key": _b64(etcd.wait_prefix(name)), "range_end": _prefix_end(etcd.wait_prefix(name))},
            "test",
            name,
        )
        lease = int(answer["kvs"][0]["lease"])
        assert etcd._time_to_live(lease, "test", name)[0] > 0
        await asyncio.sleep(0.05)  # into its watch
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return lease

    lease = run(main())
    wait_for(lambda: etcd.queue(name) == [], what="wait key gone")
    wait_for(lambda: etcd._time_to_live(lease, "test", name)[0] == -1, what="lease revoked")
    assert [key for key in etcd._entries if key[0] == name] == [(name, holder.owner)]
    info = etcd.inspect(name)
    assert info is not None and info.owner == holder.owner and info.waiters == 0
    holder.release()


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(ticks=st.lists(st.integers(0, 40), min_size=4, max_size=4))
def test_an_acquire_cancelled_at_any_point_leaves_nothing(
    own_etcd: EtcdServer, ticks: list[int]
) -> None:
    """Cancelled after any number of loop turns (in the connect, the grant, the
    transaction, or after it), an acquire leaves no lock key, waiter key or lease:
    the lease id is known before the grant is sent."""
    backend = backend_for(own_etcd.location, prefix="cancel")
    holder = current_holder()
    before = leases(backend)

    async def main() -> None:
        blocker = await backend.aacquire("busy", "blocker", 30, holder)
        assert blocker.acquired
        for i, turns in enumerate(ticks):
            target, wait = ("free", 0.0) if i % 2 else ("busy", 10.0)
            task = asyncio.create_task(backend.aacquire(target, f"o{i}", 30, holder, wait=wait))
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            try:
                result = await task
            except asyncio.CancelledError:
                continue
            # Finished before the cancel: give back what it got, as a caller would.
            if result.acquired:
                assert await backend.arelease(target, f"o{i}")
            else:
                await backend.aleave_queue(target, f"o{i}")
        assert await backend.arelease("busy", "blocker")

    run(main())
    wait_for(lambda: leases(backend) == before, what="every lease revoked")
    assert keys_under(backend, "cancel/lock/") == []
    assert keys_under(backend, "cancel/wait/") == []
    assert backend._entries == {}
    backend.close()


# -- connections ---------------------------------------------------------------------


def test_a_connection_that_died_while_idle_is_replaced_transparently(
    own_etcd: EtcdServer,
) -> None:
    backend = backend_for(own_etcd.location, prefix="idle")
    holder = current_holder()

    async def main() -> None:
        assert (await backend.aacquire("n", "o1", 30, holder)).acquired
        side = backend._loops[asyncio.get_running_loop()]
        assert len(side.idle) == 1
        old = side.idle[0]
        # Restarted without letting the loop run: the connection still looks open,
        # so the next request is written to it, and finds it dead.
        own_etcd.kill()
        own_etcd.start()
        assert old.idle_and_open()
        assert await backend.arelease("n", "o1")  # no error: one more try, new connection
        assert side.idle and old not in side.idle
        # And when the loop has seen it close, it is not even tried.
        reused = side.idle[-1]
        own_etcd.kill()
        own_etcd.start()
        await asyncio.sleep(0.1)
        assert (await backend.aacquire("n", "o2", 30, holder)).acquired
        assert reused not in side.idle
        assert await backend.arelease("n", "o2")

    run(main())
    backend.close()


def test_a_server_that_is_down_fails_fast() -> None:
    port = _free_port()  # nothing listens there
    backend = backend_for(f"http://127.0.0.1:{port}")

    async def main() -> None:
        start = time.monotonic()
        with pytest.raises(LockBackendUnavailable) as excinfo:
            await backend.aacquire("x", "o", 5, current_holder())
        assert time.monotonic() - start < 1.0
        assert f"127.0.0.1:{port}" in str(excinfo.value)
        with pytest.raises(LockBackendUnavailable):
            await backend.await_release("x", 5, owner="o")

    run(main())


def test_a_silent_server_fails_within_the_socket_timeout() -> None:
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        location = f"http://127.0.0.1:{silent.getsockname()[1]}"
        backend = backend_for(location, socket_timeout=0.5, connect_timeout=0.5)

        async def main() -> None:
            start = time.monotonic()
            with pytest.raises(LockBackendUnavailable) as excinfo:
                await backend.aacquire("x", "o", 5, current_holder())
            assert time.monotonic() - start < 2.0
            assert "no answer within 0.5 s" in str(excinfo.value)

        run(main())


# -- loss ----------------------------------------------------------------------------


def test_loss_is_loud_in_asyncio(etcd: EtcdBackend, name: str, no_threads: None) -> None:
    async def main() -> None:
        lease = await alock(name, backend="etcd", ttl=30).acquire()
        assert etcd.force_release(name, token=lease.fencing_token)
        with pytest.raises(LockLost):
            await lease.extend()
        assert not lease.held()
        with pytest.raises(LockLost):
            async with alock(name, backend="etcd", ttl=30) as other:
                assert etcd.force_release(name, token=other.fencing_token)
        assert not await lease.release()

    run(main())
    assert etcd.inspect(name) is None


# -- fork ----------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_opens_its_own_asyncio_connections(own_etcd: EtcdServer) -> None:
    backend = backend_for(own_etcd.location, prefix="fork")
    holder = current_holder()
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(backend.aacquire("p", "parent", 30, holder)).acquired
        parents = list(backend._loops[loop].idle)
        assert parents
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 0
            try:
                result = loop.run_until_complete(backend.aacquire("c", "child", 30, holder))
                side = backend._loops[loop]
                fresh = all(conn not in side.idle for conn in parents)
                released = loop.run_until_complete(backend.arelease("c", "child"))
                os.write(write, repr([result.acquired, fresh, released]).encode())
            except BaseException as exc:
                os.write(write, repr(exc).encode())
                code = 3
            os._exit(code)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        text = os.read(read, 1000).decode()
        os.close(read)
        assert os.waitstatus_to_exitcode(status) == 0, text
        assert text == "[True, True, True]"
        # The parent's connection was neither used nor closed by the child.
        assert loop.run_until_complete(backend.arelease("p", "parent"))
        assert backend._loops[loop].idle[-1] is parents[-1]
    finally:
        backend.close()
        loop.close()


# -- sync and asyncio together -------------------------------------------------------

_OPS = st.lists(
    st.tuples(
        st.sampled_from(["sync", "async"]),
        st.sampled_from(["acquire", "release", "extend", "force"]),
        st.integers(0, 2),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=_OPS)
def test_sync_and_asyncio_callers_of_one_name_agree(own_etcd: EtcdServer, ops: list[Any]) -> None:
    """Each step's answer matches a model of one lock: one holder at most, an acquire
    by the holder returns its token again, every new holder's token is above all
    before, release and extend say True only to the holder."""
    backend = backend_for(own_etcd.location, prefix="mixed")
    holder_info = current_holder()
    loop = asyncio.new_event_loop()
    held_by: int | None = None
    token = last = 0
    try:
        for mode, op, who in ops:
            owner = f"o{who}"

            if op == "acquire":
                if mode == "sync":
                    result = backend.acquire("n", owner, 30, holder_info)
                else:
                    result = loop.run_until_complete(backend.aacquire("n", owner, 30, holder_info))
                assert result.acquired == (held_by in (None, who))
                if result.acquired and held_by == who:
                    assert result.fencing_token == token
                elif result.acquired:
                    assert result.fencing_token > last
                    held_by, token = who, result.fencing_token
                    last = token
            elif op == "release":
                if mode == "sync":
                    released = backend.release("n", owner)
                else:
                    released = loop.run_until_complete(backend.arelease("n", owner))
                assert released == (held_by == who)
                if released:
                    held_by = None
            elif op == "extend":
                if mode == "sync":
                    extended = backend.extend("n", owner, 30)
                else:
                    extended = loop.run_until_complete(backend.aextend("n", owner, 30))
                assert extended == (held_by == who)
            else:
                assert backend.force_release("n") == (held_by is not None)
                if held_by is not None:
                    last = max(last, backend.fencing_counter("n"))
                held_by = None
        if held_by is not None:
            assert backend.release("n", f"o{held_by}")
        assert backend.inspect("n") is None
    finally:
        backend.close()
        loop.close()
