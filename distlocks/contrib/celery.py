"""Celery single execution: at most one run of a task per key at a time.

Two locks are involved, both named from the task's arguments:

* the **run lock**, taken by the worker around the task body, renewed while the
  body runs and released when it returns. Its lease is the task's
  :func:`current_lease` (``self.lease`` in a bound task), for fenced writes;
* with ``unique_while``, a **queue marker** taken by ``apply_async()`` before the
  message is published, so that a duplicate call returns the
  :class:`~celery.result.AsyncResult` of the task already waiting (or running)
  instead of queueing another. It lasts for the countdown or eta plus
  ``unique_ttl``; the worker removes it when the run starts, after taking the run
  lock, so at every moment from enqueue to the end of the run one of the two is held.
  With ``"queued_or_running"`` the worker keeps the marker (renewed with the run
  lock) until the run ends, so a duplicate is answered from the marker alone and
  no caller is ever handed the id of a message that was not published.

Both carry the Celery task id (and the run lock the attempt number) in their holder
metadata. That is how a duplicate finds the task to return, how a redelivered
message (``acks_late``) recognises its own earlier delivery (it waits for a dead
worker's lease to run out, and writes no state if that delivery is still alive), and
how a retried run recognises the run lock its previous attempt kept through the
countdown, so that no copy can take the key in between.

A deduplicated call that carries a canvas (``link``, ``link_error``, a chain, a
group or a chord) cannot be attached to the copy already queued or running: it
fails at once under its own id with :class:`Deduplicated`, which fails the rest of
the chain, runs its ``link_error`` callbacks and fails its chord, so nothing waits
on a message that was never sent.

Why this is one module of over 600 lines (issue 28's size rule): the above is one
protocol, and :class:`SingleExecutionTask` implements both of its ends, the
publishing side (``apply_async()`` takes the marker) and the worker side
(``__call__`` takes the run lock, hands over or keeps the marker, keeps the run lock
through a retry's countdown), which recognise each other by the holder metadata.
The helpers below the class (the key made from the arguments, the marker's
lifetime, the retry and eta arithmetic) exist only for it and must agree between
the two ends. Split, each end of the hand-off would be read without the other.
What is apart, in :mod:`distlocks.contrib.celery_redis`, is how the two locks share
round trips on a Redis server (pipelined calls, the enqueue check as one script, with
the message's publish in it where the broker is the same database): an optimisation
of the calls made here, not a part of the protocol.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import difflib
import hashlib
import inspect
import json
import logging
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, fields
from decimal import Decimal
from typing import Any, ClassVar
from uuid import UUID

from django.core.exceptions import ImproperlyConfigured

from distlocks import fencing, transactions
from distlocks.backends.base import AcquireResult, BaseBackend
from distlocks.conf import conf
from distlocks.contrib import celery_redis as _together
from distlocks.exceptions import LockError, LockNotAcquired
from distlocks.handler import backends, check_alias
from distlocks.lease import Lease
from distlocks.locks import (
    Lock,
    _exit_problem,
    _not_acquired,
    _ttl_arg,
    _when_dropped,
    announce_acquired,
    current_holder,
    finish_lease,
    holder_extra,
    new_owner,
)
from distlocks.renewal import renewer
from distlocks.validation import (
    MAX_NAME_LENGTH,
    MAX_TTL,
    validate_name,
    validate_timeout,
    validate_ttl,
)

try:
    from celery import Task, shared_task
    from celery.app.task import Context
    from celery.backends.base import BaseBackend as _ResultBackend
    from celery.exceptions import Ignore, Retry
    from celery.local import Proxy
    from celery.signals import before_task_publish
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "distlocks.contrib.celery needs Celery 5.4 or later: pip install 'distlocks[celery]'."
    ) from exc

try:
    from celery.backends.redis import RedisBackend as _RedisResults
except ImportError:  # pragma: no cover - a Celery without its Redis result backend
    _RedisResults = None

try:
    from celery.contrib.django.task import DjangoTask as _TaskBase
except ImportError:  # pragma: no cover - Celery without its Django task class
    _TaskBase = Task

__all__ = [
    "AlreadyRunning",
    "Deduplicated",
    "SingleExecution",
    "SingleExecutionTask",
    "current_lease",
    "single_execution",
]

logger = logging.getLogger(__name__)

ON_DUPLICATE = ("skip", "raise", "retry")
UNIQUE_WHILE = ("queued", "queued_or_running")
#: Appended to the run lock's name to name the queue marker.
QUEUED_SUFFIX = ":queued"
#: Prefix of the default (hashed) run lock names.
KEY_PREFIX = "celery:"
_DIGEST_LENGTH = 32
#: Options that attach more work to a call: a deduplicated call carrying one of them
#: fails (:class:`Deduplicated`) instead of being merged into the existing task.
CANVAS_OPTIONS = ("link", "link_error", "chain", "chord", "group_id")

_current: ContextVar[Lease | None] = ContextVar("distlocks_celery_lease", default=None)
#: Run locks held by the current context, so a nested (eager) run of the same key,
#: such as an eager ``self.retry()``, does not wait for its own lock.
_running: ContextVar[frozenset[str]] = ContextVar("distlocks_celery_running", default=frozenset())
#: In a run: its marker (None: still the run's), and the markers a message published
#: under the run's own id took (their lifetime), which the run's end keeps for it.
_republished: ContextVar[dict[str, float | None] | None] = ContextVar(
    "distlocks_celery_republished", default=None
)


def current_lease() -> Lease | None:
    """The run lock's lease of the single-execution task running in this context.

    ``None`` outside such a task. Pass it to fenced writes
    (``obj.save(fencing_token=current_lease())``) and check it with ``ensure_held()``.
    """
    return _current.get()


class AlreadyRunning(LockNotAcquired):
    """Another run of the task with the same key holds the run lock
    (raised with ``on_duplicate="raise"``, and the retry reason with ``"retry"``)."""

    def __init__(self, task: str, name: str, backend: str, holder_task_id: str = "") -> None:
        LockError.__init__(self, task, name, backend, holder_task_id)
        self.task = task
        self.name = name
        self.backend = backend
        self.timeout = 0
        #: The Celery task id of the run holding the lock, where known.
        self.holder_task_id = holder_task_id

    def __str__(self) -> str:
        by = f" (task {self.holder_task_id})" if self.holder_task_id else ""
        return (
            f"Task {self.task!r} did not run: lock {self.name!r} on backend {self.backend!r} "
            f"is held by another run with the same key{by}, in progress or kept by "
            f"lock_at_least_for."
        )


class Deduplicated(AlreadyRunning):
    """A call made with ``unique_while`` found a copy with the same key queued or
    running, and carries a canvas (``link``, ``link_error``, chain, group, chord) that
    cannot be attached to that copy. Stored as the call's own FAILURE, so the rest of
    the canvas fails with it instead of waiting for ever; ``holder_task_id`` names
    the copy."""

    def __str__(self) -> str:
        return (
            f"Task {self.task!r} was not queued: a copy with the same key (lock "
            f"{self.name!r}, task {self.holder_task_id}) is already queued or running, "
            f"and the link, chain, group or chord of this call cannot be attached to it. "
            f"Wait for that task instead, or call this one without unique_while."
        )


@dataclass(frozen=True)
class SingleExecution:
    """The options of a single-execution task, checked when the task is defined.

    ``key``: a ``str.format`` template over the task's arguments (``"report:{day}"``;
    the result is the lock name as it stands, so it can be shared with ``lock()``
    calls and ``FencedModel`` rows), or a callable called with the task's arguments
    as keywords (bound to its signature, defaults applied) and returning the name.
    By default: ``celery:<task name>:<hash of all arguments bound to the
    signature>``, so positional and keyword calls give the same key.
    ``ttl``: the run lock's lease, renewed while the task runs (default
    ``DISTLOCKS_DEFAULT_TTL``); a worker that dies frees the lock within it.
    ``backend``: the ``DISTLOCKS_BACKENDS`` alias.
    ``timeout``: how long a run waits for a busy run lock before ``on_duplicate``.
    ``on_duplicate``: ``"skip"`` (return None), ``"raise"`` (:class:`AlreadyRunning`)
    or ``"retry"`` (``self.retry(countdown=retry_countdown)``).
    ``unique_while``: ``"queued"`` or ``"queued_or_running"`` deduplicates
    ``apply_async()``/``delay()``: a duplicate returns the existing ``AsyncResult``.
    ``unique_ttl``: how long a queued marker outlives the countdown/eta, in case the
    message is never run (a lost message, a purged queue).
    ``lock_at_least_for``: keep the run lock this many seconds after the run
    started even if it finished sooner (periodic tasks on several nodes).
    ``claim``: a callable called with the task's arguments as keywords (like a key
    callable) returning the model instances and querysets the run will change (one,
    or a list/tuple of them); right after the run lock is granted and before the
    body, they are claimed with the run lock's fencing token
    (:meth:`Lease.claim <distlocks.lease.BaseLease.claim>`), so a paused earlier run
    can no longer write to them.
    """

    key: str | Callable[..., str] | None = None
    ttl: float | None = None
    backend: str = "default"
    timeout: float = 0.0
    on_duplicate: str = "skip"
    retry_countdown: float = 10.0
    unique_while: str | None = None
    unique_ttl: float = 3600.0
    lock_at_least_for: float | None = None
    claim: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if self.key is not None and not (isinstance(self.key, str) or callable(self.key)):
            raise TypeError(
                f"key must be a str.format template or a callable returning the lock name, "
                f"not {type(self.key).__name__}."
            )
        if isinstance(self.key, str) and not self.key:
            raise ValueError("key must not be empty; leave it out for the default key.")
        if self.ttl is not None:
            validate_ttl(self.ttl)
        if not isinstance(self.backend, str) or not self.backend:
            raise TypeError(f"backend must be a DISTLOCKS_BACKENDS alias, not {self.backend!r}.")
        if validate_timeout(self.timeout) is None:
            raise ValueError("timeout must be a number of seconds; None would block a worker.")
        if self.on_duplicate not in ON_DUPLICATE:
            raise ValueError(
                f"on_duplicate must be one of {', '.join(map(repr, ON_DUPLICATE))}, "
                f"not {self.on_duplicate!r}."
            )
        validate_ttl(self.retry_countdown, "retry_countdown")
        if self.unique_while is not None and self.unique_while not in UNIQUE_WHILE:
            raise ValueError(
                f"unique_while must be None, {UNIQUE_WHILE[0]!r} or {UNIQUE_WHILE[1]!r}, "
                f"not {self.unique_while!r}."
            )
        validate_ttl(self.unique_ttl, "unique_ttl")
        if self.lock_at_least_for is not None:
            validate_ttl(self.lock_at_least_for, "lock_at_least_for")
        if self.claim is not None and not callable(self.claim):
            raise TypeError(
                f"claim must be a callable taking the task's arguments as keywords and "
                f"returning the instances or querysets to claim, not "
                f"{type(self.claim).__name__}."
            )

    @classmethod
    def coerce(cls, value: Any) -> SingleExecution:
        """Options given as a mapping (``single_execution={...}`` on a task) or as is."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(
                f"single_execution must be a dict of options, not {type(value).__name__}."
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise TypeError(
                f"Unknown single_execution option(s) {', '.join(map(repr, unknown))}; "
                f"the options are {', '.join(sorted(known))}."
            )
        return cls(**value)

    @property
    def lease_ttl(self) -> float:
        # The setting is read at every run (override_settings), checked by the shortcut
        # lock() uses for the usual value.
        return self.ttl if self.ttl is not None else _ttl_arg(conf.DEFAULT_TTL)


class SingleExecutionTask(_TaskBase):
    """A Celery task class whose runs hold a lock named from their arguments.

    Use it as ``@app.task(base=SingleExecutionTask, single_execution={...})`` (the
    options of :class:`SingleExecution`), subclass it with a ``single_execution``
    attribute, or let :func:`single_execution` build the task.
    """

    #: Options, as a dict or a :class:`SingleExecution`; checked when the class is made.
    single_execution: ClassVar[Mapping[str, Any] | SingleExecution | None] = None
    _single: ClassVar[SingleExecution] = SingleExecution()

    #: Whether the ``__call__`` after this class's is Celery's own (see :meth:`_body`).
    _body_is_run: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._single = SingleExecution.coerce(cls.single_execution)
        cls._body_is_run = _next_call_is_celerys(cls)

    # -- keys -------------------------------------------------------------------

    @property
    def lease(self) -> Lease | None:
        """The run lock's lease while this task runs in the current context."""
        return current_lease()

    def lock_name(self, args: Any = (), kwargs: Mapping[str, Any] | None = None) -> str:
        """The run lock's name for a call with ``args`` and ``kwargs``.

        Raises ``TypeError``/``ValueError`` saying what to change when the arguments do
        not fit the task's signature or cannot be turned into a key.
        """
        bound = self._arguments(tuple(args or ()), kwargs or {})
        key = self._single.key
        if key is None:
            prefix = self.__dict__.get("_distlocks_key_prefix")
            if prefix is None:
                prefix = self.__dict__["_distlocks_key_prefix"] = _default_prefix(self.name)
            if prefix:
                # The prefix was checked once; a hex digest needs no check.
                return prefix + _digest(self.name, bound)
        # As the message carries them (tuples become lists, dict keys strings), so the
        # publisher and the worker make the same name whatever the serializer.
        arguments = {} if key is None else {p: _as_sent(v) for p, v in bound.items()}
        if key is None:
            name = _default_name(self.name, bound)
        elif isinstance(key, str):
            try:
                name = key.format_map(arguments)
            except (KeyError, AttributeError, IndexError) as exc:
                raise ValueError(
                    f"The key template {key!r} of task {self.name!r} does not fit its "
                    f"arguments ({', '.join(bound) or 'none'}): {exc!r}."
                ) from exc
        else:
            name = key(**arguments)
            if not isinstance(name, str):
                raise TypeError(
                    f"The key callable of task {self.name!r} returned "
                    f"{type(name).__name__}; it must return the lock name as a str."
                )
        try:
            return validate_name(name)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"Task {self.name!r} made an unusable lock name: {exc}") from exc

    def _arguments(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The call's arguments by parameter name, bound to the task's signature with
        its defaults applied; TypeError saying what is wrong when they do not fit."""
        signature = self.__dict__.get("_distlocks_signature")
        if signature is None:
            signature = self.__dict__["_distlocks_signature"] = inspect.signature(self.run)
            self.__dict__["_distlocks_plain_params"] = _plain_params(signature)
        try:
            return _bound(signature, self.__dict__["_distlocks_plain_params"], args, kwargs)
        except TypeError as exc:
            raise TypeError(f"Task {self.name!r} cannot take these arguments: {exc}.") from exc

    def _lock_backend(self, needs_expiry: str = "") -> BaseBackend:
        alias = self._single.backend
        check_alias(alias)
        backend = backends[alias]
        if needs_expiry and not backend.expires_on_server:
            raise ImproperlyConfigured(
                f"Task {self.name!r} uses {needs_expiry}, which needs a backend whose locks "
                f"expire on the server; backend {alias!r} frees a lock only when its holder "
                f"releases it or disconnects. Give the task a Redis backend "
                f"(single_execution backend=...)."
            )
        return backend

    def _holder_task_id(self, backend: BaseBackend, name: str) -> str | None:
        """The Celery task id recorded by the holder of ``name`` (None: free or unknown)."""
        info = backend.inspect(name)
        if info is None or info.extra.get("celery_eager"):
            return None
        return str(info.extra.get("celery_task_id") or "") or None

    # -- enqueue ------------------------------------------------------------------

    def apply_async(
        self,
        args: Any = None,
        kwargs: Mapping[str, Any] | None = None,
        task_id: str | None = None,
        **options: Any,
    ) -> Any:
        """Publish the task; with ``unique_while``, return the existing task's result
        instead of queueing a duplicate. Arguments that cannot make a key raise here,
        before anything is published."""
        single = self._single
        name = self.lock_name(args, kwargs)
        if single.unique_while is None:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        backend = self._lock_backend(f"unique_while={single.unique_while!r}")
        retrying = self._is_own_retry(task_id)
        fresh = task_id is None
        task_id = task_id or str(uuid.uuid4())
        marker, owner = name + QUEUED_SUFFIX, _marker_owner(task_id)
        # An eta years ahead must not make a marker the servers cannot store: past the
        # bound, the duplicate check lapses at MAX_TTL (a year) instead.
        ttl = min(single.unique_ttl + _publish_delay(options), MAX_TTL)
        holder = current_holder()
        holder = type(holder)(
            holder.host, holder.pid, holder.thread,
            {**holder.extra, "celery_task_id": task_id, "celery_task": self.name},
        )  # fmt: skip
        if retrying:
            # self.retry() of the running task, under its own id: the marker is its own
            # (same owner), or a newer copy's in "queued" mode; either way the retry is
            # published, never answered with another task's result.
            taken = backend.acquire(marker, owner, ttl, holder, wait=0.0).acquired
            markers = _republished.get()
            held_by_run = markers is not None and marker in markers
            try:
                published = super().apply_async(args, kwargs, task_id=task_id, **options)
            except BaseException:
                # Not published: nothing may keep duplicates away, but a marker the run
                # holds is the run's to let go, at its end.
                if taken and not held_by_run:
                    backend.release_quietly(marker, owner)
                raise
            if taken and markers is not None:
                # A message of this id is queued now (a retry with throw=False, or
                # self.replace()): the run's end keeps the marker for it.
                markers[marker] = ttl
            return published
        existing = None
        running_check = single.unique_while == "queued_or_running"
        run_lock = name if running_check else None
        if fresh and _together.usable(backend) and self._publish_can_fold(options):
            # The broker on the lock server's database: the check, the marker and the
            # publish in one script, one round trip (None: not here, nothing written).
            folded = _together.publish_with_marker(
                self.app, backend, marker, owner, ttl, holder, run_lock,
                lambda producer: super(SingleExecutionTask, self).apply_async(
                    args, kwargs, task_id=task_id, producer=producer, **options
                ),
            )  # fmt: skip
            if folded is not None:
                kind, found = folded
                if kind == _together.SENT:
                    return found
                self._unsubscribe(task_id, options)  # never published: nothing to wait for
                if not found:  # the marker is held, by no task: nothing to return
                    raise LockNotAcquired(marker, backend.alias, 0)
                return self._deduplicated(found, name, task_id, args, kwargs, options)
        # On Redis, the check and the marker are one script: one round trip.
        together = (
            _together.enqueue(backend, marker, owner, ttl, holder, run_lock)
            if _together.usable(backend)
            else None
        )
        if together is not None:
            kind, found = together
            if kind == _together.TAKEN:
                if not found.acquired:
                    raise LockNotAcquired(marker, backend.alias, 0)
            elif not found:  # the marker is held, by no task: nothing to return
                raise LockNotAcquired(marker, backend.alias, 0)
            else:
                existing = found
        elif running_check:
            # A run that no marker covers (started by apply(), send_task(), or after
            # its marker ran out, or a retry's countdown): it is the task to return.
            # Checked *before* the marker is taken, so a taken marker is never given
            # back and no caller sees the id of a message that is not published.
            existing = self._holder_task_id(backend, name)
        if existing is None and together is None:
            for _attempt in range(5):
                if backend.acquire(marker, owner, ttl, holder, wait=0.0).acquired:
                    break
                existing = self._holder_task_id(backend, marker)
                if existing is not None:
                    break
                # The marker went away between the two calls (the run ended): try again.
            else:
                raise LockNotAcquired(marker, backend.alias, 0)
        if existing is not None and existing != task_id:
            return self._deduplicated(existing, name, task_id, args, kwargs, options)
        try:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        except BaseException:
            # Not published: nothing may keep duplicates away.
            backend.release_quietly(marker, owner)
            raise

    def _publish_can_fold(self, options: Mapping[str, Any]) -> bool:
        """Whether this call's publish may go in the marker's script: published to the
        app's broker through its producer pool (not a caller's producer or connection,
        not run eagerly), by a call whose result backend does nothing for it before
        the publish, or only subscribes to its result (Redis), which
        :meth:`_unsubscribe` undoes for a call answered with another task's id. (RPC
        declares its reply queue, shared by every call: the plain path.)

        Not while anything listens to ``before_task_publish``: Celery sends it before
        the publish, so a duplicate answered from inside it would be heard of by
        receivers that never hear ``after_task_publish`` (tracing opens a span in the
        one and closes it in the other), and a call the fold gives back to the plain
        path would be heard of twice."""
        if "producer" in options or "connection" in options or self.app.conf.task_always_eager:
            return False
        if before_task_publish.has_listeners(self.name):
            return False
        results = self.backend
        return (
            bool(options.get("ignore_result", self.ignore_result))
            or type(results).on_task_call is _ResultBackend.on_task_call
            or (_RedisResults is not None and isinstance(results, _RedisResults))
        )

    def _unsubscribe(self, task_id: str, options: Mapping[str, Any]) -> None:
        """Undo what Celery's publish did for ``task_id`` before its message turned out
        to be a duplicate's, never sent: the Redis result backend's subscription to its
        result (the call returns another task's id; nobody will wait for this one)."""
        results = self.backend
        if (
            not options.get("ignore_result", self.ignore_result)
            and _RedisResults is not None
            and isinstance(results, _RedisResults)
        ):
            results.result_consumer.cancel_for(task_id)

    def _is_own_retry(self, task_id: str | None) -> bool:
        """Whether this publish is ``self.retry()`` of the run in progress."""
        if task_id is None or self.request_stack is None:
            # No request stack: Celery binds a task class on its first use, and a thread
            # can find it registered before another thread has bound it. Celery's own
            # publish needs no request then, and a task not yet bound is not running.
            return False
        request = self.request
        return not request.called_directly and request.id == task_id

    def _deduplicated(
        self,
        existing: str,
        name: str,
        task_id: str,
        args: Any,
        kwargs: Mapping[str, Any] | None,
        options: Mapping[str, Any],
    ) -> Any:
        """The answer to a duplicate call: the existing task's result, or, for a call
        that carries a canvas, its own id failed with :class:`Deduplicated`."""
        if not any(options.get(option) for option in CANVAS_OPTIONS):
            logger.info("Task %s: duplicate of task %s, not queued", self.name, existing)
            return self.AsyncResult(existing)
        # The link, chain, group or chord expects this id to finish. Celery offers no way
        # to hang callbacks on a message already sent, so the call fails here, in the
        # result backend, the way a failed run would: the rest of the chain is marked
        # failed, link_error callbacks run and the chord's counter moves.
        exc = Deduplicated(self.name, name, self._single.backend, existing)
        request = Context(
            id=task_id, task=self.name, args=list(args or ()), kwargs=dict(kwargs or {}),
            chain=options.get("chain"), chord=options.get("chord"),
            errbacks=_as_list(options.get("link_error")), callbacks=_as_list(options.get("link")),
            group=options.get("group_id"), group_index=options.get("group_index"),
            root_id=options.get("root_id") or task_id, parent_id=options.get("parent_id"),
            delivery_info={}, ignore_result=False, hostname=None, reply_to=None,
        )  # fmt: skip
        logger.warning("Task %s[%s] not queued: %s", self.name, task_id, exc)
        self.backend.mark_as_failure(task_id, exc, request=request)
        return self.AsyncResult(task_id)

    # -- run --------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = self.lock_name(args, kwargs)
        if name in _running.get():
            # A nested run of the same key in this context (an eager self.retry()):
            # the outer run already holds the lock.
            return super().__call__(*args, **kwargs)
        request = self.request
        task_id = str(request.id) if not request.called_directly and request.id else None
        attempt = int(request.retries or 0) if task_id else 0
        extra = {"celery_task": self.name}
        if task_id:
            extra["celery_task_id"] = task_id
            extra["celery_attempt"] = str(attempt)
            if request.is_eager and not self.app.conf.task_store_eager_result:
                # Run by apply(): no result is stored under this id, so a duplicate
                # call must not be handed it (it would wait on PENDING for ever).
                extra["celery_eager"] = "1"
        # Locks taken inside the task record it too (the admin page shows it).
        scope = holder_extra.set({**holder_extra.get(), **extra})
        try:
            single = self._single
            backend = self._lock_backend()
            if single.lock_at_least_for is not None:
                self._lock_backend("lock_at_least_for")
            ttl = single.lease_ttl
            # With "queued_or_running" the marker is taken over first (its owner is
            # this task id): through a redelivery's wait for a dead worker's lease, the
            # key stays covered. Not for a run by apply() whose result is not stored:
            # a duplicate call is then published (and meets the run lock), never
            # handed an id that would stay PENDING. With "queued" it is let go once
            # the run lock (or the duplicate holding it) covers the key.
            hold = bool(
                single.unique_while == "queued_or_running"
                and task_id
                and "celery_eager" not in extra
            )
            drop = bool(single.unique_while == "queued" and task_id)
            marker: Lease | None = None
            first: tuple[Lease | None, Lease | None] | None = None
            # The run lock's owner, one for every attempt of this run: where the first
            # attempt's reply was lost (the connection broke, and again on the resend),
            # the server may hold the lock for it, and the plain attempt that follows
            # is then answered as that grant's owner, not made to wait out its lease.
            owner = new_owner()
            if (hold or drop) and _together.usable(backend) and not transactions.pending:
                # On Redis, the marker's call and the first attempt at the run lock
                # go in one round trip, in the same order.
                first = self._first_together(backend, name, str(task_id), ttl, hold, owner)
            if first is not None:
                lease, marker = first
                if hold and marker is None:
                    self._marker_taken(name, str(task_id))
                drop = False
            elif hold:
                marker = self._hold_marker(name, str(task_id))
            try:
                if first is not None and lease is not None:
                    redelivered = False
                else:
                    lease, redelivered = self._take_run_lock(
                        backend, name, task_id, attempt, ttl, owner, tried=first is not None
                    )
            except BaseException:
                _end_marker(marker)
                raise
            finally:
                if drop:
                    backend.release_quietly(name + QUEUED_SUFFIX, _marker_owner(str(task_id)))
            if lease is None:
                if redelivered:
                    # Our own earlier delivery is alive and holds the lock: this one
                    # writes no state, so the real run's result is the one stored. The
                    # marker is that delivery's too: leave it to its renewal.
                    _end_marker(marker, keep=ttl)
                    raise Ignore()
                _end_marker(marker)
                return self._duplicate(name, attempt)
            return self._run(lease, marker, name, args, kwargs)
        finally:
            holder_extra.reset(scope)

    def _first_together(
        self, backend: BaseBackend, name: str, task_id: str, ttl: float, hold: bool, owner: str
    ) -> tuple[Lease | None, Lease | None] | None:
        """The first attempt at the run lock (as ``owner``) and the marker's call in one
        round trip: (the run lock's lease or None, the marker held with ``hold`` or
        None), or None where they could not be sent together (the caller makes them
        one by one, the run lock's as the same ``owner``: the server may have run
        these)."""
        if not hold and not _together.two_slots(backend):
            return None  # the run start's script names the keys of two slots
        marker_name, marker_owner = name + QUEUED_SUFFIX, _marker_owner(task_id)
        began = time.monotonic()
        holder = current_holder()
        calls: list[tuple[Any, list[str], list[Any]]]
        if hold:
            calls = [
                _together.acquire_call(backend, marker_name, marker_owner, ttl, holder),
                _together.acquire_call(backend, name, owner, ttl, holder),
            ]
        else:
            # The marker let go and the run lock taken in one script.
            start = _together.run_start_call(
                backend, name, owner, ttl, holder, marker_name, marker_owner
            )
            calls = [start]
        try:
            replies = _together.send_together(backend, calls)
        except Exception as exc:
            if hold:  # in doubt, like the run lock: given back (that request only)
                _together.acquire_error(backend, marker_name, marker_owner, exc, calls[0][2])
            error = _together.acquire_error(backend, name, owner, exc, calls[-1][2])
            _not_acquired(backend, name, began, error)
            raise error from exc
        if replies is None or (not hold and _together.refused_two_slots(backend, replies[0])):
            return None  # (refused: nothing ran)
        run_reply = replies[-1]
        marker_reply = replies[0]
        if not hold and not isinstance(run_reply, Exception):
            run_reply, marker_error = _together.run_started(run_reply)
            if marker_error:
                logger.warning("Could not release queue marker %r: %s", marker_name, marker_error)
        try:
            if hold and isinstance(marker_reply, Exception):
                _together.acquired(  # raises
                    backend, marker_name, marker_owner, marker_reply, calls[0][2]
                )
            result = _together.acquired(backend, name, owner, run_reply, calls[-1][2])
        except LockError as error:
            # Nothing half-done stays behind: what was granted is given back.
            if not isinstance(run_reply, Exception) and run_reply[0]:
                backend.release_quietly(name, owner)
            if hold and not isinstance(marker_reply, Exception) and marker_reply[0]:
                backend.release_quietly(marker_name, marker_owner)
            _not_acquired(backend, name, began, error)
            raise
        marker = None
        if hold:
            held = _together.acquired(backend, marker_name, marker_owner, marker_reply, calls[0][2])
            if held.acquired:
                marker = _granted(backend, marker_name, marker_owner, ttl, held, began)
        try:
            lease = _granted(backend, name, owner, ttl, result, began, signal=True)
        except BaseException:
            # A failing lock_acquired receiver gave the run lock back: the run never
            # starts, so the marker taken over for it is let go too (else its renewal
            # would keep it for as long as this process lives).
            _end_marker(marker)
            raise
        return lease, marker

    def _hold_marker(self, name: str, task_id: str) -> Lease | None:
        """The queue marker of ``task_id``, held (renewed like the run lock) for as long
        as its run lasts, with ``"queued_or_running"``."""
        marker = name + QUEUED_SUFFIX
        held = _hold(self._lock_backend(), marker, _marker_owner(task_id), self._single.lease_ttl)
        if held is None:
            self._marker_taken(name, task_id)
        return held

    def _marker_taken(self, name: str, task_id: str) -> None:
        logger.warning(
            "Task %s[%s]: its queue marker %r ran out and was taken by another call; "
            "that call's message will meet the run lock.",
            self.name, task_id, name + QUEUED_SUFFIX,
        )  # fmt: skip

    def _take_run_lock(
        self,
        backend: BaseBackend,
        name: str,
        task_id: str | None,
        attempt: int,
        ttl: float,
        owner: str,
        *,
        tried: bool = False,
    ) -> tuple[Lease | None, bool]:
        """The run lock's lease (None: a duplicate), and whether the lock is held by
        an earlier delivery of this very message that is still alive. ``owner``: the
        first attempt's. ``tried``: the first attempt was made already, and the lock
        was busy."""
        single = self._single
        if not tried:
            lease = _try_lease(backend, name, ttl, owner)
            if lease is not None:
                return lease, False
        run_lock = Lock(name, backend=single.backend, ttl=ttl)
        info = backend.inspect(name) if task_id else None
        if info is not None and str(info.extra.get("celery_task_id") or "") == task_id:
            held_attempt = _attempt_of(info.extra)
            if held_attempt is not None and held_attempt < attempt:
                # Our previous attempt kept the lock through its retry's countdown,
                # so no copy could take the key: take it over (with a new token). Only
                # a lock it parked (kept, not running): an attempt that retried with
                # throw=False, or caught its Retry, is still running the body.
                if info.extra.get("kept") and backend.release(name, info.owner):
                    with _suppress_not_acquired():
                        return run_lock.acquire(timeout=0), False
                # Still running, or a copy got in when it was free: handled as a
                # duplicate below (a retried attempt is retried again, never skipped).
            else:
                # An earlier delivery of this very message holds it: its worker died
                # (acks_late redelivery) or still runs past the broker's visibility
                # timeout. A dead holder's lease runs out within its ttl; wait for that.
                logger.info(
                    "Task %s[%s]: an earlier delivery holds lock %r; waiting up to its ttl",
                    self.name, task_id, name,
                )  # fmt: skip
                with _suppress_not_acquired():
                    return run_lock.acquire(timeout=ttl + 1.0), False
                return None, True
        if single.timeout > 0:
            with _suppress_not_acquired():
                return run_lock.acquire(timeout=single.timeout), False
        return None, False

    def _duplicate(self, name: str, attempt: int) -> Any:
        single = self._single
        holder = self._holder_task_id(self._lock_backend(), name) or ""
        exc = AlreadyRunning(self.name, name, single.backend, holder)
        policy = single.on_duplicate
        if policy == "skip" and attempt > 0:
            # A retried run's work was never done: reporting it as done (SUCCESS/None)
            # would lose it. Retry again; when retries run out it fails with the reason.
            policy = "retry"
        if policy == "skip":
            logger.info("Skipped task %s[%s]: %s", self.name, self.request.id, exc)
            return None
        if policy == "retry":
            raise self.retry(countdown=single.retry_countdown, exc=exc)
        raise exc

    def _run(
        self,
        lease: Lease,
        marker: Lease | None,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        fence = fencing.enter(lease)
        current = _current.set(lease)
        running = _running.set(_running.get() | {name})
        markers: dict[str, float | None] = {} if marker is None else {marker.name: None}
        republished = _republished.set(markers)
        started = time.monotonic()
        try:
            if self._single.claim is not None:
                self._claim(lease, args, kwargs)
            result = self._body(args, kwargs)
        except Retry as exc:
            _republished.reset(republished)
            _running.reset(running)
            _current.reset(current)
            fencing.leave(fence)
            self._keep_for_retry(lease, marker, exc, started)
            raise
        except BaseException:
            _republished.reset(republished)
            _running.reset(running)
            _current.reset(current)
            fencing.leave(fence)
            self._finish_run(lease, marker, started, body_failed=True, markers=markers)
            raise
        _republished.reset(republished)
        _running.reset(running)
        _current.reset(current)
        fencing.leave(fence)
        self._finish_run(lease, marker, started, body_failed=False, markers=markers)
        return result

    def _body(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The task's body, as Celery's ``Task.__call__`` runs it.

        Under Celery's tracer (a worker, ``apply()``) the request is on the stack
        already: a worker with its optimisations skips ``Task.__call__`` then, by this
        same rule (``celery.app.trace._install_stack_protection``), and so does this,
        where the tracer runs without them (``apply()``, a worker's ``Request`` used
        directly): that call would only push a copy of the same request (a second
        ``Context`` and its headers, about 20 us a run). A direct call, a nested call
        of the task from its own body, or a class whose ``__call__`` between this one
        and Celery's has work of its own, goes through ``super().__call__``."""
        if type(self)._body_is_run:
            stack = self.request_stack
            request = stack.top
            if (
                request is not None
                and not request._protected
                and len(stack) == 1
                and not request.called_directly
            ):
                request._protected = 1
                return self.run(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def _finish_run(
        self,
        lease: Lease,
        marker: Lease | None,
        started: float,
        *,
        body_failed: bool,
        markers: Mapping[str, float | None],
    ) -> None:
        """The end of a run: the run lock released (or kept, see :meth:`_finish`), then
        the marker kept for it; on Redis both releases in one round trip. A marker that
        a message of the run's own id took meanwhile (``self.replace()``, a retry with
        ``throw=False``) is kept for that message instead."""
        keep = None if marker is None else markers.get(marker.name)
        if (
            marker is not None
            and keep is None
            and self._single.lock_at_least_for is None
            and _together.usable(lease._backend)  # type: ignore[arg-type]
        ):
            lease.held()  # notices a lease that ran out while the body ran
            try:
                freed = _together.release_both(lease, marker)
            except LockError:
                if not body_failed:
                    raise
                logger.exception("Could not release lock %r after an error in its task", lease.name)
                return
            if freed is not None:
                problem = _exit_problem(lease, body_failed)
                if problem is not None:
                    raise problem
                return
        try:
            self._finish(lease, started, body_failed=body_failed)
        finally:
            _end_marker(marker, keep=keep)

    def _claim(self, lease: Lease, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Claim the rows the run will change, with the run lock's token."""
        claim = self._single.claim
        assert claim is not None
        targets = claim(**self._arguments(args, kwargs))
        if targets is None:
            return
        if not isinstance(targets, list | tuple):
            targets = (targets,)
        if targets:
            lease.claim(*targets)

    def _keep_for_retry(
        self, lease: Lease, marker: Lease | None, retry: Retry, started: float
    ) -> None:
        """``self.retry()``: keep the run lock (and the marker) until the retry runs,
        so that no copy can take the key during the countdown."""
        backend = self._lock_backend()
        if retry.is_eager or not backend.expires_on_server or not lease.held():
            # An eager retry has already run; a lock that never expires on the server
            # cannot be left behind (a retried run that then finds a copy retries again).
            try:
                self._finish(lease, started, body_failed=True)
            finally:
                _end_marker(marker)
            return
        delay = _until(retry.when)
        try:
            lease.release_after(min(delay + self._single.lease_ttl, MAX_TTL))
        except LockError:
            logger.exception("Could not keep lock %r for the retry of %s", lease.name, self.name)
            finish_lease(lease, body_failed=True)
        if marker is not None:
            try:
                marker.release_after(min(delay + self._single.unique_ttl, MAX_TTL))
            except LockError:
                logger.warning("Could not keep queue marker %r", marker.name, exc_info=True)

    def _finish(self, lease: Lease, started: float, *, body_failed: bool) -> None:
        """Release the run lock, or with ``lock_at_least_for`` leave it to expire then.

        A lease lost while the body ran raises LockLost here unless the body raised.
        """
        at_least = self._single.lock_at_least_for
        if at_least is not None:
            left = at_least - (time.monotonic() - started)
            if left >= 0.01 and lease.held():
                try:
                    lease.release_after(left)
                    return
                except LockError:
                    if not body_failed:
                        raise
                    logger.exception("Could not keep lock %r after task %s", lease.name, self.name)
                    return
        finish_lease(lease, body_failed=body_failed)


def _next_call_is_celerys(cls: type) -> bool:
    """Whether the first ``__call__`` after :class:`SingleExecutionTask`'s in ``cls``'s
    method order is Celery's ``Task.__call__`` (its own, or the worker's patch of it),
    which :meth:`SingleExecutionTask._body` may stand in for."""
    mro = cls.__mro__
    for klass in mro[mro.index(SingleExecutionTask) + 1 :]:
        if "__call__" in vars(klass):
            return klass is Task
    return False


SingleExecutionTask._body_is_run = _next_call_is_celerys(SingleExecutionTask)


def single_execution(
    func: Callable[..., Any] | None = None,
    /,
    *,
    key: str | Callable[..., str] | None = None,
    ttl: float | None = None,
    backend: str = "default",
    timeout: float = 0.0,
    on_duplicate: str = "skip",
    retry_countdown: float = 10.0,
    unique_while: str | None = None,
    unique_ttl: float = 3600.0,
    lock_at_least_for: float | None = None,
    claim: Callable[..., Any] | None = None,
    app: Any = None,
    **task_options: Any,
) -> Any:
    """Make a Celery task of ``func`` that runs at most once at a time per key.

    Use it in place of ``@shared_task`` (or ``@app.task`` with ``app=``); the
    options are those of :class:`SingleExecution`, and any other keyword argument
    (``bind``, ``name``, ``acks_late``, ``time_limit``...) goes to Celery::

        @single_execution(key="report:{day}", ttl=60, bind=True)
        def nightly_report(self, day): ...
    """
    _refuse_misspelt_options(task_options)
    options = SingleExecution(
        key=key, ttl=ttl, backend=backend, timeout=timeout, on_duplicate=on_duplicate,
        retry_countdown=retry_countdown, unique_while=unique_while, unique_ttl=unique_ttl,
        lock_at_least_for=lock_at_least_for, claim=claim,
    )  # fmt: skip
    base = task_options.pop("base", SingleExecutionTask)
    if not (isinstance(base, type) and issubclass(base, SingleExecutionTask)):
        raise TypeError(f"base must be a subclass of SingleExecutionTask, not {base!r}.")

    def decorate(fn: Callable[..., Any]) -> Any:
        if isinstance(fn, Task) or issubclass(type(fn), Proxy):
            raise TypeError(
                "single_execution() makes the Celery task itself: use it in place of "
                "@app.task/@shared_task (passing task options to it), or use "
                "@app.task(base=SingleExecutionTask, single_execution={...})."
            )
        if not callable(fn):
            raise TypeError(f"single_execution() decorates a function, not {fn!r}.")
        factory = shared_task if app is None else app.task
        return factory(base=base, single_execution=options, **task_options)(fn)

    return decorate if func is None else decorate(func)


# -- helpers ------------------------------------------------------------------


def _refuse_misspelt_options(task_options: Mapping[str, Any]) -> None:
    """Refuse a keyword that looks like a misspelt option of ours (``on_duplicat=``).

    single_execution() hands the keywords it does not know to Celery, which takes any
    name as a task attribute: the option meant would silently keep its default. Names
    Celery's Task has are left alone, and none of Celery's is this close to ours."""
    ours = [f.name for f in fields(SingleExecution)]
    for name in task_options:
        if hasattr(Task, name):
            continue
        close = difflib.get_close_matches(name, ours, n=1, cutoff=0.6)
        if close:
            raise TypeError(
                f"single_execution() got {name!r}: did you mean {close[0]!r}? Its other "
                "keyword arguments go to Celery, which would accept the name silently."
            )


def _marker_owner(task_id: str) -> str:
    """The queue marker's owner: the task id, so a retry (same id) re-takes it."""
    return f"celery-task:{task_id}"


def _hold(backend: BaseBackend, name: str, owner: str, ttl: float) -> Lease | None:
    """A renewed lease on ``name`` for ``owner``, who may hold it already (the queue
    marker a worker keeps for the run it covers); None if someone else holds it."""
    started = time.monotonic()
    result = backend.acquire(name, owner, ttl, current_holder(), wait=0.0)
    if not result.acquired:
        info = backend.inspect(name)
        # Not every backend treats a second acquire by the same owner as a success.
        if info is None or info.owner != owner or not backend.extend(name, owner, ttl):
            return None
        result = AcquireResult(True, info.fencing_token, ttl)
    lease, _ = _renewed_lease(backend, name, owner, ttl, result, started)
    return lease


def _renewed_lease(
    backend: BaseBackend, name: str, owner: str, ttl: float, result: AcquireResult, started: float
) -> tuple[Lease, float | None]:
    """The lease of a grant, registered for renewal when it needs it; with when its
    first renewal is due (None: it is not renewed)."""
    lease = Lease(
        backend=backend, name=name, owner=owner, fencing_token=result.fencing_token,
        ttl=ttl, started=started, remaining=result.remaining,
    )  # fmt: skip
    due = lease._renewal_due()
    if due is not None:
        renewer(backend.alias).add(lease, due)
    return lease, due


def _try_lease(
    backend: BaseBackend, name: str, ttl: float, owner: str | None = None
) -> Lease | None:
    """One attempt at the run lock: what ``Lock(name, ttl=ttl).acquire(timeout=0)``
    does (the same lease, renewal, signals), without the lock object and its checks,
    which the task's options passed once. None if the lock is busy. ``owner``: an
    earlier attempt's whose answer was lost (a grant to it is this attempt's)."""
    if transactions.pending:
        # A lock released inside a transaction that has not ended may be this one:
        # lock() knows how to take it back.
        with _suppress_not_acquired():
            return Lock(name, backend=backend.alias, ttl=ttl).acquire(timeout=0)
        return None
    began = time.monotonic()
    owner = owner or new_owner()
    try:
        result = backend.acquire(name, owner, ttl, current_holder(), wait=0.0)
    except LockError as exc:
        _not_acquired(backend, name, began, exc)
        raise
    return _granted(backend, name, owner, ttl, result, began, signal=True)


def _granted(
    backend: BaseBackend,
    name: str,
    owner: str,
    ttl: float,
    result: AcquireResult,
    began: float,
    *,
    signal: bool = False,
) -> Lease | None:
    """The lease of a grant (None: not granted), renewed in the background, as
    :func:`~distlocks.locks.acquire_lease` makes it; with ``signal``, the
    ``lock_acquired``/``lock_not_acquired`` receivers hear of it (not for markers)."""
    if not result.acquired:
        if signal:
            _not_acquired(backend, name, began, LockNotAcquired(name, backend.alias, 0))
        return None
    # Nothing expires on the server: the local lease starts at the grant.
    started = began if backend.expires_on_server else time.monotonic()
    lease, due = _renewed_lease(backend, name, owner, ttl, result, started)
    if due is None and not backend.expires_on_server:
        # Dropped without a release, it is released then (as lock() guards it).
        weakref.finalize(lease, _when_dropped, backend, name, owner, lease._ended)
    if signal:
        announce_acquired(lease, began)
    return lease


def _end_marker(marker: Lease | None, keep: float | None = None) -> None:
    """Give back the queue marker kept for a run that has ended (with ``keep``: stop
    renewing it and let it run out that many seconds from now)."""
    if marker is None:
        return
    try:
        if keep is None:
            marker.release()
        else:
            marker.release_after(keep)
    except LockError:  # it runs out by itself within the run lock's ttl
        logger.warning("Could not release queue marker %r", marker.name, exc_info=True)


class _suppress_not_acquired(contextlib.suppress):
    """``with _suppress_not_acquired(): return lock.acquire(...)``: go on if busy."""

    def __init__(self) -> None:
        super().__init__(LockNotAcquired)


def _as_list(value: Any) -> list[Any] | None:
    """A ``link``/``link_error`` option (one signature or several) as a list."""
    if not value:
        return None
    return list(value) if isinstance(value, list | tuple) else [value]


def _attempt_of(extra: Mapping[str, Any]) -> int | None:
    """The retry number recorded with a run lock (None: not recorded)."""
    try:
        return int(extra["celery_attempt"])
    except (KeyError, TypeError, ValueError):
        return None


def _until(when: Any) -> float:
    """Seconds until a retry's ``when`` (a countdown, an eta, or None)."""
    if isinstance(when, dt.datetime):
        return _publish_delay({"eta": when})
    try:
        return max(0.0, float(when or 0))
    except (TypeError, ValueError):
        return 0.0


def _publish_delay(options: Mapping[str, Any]) -> float:
    """Seconds until a message published with these options may run."""
    eta = options.get("eta")
    if eta is not None:
        if isinstance(eta, str):
            eta = dt.datetime.fromisoformat(eta)
        if eta.tzinfo is None:
            eta = eta.replace(tzinfo=dt.UTC)
        return max(0.0, (eta - dt.datetime.now(dt.UTC)).total_seconds())
    countdown = options.get("countdown")
    return max(0.0, float(countdown)) if countdown else 0.0


def _plain_params(signature: inspect.Signature) -> tuple[tuple[str, Any], ...] | None:
    """(name, default) of each parameter where all are plain ones (positional or
    keyword, the usual task signature), for :func:`_bound`; None otherwise."""
    params = signature.parameters.values()
    if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
        return None
    return tuple((p.name, p.default) for p in params)


def _bound(
    signature: inspect.Signature,
    plain: tuple[tuple[str, Any], ...] | None,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> dict[str, Any]:
    """``signature.bind(*args, **kwargs)`` with its defaults applied, as a dict. A
    signature of ``plain`` parameters is bound here, in a few microseconds where
    ``bind()`` takes about ten (twice a run: publish and worker); any call it cannot
    bind that way (too many arguments, one missing, unknown or given twice) goes to
    ``bind()``, which binds it or raises its own TypeError."""
    if plain is not None and len(args) <= len(plain):
        out: dict[str, Any] = {}
        given = len(args)
        used = 0
        for i, (name, default) in enumerate(plain):
            if i < given:
                out[name] = args[i]
            elif name in kwargs:
                out[name] = kwargs[name]
                used += 1
            elif default is not inspect.Parameter.empty:
                out[name] = default
            else:
                break
        else:
            if used == len(kwargs):
                return out
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _as_sent(value: Any) -> Any:
    """``value`` with the shapes a JSON message gives it: tuples as lists, dict keys as
    strings (as JSON writes them); anything else as it is."""
    if isinstance(value, list | tuple):
        return [_as_sent(item) for item in value]
    if isinstance(value, dict):
        return {
            (key if isinstance(key, str) else json.dumps(key, default=str)): _as_sent(item)
            for key, item in value.items()
        }
    return value


def _default_name(task_name: str, arguments: Mapping[str, Any]) -> str:
    """``celery:<task name>:<digest>``: readable, stable, and short enough."""
    room = MAX_NAME_LENGTH - len(KEY_PREFIX) - _DIGEST_LENGTH - 1
    return f"{KEY_PREFIX}{task_name[:room]}:{_digest(task_name, arguments)}"


def _default_prefix(task_name: str) -> str:
    """``celery:<task name>:`` of the default names, checked as a lock name ("" when it
    is not one: the full name is then checked, and refused, at every call)."""
    room = MAX_NAME_LENGTH - len(KEY_PREFIX) - _DIGEST_LENGTH - 1
    prefix = f"{KEY_PREFIX}{task_name[:room]}:"
    try:
        validate_name(prefix)
    except (TypeError, ValueError):
        return ""
    return prefix


def _digest(task_name: str, arguments: Mapping[str, Any]) -> str:
    """The digest of the default names: the arguments as canonical JSON (and the task's
    name where it is too long to show whole), hashed."""
    encoded = json.dumps(
        {param: _canonical(value, task_name, param) for param, value in arguments.items()},
        sort_keys=True,
        separators=(",", ":"),
        allow_nan=False,
    )
    room = MAX_NAME_LENGTH - len(KEY_PREFIX) - _DIGEST_LENGTH - 1
    if len(task_name) > room:
        # The name is cut short in the key: the digest covers it whole, so two tasks
        # whose long names share a beginning never share a lock.
        encoded = f"{task_name}\x00{encoded}"
    return hashlib.sha256(encoded.encode()).hexdigest()[:_DIGEST_LENGTH]


def _canonical(value: Any, task: str, path: str) -> Any:
    """``value`` as the JSON-like data a Celery message carries it as, so the key made
    when publishing equals the key made by the worker from the decoded message.

    Tuples become lists and sets sorted lists; Decimal, UUID and dates become
    strings. Anything else is refused: its ``str()`` is not a stable identity.
    """
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"Argument {path} of task {task!r} is {value!r}; it cannot be a key.")
        return value
    if isinstance(value, list | tuple):
        return [_canonical(item, task, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, set | frozenset):
        items = [_canonical(item, task, f"{path}{{}}") for item in value]
        return sorted(items, key=lambda item: json.dumps(item, sort_keys=True))
    if isinstance(value, Mapping):
        out = {}
        for k, item in value.items():
            if not isinstance(k, str | int | float | bool) and k is not None:
                raise TypeError(
                    f"Argument {path} of task {task!r} has a {type(k).__name__} dict key; "
                    f"keys must be str, int, float, bool or None to make a lock key."
                )
            text = k if isinstance(k, str) else json.dumps(k)
            out[text] = _canonical(item, task, f"{path}[{k!r}]")
        return out
    if isinstance(value, Decimal | UUID):
        return str(value)
    if isinstance(value, dt.date | dt.time):  # datetime is a date
        return value.isoformat()
    raise TypeError(
        f"Argument {path} of task {task!r} is a {type(value).__module__}."
        f"{type(value).__qualname__}, which cannot be turned into a lock key. Pass "
        f"JSON-like values (str, int, float, bool, None, list, dict, Decimal, UUID, "
        f"date/time), e.g. a model's pk instead of the instance, or give the task "
        f"key=... naming the lock yourself."
    )
