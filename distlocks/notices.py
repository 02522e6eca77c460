"""The notices of losses found by a renewer's scheduling thread, run on threads of their own.

A loss found at a lease's deadline by the scheduler (:class:`distlocks.renewal.Renewer`)
runs the holder's code: the ``lock_lost`` receivers and the ``on_lost`` callback. That code
may be slow, may block, or may call ``release()`` or ``extend()`` on the lost lease, which
wait for the lease's mutex, held by the stuck renewal call. Run on the scheduler, it would
stop the renewal of every other lease of the backend and the notice of their own deadlines.
The scheduler records the loss itself (``held()`` is False at the deadline) and posts the
notice here.

One thread (``distlocks-lost-notices:<alias>``, a daemon) runs the notices in turn; another
starts when notices wait while no thread is idle (at most
:data:`MAX_NOTIFIERS`), so one blocked callback does not hold up the others' notices. The
threads exit after a while with nothing to do.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distlocks.lease import BaseLease

logger = logging.getLogger(__name__)

#: Most threads running one backend's loss notices at once.
MAX_NOTIFIERS = 4
#: Seconds a notice thread lingers with nothing to do before exiting.
IDLE_EXIT = 30.0


class Crew:
    """The count of a small pool of daemon threads serving one queue under one condition
    (the renewer's callers, the notice threads): how many run, how many wait idle."""

    def __init__(self) -> None:
        self.threads = 0
        self.idle = 0

    def wait_for_work(self, cond: threading.Condition, queue: collections.deque[Any]) -> bool:
        """Called by a thread of the crew with ``cond`` held: wait until ``queue`` has
        something (True), or, after :data:`IDLE_EXIT` seconds with nothing, uncount the
        thread (in the same step as the check: work posted later starts a thread of its
        own) and return False: the thread ends."""
        idle_since = time.monotonic()
        while not queue:
            if time.monotonic() - idle_since >= IDLE_EXIT:
                self.threads -= 1
                return False
            self.idle += 1
            try:
                cond.wait(IDLE_EXIT)
            finally:
                self.idle -= 1
        return True


class LossNotices:
    """The loss notices of one backend alias's renewer, run off its scheduling thread."""

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[tuple[BaseLease, str]] = collections.deque()
        self._crew = Crew()

    def post(self, notices: list[tuple[BaseLease, str]]) -> None:
        """Have each ``(lease, reason)`` told (the lease already ended lost)."""
        if not notices:
            return
        with self._cond:
            self._queue.extend(notices)
            crew = self._crew
            if crew.idle:
                self._cond.notify(len(notices))
            if len(self._queue) <= crew.idle or crew.threads >= MAX_NOTIFIERS:
                return  # taken by an idle thread, or the first to finish its notice
            thread = threading.Thread(
                target=self._run, name=f"distlocks-lost-notices:{self.alias}", daemon=True
            )
            try:
                thread.start()
            except RuntimeError:
                # No thread to be had (the interpreter is exiting): told here rather
                # than never, if no other thread will.
                if crew.threads:
                    return
                inline = list(self._queue)
                self._queue.clear()
            else:
                crew.threads += 1
                return
        for lease, reason in inline:
            tell(lease, reason)

    def _run(self) -> None:
        counted = True
        try:
            while True:
                with self._cond:
                    if not self._crew.wait_for_work(self._cond, self._queue):
                        counted = False
                        return
                    lease, reason = self._queue.popleft()
                tell(lease, reason)
        finally:
            if counted:  # ended by an error of its own
                with self._cond:
                    self._crew.threads -= 1


def tell(lease: BaseLease, reason: str) -> None:
    """Run the notice of the loss of ``lease`` (it already ended lost)."""
    try:
        lease._notify_lost(reason)
    except Exception:  # it never raises; a bug must not end the thread's other notices
        logger.exception("Notice of the loss of lock %r failed", lease.name)
