"""Attacks on three shortcuts of issue 29 (review 3): the argument checks of lock() and
alock() passed by two comparisons, alock()'s one renewer per event loop (a heap and one
loop timer), and the Redis listing index's sweep from a cursor kept on the server.

Each test states the guarantee the shortcut must keep; the in-process backend where
the layer above every backend is tested, a real Redis server for the scripts."""

from __future__ import annotations

import asyncio
import contextlib
import decimal
import fractions
import math
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from hypothesis import given, settings
from hypothesis import strategies as st

from distlocks import alock, lock
from distlocks.backends.base import Holder
from distlocks.backends.redis import RedisBackend
from distlocks.backends.redis.scripts import INDEX_SWEEP_EVERY
from distlocks.renewal import loop_renewer
from distlocks.validation import validate_timeout, validate_ttl

ALIAS = "locmem"


# -- (a) the argument shortcuts -----------------------------------------------------


class _Floaty:
    """A number-like object (as numpy's scalars are to the stdlib): __float__ and
    __index__, yet neither an int nor a float."""

    def __float__(self) -> float:
        return 30.0

    def __index__(self) -> int:
        return 30


class _LyingInt(int):
    """An int subclass whose comparisons say it is always in range."""

    def __le__(self, other: object) -> bool:
        return True

    def __ge__(self, other: object) -> bool:
        return True


class _LyingFloat(float):
    def __le__(self, other: object) -> bool:
        return True

    def __ge__(self, other: object) -> bool:
        return True


def _numpy_values() -> list[Any]:
    try:
        import numpy
    except ImportError:  # numpy is no dependency: its scalars are tried where present
        return []
    return [numpy.float64(30.0), numpy.float32(0.5), numpy.int64(30), numpy.bool_(True),
            numpy.float64("nan")]  # fmt: skip


_ODD = [
    decimal.Decimal("30"), decimal.Decimal("NaN"), fractions.Fraction(1, 2), _Floaty(),
    _LyingInt(-5), _LyingInt(10**12), _LyingFloat(-1.0), _LyingFloat(math.nan), -0.0, 0.0,
    1e308, -1e308, 5e-324, 10**400, -(10**400), 2**53 + 1, "30", "", None, True, False,
    math.inf, -math.inf, math.nan, 0.01, 0.009999999999999998, 365 * 86400,
    365 * 86400 + 1e-9, [30], (30,), b"30",
]  # fmt: skip
_VALUES = st.one_of(
    st.sampled_from(_ODD + _numpy_values()),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(),
)


def _verdict(func: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    try:
        value = func(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        return (type(exc), str(exc))
    return ("ok", type(value), repr(value))


def _lock_field(field: str, **kwargs: Any) -> tuple[Any, ...]:
    try:
        built = lock("review3:args", backend=ALIAS, **kwargs)
    except (TypeError, ValueError) as exc:
        return (type(exc), str(exc))
    value = {"ttl": built._ttl, "timeout": built._timeout, "max_hold": built.max_hold}[field]
    return ("ok", type(value), repr(value))


@settings(max_examples=400, deadline=None)
@given(_VALUES)
def test_every_number_gets_the_full_checks_verdict(value: Any) -> None:
    """lock(ttl=, timeout=, max_hold=), alock()'s and acquire(timeout=)'s shortcuts give
    each value exactly what validate_ttl()/validate_timeout() give: the same float (its
    sign too), or the same error and message."""
    ttl = ("ok", type(None), "None") if value is None else _verdict(validate_ttl, value)
    hold = (
        ("ok", type(None), "None") if value is None else _verdict(validate_ttl, value, "max_hold")
    )
    timeout = _verdict(validate_timeout, value)
    assert _lock_field("ttl", ttl=value) == ttl
    assert _lock_field("max_hold", max_hold=value) == hold
    assert _lock_field("timeout", timeout=value) == timeout
    try:
        alock("review3:args", backend=ALIAS, ttl=value)
        got: tuple[Any, ...] = ("ok",)
    except (TypeError, ValueError) as exc:
        got = (type(exc), str(exc))
    assert got[0] == ttl[0] and got[1:] == (ttl[1:] if got[0] != "ok" else ())
    # acquire(timeout=...) of an existing lock: its shortcut is checked before any I/O.
    from distlocks.locks import _timeout_arg

    assert _verdict(_timeout_arg, value) == timeout


@pytest.mark.parametrize(("typo", "meant"), [("defualt", "default"), ("locmme", "locmem")])
def test_a_misspelt_backend_alias_says_which_was_meant(typo: str, meant: str) -> None:
    for build in (lock, alock):
        with pytest.raises(ImproperlyConfigured, match=rf"did you mean '{meant}'\?"):
            build("review3:alias", backend=typo)


def test_a_backend_object_is_refused_with_what_to_pass() -> None:
    from distlocks import get_backend

    with pytest.raises(TypeError, match="backend must be an alias string"):
        lock("review3:alias", backend=get_backend(ALIAS))  # type: ignore[arg-type]


# -- (b) one renewer per event loop -------------------------------------------------


def _pending_timers(loop: asyncio.AbstractEventLoop, renewer: Any) -> int:
    """Timers of ``renewer`` still to fire on ``loop`` (asyncio's own loop keeps them in
    ``_scheduled``)."""
    scheduled = getattr(loop, "_scheduled", None)
    if scheduled is None:
        pytest.skip("this event loop does not show its timers")
    return sum(
        1
        for handle in scheduled
        if not handle.cancelled() and getattr(handle._callback, "__self__", None) is renewer
    )


def test_one_loop_keeps_one_renewal_timer_however_its_leases_mix() -> None:
    """Leases of different ttls on one loop: every renewal of the short one re-adds it
    ahead of the long one. The loop must still hold one timer of the renewer, not one
    more per turn (they piled up until the long lease's turn: thousands for a lease of an
    hour beside one of a second, each firing for nothing)."""

    async def main() -> tuple[int, int, bool]:
        loop = asyncio.get_running_loop()
        most = 0
        async with alock("review3:long", backend=ALIAS, ttl=60, timeout=0):
            async with alock("review3:short", backend=ALIAS, ttl=1, timeout=0) as short:
                renewer = loop_renewer(loop)
                deadline = loop.time() + 60
                while short.renewals < 6 and short.held() and loop.time() < deadline:
                    most = max(most, _pending_timers(loop, renewer))
                    await asyncio.sleep(0.01)
                return most, short.renewals, short.held()

    most, renewals, held = asyncio.run(main())
    assert held and renewals >= 6
    assert most <= 1, f"{most} renewal timers pending on one loop"


def test_an_async_lease_dropped_while_held_is_released_not_renewed_for_ever(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An alock() lease its holder dropped without release() is released at its next
    renewal turn, as lock()'s renewer does: the loop's renewer kept it alive and renewed
    it for as long as the loop ran, so nobody else could ever take the lock."""
    import gc

    async def main() -> bool:
        # A 3 s lease, not 0.6 s: the renewer's turn (a third of the ttl in) must come
        # before the lease runs out, or the next acquire takes the lock by expiry and
        # returns before the renewer ever looks (a busy machine delayed it past 0.6 s).
        await alock("review3:dropped", backend=ALIAS, ttl=3, timeout=0).acquire()
        gc.collect()  # the lease is dropped: nothing refers to it but the renewer
        # Several ttls: a lease renewed for ever keeps the lock past them all.
        again = await alock("review3:dropped", backend=ALIAS, ttl=30, timeout=20).acquire()
        try:
            return again.held()
        finally:
            await again.release()

    with caplog.at_level("WARNING", logger="distlocks"):
        assert asyncio.run(main())
    assert "dropped without release()" in caplog.text


def test_loops_in_threads_and_in_turn_each_renew_their_own_leases() -> None:
    """Four threads, each running two event loops one after the other (asyncio.run()
    twice), each loop with a short and a long lease: every short lease is renewed
    while held, each loop keeps at most one timer of its renewer, and every lease is
    released at the end."""
    import threading

    results: list[tuple[int, bool, int]] = []
    errors: list[BaseException] = []

    async def one(tag: str) -> tuple[int, bool, int]:
        loop = asyncio.get_running_loop()
        most = 0
        async with alock(f"review3:{tag}:long", backend=ALIAS, ttl=60, timeout=0):
            async with alock(f"review3:{tag}:short", backend=ALIAS, ttl=1, timeout=0) as short:
                renewer = loop_renewer(loop)
                deadline = loop.time() + 60
                while short.renewals < 3 and short.held() and loop.time() < deadline:
                    most = max(most, _pending_timers(loop, renewer))
                    await asyncio.sleep(0.01)
                return short.renewals, short.held(), most

    def thread(i: int) -> None:
        try:
            for run in range(2):
                results.append(asyncio.run(one(f"t{i}:{run}")))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=thread, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(results) == 8
    assert all(renewals >= 3 and held and most <= 1 for renewals, held, most in results)


def test_an_async_renewal_that_cannot_reach_the_server_reports_the_loss(
    own_redis: Any, settings: Any
) -> None:
    """The server goes away under a held alock() lease: its renewals fail, are retried
    while the lease lasts, and then the loss is reported once, by the lock_lost signal,
    the on_lost callback and LockLost at the block's end, with the renewal's error in
    its reason (as with a renewal task per lease)."""
    from distlocks import signals
    from distlocks.exceptions import LockLost

    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "down": {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": own_redis.url,
            "OPTIONS": {"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
        },
    }
    reasons: list[str] = []
    called: list[Any] = []

    def on_signal(sender: Any, lease: Any, reason: str, **kwargs: Any) -> None:
        reasons.append(reason)

    async def main() -> None:
        lost = asyncio.Event()

        def on_lost(lease: Any) -> None:
            called.append(lease)
            lost.set()

        async with alock("review3:down", backend="down", ttl=1.5, on_lost=on_lost) as lease:
            own_redis.kill()
            await asyncio.wait_for(lost.wait(), 60)
            assert not lease.held() and lease.renewals == 0

    signals.lock_lost.connect(on_signal)
    try:
        with pytest.raises(LockLost, match="last renewal error"):
            asyncio.run(main())
    finally:
        signals.lock_lost.disconnect(on_signal)
    assert len(reasons) == 1 and len(called) == 1, (reasons, called)
    assert "ran out without being renewed" in reasons[0]
    assert "last renewal error" in reasons[0]


def test_a_task_cancelled_while_holding_frees_the_lock_and_its_renewal() -> None:
    """Cancelling the task inside its alock() block releases the lease on the way out;
    the renewer holds nothing of it afterwards (no renewal turn ever runs for it), and
    the lock can be taken at once."""

    async def main() -> tuple[bool, int, bool]:
        inside = asyncio.Event()
        seen: list[Any] = []

        async def holder() -> None:
            async with alock("review3:cancelled", backend=ALIAS, ttl=1, timeout=0) as lease:
                seen.append(lease)
                inside.set()
                await asyncio.Event().wait()  # until cancelled

        task = asyncio.create_task(holder())
        await asyncio.wait_for(inside.wait(), 30)
        lease = seen[0]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while lease.renewals < 2 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        again = await alock("review3:cancelled", backend=ALIAS, ttl=30, timeout=0).acquire()
        await again.release()
        renewer = loop_renewer(loop)
        live = [e for e in renewer._heap if e[2]() is lease and not e[3][3]["ended"]]
        return lease.state == "released", len(live), lease._renew_task is None

    released, live, idle = asyncio.run(main())
    assert released and live == 0 and idle


# -- (c) the Redis listing index's sweep --------------------------------------------

HOLDER = Holder("host", 1, "thread")


@pytest.fixture
def sweep_backend() -> Iterator[RedisBackend]:
    prefix = f"review3-{uuid.uuid4().hex[:8]}"
    backend = RedisBackend(
        "review3", {"LOCATION": django_settings.REDIS_URL, "OPTIONS": {"key_prefix": prefix}}
    )
    assert backend.listing_index
    yield backend
    keys = list(backend.client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        backend.client.delete(*keys)
    backend.close()


@pytest.mark.parametrize(
    "corrupt",
    ["garbage", "-1", "99999999999999999999999", "", " 7", "hash", "list"],
)
def test_a_corrupt_sweep_cursor_never_fails_a_grant(
    sweep_backend: RedisBackend, corrupt: str
) -> None:
    """The sweep runs after a grant is written: a cursor it cannot use (rewritten by
    hand, of another type) made the grant's script fail there, so the caller was told
    "error" while the lock stayed held for its ttl by an owner nobody had, on one grant
    in INDEX_SWEEP_EVERY, for ever. A bad cursor must start the pass again instead."""
    client = sweep_backend.client
    state = f"{sweep_backend.index_key}:sweep"
    client.delete(state)
    if corrupt == "hash":
        client.hset(state, "cursor", "0")
    elif corrupt == "list":
        client.rpush(state, "0")
    else:
        client.set(state, corrupt)
    before = client.type(state)
    swept = False
    for i in range(50 * INDEX_SWEEP_EVERY):
        name, owner = f"n{i}", uuid.uuid4().hex
        result = sweep_backend.acquire(name, owner, 30.0, HOLDER)  # raised before the fix
        assert result.acquired
        assert sweep_backend.release(name, owner)
        now = client.type(state)
        if now != before or (now == b"string" and client.get(state) != corrupt.encode()):
            swept = True  # the sweep ran and wrote a cursor of its own
            break
    assert swept, "no grant swept in 400: the test proves nothing"
    assert client.type(state) == b"string" and client.get(state).isdigit()
    assert list(client.scan_iter(match=f"{sweep_backend.key_prefix}:*:lock")) == []
