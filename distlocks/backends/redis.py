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

import contextlib
import datetime as dt
import hashlib
import json
import threading
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.base import AcquireResult, BaseBackend, Holder, LockInfo
from distlocks.conf import conf
from distlocks.exceptions import LockBackendUnavailable, LockError

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImproperlyConfigured(
        "distlocks.backends.redis.RedisBackend needs redis-py: pip install 'distlocks[redis]'."
    ) from exc

# KEYS: lock hash, fence counter.
# ARGV: owner, ttl ms, name, host, pid, thread, extra (JSON).
# Returns {1, token, ttl ms} when granted, {0, 0, holder's pttl} when busy.
ACQUIRE = """
local holder = redis.call('HGET', KEYS[1], 'owner')
if holder then
  if holder == ARGV[1] then
    -- Same owner: a retried request whose first reply was lost. It is ours.
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, tonumber(redis.call('HGET', KEYS[1], 'token')), tonumber(ARGV[2])}
  end
  return {0, 0, redis.call('PTTL', KEYS[1])}
end
local token = redis.call('INCR', KEYS[2])
local now = redis.call('TIME')
redis.call('HSET', KEYS[1],
  'owner', ARGV[1], 'token', token, 'name', ARGV[3], 'host', ARGV[4], 'pid', ARGV[5],
  'thread', ARGV[6], 'extra', ARGV[7], 'ttl', ARGV[2], 'renewals', 0,
  'acquired_at', now[1] * 1000 + math.floor(now[2] / 1000))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, token, tonumber(ARGV[2])}
"""

# KEYS: lock hash. ARGV: owner. Compare-and-delete.
RELEASE = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

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

# KEYS: lock hash, fence counter. Unconditional delete; the counter moves on so
# that the evicted holder's token is already outdated.
FORCE_RELEASE = """
local existed = redis.call('DEL', KEYS[1])
redis.call('INCR', KEYS[2])
return existed
"""

_SCHEMES = ("redis", "rediss", "unix")
_UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError)


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
                        "acquire": client.register_script(ACQUIRE),
                        "release": client.register_script(RELEASE),
                        "extend": client.register_script(EXTEND),
                        "force_release": client.register_script(FORCE_RELEASE),
                    }
                    self._client = client
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client.connection_pool.disconnect()
            self._client = None

    # -- keys -----------------------------------------------------------------

    def keys(self, name: str) -> tuple[str, str]:
        """The lock hash key and the fencing counter key of ``name``."""
        tag = name
        if "{" in name or "}" in name:
            tag = "#" + hashlib.sha256(name.encode()).hexdigest()[:32]
        base = f"{self.key_prefix}:{{{tag}}}"
        return f"{base}:lock", f"{base}:fence"

    # -- calls ----------------------------------------------------------------

    @contextlib.contextmanager
    def _errors(self, action: str, name: str) -> Iterator[None]:
        try:
            yield
        except _UNAVAILABLE as exc:
            raise LockBackendUnavailable(
                self.alias, f"{action} {name!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
        except redis.RedisError as exc:
            raise LockError(
                f"Redis error while trying to {action} lock {name!r} on backend "
                f"{self.alias!r}: {type(exc).__name__}: {exc}"
            ) from exc

    def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        client = self.client
        return self._scripts[script](keys=keys, args=args, client=client)

    def acquire(self, name: str, owner: str, ttl: float, holder: Holder) -> AcquireResult:
        ttl_ms = max(1, round(ttl * 1000))
        args = [
            owner, ttl_ms, name, holder.host, holder.pid, holder.thread,
            json.dumps(dict(holder.extra), separators=(",", ":")),
        ]  # fmt: skip
        try:
            with self._errors("acquire", name):
                granted, token, remaining_ms = self._run("acquire", list(self.keys(name)), args)
        except LockBackendUnavailable as exc:
            if isinstance(exc.__cause__, redis.TimeoutError):
                # The script may have run and only the reply was lost: give the lock
                # back rather than leave it held by a lease nobody knows about.
                with contextlib.suppress(LockError):
                    self.release(name, owner)
            raise
        remaining = None if remaining_ms < 0 else remaining_ms / 1000
        return AcquireResult(bool(granted), int(token), remaining)

    def release(self, name: str, owner: str) -> bool:
        with self._errors("release", name):
            return bool(self._run("release", [self.keys(name)[0]], [owner]))

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        ttl_ms = max(1, round(ttl * 1000))
        with self._errors("extend", name):
            return bool(self._run("extend", [self.keys(name)[0]], [owner, ttl_ms]))

    def force_release(self, name: str) -> bool:
        with self._errors("force-release", name):
            return bool(self._run("force_release", list(self.keys(name)), []))

    def fencing_counter(self, name: str) -> int:
        """The last fencing token issued for ``name`` (0 if none)."""
        with self._errors("read the fencing counter of", name):
            return int(self.client.get(self.keys(name)[1]) or 0)

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
        key = self.keys(name)[0]
        with self._errors("inspect", name):
            pipe = self.client.pipeline(transaction=True)
            pipe.hgetall(key)
            pipe.pttl(key)
            fields, pttl = pipe.execute()
        if not fields:
            return None
        return self._info(fields, pttl)

    def iter_locks(self) -> Iterator[LockInfo]:
        pattern = f"{self.key_prefix}:{{*}}:lock"
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
