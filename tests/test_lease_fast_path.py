"""The uncontended path of lock()/alock() skips work it can prove unneeded (issue 29):
arguments checked once per distinct value, no renewal task per async lease, no signal
sent to nobody. These tests hold the guarantees those shortcuts must keep.

Run on the in-process backend: what is tested is the layer above every backend.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distlocks import alock, lock, signals
from distlocks.validation import validate_flag, validate_timeout, validate_ttl

ALIAS = "locmem"


class _Float(float):
    """A float subclass: equal to, and hashed like, a float it is not."""


class _Int(int):
    pass


# Values equal (==, same hash) to each other across types are the trap of a value cache:
# True == 1 == 1.0, yet only numbers are lease lengths and only bools are flags.
_tricky = st.sampled_from(
    [
        True, False, 1, 0, 1.0, 0.0, -1, 30, 30.0, 0.005, 0.01, 10**400, 365 * 86400,
        365 * 86400 + 1, math.nan, math.inf, -math.inf, "1", "30", None, _Float(30.0),
        _Int(30), _Int(1), b"1", 1 + 0j,
    ]
)  # fmt: skip
_values = st.one_of(_tricky, st.floats(allow_nan=True), st.integers(-5, 10**6))


def _outcome(check: Any, value: Any) -> Any:
    """What a fresh check says of ``value``: the value it gives, or its error."""
    try:
        return ("ok", check(value))
    except (TypeError, ValueError) as exc:
        return (type(exc), str(exc))


def _built(**kwargs: Any) -> Any:
    try:
        return ("ok", lock("fast-path:args", backend=ALIAS, **kwargs))
    except (TypeError, ValueError) as exc:
        return (type(exc), str(exc))


def _same(expected: Any, got: Any) -> None:
    assert expected[0] == got[0], (expected, got)
    if expected[0] == "ok":
        # Same value and same type: 1 must not come back as True, nor True as 1.0.
        assert type(expected[1]) is type(got[1]) and (
            expected[1] == got[1] or expected[1] != expected[1]
        ), (expected, got)
    else:
        assert expected[1] == got[1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ttl", "timeout", "max_hold"]), _values), max_size=8))
def test_number_arguments_are_checked_alike_however_often_seen(
    calls: list[tuple[str, Any]],
) -> None:
    """Each call of lock() judges its numbers as a fresh check would, whatever values
    earlier calls passed (a cache keyed by value must not let True pass as ttl=1)."""
    for option, value in calls * 2:  # each value twice: the second may come from a cache
        got = _built(**{option: value})
        check = {"ttl": validate_ttl, "timeout": validate_timeout, "max_hold": validate_ttl}
        if value is None and option != "timeout":
            expected: Any = ("ok", None)  # the default
        elif option == "max_hold":
            expected = _outcome(lambda v: validate_ttl(v, "max_hold"), value)
        else:
            expected = _outcome(check[option], value)
        if got[0] == "ok":
            lock_ = got[1]
            stored = {"ttl": lock_._ttl, "timeout": lock_._timeout, "max_hold": lock_.max_hold}
            got = ("ok", stored[option])
        _same(expected, got)


_FLAGS = ["auto_renew", "reentrant", "fair", "release_on_commit"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_FLAGS), _values), max_size=8))
def test_flags_are_checked_alike_however_often_seen(calls: list[tuple[str, Any]]) -> None:
    for option, value in calls * 2:
        got = _built(**{option: value})
        if option == "release_on_commit" and value is None:
            expected: Any = ("ok", None)
        else:
            expected = _outcome(lambda v, o=option: validate_flag(v, o), value)
        if got[0] == "ok":
            got = ("ok", getattr(got[1], option))
        _same(expected, got)


def test_async_lease_renews_and_stops_at_release() -> None:
    """An auto-renewed alock() lease is renewed while held, and nothing of its renewal
    is left on the loop once released."""

    async def main() -> tuple[int, int]:
        async with alock("fast-path:arenew", backend=ALIAS, ttl=1, timeout=0) as lease:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while lease.renewals < 3 and loop.time() < deadline:
                await asyncio.sleep(0.02)
            assert lease.held()
        renewals = lease.renewals
        # Long enough for several renewals had any survived the release.
        await asyncio.sleep(1.2)
        return renewals, lease.renewals

    before, after = asyncio.run(main())
    assert before >= 3
    assert after == before


@pytest.mark.parametrize("use_async", [False, True])
def test_signals_reach_receivers_connected_after_a_quiet_cycle(use_async: bool) -> None:
    """A cycle with no receivers skips the signals; a receiver connected later hears the
    next cycle's acquisition and release (nothing is cached past a connect)."""
    heard: list[str] = []

    def on_acquired(sender: Any, lease: Any, waited: float, **kw: Any) -> None:
        heard.append(f"acquired:{lease.name}")

    def on_released(sender: Any, lease: Any, **kw: Any) -> None:
        heard.append(f"released:{lease.name}")

    def cycle() -> None:
        if use_async:

            async def main() -> None:
                async with alock("fast-path:signals", backend=ALIAS, timeout=0):
                    pass

            asyncio.run(main())
        else:
            with lock("fast-path:signals", backend=ALIAS, timeout=0):
                pass

    cycle()
    signals.lock_acquired.connect(on_acquired)
    signals.lock_released.connect(on_released)
    try:
        cycle()
    finally:
        signals.lock_acquired.disconnect(on_acquired)
        signals.lock_released.disconnect(on_released)
    cycle()
    assert heard == ["acquired:fast-path:signals", "released:fast-path:signals"]


def test_a_lease_due_sooner_than_those_waiting_is_renewed_in_time() -> None:
    """One loop's leases share one timer: a lease added later but due sooner (a shorter
    ttl) must move it earlier, or it runs out waiting behind the long one."""

    async def main() -> tuple[int, bool]:
        async with alock("fast-path:long", backend=ALIAS, ttl=60, timeout=0):
            async with alock("fast-path:short", backend=ALIAS, ttl=1.2, timeout=0) as short:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 30
                while short.renewals < 3 and short.held() and loop.time() < deadline:
                    await asyncio.sleep(0.02)
                return short.renewals, short.held()

    renewals, held = asyncio.run(main())
    assert held and renewals >= 3


def test_an_event_loop_is_not_kept_alive_by_its_leases() -> None:
    """The per-loop renewer refers to its loop weakly: a finished loop, with a lease
    released and one still held at its end, is collected."""
    import gc
    import weakref

    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def main() -> Any:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        async with alock("fast-path:gc-released", backend=ALIAS, ttl=30, timeout=0):
            pass
        # Held when the loop ends; released below, outside any loop.
        return await alock("fast-path:gc-held", backend=ALIAS, ttl=30, timeout=0).acquire()

    lease = asyncio.run(main())
    try:
        gc.collect()
        assert loops[0]() is None
    finally:
        from distlocks import get_backend

        get_backend(ALIAS).release(lease.name, lease.owner)
