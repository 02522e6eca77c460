"""The worker process of the fault scenarios: rounds of lock, claim, increment, release.

Each round takes the scenario's lock, claims the counter row with a fenced write
of its token (so that once it has the row, no older holder can write it any
more), reads the counter, writes it back plus one with the token, and releases.
Every step is appended to the worker's own JSON-lines log with monotonic times
(see :mod:`tests.faults.history`).

The test steers a worker through files in the scenario's directory, so a fault
lands at a known point instead of at a lucky moment: ``{proc}.hold.{point}``
makes the worker stop at that point of its next round (it writes
``{proc}.at.{point}`` and waits for ``{proc}.go.{point}``); ``{proc}.start`` opens
the gate of a worker started with ``gate``; ``stop`` ends every worker after its
round. Every wait has a deadline.

Spawned, not forked: the process sets Django up itself and reaches the servers
through the environment the test session exported.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

#: Points of a round at which the test may stop a worker.
POINTS = ("granted", "inside", "releasing")
#: No worker outlives this, whatever the test does.
MAX_LIFETIME = 150.0
GATE_LIMIT = 60.0


class Recorder:
    """Appends events to the worker's log, one JSON line per event, flushed at once
    (the process may be killed at any moment). Thread-safe: the renewal thread
    records too."""

    def __init__(self, path: Path, proc: str, lock_name: str) -> None:
        self.proc = proc
        self.lock_name = lock_name
        self._file = path.open("a", buffering=1)
        self._mutex = threading.Lock()

    def __call__(self, kind: str, **fields: Any) -> None:
        event = {"kind": kind, "proc": self.proc, "lock": self.lock_name, **fields}
        line = json.dumps(event, default=str) + "\n"
        with self._mutex:
            self._file.write(line)
            self._file.flush()


def run(spec: dict[str, Any]) -> None:
    """Entry point of a spawned worker (``spec`` is built by the scenario)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    Worker(spec).run()


class Worker:
    def __init__(self, spec: dict[str, Any]) -> None:
        from django.conf import settings
        from django.test.utils import override_settings

        self.spec = spec
        self.proc: str = spec["proc"]
        self.dir = Path(spec["dir"])
        self.name: str = spec["lock"]
        self.pk: int = spec["counter"]
        self.alias: str = spec.get("alias", "faults")
        self.ttl: float = spec.get("ttl", 1.0)
        self.timeout: float = spec.get("timeout", 20.0)
        self.rounds: int = spec.get("rounds", 1000)
        self.born = time.monotonic()
        if spec.get("backend"):
            backends = {**settings.DISTLOCKS_BACKENDS, self.alias: spec["backend"]}
            override_settings(DISTLOCKS_BACKENDS=backends).enable()
        self.record = Recorder(self.dir / f"{self.proc}.jsonl", self.proc, self.name)
        self._instrument()

    def _instrument(self) -> None:
        """Record renewals and losses. Renewals have no signal of their own, so the
        lease's bookkeeping step is wrapped (recording only, then the real step)."""
        from distlocks import signals
        from distlocks.lease import BaseLease

        record = self.record
        renewed = BaseLease._renewed

        def recording_renewed(lease: BaseLease, started: float, ttl: float) -> None:
            renewed(lease, started, ttl)
            record("renew", token=lease.fencing_token, t0=started, t1=time.monotonic())

        BaseLease._renewed = recording_renewed  # type: ignore[method-assign]

        def on_lost(sender: object, lease: BaseLease, reason: str, **kwargs: Any) -> None:
            record("lost", token=lease.fencing_token, t=time.monotonic(), reason=reason)

        signals.lock_lost.connect(on_lost, weak=False)

    # -- steering ---------------------------------------------------------------

    def _expired(self) -> bool:
        return time.monotonic() - self.born > MAX_LIFETIME

    def checkpoint(self, point: str, token: int) -> None:
        """Stop here if the test asked for it, until it says go."""
        hold = self.dir / f"{self.proc}.hold.{point}"
        if not hold.exists():
            return
        hold.unlink()
        go = self.dir / f"{self.proc}.go.{point}"
        self.record("at", point=point, token=token, t=time.monotonic())
        # Written whole, then renamed: the test must never read a half-written marker.
        marker = self.dir / f"{self.proc}.at.{point}"
        partial = marker.with_suffix(".tmp")
        partial.write_text(str(token))
        partial.replace(marker)
        deadline = time.monotonic() + GATE_LIMIT
        while not go.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.proc}: nobody said go at {point!r}")
            time.sleep(0.002)
        go.unlink()
        self.record("go", point=point, token=token, t=time.monotonic())

    def _gate(self) -> None:
        if not self.spec.get("gate"):
            return
        gate = self.dir / f"{self.proc}.start"
        deadline = time.monotonic() + GATE_LIMIT
        while not gate.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.proc}: the gate never opened")
            time.sleep(0.002)

    # -- the work ---------------------------------------------------------------

    def run(self) -> None:
        self.record("ready", t=time.monotonic(), pid=os.getpid())
        self._gate()
        done = 0
        while done < self.rounds and not (self.dir / "stop").exists() and not self._expired():
            if self.round():
                done += 1
        self.record("done", t=time.monotonic(), rounds=done)

    def round(self) -> bool:
        """One round; False when the lock could not be had (try again)."""
        from distlocks import get_backend, lock
        from distlocks.exceptions import LockBackendUnavailable, LockLost, LockNotAcquired

        record = self.record
        stage = "acquiring"
        token = 0
        released_at = 0.0
        record("attempt", t=time.monotonic())
        t0 = time.monotonic()
        try:
            with lock(self.name, backend=self.alias, ttl=self.ttl, timeout=self.timeout) as lease:
                t1 = time.monotonic()
                token = lease.fencing_token
                expires = get_backend(self.alias).expires_on_server
                record("acquire", token=token, t0=t0, t1=t1, lease=self.ttl if expires else None)
                stage = "held"
                self.checkpoint("granted", token)
                self.work(token)
                self.checkpoint("releasing", token)
                stage = "releasing"
                released_at = time.monotonic()
            record("release", token=token, t0=released_at, t1=time.monotonic(), ok=True)
        except LockLost as exc:
            record("release", token=token, t0=released_at or time.monotonic(),
                   t1=time.monotonic(), ok=False, error=f"LockLost: {exc.reason}")  # fmt: skip
        except (LockNotAcquired, LockBackendUnavailable) as exc:
            if stage == "acquiring":
                record("unavailable" if isinstance(exc, LockBackendUnavailable) else "timeout",
                       t=time.monotonic(), error=str(exc))  # fmt: skip
                time.sleep(0.05)  # busy (timeout=0) or down: do not spin
                return False
            record("release", token=token, t0=released_at or time.monotonic(),
                   t1=time.monotonic(), ok=None, error=f"{type(exc).__name__}: {exc}")  # fmt: skip
        return True

    def work(self, token: int) -> None:
        """Claim the row, then read it and write it back plus one, all fenced."""
        from distlocks.exceptions import StaleFencingToken
        from tests.testapp.models import Counter

        record = self.record
        t0 = time.monotonic()
        claim = Counter.objects.filter(pk=self.pk).fenced_update(token)
        record("write", op="claim", token=token, t0=t0, t1=time.monotonic(),
               accepted=claim.updated == 1)  # fmt: skip
        if claim.updated != 1:
            return  # a newer holder has the row already: nothing to do safely
        row = Counter.objects.get(pk=self.pk)
        self.checkpoint("inside", token)
        row.value += 1
        t0 = time.monotonic()
        try:
            # The int token, not the lease: the write must reach the storage even
            # when the lease is known lost, to show that the storage refuses it.
            row.save(fencing_token=token)
            accepted = True
        except StaleFencingToken:
            accepted = False
        record("write", op="increment", token=token, t0=t0, t1=time.monotonic(),
               accepted=accepted, value=row.value)  # fmt: skip
