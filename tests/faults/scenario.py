"""The test side of a fault scenario: spawn workers, steer them, inject faults,
merge the logs and check the history.

Faults are recorded in the scenario's own log, with the monotonic times at which
they began and ended, next to the workers' events. Every wait is bounded, and
:meth:`Scenario.cleanup` leaves no worker behind (a stopped one is continued and
killed).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from tests.faults import worker
from tests.faults.history import Report, check, load
from tests.waiting import process_alive

#: Generous: the machine may be loaded, and a wait that ends early costs nothing.
LIMIT = 60.0

Event = dict[str, Any]


class Scenario:
    def __init__(self, name: str, work: Path, lock_name: str, counter_pk: int) -> None:
        self.name = name
        self.dir = work
        self.lock = lock_name
        self.counter = counter_pk
        self.procs: dict[str, BaseProcess] = {}
        self._faults = work / "faults.jsonl"
        self._ctx = multiprocessing.get_context("spawn")

    # -- workers ------------------------------------------------------------------

    def spawn(self, proc: str, **spec: Any) -> BaseProcess:
        spec = {"proc": proc, "dir": str(self.dir), "lock": self.lock,
                "counter": self.counter, **spec}  # fmt: skip
        process = self._ctx.Process(target=worker.run, args=(spec,), name=f"fault-{proc}")
        process.start()
        self.procs[proc] = process
        return process

    def pid(self, proc: str) -> int:
        pid = self.procs[proc].pid
        assert pid is not None
        return pid

    def wait_ready(self, *procs: str) -> None:
        for proc in procs or tuple(self.procs):
            self.wait_event(lambda e, p=proc: e["kind"] == "ready" and e["proc"] == p,
                            f"{proc} ready")  # fmt: skip

    def open_gate(self, proc: str) -> None:
        (self.dir / f"{proc}.start").write_text("")

    def hold(self, proc: str, point: str) -> None:
        """Make ``proc`` stop at ``point`` of its next round."""
        assert point in worker.POINTS
        (self.dir / f"{proc}.hold.{point}").write_text("")

    def wait_at(self, proc: str, point: str) -> int:
        """Wait until ``proc`` stopped at ``point``; its token."""
        marker = self.dir / f"{proc}.at.{point}"
        self._wait(marker.exists, f"{proc} at {point}")
        return int(marker.read_text())

    def go(self, proc: str, point: str) -> None:
        (self.dir / f"{proc}.at.{point}").unlink(missing_ok=True)
        (self.dir / f"{proc}.go.{point}").write_text("")

    def stop(self) -> None:
        """Every worker ends after its current round."""
        (self.dir / "stop").write_text("")

    def join(self, *procs: str, limit: float = LIMIT) -> None:
        """Wait for workers to exit cleanly (exit code 0)."""
        deadline = time.monotonic() + limit
        for proc in procs or tuple(self.procs):
            process = self.procs[proc]
            process.join(max(0.1, deadline - time.monotonic()))
            assert process.exitcode == 0, f"{proc} exited with {process.exitcode}"

    def signal(self, proc: str, signum: int) -> None:
        os.kill(self.pid(proc), signum)

    def cleanup(self) -> None:
        """No straggler survives the test, stopped or not."""
        self.stop()
        for process in self.procs.values():
            if process.pid is not None and process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGCONT)
        for process in self.procs.values():
            process.join(5)
            if process.exitcode is None:
                process.kill()
                process.join(5)
        assert not [p.pid for p in self.procs.values() if p.pid and process_alive(p.pid)]

    # -- faults -------------------------------------------------------------------

    @contextlib.contextmanager
    def fault(self, what: str, *, ends_leases: bool = False) -> Iterator[None]:
        """Record the fault injected inside the block, with when it began and ended."""
        t0 = time.monotonic()
        yield
        event = {"kind": "fault", "what": what, "t0": t0, "t1": time.monotonic(),
                 "ends_leases": ends_leases}  # fmt: skip
        with self._faults.open("a") as fh:
            fh.write(json.dumps(event) + "\n")

    # -- the history --------------------------------------------------------------

    def events(self, kind: str | None = None, proc: str | None = None) -> list[Event]:
        paths = [self._faults, *(self.dir / f"{p}.jsonl" for p in self.procs)]
        return [
            e
            for e in load(paths)
            if (kind is None or e["kind"] == kind) and (proc is None or e.get("proc") == proc)
        ]

    def wait_event(self, predicate: Callable[[Event], bool], what: str) -> Event:
        """Wait until some event satisfies ``predicate``; that event."""
        found: list[Event] = []

        def seen() -> bool:
            found[:] = [e for e in self.events() if predicate(e)]
            return bool(found)

        self._wait(seen, what)
        return found[0]

    def accepted(self, op: str = "increment") -> list[Event]:
        return [e for e in self.events("write") if e["op"] == op and e["accepted"]]

    def wait_accepted(self, count: int, *, after: float = 0.0, what: str = "") -> None:
        """Wait for ``count`` accepted increments that began after ``after``."""
        self._wait(
            lambda: len([e for e in self.accepted() if e["t0"] > after]) >= count,
            what or f"{count} accepted increments",
        )

    def wait_granted(self, count: int, *, after: float, what: str = "") -> None:
        """Wait for ``count`` grants begun after ``after``: what a test then counts as
        the tokens after a fault (an accepted write begun after it may come from a grant
        made before it, such as the held lease's own)."""
        self._wait(
            lambda: len([e for e in self.events("acquire") if e["t0"] > after]) >= count,
            what or f"{count} grants",
        )

    def _wait(self, predicate: Callable[[], object], what: str) -> None:
        deadline = time.monotonic() + LIMIT
        while not predicate():
            dead = [p for p, proc in self.procs.items() if proc.exitcode not in (None, 0)
                    and not getattr(proc, "_expected_death", False)]  # fmt: skip
            assert not dead, f"worker(s) {dead} died while waiting for {what}"
            assert time.monotonic() < deadline, f"{what}: not within {LIMIT:.0f}s"
            time.sleep(0.01)

    def expect_death(self, proc: str) -> None:
        self.procs[proc]._expected_death = True  # type: ignore[attr-defined]

    def check(self) -> Report:
        """Check the merged history against the counter's final value, print the
        scenario's line, and fail on any violation."""
        from tests.testapp.models import Counter

        final = Counter.objects.get(pk=self.counter).value
        report = check(self.events(), final=final)
        print(f"faults[{self.name}]: {report.summary()}")
        assert report.violations == [], "\n".join(map(str, report.violations))
        return report
