"""Redis backend: one lock = one hash with an expiry, taken by one Lua script.

Keys of the lock ``name`` (``prefix`` is ``OPTIONS["key_prefix"]``, default
``DISTLOCKS_KEY_PREFIX``)::

    {prefix}:{<name>}:lock    hash: owner, token, name, host, pid, thread,
                              acquired_at (server ms), ttl (ms), renewals, extra
    {prefix}:{<name>}:fence   the per-name fencing counter (never expires)

The braces are a Redis Cluster hash tag: both keys of a lock live in one slot,
so every script below touches a single slot. A name that itself contains a
brace is tagged with a hash of the name instead.

Every operation that must be atomic (acquire, release, extend, force release)
is one ``EVALSHA``: one round trip, one server-side step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import hashlib
import inspect as pyinspect
import json
import re
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, NamedTuple
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.base import AcquireResult, BaseBackend, Holder, LockInfo
from distlocks.conf import conf
from distlocks.exceptions import LockBackendUnavailable, LockError

try:
    import redis
    import redis.asyncio
    from redis.asyncio.retry import Retry as AsyncRetry
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImproperlyConfigured(
        "distlocks.backends.redis.RedisBackend needs redis-py: pip install 'distlocks[redis]'."
    ) from exc

# Shared Lua fragments. Waiters register in KEYS waiters (zset owner -> expiry ms);
# fair waiters also queue in KEYS queue (zset owner -> arrival time in us).
_NOW = """
local now = redis.call('TIME')
local now_ms = now[1] * 1000 + math.floor(now[2] / 1000)
"""

# The next fencing token: one more than the last, and never below the server
# clock in microseconds. If the counter is lost (a restart without persistence,
# a failover to a replica that missed the last writes), tokens go on from the
# clock, which is past every token issued before: those were at most one per
# microsecond ahead of it. Lua numbers are doubles, exact up to 2^53 (year 2255).
_NEXT_TOKEN = """
local function next_token(fence, now)
  local token = math.max(tonumber(redis.call('GET', fence) or '0') + 1,
                         now[1] * 1000000 + now[2])
  redis.call('SET', fence, string.format('%d', token))
  return token
end
"""

# Forget waiters whose registration expired (they crashed or gave up silently).
_PRUNE = """
local function prune(waiters, queue, now_ms)
  local dead = redis.call('ZRANGEBYSCORE', waiters, '-inf', now_ms)
  if #dead > 0 then
    for _, w in ipairs(dead) do redis.call('ZREM', queue, w) end
    redis.call('ZREMRANGEBYSCORE', waiters, '-inf', now_ms)
  end
end
"""

# Wake one waiter after the lock became free: the head of the fair queue on its
# own list, otherwise any waiter through the shared signal list.
_WAKE = (
    _PRUNE
    + """
local function wake(waiters, queue, signal, wake_prefix, now_ms)
  if redis.call('EXISTS', waiters) == 0 then return end
  prune(waiters, queue, now_ms)
  local head = redis.call('ZRANGE', queue, 0, 0)[1]
  if head then
    redis.call('RPUSH', wake_prefix .. head, 1)
    redis.call('PEXPIRE', wake_prefix .. head, 10000)
  elseif redis.call('EXISTS', waiters) == 1 then
    redis.call('RPUSH', signal, 1)
    redis.call('LTRIM', signal, -1, -1)
    redis.call('PEXPIRE', signal, 10000)
  end
end
"""
)

# KEYS: lock hash, fence counter, waiters, queue.
# ARGV: owner, ttl ms, name, host, pid, thread, extra (JSON), wait ms, fair (0/1).
# Returns {1, token, ttl ms} when granted; {0, 0, holder's pttl or -3} when not.
ACQUIRE = (
    _NOW
    + _NEXT_TOKEN
    + _PRUNE
    + """
local holder = redis.call('HGET', KEYS[1], 'owner')
if holder == ARGV[1] then
  -- Same owner: a retried request whose first reply was lost. It is ours.
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, tonumber(redis.call('HGET', KEYS[1], 'token')), tonumber(ARGV[2])}
end
local fair = ARGV[9] == '1'
local wait_ms = tonumber(ARGV[8])
local turn = not holder
if turn and fair then
  prune(KEYS[3], KEYS[4], now_ms)
  local head = redis.call('ZRANGE', KEYS[4], 0, 0)[1]
  turn = (not head) or head == ARGV[1]
end
if not turn then
  if wait_ms > 0 then
    redis.call('ZADD', KEYS[3], now_ms + wait_ms, ARGV[1])
    if fair then
      redis.call('ZADD', KEYS[4], 'NX', now[1] * 1000000 + now[2], ARGV[1])
    end
  end
  if holder then return {0, 0, redis.call('PTTL', KEYS[1])} end
  return {0, 0, -3}
end
if wait_ms > 0 or fair then
  -- Also on a last attempt made with no time left, so no stale entry stays queued.
  redis.call('ZREM', KEYS[3], ARGV[1])
  if fair then redis.call('ZREM', KEYS[4], ARGV[1]) end
end
local token = next_token(KEYS[2], now)
redis.call('HSET', KEYS[1],
  'owner', ARGV[1], 'token', token, 'name', ARGV[3], 'host', ARGV[4], 'pid', ARGV[5],
  'thread', ARGV[6], 'extra', ARGV[7], 'ttl', ARGV[2], 'renewals', 0,
  'acquired_at', now_ms)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, token, tonumber(ARGV[2])}
"""
)

# KEYS: lock hash, waiters, queue, signal. ARGV: owner, wake key prefix.
# Compare-and-delete, then wake one waiter.
RELEASE = (
    _WAKE
    + """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
if redis.call('EXISTS', KEYS[2]) == 1 then
"""
    + _NOW
    + """
  wake(KEYS[2], KEYS[3], KEYS[4], ARGV[2], now_ms)
end
return 1
"""
)

# KEYS: lock hash. ARGV: owner, ttl ms. Compare-and-expire.
EXTEND = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('HSET', KEYS[1], 'ttl', ARGV[2])
  redis.call('HINCRBY', KEYS[1], 'renewals', 1)
  return 1
end
return 0
"""

# KEYS: lock hash, fence counter, waiters, queue, signal. ARGV: wake key prefix.
# Unconditional delete; the counter moves on so that the evicted holder's token
# is already outdated; a waiter is woken.
FORCE_RELEASE = (
    _NOW
    + _NEXT_TOKEN
    + _WAKE
    + """
local existed = redis.call('DEL', KEYS[1])
next_token(KEYS[2], now)
wake(KEYS[3], KEYS[4], KEYS[5], ARGV[1], now_ms)
return existed
"""
)

# KEYS: lock hash, waiters, queue, signal. ARGV: owner, wake key prefix.
# A waiter gives up: it leaves the queue, and if the lock is free it passes on
# a wake-up it may have consumed, so the waiters behind it are not held up.
LEAVE = (
    _NOW
    + _WAKE
    + """
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('DEL', ARGV[2] .. ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then
  wake(KEYS[2], KEYS[3], KEYS[4], ARGV[2], now_ms)
end
return 1
"""
)

SCRIPTS = {
    "acquire": ACQUIRE,
    "release": RELEASE,
    "extend": EXTEND,
    "force_release": FORCE_RELEASE,
    "leave": LEAVE,
}


_SCHEMES = ("redis", "rediss", "unix")
# Connection settings the asyncio client accepts, copied from the sync pool.
_ASYNC_KWARGS = frozenset(pyinspect.signature(redis.asyncio.Redis.__init__).parameters) - {
    "self",
    "connection_pool",
    "retry",
    "single_connection_client",
}


class Keys(NamedTuple):
    """The keys of one lock (all share one hash tag, so one cluster slot)."""

    lock: str
    fence: str
    waiters: str
    queue: str
    signal: str
    wake_prefix: str


_UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError)


def _extra_json(extra: Mapping[str, Any]) -> str:
    return json.dumps(dict(extra), separators=(",", ":")) if extra else "{}"


def _decode(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def _positive(options: Mapping[str, Any], key: str, problems: list[str]) -> None:
    value = options.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        problems.append(f"OPTIONS['{key}'] must be a number of seconds > 0, not {value!r}")


class RedisBackend(BaseBackend):
    """Locks on one Redis server (or a django-redis cache's server)."""

    wakes_on_release = True

    config_keys: ClassVar[frozenset[str]] = frozenset({"OPTIONS", "LOCATION", "CACHE"})

    #: Defaults chosen so that an unreachable server is reported within about a
    #: second instead of hanging: requests are small and answered in microseconds.
    DEFAULT_SOCKET_TIMEOUT = 1.0
    DEFAULT_CONNECT_TIMEOUT = 1.0

    def __init__(self, alias: str, config: Mapping[str, Any]) -> None:
        super().__init__(alias, config)
        self.key_prefix: str = self.options.get("key_prefix", conf.KEY_PREFIX)
        self._client: redis.Redis | None = None
        self._client_lock = threading.Lock()
        self._scripts: dict[str, Any] = {}
        self._keys_cache: dict[str, Keys] = {}
        self._async_clients: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, tuple[redis.asyncio.Redis, dict[str, Any]]
        ] = weakref.WeakKeyDictionary()

    # -- configuration ----------------------------------------------------------

    @classmethod
    def validate_config(cls, alias: str, config: Mapping[str, Any]) -> list[str]:
        problems = super().validate_config(alias, config)
        location, cache = config.get("LOCATION"), config.get("CACHE")
        if (location is None) == (cache is None):
            problems.append(
                "set exactly one of LOCATION (a redis://, rediss:// or unix:// URL) "
                "or CACHE (the alias of a django-redis cache)"
            )
        if location is not None:
            if not isinstance(location, str):
                problems.append(f"LOCATION must be a URL string, not {type(location).__name__}")
            elif urlsplit(location).scheme not in _SCHEMES:
                problems.append(
                    f"LOCATION {location!r} must start with redis://, rediss:// or unix://"
                )
        if cache is not None:
            caches = getattr(settings, "CACHES", {})
            if not isinstance(cache, str) or cache not in caches:
                problems.append(f"CACHE {cache!r} is not an alias defined in CACHES")
            elif not str(caches[cache].get("BACKEND", "")).startswith("django_redis."):
                problems.append(
                    f"CACHE {cache!r} must be a django-redis cache "
                    f"(BACKEND 'django_redis.cache.RedisCache'); use LOCATION otherwise"
                )
        options = config.get("OPTIONS") or {}
        if isinstance(options, Mapping):
            _positive(options, "socket_timeout", problems)
            _positive(options, "socket_connect_timeout", problems)
            # The global DISTLOCKS_KEY_PREFIX has a check of its own (E007).
            prefix = options.get("key_prefix", "default")
            if not isinstance(prefix, str) or not prefix or set("{}") & set(prefix):
                problems.append(
                    f"OPTIONS['key_prefix'] {prefix!r} must be a non-empty str without braces"
                )
            kwargs = options.get("client_kwargs", {})
            if not isinstance(kwargs, Mapping):
                problems.append("OPTIONS['client_kwargs'] must be a dict of redis-py arguments")
        return problems

    def _timeouts(self) -> dict[str, Any]:
        return {
            "socket_timeout": self.options.get("socket_timeout", self.DEFAULT_SOCKET_TIMEOUT),
            "socket_connect_timeout": self.options.get(
                "socket_connect_timeout", self.DEFAULT_CONNECT_TIMEOUT
            ),
            # One immediate retry on a broken pooled connection (e.g. after a server
            # restart); never on a timeout, so an unreachable server fails fast.
            "retry": Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        }

    def _build_client(self) -> redis.Redis:
        extra = dict(self.options.get("client_kwargs", {}))
        if "LOCATION" in self.config:
            return redis.Redis.from_url(self.config["LOCATION"], **{**self._timeouts(), **extra})
        try:
            from django_redis import get_redis_connection
        except ImportError as exc:
            raise ImproperlyConfigured(
                f"DISTLOCKS_BACKENDS[{self.alias!r}] uses CACHE, which needs django-redis: "
                f"pip install 'distlocks[redis]'."
            ) from exc
        # Same server and credentials as the cache, but a pool of our own, so that the
        # cache's timeouts (often none) cannot make a lock call hang.
        cache_pool = get_redis_connection(self.config["CACHE"]).connection_pool
        kwargs = dict(cache_pool.connection_kwargs)
        timeouts = self._timeouts()
        for key in ("socket_timeout", "socket_connect_timeout"):
            if kwargs.get(key) is None:
                kwargs[key] = timeouts[key]
        kwargs["retry"] = timeouts["retry"]
        kwargs.update(extra)
        pool = redis.ConnectionPool(connection_class=cache_pool.connection_class, **kwargs)
        return redis.Redis(connection_pool=pool)

    @property
    def client(self) -> redis.Redis:
        """The redis-py client (created on first use; no I/O before that)."""
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    client = self._build_client()
                    self._scripts = {
                        key: client.register_script(lua) for key, lua in SCRIPTS.items()
                    }
                    self._client = client
        return self._client

    def _async_client(self) -> tuple[redis.asyncio.Redis, dict[str, Any]]:
        """A redis.asyncio client for the running event loop (clients are per loop)."""
        loop = asyncio.get_running_loop()
        found = self._async_clients.get(loop)
        if found is None:
            pool = self.client.connection_pool
            kwargs = dict(pool.connection_kwargs)
            kwargs.pop("retry", None)
            if "path" in kwargs:
                kwargs["unix_socket_path"] = kwargs.pop("path")
            if issubclass(pool.connection_class, redis.SSLConnection):
                kwargs["ssl"] = True
            # Keep our timeouts; take the rest (address, credentials, TLS) from the
            # synchronous pool, whatever LOCATION or CACHE built it from.
            aclient = redis.asyncio.Redis(
                **{k: v for k, v in kwargs.items() if k in _ASYNC_KWARGS},
                retry=AsyncRetry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
            )
            scripts = {key: aclient.register_script(lua) for key, lua in SCRIPTS.items()}
            found = (aclient, scripts)
            self._async_clients[loop] = found
        return found

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client.connection_pool.disconnect()
            self._client = None
        self._async_clients.clear()

    # -- keys -----------------------------------------------------------------

    def keys(self, name: str) -> tuple[str, str]:
        """The lock hash key and the fencing counter key of ``name``."""
        keys = self.all_keys(name)
        return keys.lock, keys.fence

    def all_keys(self, name: str) -> Keys:
        """Every key of ``name``, all in one Redis Cluster slot."""
        keys = self._keys_cache.get(name)
        if keys is None:
            if len(self._keys_cache) >= 4096:
                self._keys_cache.clear()
            keys = self._keys_cache[name] = self._make_keys(name)
        return keys

    def _make_keys(self, name: str) -> Keys:
        tag = name
        if "{" in name or "}" in name:
            tag = "#" + hashlib.sha256(name.encode()).hexdigest()[:32]
        base = f"{self.key_prefix}:{{{tag}}}"
        return Keys(
            lock=f"{base}:lock",
            fence=f"{base}:fence",
            waiters=f"{base}:waiters",
            queue=f"{base}:queue",
            signal=f"{base}:signal",
            wake_prefix=f"{base}:wake:",
        )

    # -- calls ----------------------------------------------------------------

    @contextlib.contextmanager
    def _errors(self, action: str, name: str) -> Iterator[None]:
        try:
            yield
        except redis.RedisError as exc:
            detail = f"{type(exc).__name__}: {exc}"
            # A replica (e.g. after a failover) or a server still loading its data
            # answers these, inside scripts too: an outage, not a bug.
            if isinstance(exc, _UNAVAILABLE) or any(
                word in str(exc) for word in ("READONLY", "LOADING", "MASTERDOWN")
            ):
                raise LockBackendUnavailable(
                    self.alias, f"{action} {name!r} failed: {detail}"
                ) from exc
            raise LockError(
                f"Redis error while trying to {action} lock {name!r} on backend "
                f"{self.alias!r}: {detail}"
            ) from exc

    @contextlib.contextmanager
    def _acquiring(self, name: str, owner: str) -> Iterator[None]:
        """:meth:`_errors` for an acquire, which a timeout leaves in doubt."""
        try:
            with self._errors("acquire", name):
                yield
        except LockBackendUnavailable as exc:
            if isinstance(exc.__cause__, redis.TimeoutError):
                # The script may have run and only the reply was lost: give the lock
                # back rather than leave it held by a lease nobody knows about. In the
                # background, so the caller hears of the outage after one timeout.
                threading.Thread(
                    target=self.release_quietly, args=(name, owner), daemon=True
                ).start()
            raise

    def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        client = self.client
        return self._scripts[script](keys=keys, args=args, client=client)

    async def _arun(self, script: str, keys: list[str], args: list[Any]) -> Any:
        client, scripts = self._async_client()
        return await scripts[script](keys=keys, args=args, client=client)

    @property
    def wait_chunk(self) -> float:
        """Longest single blocking wait, kept under the socket timeout actually in force
        (which a URL query, client_kwargs or a shared cache may have set)."""
        timeout = self.client.connection_pool.connection_kwargs.get("socket_timeout")
        if timeout is None:
            timeout = 5.0 / 0.8
        return max(0.01, min(5.0, 0.8 * float(timeout)))

    def _acquire_call(
        self, name: str, owner: str, ttl: float, holder: Holder, wait: float, fair: bool
    ) -> tuple[list[str], list[Any]]:
        keys = self.all_keys(name)
        # A waiter's registration outlives one blocking wait by a margin; it is
        # renewed at every attempt, and dropped by the others once it lapses.
        register_ms = round((min(wait, self.wait_chunk) + 1.0) * 1000) if wait > 0 else 0
        args = [
            owner, max(1, round(ttl * 1000)), name, holder.host, holder.pid, holder.thread,
            _extra_json(holder.extra), register_ms, int(fair),
        ]  # fmt: skip
        return [keys.lock, keys.fence, keys.waiters, keys.queue], args

    @staticmethod
    def _acquire_result(reply: list[int]) -> AcquireResult:
        granted, token, remaining_ms = reply
        remaining = None if remaining_ms < 0 else remaining_ms / 1000
        return AcquireResult(bool(granted), int(token), remaining)

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
        keys, args = self._acquire_call(name, owner, ttl, holder, wait, fair)
        with self._acquiring(name, owner):
            return self._acquire_result(self._run("acquire", keys, args))

    async def aacquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        *,
        wait: float = 0.0,
        fair: bool = False,
    ) -> AcquireResult:
        keys, args = self._acquire_call(name, owner, ttl, holder, wait, fair)
        with self._acquiring(name, owner):
            return self._acquire_result(await self._arun("acquire", keys, args))

    def _release_call(self, name: str, owner: str) -> tuple[list[str], list[Any]]:
        k = self.all_keys(name)
        return [k.lock, k.waiters, k.queue, k.signal], [owner, k.wake_prefix]

    def release(self, name: str, owner: str) -> bool:
        with self._errors("release", name):
            return bool(self._run("release", *self._release_call(name, owner)))

    async def arelease(self, name: str, owner: str) -> bool:
        with self._errors("release", name):
            return bool(await self._arun("release", *self._release_call(name, owner)))

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        ttl_ms = max(1, round(ttl * 1000))
        with self._errors("extend", name):
            return bool(self._run("extend", [self.all_keys(name).lock], [owner, ttl_ms]))

    async def aextend(self, name: str, owner: str, ttl: float) -> bool:
        ttl_ms = max(1, round(ttl * 1000))
        with self._errors("extend", name):
            return bool(await self._arun("extend", [self.all_keys(name).lock], [owner, ttl_ms]))

    def force_release(self, name: str) -> bool:
        k = self.all_keys(name)
        with self._errors("force-release", name):
            return bool(
                self._run(
                    "force_release",
                    [k.lock, k.fence, k.waiters, k.queue, k.signal],
                    [k.wake_prefix],
                )
            )

    def _wait_key(self, name: str, owner: str, fair: bool) -> str:
        keys = self.all_keys(name)
        return keys.wake_prefix + owner if fair else keys.signal

    def wait(self, name: str, timeout: float, *, owner: str = "", fair: bool = False) -> None:
        # BLPOP returns the moment a release pushes a wake-up (or at the timeout).
        seconds = min(timeout, self.wait_chunk)
        if seconds <= 0.001:
            return
        with self._errors("wait for", name):
            self.client.blpop([self._wait_key(name, owner, fair)], timeout=seconds)

    async def await_release(
        self, name: str, timeout: float, *, owner: str = "", fair: bool = False
    ) -> None:
        seconds = min(timeout, self.wait_chunk)
        if seconds <= 0.001:
            return
        client, _ = self._async_client()
        with self._errors("wait for", name):
            await client.blpop([self._wait_key(name, owner, fair)], timeout=seconds)

    def _leave_call(self, name: str, owner: str) -> tuple[list[str], list[Any]]:
        k = self.all_keys(name)
        return [k.lock, k.waiters, k.queue, k.signal], [owner, k.wake_prefix]

    def leave_queue(self, name: str, owner: str) -> None:
        with self._errors("leave the queue of", name):
            self._run("leave", *self._leave_call(name, owner))

    async def aleave_queue(self, name: str, owner: str) -> None:
        with self._errors("leave the queue of", name):
            await self._arun("leave", *self._leave_call(name, owner))

    def fencing_counter(self, name: str) -> int:
        """The last fencing token issued for ``name`` (0 if none)."""
        with self._errors("read the fencing counter of", name):
            return int(self.client.get(self.all_keys(name).fence) or 0)

    # -- inspection -----------------------------------------------------------

    def _info(self, fields: Mapping[bytes, bytes], pttl: int) -> LockInfo:
        def get(key: str) -> str:
            return _decode(fields.get(key.encode()))

        acquired_ms = int(get("acquired_at") or 0)
        now = dt.datetime.now(dt.UTC)
        try:
            extra = json.loads(get("extra") or "{}")
        except ValueError:
            extra = {}
        return LockInfo(
            name=get("name"),
            backend=self.alias,
            owner=get("owner"),
            fencing_token=int(get("token") or 0),
            host=get("host"),
            pid=int(get("pid")) if get("pid").isdigit() else None,
            thread=get("thread"),
            acquired_at=dt.datetime.fromtimestamp(acquired_ms / 1000, dt.UTC)
            if acquired_ms
            else None,
            expires_at=now + dt.timedelta(milliseconds=pttl) if pttl >= 0 else None,
            ttl=int(get("ttl") or 0) / 1000 or None,
            renewals=int(get("renewals") or 0),
            extra=extra,
        )

    def inspect(self, name: str) -> LockInfo | None:
        keys = self.all_keys(name)
        with self._errors("inspect", name):
            pipe = self.client.pipeline(transaction=True)
            pipe.hgetall(keys.lock)
            pipe.pttl(keys.lock)
            # Lapsed registrations are pruned at every release, so ZCARD is close enough.
            pipe.zcard(keys.waiters)
            fields, pttl, waiters = pipe.execute()
        if not fields:
            return None
        return dataclasses.replace(self._info(fields, pttl), waiters=int(waiters))

    def iter_locks(self) -> Iterator[LockInfo]:
        # Glob characters in the prefix must match themselves.
        prefix = re.sub(r"([*?\[\]\\])", r"\\\1", self.key_prefix)
        pattern = f"{prefix}:{{*}}:lock"
        with self._errors("list", pattern):
            cursor = 0
            while True:
                cursor, keys = self.client.scan(cursor=cursor, match=pattern, count=1000)
                if keys:
                    pipe = self.client.pipeline(transaction=False)
                    for key in keys:
                        pipe.hgetall(key)
                        pipe.pttl(key)
                    replies = pipe.execute()
                    for fields, pttl in zip(replies[::2], replies[1::2], strict=True):
                        if fields:
                            yield self._info(fields, pttl)
                if cursor == 0:
                    break
