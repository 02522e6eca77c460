"""Review 6 of the loss reported at the deadline: what the holder's own code, run when a
lease is lost (``on_lost``, a ``lock_lost`` receiver), may do to the renewer.

The renewer's scheduling thread finds a lease whose renewal call is stuck at its
deadline. The notice it gives runs the holder's code, which may be slow, may block, or
may call ``release()`` / ``extend()`` on the lost lease, which wait for the lease's
mutex, held by the stuck call. None of that may hold up the scheduler: the other leases
of the backend are still renewed, and still reported at their own deadlines.

The backend is the in-process LocMem behind a gate (as in
``tests/test_lost_on_time_interleavings.py``): the stuck call waits there until the test
lets it answer; nothing is faked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from distlocks import get_backend, lock
from distlocks.exceptions import LockError
from distlocks.signals import lock_lost
from tests.test_lost_on_time_interleavings import LIMIT, GatedLocMem, gated  # noqa: F401


def _wait(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + LIMIT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("reaction", ["blocks", "releases", "extends", "signal-blocks"])
def test_the_holders_reaction_to_a_loss_does_not_hold_up_the_other_leases(
    gated: str,  # noqa: F811
    name: str,
    reaction: str,
) -> None:
    """Lease A's renewal is stuck; at A's deadline its loss is reported, and the
    holder's reaction blocks (it waits for something, or calls release()/extend() on A,
    which wait for A's mutex, held by the stuck call). Lease B of the same backend is
    still renewed meanwhile, and is never reported lost."""
    backend = get_backend(gated)
    assert isinstance(backend, GatedLocMem)
    go_on = threading.Event()
    reacting = threading.Event()
    outcomes: list[object] = []
    lost: list[str] = []

    def react(lease: Any) -> None:
        lost.append(lease.name)
        if lease.name != a.name:
            return
        reacting.set()
        try:
            if reaction in ("blocks", "signal-blocks"):
                assert go_on.wait(LIMIT * 4)
            elif reaction == "releases":
                outcomes.append(lease.release())
            else:
                lease.extend()
        except LockError as exc:
            outcomes.append(type(exc).__name__)

    def receiver(sender: Any, lease: Any, reason: str, **kwargs: Any) -> None:
        if lease.name == a.name:
            react(lease)

    on_lost = None if reaction == "signal-blocks" else react
    if reaction == "signal-blocks":
        lock_lost.connect(receiver, weak=False)
    a = lock(f"{name}:a", backend=gated, ttl=1, on_lost=on_lost).acquire()
    backend.stuck.add(a.name)
    assert backend.entered.wait(LIMIT)  # A's renewal is stuck
    # Taken now, so renewed in turns of its own (a turn is what is due within 20 ms).
    b = lock(f"{name}:b", backend=gated, ttl=1, on_lost=lambda x: lost.append(x.name))
    b = b.acquire()
    try:
        _wait(reacting.is_set, "A's loss to be reported")
        renewed = b.renewals
        # More than a ttl's worth of renewals of B while the reaction to A is blocked.
        _wait(lambda: b.renewals >= renewed + 4 or not b.held(), "B's renewals")
        assert b.held(), b.lost_reason
        assert lost == [a.name]
    finally:
        backend.unstuck.set()
        go_on.set()
        lock_lost.disconnect(receiver)
    _wait(lambda: outcomes or reaction in ("blocks", "signal-blocks"), "the reaction's end")
    assert b.release() is True
    assert a.release() is False
    assert lost == [a.name]
    if reaction == "releases":
        assert outcomes == [False]
    elif reaction == "extends":
        assert outcomes == ["LockLost"]


@pytest.mark.parametrize("alias", ["locmem", "redis"])
def test_a_blocked_on_lost_does_not_hold_up_the_rest_of_its_renewal_batch(
    alias: str, name: str
) -> None:
    """Leases A and B are renewed in one call (one batch). The server no longer has A
    (force-released), and A's on_lost blocks. B's answer, a success, is recorded at once
    and its mutex is free: it is not left "in flight" until A's callback returns (its
    deadline would pass meanwhile, and B be reported lost though the server renewed it
    in time)."""
    from distlocks.renewal import renewer

    go_on = threading.Event()
    reacting = threading.Event()

    def react(lease: Any) -> None:
        reacting.set()
        assert go_on.wait(LIMIT * 4)

    a = lock(f"{name}:a", backend=alias, ttl=30, auto_renew=False, on_lost=react).acquire()
    b = lock(f"{name}:b", backend=alias, ttl=30, auto_renew=False).acquire()
    assert get_backend(alias).force_release(a.name)
    # The renewer's step, run here for exactly these two leases (nothing else renews
    # them: auto_renew=False).
    caller = threading.Thread(target=renewer(alias)._renew_together, args=([a, b],))
    caller.start()
    try:
        _wait(reacting.is_set, "A's loss to be reported")
        _wait(lambda: b.renewals == 1, "B's renewal to be recorded")
        assert b.held() and not b._renewing
        # B's mutex is free: its holder's extend() does not wait for A's callback.
        b.extend()
        assert b.renewals == 2
    finally:
        go_on.set()
        caller.join(LIMIT)
    assert not caller.is_alive()
    assert a.state == "lost" and b.release() is True
