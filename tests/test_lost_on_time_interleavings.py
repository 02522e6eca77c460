"""Every interleaving of a renewal (or the holder's ``extend()``) in flight, the lease's
deadline passing, the deadline's notice, the call's late answer and a release by the
holder, driven one step at a time by Hypothesis. A release never waits for the call in flight
(its server may never answer it): it is sent beside it.

The lease is on the in-process LocMem backend (its own server, in this process) with a
gate in front of ``extend()``: the call enters, and waits until the test chooses its
answer. Nothing is faked: the answer is what LocMem itself says when the gate opens
("success": the lock is extended then; "gone": it was force-released first, so LocMem
answers False; "error": the request never reached it). The deadline passing is the one
input not taken from the clock: the lease's monotonic deadline is moved into the past,
so no step depends on how fast the machine is.

After every step: the loss is reported at most once (``on_lost`` and ``lock_lost``
alike), never for a lease released cleanly, never without a cause (a passed deadline or
a "gone" answer), and a lost lease stays lost. After a successful answer that came too
late, what it extended on the server is given back at once.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings
from hypothesis import HealthCheck
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from distlocks import get_backend, lock
from distlocks.backends.locmem import LocMemBackend
from distlocks.exceptions import LockBackendUnavailable, LockError, LockLost
from distlocks.signals import lock_lost
from distlocks.testing.contract import _in_child

LIMIT = 30.0  # seconds any step may wait for a thread (generous; never reached)


class GatedLocMem(LocMemBackend):
    """LocMem whose ``extend()`` waits at a gate, when armed, for the test's answer."""

    def __init__(self, alias: str, config: Mapping[str, Any]) -> None:
        super().__init__(alias, config)
        self.armed = False
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.answer = "success"
        # Names whose every extend() waits until `unstuck` is set.
        self.stuck: set[str] = set()
        self.unstuck = threading.Event()

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        if name in self.stuck:
            self.entered.set()
            assert self.unstuck.wait(LIMIT * 4)
        if self.armed:
            self.armed = False
            self.entered.set()
            assert self.opened.wait(LIMIT)
            if self.answer == "error":
                raise LockBackendUnavailable(self.alias, "no route to the server (test)")
            if self.answer == "gone":
                self.force_release(name)
        return super().extend(name, owner, ttl)


@pytest.fixture
def gated() -> Iterator[str]:
    config = {
        **settings.DISTLOCKS_BACKENDS,
        "gated": {"BACKEND": f"{__name__}.GatedLocMem"},
    }
    with override_settings(DISTLOCKS_BACKENDS=config):
        yield "gated"


class Interleavings(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.backend = get_backend("gated")
        assert isinstance(self.backend, GatedLocMem)
        self.name = f"interleave:{time.monotonic_ns()}"
        self.calls: list[str] = []
        self.signals = 0
        self.receiver = self._signalled
        lock_lost.connect(self.receiver, weak=False)
        # Nothing renews it behind the test's back: the test runs the renewer's steps.
        self.lease = lock(
            self.name, backend="gated", ttl=600, auto_renew=False, on_lost=self._lost
        ).acquire()
        self.call: threading.Thread | None = None  # the call in flight, if any
        self.call_kind = ""
        self.call_errors: list[BaseException] = []
        self.unexpected: list[BaseException] = []
        self.releaser: threading.Thread | None = None
        self.release_results: list[bool] = []
        self.deadline_passed = False
        self.gone = False
        self.ever_lost = False
        self.late_success_checks = 0

    def _lost(self, lease: Any) -> None:
        self.calls.append(lease.lost_reason)

    def _signalled(self, sender: Any, lease: Any, reason: str, **kwargs: Any) -> None:
        if lease is self.lease:
            self.signals += 1

    # -- steps -------------------------------------------------------------------

    def _start(self, kind: str, target: Any) -> None:
        self.backend.entered.clear()
        self.backend.opened.clear()
        self.backend.armed = True

        def run() -> None:
            try:
                target()
            except (LockLost, LockError) as exc:
                self.call_errors.append(exc)
            except BaseException as exc:  # reported by the invariant
                self.unexpected.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + LIMIT
        while not self.backend.entered.is_set() and thread.is_alive():
            assert time.monotonic() < deadline, "the call neither entered nor ended"
            time.sleep(0.001)
        if self.backend.entered.is_set():
            self.call, self.call_kind = thread, kind
        else:  # decided not to call the server (lost, released): it has ended
            self.backend.armed = False
            thread.join(LIMIT)

    @precondition(lambda self: self.call is None and self.releaser is None)
    @rule()
    def renewal_starts(self) -> None:
        """What a renewal caller thread runs for this lease."""
        self._start("renewal", self.lease._renew_once)

    @precondition(lambda self: self.call is None and self.releaser is None)
    @rule()
    def holder_extends(self) -> None:
        self._start("extend", self.lease.extend)

    @rule()
    def deadline_passes(self) -> None:
        valid_until = self.lease._valid_until
        if valid_until is not None and self.lease.state == "held":
            self.lease._valid_until = min(valid_until, time.monotonic() - 0.001)
            self.deadline_passed = True

    @rule()
    def deadline_notice(self) -> None:
        """What the renewer's scheduler (or the loop's renewer) does at a deadline."""
        self.lease.held()

    @precondition(lambda self: self.call is not None)
    @rule(answer=st.sampled_from(["success", "gone", "error"]))
    def answer_arrives(self, answer: str) -> None:
        assert self.call is not None
        lost_before = self.lease.state == "lost"
        self.backend.answer = answer
        self.backend.opened.set()
        errors = len(self.call_errors)
        self.call.join(LIMIT)
        assert not self.call.is_alive()
        self.call = None
        if self.call_kind == "extend" and True in self.release_results:
            # Released while the holder's extension was in flight: never a success.
            assert len(self.call_errors) == errors + 1, self.call_errors
        if answer == "gone":
            self.gone = True
        if answer == "success" and (lost_before or self.lease.state == "lost"):
            # Too late: the lease stays lost, and the lock it just extended is given
            # back at once, so nobody waits for it to expire.
            assert self.lease.state == "lost"
            info = self.backend.inspect(self.name)
            assert info is None or info.owner != self.lease.owner
            self.late_success_checks += 1
        if answer == "success" and self.lease.state == "held":
            assert self.lease.remaining() > 0

    @precondition(lambda self: self.releaser is None)
    @rule()
    def holder_releases(self) -> None:
        if self.call is None:
            self.release_results.append(self.lease.release())
            self.releaser = threading.current_thread()  # once
            return
        # A call is in flight, held at the gate until the test answers it: the release
        # does not wait for it (the server may never answer), it is sent beside it.
        thread = threading.Thread(target=lambda: self.release_results.append(self.lease.release()))
        thread.start()
        thread.join(LIMIT)
        assert not thread.is_alive(), "release() waited for the call in flight"
        assert self.call.is_alive()  # still unanswered
        self.releaser = thread

    @precondition(lambda self: self.releaser is not None and len(self.release_results) < 3)
    @rule()
    def another_thread_releases(self) -> None:
        """A release again, from another thread (the holder's and a cleanup's, say):
        whatever is in flight, it does not wait, sends no second release and reports
        no loss of its own (see the invariants)."""
        thread = threading.Thread(target=lambda: self.release_results.append(self.lease.release()))
        thread.start()
        thread.join(LIMIT)
        assert not thread.is_alive(), "a second release waited for the call in flight"

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def reported_once_and_only_with_a_cause(self) -> None:
        assert not self.unexpected, self.unexpected
        assert len(self.calls) <= 1, self.calls
        assert self.signals == len(self.calls)
        state = self.lease._state
        if state == "lost":
            self.ever_lost = True
            assert self.deadline_passed or self.gone, self.lease.lost_reason
        if self.ever_lost:
            assert state == "lost" and not self.lease.held()
        if state == "released":
            assert not self.calls
        if self.deadline_passed:
            # Whatever answers later: a lease past its deadline is never held again.
            assert not self.lease.held()

    @invariant()
    def a_release_that_says_so_freed_the_lock(self) -> None:
        """A release that returned True left nothing of the lease on the server, and
        the lease released for good, whatever the call in flight answers later."""
        if True in self.release_results:
            assert self.release_results.count(True) == 1, self.release_results
            assert self.lease._state == "released"
            info = self.backend.inspect(self.name)
            assert info is None or info.owner != self.lease.owner

    @invariant()
    def a_deadline_passed_in_flight_says_so(self) -> None:
        if self.calls and self.call is not None:
            assert "no answer" in self.calls[0], self.calls[0]

    def teardown(self) -> None:
        if self.call is not None:
            self.backend.answer = "error"
            self.backend.opened.set()
            self.call.join(LIMIT)
        if self.releaser is not None and self.releaser is not threading.current_thread():
            self.releaser.join(LIMIT)
        lock_lost.disconnect(self.receiver)
        # Whatever happened, the lock is not left held by this lease.
        self.lease.release()
        info = self.backend.inspect(self.name)
        assert info is None or info.owner != self.lease.owner


def test_release_deadline_and_late_answer_interleavings(gated: str) -> None:
    run_state_machine_as_test(
        Interleavings,
        settings=hsettings(
            max_examples=300,
            stateful_step_count=12,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def _stuck_lease(gated: str, name: str, ttl: float, lost: list[str]) -> tuple[GatedLocMem, Any]:
    """A lease of the gated backend whose every extension waits at the gate (until the
    test sets ``unstuck``); its loss appends its name to ``lost``."""
    backend = get_backend(gated)
    assert isinstance(backend, GatedLocMem)
    lease = lock(f"{name}:stuck", backend=gated, ttl=ttl, on_lost=lambda x: lost.append(x.name))
    lease = lease.acquire()
    backend.stuck.add(lease.name)
    return backend, lease


def test_one_stuck_call_does_not_hold_up_the_other_leases_of_its_backend(
    gated: str, name: str
) -> None:
    """The renewal of one lease is stuck in its backend call (its connection hangs); the
    other leases of the same backend, due at other times, are still renewed (by another
    caller thread), and the stuck one is reported lost at its deadline."""
    lost: list[str] = []
    backend, a = _stuck_lease(gated, name, 1, lost)
    assert backend.entered.wait(LIMIT)  # its renewal is stuck
    # Taken now, so renewed in turns of its own (a turn is what is due within 20 ms).
    b = lock(f"{name}:other", backend=gated, ttl=1, on_lost=lambda x: lost.append(x.name))
    b = b.acquire()
    try:
        renewed = b.renewals
        deadline = time.monotonic() + LIMIT
        while b.renewals < renewed + 4:  # more than a ttl's worth of renewals
            assert time.monotonic() < deadline, "the other lease is no longer renewed"
            time.sleep(0.01)
        assert b.held()
        # Told on a notice thread: waited for, not assumed done.
        deadline = time.monotonic() + LIMIT
        while not lost:
            assert time.monotonic() < deadline, "the stuck lease's loss was not told"
            time.sleep(0.01)
        assert lost == [a.name]
        assert "no answer" in a.lost_reason
    finally:
        backend.unstuck.set()
        b.release()
        a.release()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_a_renewal_is_stuck(gated: str, name: str) -> None:
    """Forked while a caller thread of the parent is stuck in a renewal, holding the
    lease's mutex: in the child the inherited lease is not held, extend() refuses at
    once (it does not wait for that mutex), nothing reports the parent's lease lost, and
    a lease the child takes is renewed by the child's own renewer."""
    lost: list[str] = []
    backend, a = _stuck_lease(gated, name, 30, lost)
    # Its renewal is stuck: the renewer's caller thread holds its mutex (30 s lease,
    # renewed at 10 s: started by hand, as the caller does, not waited for).
    caller = threading.Thread(target=a._renew_once)
    caller.start()
    try:
        assert backend.entered.wait(LIMIT)

        def child() -> list[object]:
            seen: list[object] = [a.held()]
            try:
                a.extend()
                seen.append("extended")
            except LockLost:
                seen.append("LockLost")
            own = lock(f"{name}:child", backend="locmem", ttl=3).acquire()
            limit = time.monotonic() + LIMIT
            while own.renewals < 2 and time.monotonic() < limit:
                time.sleep(0.01)
            seen.append(own.renewals >= 2 and own.held())
            own.release()
            seen.append(lost)
            return seen

        text = _in_child(child)
        assert text == "[False, 'LockLost', True, []]", text
    finally:
        backend.unstuck.set()
        caller.join(LIMIT)
    assert a.held() and not lost  # the parent's lease, renewed once its call answered
    assert a.release() is True


def test_a_renewal_about_to_send_gives_way_to_a_release(name: str) -> None:
    """The window the release cannot see a call in: a renewal has taken the lease's mutex
    and not yet marked its call in flight. A release arriving then waits for the mutex,
    marked as coming; the renewal sees the mark before it sends anything and gives way,
    so the release never waits behind a call that could be stuck."""
    lease = lock(name, backend="locmem", ttl=600, auto_renew=False).acquire()
    lease._mutex.acquire()  # the renewal (this thread), before its call is marked
    released: list[bool] = []
    releaser = threading.Thread(target=lambda: released.append(lease.release()))
    releaser.start()
    try:
        deadline = time.monotonic() + LIMIT
        while not lease._releasing:
            assert time.monotonic() < deadline, "the release did not mark itself"
            time.sleep(0.001)
        assert releaser.is_alive()  # it waits for the mutex: no call was in flight
        lease._renewing = time.monotonic()  # the renewal marks its call, then looks
        assert lease._call_may_start() is False
        assert lease._renewing == 0.0
    finally:
        lease._mutex.release()
    releaser.join(LIMIT)
    assert released == [True]
    assert lease.state == "released" and not lease._releasing
