"""The Redlock backend's masters: one single-node backend per master, a thread pool
each, rounds of requests to all of them at once, which of them are down, and the
errors that say how many answered."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from distlocks.backends.redis import RedisBackend
from distlocks.backends.redlock.config import (
    _REDIS_OPTIONS,
    DEFAULT_DRIFT_FACTOR,
    DEFAULT_DRIFT_MARGIN,
    RedlockConfig,
    describe_url,
)
from distlocks.backends.redlock.quorum import _Replies, drift, quorum
from distlocks.backends.redlock.scripts import _SCRIPTS
from distlocks.exceptions import LockBackendUnavailable, LockError

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Threads per master; a call that finds them all busy waits its turn (bounded by the
#: round's deadline, after which it counts as not answered).
THREADS_PER_MASTER = 32


class RedlockMasters(RedlockConfig):
    """The masters of a Redlock backend (``LOCATION``: their URLs) and the rounds of
    requests sent to them; the recipe's classes are built on it."""

    def __init__(self, alias: str, config: Mapping[str, Any]) -> None:
        super().__init__(alias, config)
        self.urls: list[str] = list(config["LOCATION"])
        redis_options = {k: v for k, v in self.options.items() if k in _REDIS_OPTIONS}
        #: One single-node backend per master, in ``LOCATION`` order.
        self.masters: list[RedisBackend] = [
            RedisBackend(
                f"{alias}[{index}]",
                {
                    "BACKEND": "distlocks.backends.redis.RedisBackend",
                    "LOCATION": url,
                    # Redlock lists each master by SCAN: its scripts keep no listing index.
                    "OPTIONS": {**redis_options, "listing_index": False},
                },
            )
            for index, url in enumerate(self.urls)
        ]
        self.quorum = quorum(len(self.masters))
        self.drift_factor = float(self.options.get("drift_factor", DEFAULT_DRIFT_FACTOR))
        self.drift_margin = float(self.options.get("drift_margin", DEFAULT_DRIFT_MARGIN))
        self._lock = threading.Lock()
        self._executors: list[concurrent.futures.ThreadPoolExecutor] | None = None
        self._scripts: dict[int, dict[str, Any]] = {}
        self._round_timeout: float | None = None
        #: Masters whose last call failed (waiters listen on the others first).
        self._down: set[int] = set()
        _instances.add(self)

    def drift(self, ttl: float) -> float:
        """Seconds taken off a lease for clocks that run at different speeds."""
        return drift(ttl, self.drift_factor, self.drift_margin)

    # -- the rounds -------------------------------------------------------------

    def _pool(self, index: int) -> concurrent.futures.ThreadPoolExecutor:
        executors = self._executors
        if executors is None:
            with self._lock:
                executors = self._executors
                if executors is None:
                    executors = self._executors = [
                        concurrent.futures.ThreadPoolExecutor(
                            max_workers=THREADS_PER_MASTER,
                            thread_name_prefix=f"distlocks-{self.alias}-m{i}",
                        )
                        for i in range(len(self.masters))
                    ]
        return executors[index]

    def _submit(
        self, index: int, func: Callable[..., T], *args: Any
    ) -> concurrent.futures.Future[T]:
        try:
            return self._pool(index).submit(func, *args)
        except RuntimeError:
            # close() shut that pool down meanwhile (the settings changed): the
            # backend goes on with fresh pools, as its clients do.
            return self._pool(index).submit(func, *args)

    def _hopeless(self, replies: _Replies[Any]) -> bool:
        """Too many masters failed for a quorum to answer: stop waiting for the rest."""
        return len(replies.errors) > len(self.masters) - self.quorum

    @property
    def round_timeout(self) -> float:
        """How long one round waits for the masters: the longest socket or connect
        timeout in force on their connections, plus a little for thread hand-offs."""
        if self._round_timeout is None:
            longest = 0.0
            for master in self.masters:
                kwargs = master.client.connection_pool.connection_kwargs
                for key in ("socket_timeout", "socket_connect_timeout"):
                    value = kwargs.get(key)
                    longest = max(
                        longest,
                        RedisBackend.DEFAULT_SOCKET_TIMEOUT if value is None else float(value),
                    )
            self._round_timeout = longest + 0.05
        return self._round_timeout

    def _round(
        self,
        call: Callable[[int], T],
        *,
        decided: Callable[[_Replies[T]], bool] | None = None,
        only: Iterable[int] | None = None,
    ) -> _Replies[T]:
        """Run ``call(index)`` for every master (or those in ``only``) concurrently.

        Returns when all have answered, when ``decided`` says the outcome is known
        (the others are left running, in ``pending``), or after :attr:`round_timeout`:
        a master whose answer is not in by then counts as failed.
        """
        indexes = range(len(self.masters)) if only is None else list(only)
        deadline = time.monotonic() + self.round_timeout
        futures = {self._submit(i, call, i): i for i in indexes}
        replies: _Replies[T] = _Replies()
        waiting = set(futures)
        while waiting:
            # Past the deadline, still collect the answers already in: the caller may
            # come back late (a loaded machine), and a master that answered in time
            # has not failed.
            remaining = deadline - time.monotonic()
            finished, waiting = concurrent.futures.wait(
                waiting, timeout=max(remaining, 0), return_when=concurrent.futures.FIRST_COMPLETED
            )
            for future in finished:
                index = futures[future]
                try:
                    replies.results[index] = future.result()
                except LockError as exc:
                    replies.errors[index] = exc
                    self._note(index, exc)
                else:
                    self._note(index, None)
            if waiting and decided is not None and decided(replies):
                replies.pending = {futures[f]: f for f in waiting}
                return replies
            if remaining <= 0:
                break
        for future in waiting:
            index = futures[future]
            if not future.cancel():  # it started: it may still reach the master
                replies.pending[index] = future
            error = LockBackendUnavailable(
                self.masters[index].alias,
                f"{describe_url(self.urls[index])} did not answer within {self.round_timeout:.2f}s",
            )
            replies.errors[index] = error
            self._note(index, error)
        return replies

    def _note(self, index: int, error: Exception | None) -> None:
        """Keep track of which masters are failing, and say so once per change."""
        if error is None:
            if index in self._down:
                self._down.discard(index)
                logger.info(
                    "Redlock master %s of backend %r answers again",
                    describe_url(self.urls[index]), self.alias,
                )  # fmt: skip
        elif index not in self._down:
            self._down.add(index)
            logger.warning(
                "Redlock master %s of backend %r failed (%s); locks carry on while %d of %d "
                "masters answer",
                describe_url(self.urls[index]), self.alias, error, self.quorum, len(self.masters),
            )  # fmt: skip

    def _no_quorum(self, action: str, name: str, replies: _Replies[Any]) -> LockBackendUnavailable:
        """The error for a round that did not reach enough masters."""
        answered = len(self.masters) - len(replies.errors)
        details = "; ".join(
            f"{describe_url(self.urls[i])}: {_reason(exc)}"
            for i, exc in sorted(replies.errors.items())
        )
        error = LockBackendUnavailable(
            self.alias,
            f"could not {action} lock {name!r}: only {answered} of {len(self.masters)} Redis "
            f"masters answered and a quorum needs {self.quorum} ({details})",
        )
        error.__cause__ = next(iter(replies.errors.values()), None)
        return error

    def _unconfirmed(
        self, action: str, name: str, yes: int, replies: _Replies[Any]
    ) -> LockBackendUnavailable:
        """The error for a compare-and-something that the masters which did not answer
        leave undecided: too few confirmed it, too few denied it."""
        if len(replies.errors) > len(self.masters) - self.quorum:
            return self._no_quorum(action, name, replies)
        no = len(replies.results) - yes
        details = "; ".join(
            f"{describe_url(self.urls[i])}: {_reason(exc)}"
            for i, exc in sorted(replies.errors.items())
        )
        error = LockBackendUnavailable(
            self.alias,
            f"could not {action} lock {name!r}: {yes} of {len(self.masters)} Redis masters "
            f"confirmed it, {no} did not have it and {len(replies.errors)} did not answer; "
            f"a quorum needs {self.quorum}, so whether it is still held is unknown ({details})",
        )
        error.__cause__ = next(iter(replies.errors.values()), None)
        return error

    def _need_quorum(self, action: str, name: str, replies: _Replies[Any]) -> None:
        if len(self.masters) - len(replies.errors) < self.quorum:
            raise self._no_quorum(action, name, replies)

    def _script(self, index: int, key: str) -> Any:
        scripts = self._scripts.get(index)
        if scripts is None:
            client = self.masters[index].client
            scripts = {k: client.register_script(lua) for k, lua in _SCRIPTS.items()}
            self._scripts[index] = scripts
        return scripts[key]

    def _run(
        self, index: int, key: str, action: str, name: str, keys: list[str], args: list[Any]
    ) -> Any:
        master = self.masters[index]
        script = self._script(index, key)
        with master._errors(action, name):
            return script(keys=keys, args=args, client=master.client)

    def close(self) -> None:
        with self._lock:
            executors, self._executors = self._executors, None
            self._scripts.clear()
            self._round_timeout = None
        for executor in executors or ():
            executor.shutdown(wait=False, cancel_futures=True)
        for master in self.masters:
            master.close()


_instances: weakref.WeakSet[RedlockMasters] = weakref.WeakSet()


def _new_pools_after_fork() -> None:
    """A forked child has none of its parent's threads: the executors it inherited
    believe their workers exist and would never run a round (every master "did not
    answer"). The child starts pools of its own on first use; the parent's are
    dropped without a shutdown (which would wait on threads that are not there).
    The masters' clients handle the fork themselves (RedisBackend)."""
    for backend in list(_instances):
        backend._lock = threading.Lock()
        backend._executors = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_pools_after_fork)


def _reason(exc: Exception) -> str:
    """The driver's own words for a master's failure, when there are any."""
    cause = exc.__cause__
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    return str(exc)


def _quietly(func: Callable[..., object], *args: Any) -> None:
    try:
        func(*args)
    except LockError:
        logger.debug("Redlock clean-up call failed", exc_info=True)
