"""Redlock backend: a lock is held when a majority of N independent Redis masters hold it.

Each master is driven by a :class:`~distlocks.backends.redis.RedisBackend` of its
own, on the single-node key layout: release, force release and leaving the wait
queue are the single-node Lua scripts; acquire wraps the single-node one, and this
module adds three of its own (confirm a grant, give back, extend). Around them, the
quorum:

* every request goes to all masters at once (one thread pool per master, so a
  hung master only backs up its own pool), and each round waits at most the
  socket timeout for answers;
* an acquisition needs ``N // 2 + 1`` grants, and its validity is what is left
  of the ttl after the round trips and a clock-drift allowance; a failed attempt
  gives back every grant it got, so no master keeps a partial lock;
* the attempts of one waiting acquisition share its owner, so every request also
  carries the attempt's id, and each entry records the newest step of its owner
  that made it its own: an attempt, or the lease once renewed. A request of an
  older step (a give-back, confirmation or grant that arrives late) changes
  nothing, so it cannot free or shorten what a newer attempt or the lease counts on;
* release and renewal succeed when a quorum confirms them, and report the lease
  gone only when so many masters deny it that no quorum can hold it; when the
  masters that did not answer decide it, they raise LockBackendUnavailable;
* fencing tokens: each master mints ``max(last + 1, its clock in µs)`` as the
  single-node backend does; the grant takes the largest token of its quorum and,
  in a second short round, raises the counter of every granting master to that
  token, while its own entry is still there. Any later
  quorum shares a master with this one, and that master can only grant after
  this lease ended there, so it mints above the token. See ``docs/backends.md``.

Redlock survives the crash of a minority of masters. It does not survive a
client paused past its lease or a master clock that jumps: fencing tokens, checked
by the storage, are still what keeps those cases safe.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import datetime as dt
import itertools
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar
from urllib.parse import urlsplit

from django.core.checks import CheckMessage, Warning

from distlocks.backends.base import AcquireResult, BaseBackend, Holder, LockInfo
from distlocks.backends.redis import _NEXT_TOKEN, RELEASE, RedisBackend
from distlocks.backends.redis import ACQUIRE as SINGLE_ACQUIRE
from distlocks.exceptions import LockBackendUnavailable, LockError
from distlocks.redaction import redact_url

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: The ID of the system-check warning for an even number of masters.
W_EVEN_MASTERS = "distlocks.W002"
EVEN_MASTERS = (
    "A Redlock backend with an even number of masters tolerates no more failures than one fewer."
)

MIN_MASTERS = 3
DEFAULT_DRIFT_FACTOR = 0.01
DEFAULT_DRIFT_MARGIN = 0.002
#: Upper bound of the random pause before retrying after a split vote, in seconds.
RETRY_JITTER = 0.03
#: Threads per master; a call that finds them all busy waits its turn (bounded by the
#: round's deadline, after which it counts as not answered).
THREADS_PER_MASTER = 32
_REDIS_OPTIONS = frozenset(
    {"socket_timeout", "socket_connect_timeout", "key_prefix", "client_kwargs"}
)
_OPTIONS = _REDIS_OPTIONS | {"drift_factor", "drift_margin"}
_SCHEMES = ("redis", "rediss", "unix")

# Every request of an acquisition attempt carries the attempt's id, and every entry
# records the id of the step of its owner that last made it its own: an attempt
# (ids grow, see _next_attempt) or, once renewed, the lease ('lease'). A request of
# an older step than the entry's is stale: it changes nothing.
_OURS = """
local function ours(lock, owner, attempt)
  local entry = redis.call('HMGET', lock, 'owner', 'attempt')
  if entry[1] ~= owner then return false end
  return entry[2] ~= 'lease' and (tonumber(entry[2]) or 0) <= tonumber(attempt)
end
"""

# KEYS and ARGV as the single-node acquire, plus a last ARGV: the attempt id.
# The single-node script, except for an entry its owner holds already: a newer attempt
# takes it over (the older attempt failed, and its late give-back and confirmation
# must then miss it), while a stale request leaves it as it is and is refused.
ACQUIRE = (
    _OURS
    + _NEXT_TOKEN
    + """
local attempt = ARGV[#ARGV]
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  if not ours(KEYS[1], ARGV[1], attempt) then
    return {0, 0, redis.call('PTTL', KEYS[1])}
  end
  redis.call('HSET', KEYS[1], 'attempt', attempt)
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  local t = redis.call('TIME')
  local t_ms = t[1] * 1000 + math.floor(t[2] / 1000)
  keep_fence(KEYS[2], t_ms + tonumber(ARGV[2]), t_ms)
  if tonumber(ARGV[8]) > 0 or ARGV[9] == '1' then
    -- As a fresh grant does: the owner is no longer waiting here.
    redis.call('ZREM', KEYS[3], ARGV[1])
    redis.call('ZREM', KEYS[4], ARGV[1])
  end
  return {1, tonumber(redis.call('HGET', KEYS[1], 'token')), tonumber(ARGV[2])}
end
local function single_node()
"""
    + SINGLE_ACQUIRE
    + """
end
local reply = single_node()
if reply[1] == 1 then redis.call('HSET', KEYS[1], 'attempt', attempt) end
return reply
"""
)

# KEYS: lock hash, fence counter. ARGV: owner, token, attempt id.
# Second round of a grant: while this attempt's own entry is still there, raise the
# fencing counter to the grant's token (the largest of the quorum) and record that
# token in the lock hash, so every master of the quorum reports the same one. The
# token may come from a master whose clock is ahead of this one's: keep_fence() keeps
# the counter until this master's clock has passed it too (and the entry has ended).
CONFIRM = (
    _NEXT_TOKEN
    + """
local entry = redis.call('HMGET', KEYS[1], 'owner', 'attempt')
if entry[1] ~= ARGV[1] or entry[2] ~= ARGV[3] then return 0 end
if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(ARGV[2]) then
  redis.call('SET', KEYS[2], ARGV[2])
end
redis.call('HSET', KEYS[1], 'token', ARGV[2])
local t = redis.call('TIME')
local now_ms = t[1] * 1000 + math.floor(t[2] / 1000)
keep_fence(KEYS[2], now_ms + math.max(0, redis.call('PTTL', KEYS[1])), now_ms)
return 1
"""
)

# KEYS and ARGV as the single-node release, plus ARGV[3]: an attempt id.
# The release of what an attempt got and does not count on, which may reach a master
# late (its request was still running, or timed out). By then the owner's next
# attempt may have taken the entry over, or the lease renewed it: those are left.
GIVE_BACK = (
    _OURS
    + """
if not ours(KEYS[1], ARGV[1], ARGV[3]) then return 0 end
"""
    + RELEASE
)

# KEYS: lock hash, fence counter. ARGV: owner, expiry ms, ttl ms.
# Compare-and-expire, as the single-node script, but the server keeps the lock for
# the ttl plus the drift allowance while the hash records the ttl asked for. The entry
# becomes the lease's: no give-back or request of an attempt can touch it any more,
# so every entry this counts stays the lease's until it is released or expires. The
# counter is kept at least as long as the entry.
EXTEND = (
    _NEXT_TOKEN
    + """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local t = redis.call('TIME')
local now_ms = t[1] * 1000 + math.floor(t[2] / 1000)
keep_fence(KEYS[2], now_ms + tonumber(ARGV[2]), now_ms)
redis.call('HSET', KEYS[1], 'ttl', ARGV[3], 'attempt', 'lease')
redis.call('HINCRBY', KEYS[1], 'renewals', 1)
return 1
"""
)

# KEYS: lock hashes, then their fence counters in the same order. ARGV: owner, expiry
# ms, ttl ms, for each lock hash in turn.
# EXTEND for the renewer's batch: one call per master; each entry is still
# compare-and-expire on its own. Returns 1 or 0 per key.
EXTEND_MANY = (
    _NEXT_TOKEN
    + """
local out = {}
local n = #KEYS / 2
local t = redis.call('TIME')
local now_ms = t[1] * 1000 + math.floor(t[2] / 1000)
for i = 1, n do
  local at = 3 * (i - 1)
  if redis.call('HGET', KEYS[i], 'owner') == ARGV[at + 1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[at + 2])
    keep_fence(KEYS[n + i], now_ms + tonumber(ARGV[at + 2]), now_ms)
    redis.call('HSET', KEYS[i], 'ttl', ARGV[at + 3], 'attempt', 'lease')
    redis.call('HINCRBY', KEYS[i], 'renewals', 1)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""
)

_SCRIPTS = {
    "acquire": ACQUIRE,
    "confirm": CONFIRM,
    "give_back": GIVE_BACK,
    "extend": EXTEND,
    "extend_many": EXTEND_MANY,
}


_attempt_ids = itertools.count(1)
_attempt_ids_lock = threading.Lock()


def _next_attempt() -> str:
    """A new attempt id, larger than every one this process handed out before.

    The attempts of one acquisition run one after the other in one process (its
    owner is unique to it), so on a master a larger id is always the newer attempt:
    what lets a script tell a late request of a failed attempt from the current one.
    """
    with _attempt_ids_lock:
        return str(next(_attempt_ids))


def quorum(masters: int) -> int:
    """How many of ``masters`` must agree: a strict majority."""
    return masters // 2 + 1


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def describe_url(url: str) -> str:
    """A master's URL without its credentials, for messages and logs."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"unix://{parts.path}"
    host = parts.hostname or "?"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def _server_of(url: str) -> tuple[str, ...]:
    """What identifies the Redis server a URL points at (databases of one server are
    one server: they fail together)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return ("unix", parts.path)
    return ("tcp", (parts.hostname or "localhost").lower(), str(parts.port or 6379))


def _number(options: Mapping[str, Any], key: str, low: float, high: float | None) -> str | None:
    value = options.get(key)
    if value is None:
        return None
    bad = isinstance(value, bool) or not isinstance(value, int | float)
    if bad or value < low or (high is not None and value >= high):
        limit = f"{low:g} <= value < {high:g}" if high is not None else f">= {low:g}"
        return f"OPTIONS['{key}'] must be a number ({limit}), not {value!r}"
    return None


@dataclass
class _Replies(Generic[T]):
    """What one round of requests to the masters brought back."""

    results: dict[int, T] = field(default_factory=dict)
    errors: dict[int, Exception] = field(default_factory=dict)
    #: Requests still running when the round ended (decided early, or out of time:
    #: those are in ``errors`` too).
    pending: dict[int, concurrent.futures.Future[T]] = field(default_factory=dict)


class RedlockBackend(BaseBackend):
    """Locks held by a majority of N independent Redis masters (``LOCATION``: their URLs)."""

    wakes_on_release = True
    config_keys: ClassVar[frozenset[str]] = frozenset({"OPTIONS", "LOCATION"})

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

    # -- configuration ----------------------------------------------------------

    @classmethod
    def validate_config(cls, alias: str, config: Mapping[str, Any]) -> list[str]:
        problems = super().validate_config(alias, config)
        location = config.get("LOCATION")
        example = (
            "e.g. ['redis://redis-1:6379/0', 'redis://redis-2:6379/0', 'redis://redis-3:6379/0']"
        )
        if isinstance(location, str):
            problems.append(
                f"LOCATION must be a list of at least {MIN_MASTERS} Redis URLs, one per "
                f"independent master, not one URL string ({example}); for a single server "
                f"use distlocks.backends.redis.RedisBackend"
            )
        elif not isinstance(location, list | tuple):
            got = "missing" if location is None else f"a {type(location).__name__}"
            problems.append(
                f"LOCATION must be a list of at least {MIN_MASTERS} Redis URLs, one per "
                f"independent master ({example}); it is {got}"
            )
        else:
            problems.extend(cls._location_problems(alias, list(location), config))
        options = config.get("OPTIONS") or {}
        if isinstance(options, Mapping):
            unknown = set(options) - _OPTIONS
            if unknown:
                problems.append(
                    f"unknown OPTIONS key(s) {', '.join(sorted(map(str, unknown)))}; "
                    f"RedlockBackend accepts {', '.join(sorted(_OPTIONS))}"
                )
            for problem in (
                _number(options, "drift_factor", 0.0, 1.0),
                _number(options, "drift_margin", 0.0, None),
            ):
                if problem:
                    problems.append(problem)
        return problems

    @classmethod
    def _location_problems(
        cls, alias: str, location: list[Any], config: Mapping[str, Any]
    ) -> list[str]:
        problems: list[str] = []
        if len(location) < MIN_MASTERS:
            problems.append(
                f"LOCATION lists {len(location)} master(s); Redlock needs at least "
                f"{MIN_MASTERS} independent Redis masters (with fewer, losing one loses the "
                f"quorum); for a single server use distlocks.backends.redis.RedisBackend"
            )
        seen: dict[tuple[str, ...], str] = {}
        options = config.get("OPTIONS") or {}
        redis_options = (
            {k: v for k, v in options.items() if k in _REDIS_OPTIONS}
            if isinstance(options, Mapping)
            else {}
        )
        for index, url in enumerate(location):
            if not isinstance(url, str) or urlsplit(url).scheme not in _SCHEMES:
                shown = redact_url(url) if isinstance(url, str) else f"a {type(url).__name__}"
                problems.append(
                    f"LOCATION[{index}] = {shown!r} must be a URL starting with redis://, "
                    f"rediss:// or unix://"
                )
                continue
            # The single-node checks (the URL itself, the options) apply to every master.
            single = {"LOCATION": url, "OPTIONS": redis_options}
            own = RedisBackend.validate_config(alias, single)
            problems.extend(problem for problem in own if problem not in problems)
            if own:
                continue  # a URL that does not parse names no server to compare
            server = _server_of(url)
            if server in seen:
                problems.append(
                    f"LOCATION[{index}] points at the same Redis server as {seen[server]!r}; "
                    f"each master must be a separate server (databases of one server fail "
                    f"together, and one server must not count twice toward the quorum)"
                )
            seen.setdefault(server, describe_url(url))
        return problems

    @classmethod
    def check_config(cls, alias: str, config: Mapping[str, Any]) -> list[CheckMessage]:
        messages = super().check_config(alias, config)
        location = config.get("LOCATION")
        if not messages and isinstance(location, list | tuple) and len(location) % 2 == 0:
            count = len(location)
            messages.append(
                Warning(
                    EVEN_MASTERS,
                    hint=f"DISTLOCKS_BACKENDS[{alias!r}] lists {count} masters: a quorum is "
                    f"{quorum(count)}, so it survives {count - quorum(count)} failure(s), as "
                    f"{count - 1} masters would. Use an odd number (3, 5, 7).",
                    id=W_EVEN_MASTERS,
                )
            )
        return messages

    def drift(self, ttl: float) -> float:
        """Seconds taken off a lease for clocks that run at different speeds."""
        return ttl * self.drift_factor + self.drift_margin

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

    # -- acquire ----------------------------------------------------------------

    def _acquire_on(
        self, index: int, name: str, owner: str, ttl: float, holder: Holder, wait: float,
        fair: bool, attempt: str,
    ) -> AcquireResult:  # fmt: skip
        # The single-node arguments and reply, and no single-node clean-up after a
        # timeout: here a failed attempt cleans up with GIVE_BACK.
        master = self.masters[index]
        keys, args = master._acquire_call(name, owner, ttl, holder, wait, fair)
        reply = self._run(index, "acquire", "acquire", name, keys, [*args, attempt])
        return master._acquire_result(reply)

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
        return bool(self._run(index, "give_back", "release", name, keys, [*args, attempt]))

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

    # -- release, renewal ---------------------------------------------------------

    def _by_quorum(self, action: str, name: str, call: Callable[[int], bool]) -> bool:
        """Run a compare-and-something on every master: True once a quorum confirms,
        False once so many say "not held" that no quorum can hold it, and
        LockBackendUnavailable when the masters that did not answer decide it.

        Not-held answers and failures are not added up: one master without the entry
        (it never confirmed the grant, or restarted empty) and one that does not answer
        in time leave the lease unconfirmed, not lost; the one that did not answer may
        still hold it. Like a single server that times out, that is an outage: the
        lease keeps the validity it had, and a renewal tries again."""
        spare = len(self.masters) - self.quorum

        def decided(replies: _Replies[bool]) -> bool:
            yes = sum(1 for ok in replies.results.values() if ok)
            no = len(replies.results) - yes
            return yes >= self.quorum or no > spare or len(replies.errors) > spare

        replies = self._round(call, decided=decided)
        yes = sum(1 for ok in replies.results.values() if ok)
        if yes >= self.quorum:
            return True
        if len(replies.results) - yes > spare:
            return False
        raise self._unconfirmed(action, name, yes, replies)

    def release(self, name: str, owner: str) -> bool:
        return self._by_quorum("release", name, lambda i: self.masters[i].release(name, owner))

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        # The lease counts ``ttl`` from the moment this call started; the masters keep
        # the lock for the drift allowance longer, so that count stays inside theirs
        # even if their clocks run a little fast.
        args = [owner, _ms(ttl + self.drift(ttl)), _ms(ttl)]

        def extend(index: int) -> bool:
            keys = self.masters[index].all_keys(name)
            return bool(self._run(index, "extend", "extend", name, [keys.lock, keys.fence], args))

        return self._by_quorum("extend", name, extend)

    def extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool | LockError]:
        """Renew many leases with one round to the masters (one script on each per
        :attr:`RedisBackend.EXTEND_BATCH` leases); each lease is decided by its own
        quorum, as :meth:`extend` decides one."""
        results: list[bool | LockError] = []
        spare = len(self.masters) - self.quorum
        batch = RedisBackend.EXTEND_BATCH
        for start in range(0, len(leases), batch):
            chunk = leases[start : start + batch]
            args: list[Any] = []
            for _, owner, ttl in chunk:
                args += (owner, _ms(ttl + self.drift(ttl)), _ms(ttl))

            def extend(index: int, chunk: Sequence[Any] = chunk, args: list[Any] = args) -> Any:
                master = self.masters[index]
                keys = [master.all_keys(name).lock for name, _, _ in chunk]
                keys += [master.all_keys(name).fence for name, _, _ in chunk]
                what = f"{len(chunk)} leases"
                return self._run(index, "extend_many", "renew", what, keys, args)

            replies = self._round(extend)
            for at in range(len(chunk)):
                yes = sum(1 for answers in replies.results.values() if answers[at])
                if yes >= self.quorum:
                    results.append(True)
                elif len(replies.results) - yes > spare:
                    results.append(False)
                else:
                    results.append(self._unconfirmed("renew", chunk[at][0], yes, replies))
        return results

    def force_release(self, name: str, token: int | None = None) -> bool:
        # Each master compares its own entry's token (every master of the grant's quorum
        # records the grant's token) and deletes it in one step. An entry a master never
        # had confirmed keeps an older token and is left to expire: it cannot make a
        # quorum on its own.
        replies = self._round(
            lambda i: self.masters[i].force_release(name, token), decided=self._hopeless
        )
        self._need_quorum("force-release", name, replies)
        return any(replies.results.values())

    def fencing_counter(self, name: str) -> int:
        """The highest counter among the masters (a quorum must answer): at least every
        token granted for ``name`` so far."""
        replies = self._round(
            lambda i: self.masters[i].fencing_counter(name), decided=self._hopeless
        )
        self._need_quorum("read the fencing counter of", name, replies)
        return max(replies.results.values(), default=0)

    # -- waiting ------------------------------------------------------------------

    def wait(self, name: str, timeout: float, *, owner: str = "", fair: bool = False) -> None:
        # Waiters block on one master's wake-up list (each release pushes one on every
        # master that has waiters). Masters that answered last time are tried first.
        deadline = time.monotonic() + timeout
        order = sorted(range(len(self.masters)), key=lambda i: (i in self._down, i))
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

    # -- inspection ---------------------------------------------------------------

    def _holder(
        self, infos: Sequence[LockInfo | None], unanswered: int, *, count_waiters: bool
    ) -> LockInfo | None:
        """The lock as the quorum sees it, from the masters' own views of ``name``.

        Its holder is the owner with the most entries, provided they could make a
        quorum (counting masters that did not answer); a lone leftover of an attempt
        that failed is not a lock. Its token is the one most entries agree on (every
        confirmed master records the grant's token); its expiry is when fewer than a
        quorum of entries will remain.
        """
        entries: dict[str, list[LockInfo]] = collections.defaultdict(list)
        for info in infos:
            if info is not None:
                entries[info.owner].append(info)
        if not entries:
            return None
        owned = max(
            entries.values(), key=lambda found: (len(found), max(i.fencing_token for i in found))
        )
        if len(owned) + unanswered < self.quorum:
            return None
        tokens = collections.Counter(info.fencing_token for info in owned)
        token = max(tokens, key=lambda t: (tokens[t], t))
        far = dt.datetime.max.replace(tzinfo=dt.UTC)
        owned.sort(key=lambda info: info.expires_at or far, reverse=True)
        base = owned[min(self.quorum, len(owned)) - 1]
        waiters = None
        if count_waiters:
            counts = sorted(((info.waiters or 0) if info else 0 for info in infos), reverse=True)
            waiters = counts[min(self.quorum, len(counts)) - 1]
        return dataclasses.replace(
            base,
            backend=self.alias,
            fencing_token=token,
            waiters=waiters,
            extra={**base.extra, "masters": f"{len(owned)}/{len(self.masters)}"},
        )

    def inspect(self, name: str) -> LockInfo | None:
        replies = self._round(lambda i: self.masters[i].inspect(name), decided=self._hopeless)
        self._need_quorum("inspect", name, replies)
        return self._holder(list(replies.results.values()), len(replies.errors), count_waiters=True)

    def iter_locks(self) -> Iterator[LockInfo]:
        replies = self._round(lambda i: list(self.masters[i].iter_locks()), decided=self._hopeless)
        self._need_quorum("list", "*", replies)
        by_name: dict[str, list[LockInfo | None]] = collections.defaultdict(list)
        for found in replies.results.values():
            for info in found:
                by_name[info.name].append(info)
        for name in sorted(by_name):
            views = by_name[name]
            views += [None] * (len(replies.results) - len(views))
            held = self._holder(views, len(replies.errors), count_waiters=True)
            if held is not None:
                yield held

    def close(self) -> None:
        with self._lock:
            executors, self._executors = self._executors, None
            self._scripts.clear()
            self._round_timeout = None
        for executor in executors or ():
            executor.shutdown(wait=False, cancel_futures=True)
        for master in self.masters:
            master.close()


_instances: weakref.WeakSet[RedlockBackend] = weakref.WeakSet()


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
