"""The Redis backend's background give-backs: the threads that read the replies of a
give-back sent behind an unanswered request (and then close its connection), and
those that send a give-back on another connection; a bounded set of each per process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from typing import Any

import redis

logger = logging.getLogger("distlocks.backends.redis")

#: How long a give-back sent behind an unanswered request waits for the two replies
#: before its connection is closed. Closing is safe at any time (see
#: RedisCalls._give_back_behind); waiting only spares the server a reset connection.
GIVE_BACK_DRAIN = 30.0


def _drain(conn: Any, replies: int, slot: Any, pool: Any) -> None:
    """Read the ``replies`` still due on ``conn`` (the unanswered request's, then its
    give-back's), then close it and give it back: to ``pool`` (if it was checked out of
    it), or with ``slot`` (its pinned slot, if it was one, dropped when this ends)."""
    try:
        for _ in range(replies):
            # An error reply (the script's, NOSCRIPT) is a reply all the same.
            with contextlib.suppress(redis.ResponseError):
                conn.read_response(timeout=GIVE_BACK_DRAIN, disconnect_on_error=False)
    except Exception as exc:
        # Closing now is safe: what was written goes out before the FIN, and the
        # server runs it in order (or drops the rest of it with the connection).
        logger.debug("Stopped waiting for the give-back's reply: %s", exc)
    finally:
        conn.disconnect()
        if pool is not None:
            pool.release(conn)
        del slot


#: Threads of this process that read the replies of give-backs sent behind a request
#: (:func:`_drain`), and threads that send give-backs on another connection. Bounded: a
#: burst of timed-out acquires (a stalled server) queues its drains rather than start
#: a thread each. A queued drain loses nothing: its give-back is on the wire already,
#: and its connection stays open until it is read (the server runs what it received).
GIVE_BACK_THREADS = 4


class _Workers:
    """A bounded set of daemon threads of this process for one kind of background
    work, started as the work comes (never more than :data:`GIVE_BACK_THREADS`), fed
    from one queue. Daemon threads, unlike a ThreadPoolExecutor's: the interpreter's
    exit does not wait for a drain of a server that does not answer. A forked child
    has none of its parent's threads: it starts its own."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.after_fork()

    def after_fork(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[Any, tuple[Any, ...]]] = queue.SimpleQueue()
        #: Threads started, and those waiting for work that no submit has claimed.
        self.threads = self._idle = 0

    def submit(self, func: Any, *args: Any) -> None:
        with self._lock:
            self._queue.put((func, args))
            if self._idle > 0:
                self._idle -= 1  # an idle thread takes it
                return
            if self.threads >= GIVE_BACK_THREADS:
                return  # queued: the next thread to finish takes it
            self.threads += 1
        threading.Thread(target=self._work, daemon=True, name=f"distlocks-{self.kind}").start()

    def _work(self) -> None:
        work = self._queue
        while True:
            func, args = work.get()
            try:
                func(*args)
            except Exception:  # each job reports its own failures; never lose the thread
                logger.exception("distlocks background %s failed", self.kind)
            with self._lock:
                self._idle += 1


#: Drains, and give-backs on another connection: apart, so that drains waiting on a
#: stalled server do not hold up give-backs to a server that answers.
_drains, _give_backs = _Workers("give-back-drain"), _Workers("give-back")
for _workers in (_drains, _give_backs):
    os.register_at_fork(after_in_child=_workers.after_fork)


def _start_drain(conn: Any, replies: int, slot: Any, pool: Any) -> None:
    _drains.submit(_drain, conn, replies, slot, pool)


def _background(func: Any, *args: Any) -> None:
    """Run ``func(*args)`` on one of the process's give-back threads."""
    _give_backs.submit(func, *args)
