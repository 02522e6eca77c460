"""The asyncio read watch (clients._ReadWatch) as a state machine: reads of any
timeouts start and end in any order, on connections made and dropped (so ``id()``s are
reused), while the loop's clock moves and its timer fires. Invariants: a read is
aborted exactly when its deadline passes before it ends, never earlier, never a read
that ended already; ``end()`` says so once; nothing stays behind; the one timer is
always due no later than the earliest deadline of the reads under way.

The loop is a clock and a timer heap (no I/O: the watch does none); the connections
are the attribute the watch touches (``_writer.transport.abort``).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from distlocks.backends.redis.clients import _ReadWatch


class _Handle:
    def __init__(self, when: float, callback: Any, args: tuple[Any, ...]) -> None:
        self.when, self.callback, self.args, self.cancelled = when, callback, args, False

    def cancel(self) -> None:
        self.cancelled = True


class _Clock:
    """The two things of an event loop the watch uses: time() and call_at()."""

    def __init__(self) -> None:
        self.now = 0.0
        self.heap: list[tuple[float, int, _Handle]] = []
        self.order = itertools.count()

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Any, *args: Any) -> _Handle:
        handle = _Handle(when, callback, args)
        heapq.heappush(self.heap, (when, next(self.order), handle))
        return handle

    def advance(self, seconds: float) -> None:
        """Move the clock, running the timers due meanwhile in order, as a loop does."""
        target = self.now + seconds
        while self.heap and self.heap[0][0] <= target:
            when, _, handle = heapq.heappop(self.heap)
            self.now = max(self.now, when)
            if not handle.cancelled:
                handle.callback(*handle.args)
        self.now = target

    def pending(self) -> list[float]:
        return [when for when, _, handle in self.heap if not handle.cancelled]


class _Transport:
    def __init__(self) -> None:
        self.aborted = 0

    def abort(self) -> None:
        self.aborted += 1


class _Writer:
    def __init__(self) -> None:
        self.transport = _Transport()


class _Conn:
    def __init__(self) -> None:
        self._writer = _Writer()


class WatchMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = _Clock()
        self.watch = _ReadWatch()
        #: Reads under way: connection -> its deadline.
        self.reading: dict[_Conn, float] = {}
        #: Connections made and not yet dropped, reading or not.
        self.idle: list[_Conn] = []

    @rule(timeout=st.sampled_from([0.0, 0.05, 0.3, 1.0, 5.0, 60.0]))
    def start_a_read(self, timeout: float) -> None:
        # A new connection most of the time: ids of dropped ones get reused.
        conn = self.idle.pop() if self.idle else _Conn()
        conn._writer = _Writer()  # a fresh transport, as after a reconnect
        self.watch.start(self.loop, conn, timeout)  # type: ignore[arg-type]
        self.reading[conn] = self.loop.now + timeout

    @precondition(lambda self: bool(self.reading))
    @rule(data=st.data(), keep=st.booleans())
    def end_a_read(self, data: st.DataObject, keep: bool) -> None:
        conn = data.draw(st.sampled_from(sorted(self.reading, key=id)))
        deadline = self.reading.pop(conn)
        aborted = conn._writer.transport.aborted
        assert aborted <= 1
        # Aborted exactly when its deadline passed (the timer ran) before it ended.
        late = deadline <= self.loop.now and aborted == 1
        assert self.watch.end(conn) is bool(aborted)
        assert late or not aborted, "aborted before its deadline"
        if keep:
            self.idle.append(conn)

    @rule(seconds=st.sampled_from([0.0, 0.01, 0.1, 0.5, 2.0, 30.0, 100.0]))
    def time_passes(self, seconds: float) -> None:
        self.loop.advance(seconds)

    @rule()
    def drop_idle_connections(self) -> None:
        self.idle.clear()

    @invariant()
    def reads_past_their_deadline_are_aborted(self) -> None:
        for conn, deadline in self.reading.items():
            aborted = conn._writer.transport.aborted
            if deadline < self.loop.now:
                assert aborted == 1, "a read past its deadline not aborted"
            elif deadline > self.loop.now:
                assert aborted == 0, "a read aborted before its deadline"

    @invariant()
    def the_timer_is_due_by_the_earliest_deadline(self) -> None:
        waiting = [d for conn, d in self.reading.items() if not conn._writer.transport.aborted]
        if waiting:
            pending = self.loop.pending()
            assert pending and min(pending) <= min(waiting), (pending, min(waiting))

    @invariant()
    def nothing_stays_behind(self) -> None:
        assert len(self.watch.deadlines) <= len(self.reading)
        assert len(self.watch.expired) <= len(self.reading)
        if not self.reading:
            assert self.watch.deadlines == {} and self.watch.expired == set()


WatchMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_the_read_watch = WatchMachine.TestCase
