"""The Redlock lock recipe, acquire and wait: one acquisition attempt across the
masters (its id, the grants, their confirmation), the give-back of what a failed
attempt got, and waiting for a release."""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from distlocks.backends.base import AcquireResult, Holder
from distlocks.backends.redis import lock as single
from distlocks.backends.redlock.masters import RedlockMasters, _quietly
from distlocks.backends.redlock.quorum import _Replies
from distlocks.backends.redlock.scripts import GIVE_BACK
from distlocks.exceptions import LockError

logger = logging.getLogger(__name__)

#: Upper bound of the random pause before retrying after a split vote, in seconds.
RETRY_JITTER = 0.03


_attempt_ids = itertools.count(1)
_attempt_ids_lock = threading.Lock()


def _attempt_request(attempt: str) -> str:
    """The request id of ``attempt`` on every master (see the single-node GIVE_BACK):
    unique across processes, where attempt ids are only ordered within one."""
    return f"{single._process_id[0]}.a{attempt}"


def _next_attempt() -> str:
    """A new attempt id, larger than every one this process handed out before.

    The attempts of one acquisition run one after the other in one process (its
    owner is unique to it), so on a master a larger id is always the newer attempt:
    what lets a script tell a late request of a failed attempt from the current one.
    """
    with _attempt_ids_lock:
        return str(next(_attempt_ids))


#: How many callers' "masters that refused you last" :meth:`RedlockAttempts.wait` keeps
#: (one entry per waiting acquisition; one that gave up leaves its entry behind).
REFUSERS_KEPT = 1024


class RedlockAttempts(RedlockMasters):
    """Acquire a lock on a quorum of masters, and wait for its release."""

    def __init__(self, alias: str, config: Mapping[str, Any]) -> None:
        super().__init__(alias, config)
        # (name, owner) -> the masters that refused that caller's last attempt: where
        # the lock is still held, so where its release will push a wake-up.
        self._refusers: collections.OrderedDict[tuple[str, str], list[int]] = (
            collections.OrderedDict()
        )
        self._refusers_lock = threading.Lock()

    def _acquire_on(
        self, index: int, name: str, owner: str, ttl: float, holder: Holder, wait: float,
        fair: bool, attempt: str,
    ) -> AcquireResult:  # fmt: skip
        # The single-node arguments and reply, and no single-node clean-up after a
        # timeout: here a failed attempt cleans up with GIVE_BACK.
        master = self.masters[index]
        keys, args = master._acquire_call(name, owner, ttl, holder, wait, fair)
        args[8] = f"{int(fair)}{_attempt_request(attempt)}"  # the attempt's request id
        # On a connection in hand: a reply that does not come has this attempt's
        # GIVE_BACK sent behind the request on the same connection, so it runs after
        # the request however late that reaches the master (see _run_taking).
        undo = (self._give_back_call, index, name, owner, attempt)
        with master._errors("acquire", name):
            reply = master._run_taking(self._script(index, "acquire"), keys, [*args, attempt], undo)
        return master._acquire_result(reply)

    def _give_back_call(
        self, index: int, name: str, owner: str, attempt: str
    ) -> tuple[str, list[str], list[Any]]:
        keys, args = self.masters[index]._release_call(name, owner)
        return GIVE_BACK, keys, [*args, attempt, _attempt_request(attempt)]

    def acquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        *,
        wait: float = 0.0,
        fair: bool = False,
    ) -> AcquireResult:
        started = time.monotonic()
        attempt = _next_attempt()
        spare = len(self.masters) - self.quorum  # how many may fail with a quorum left

        def lost_cause(replies: _Replies[AcquireResult]) -> bool:
            refused = sum(1 for r in replies.results.values() if not r.acquired)
            return refused + len(replies.errors) > spare

        replies = self._round(
            lambda i: self._acquire_on(i, name, owner, ttl, holder, wait, fair, attempt),
            decided=lost_cause,
        )
        granted = {i: r for i, r in replies.results.items() if r.acquired}
        errors = dict(replies.errors)
        if len(granted) >= self.quorum:
            token = max(r.fencing_token for r in granted.values())
            confirmed, confirm_errors = self._confirm(name, owner, token, attempt, granted)
            errors.update(confirm_errors)
            validity = ttl - (time.monotonic() - started) - self.drift(ttl)
            if len(confirmed) >= self.quorum and validity > 0:
                # Masters that did not answer in time may still have granted it: an
                # entry there is not part of this lease, so it is given back.
                self._give_back_later(name, owner, attempt, ttl, replies)
                if wait > 0 or fair:
                    refusing = [i for i, r in replies.results.items() if not r.acquired]
                    self._leave_elsewhere(name, owner, refusing)
                return AcquireResult(True, token, validity)
            if len(confirmed) >= self.quorum:
                logger.warning(
                    "Acquiring %r on Redlock backend %r took %.3fs, which leaves nothing of "
                    "its %gs ttl after the drift allowance; the grant was given back. Use a "
                    "longer ttl or shorter socket timeouts.",
                    name, self.alias, time.monotonic() - started, ttl,
                )  # fmt: skip
        self._give_back(name, owner, attempt, ttl, replies)
        if wait > 0 or fair:
            self._remember_refusers(name, owner, replies)
        if len(errors) > spare:
            raise self._no_quorum("acquire", name, _Replies(errors=errors))
        waits = [r.remaining for r in replies.results.values() if not r.acquired and r.remaining]
        refused = len(replies.results) - len(granted)
        if refused > spare and waits:
            # Held by someone: retry by the time the first of its entries runs out.
            return AcquireResult(False, 0, min(waits))
        if refused > spare:
            return AcquireResult(False, 0, None)  # fair: free, but not this caller's turn
        # A split vote (or a grant that came too late): nobody holds a quorum. Retry
        # after a random pause so that competing callers do not split again.
        return AcquireResult(False, 0, random.uniform(0.001, RETRY_JITTER))

    def _remember_refusers(self, name: str, owner: str, replies: _Replies[AcquireResult]) -> None:
        refusing = sorted(i for i, r in replies.results.items() if not r.acquired)
        with self._refusers_lock:
            self._refusers[(name, owner)] = refusing
            self._refusers.move_to_end((name, owner))
            while len(self._refusers) > REFUSERS_KEPT:
                self._refusers.popitem(last=False)

    def _confirm(
        self,
        name: str,
        owner: str,
        token: int,
        attempt: str,
        granted: Mapping[int, AcquireResult],
    ) -> tuple[set[int], dict[int, Exception]]:
        """Second round of a grant, on every master that granted it: raise its counter
        to ``token``, if the entry ``attempt`` was granted is still there.

        Returns the masters that did (only they count toward the quorum), and those
        that failed to answer.
        """

        def confirm(index: int) -> bool:
            keys = self.masters[index].all_keys(name)
            return bool(
                self._run(index, "confirm", "acquire", name, [keys.lock, keys.fence],
                          [owner, str(token), attempt])
            )  # fmt: skip

        replies = self._round(confirm, only=granted)
        return {i for i, ok in replies.results.items() if ok}, replies.errors

    def _give_back_on(self, index: int, name: str, owner: str, attempt: str) -> bool:
        master = self.masters[index]
        keys, args = master._release_call(name, owner)
        args += (attempt, _attempt_request(attempt))
        return bool(self._run(index, "give_back", "release", name, keys, args))

    def _give_back(
        self, name: str, owner: str, attempt: str, ttl: float, replies: _Replies[AcquireResult]
    ) -> None:
        """Give back what a failed attempt got: at once on the masters that granted it,
        later on those whose answer is still to come or was lost to an error."""
        granted = [i for i, r in replies.results.items() if r.acquired]
        if granted:
            self._round(lambda i: self._give_back_on(i, name, owner, attempt), only=granted)
        self._give_back_later(name, owner, attempt, ttl, replies)

    def _give_back_later(
        self, name: str, owner: str, attempt: str, ttl: float, replies: _Replies[AcquireResult]
    ) -> None:
        """In the background, give back on the masters whose request may still grant (or
        may have granted, unanswered) a lock this attempt does not count on.

        GIVE_BACK frees only an entry no newer attempt took over and no renewal made
        the lease's, so it may arrive at any time. Past the moment the entry would
        have expired anyway it is skipped, so a master that hangs does not pile up
        work."""
        skip_after = time.monotonic() + ttl + self.round_timeout

        def give_back(index: int) -> None:
            if time.monotonic() < skip_after:
                _quietly(self._give_back_on, index, name, owner, attempt)

        def later(index: int) -> Callable[[concurrent.futures.Future[AcquireResult]], None]:
            def when_done(_: concurrent.futures.Future[AcquireResult]) -> None:
                self._submit(index, give_back, index)

            return when_done

        for index, future in replies.pending.items():
            future.add_done_callback(later(index))
        for index in replies.errors:
            if index not in replies.pending:
                self._submit(index, give_back, index)

    def _leave_elsewhere(self, name: str, owner: str, refused: Iterable[int]) -> None:
        """After a grant, drop the caller's waiter registration on the masters that
        refused it (the grant itself removed it on the others). In the background."""
        for index in refused:
            master = self.masters[index]
            self._submit(index, _quietly, master.leave_queue, name, owner)

    # -- waiting ------------------------------------------------------------------

    def wait(self, name: str, timeout: float, *, owner: str = "", fair: bool = False) -> None:
        # Waiters block on one master's wake-up list (each release pushes one on every
        # master that has waiters). Masters that answered last time are tried first,
        # and of those the ones that refused this caller's last attempt: a release
        # reaches the masters one by one, and a waiter woken by its first step may try
        # before the others had theirs; listening where it woke, nothing would wake it
        # again (that wake-up is spent) and it would wait a whole chunk.
        deadline = time.monotonic() + timeout
        with self._refusers_lock:
            refusers = set(self._refusers.pop((name, owner), ()))
        order = sorted(
            range(len(self.masters)),
            key=lambda i: (i in self._down, i not in refusers, i),
        )
        for index in order:
            remaining = deadline - time.monotonic()
            if remaining <= 0.001:
                return
            try:
                self.masters[index].wait(name, remaining, owner=owner, fair=fair)
            except LockError as exc:
                self._note(index, exc)
                continue
            self._note(index, None)
            return
        # No master to listen on: pause briefly rather than spin; the next attempt
        # reports the outage if there is no quorum.
        time.sleep(min(max(0.0, deadline - time.monotonic()), 0.05))

    def leave_queue(self, name: str, owner: str) -> None:
        replies = self._round(
            lambda i: self.masters[i].leave_queue(name, owner), decided=self._hopeless
        )
        self._need_quorum("leave the queue of", name, replies)
