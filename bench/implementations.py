"""The Redis lock implementations compared, one registered class each.

Every implementation gets its own redis-py client on the same server. Lock
objects are created per acquisition, as application code creates them (one lock
name per invoice, per job...), so construction cost is part of what is measured.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import redis

from bench.base import Env, Implementation, implementation

# Peers log every acquisition or failed try; none of that belongs in the timings.
for _logger in ("redis_lock", "pottery"):
    logging.getLogger(_logger).setLevel(logging.ERROR)

_COMPARE_AND_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# The same, plus one wake-up token for the longest-waiting BLPOP on KEYS[2]:
# the least a lock needs for waiters to be woken by the release, not by a timer.
_COMPARE_DELETE_AND_WAKE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('RPUSH', KEYS[2], 1)
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""

# Bounds one BLPOP of the floor, so a lost wake-up (an expired lease) costs at most this.
_FLOOR_MAX_BLOCK = 0.1


class RedisImplementation(Implementation):
    """Base of the implementations that run on the one Redis server."""

    family = "redis"
    servers = frozenset({"redis"})

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self.client = redis.Redis.from_url(env.redis_url)

    def close(self) -> None:
        self.client.close()
        self.client.connection_pool.disconnect()


@implementation
class RawFloor(RedisImplementation):
    """redis-py with nothing on top: ``SET key token NX PX`` and a compare-and-delete script.

    Blocking uses the least that wakes waiters on release: the release script also
    pushes one token on a wake-up list that waiters ``BLPOP``.
    """

    name = "floor"
    label = "raw SET NX PX + compare-and-delete"
    role = "floor"
    distribution = "redis"

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self._release = self.client.register_script(_COMPARE_AND_DELETE)
        self._release_and_wake = self.client.register_script(_COMPARE_DELETE_AND_WAKE)

    def try_acquire(self, name: str, ttl: float) -> tuple[str, str] | None:
        token = uuid.uuid4().hex
        if self.client.set(name, token, nx=True, px=int(ttl * 1000)):
            return name, token
        return None

    def release(self, handle: tuple[str, str]) -> None:
        self._release(keys=[handle[0]], args=[handle[1]])

    def acquire_blocking(self, name: str, ttl: float, timeout: float) -> tuple[str, str] | None:
        deadline = time.monotonic() + timeout
        wake_key = f"{name}:wake"
        while True:
            handle = self.try_acquire(name, ttl)
            if handle is not None:
                return handle
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.client.blpop([wake_key], timeout=min(left, _FLOOR_MAX_BLOCK))

    def release_contended(self, handle: tuple[str, str]) -> None:
        name, token = handle
        self._release_and_wake(keys=[name, f"{name}:wake"], args=[token, 1000])


@implementation
class Distlocks(Implementation):
    """distlocks through its public API: ``with lock(name, ttl=..., timeout=0):``."""

    name = "distlocks"
    label = "distlocks lock() (public API)"
    role = "distlocks"
    family = "redis"
    servers = frozenset({"redis"})
    distribution = "distlocks"
    reference = True
    key_patterns = ("distlocks-bench:*",)

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        from distlocks import get_backend, lock
        from distlocks.exceptions import LockNotAcquired

        self._lock = lock
        self._not_acquired = LockNotAcquired
        self.backend = get_backend("default")

    def cycle(self, name: str, ttl: float) -> None:
        with self._lock(name, ttl=ttl, timeout=0):
            pass

    def try_acquire(self, name: str, ttl: float) -> Any | None:
        try:
            return self._lock(name, ttl=ttl, timeout=0).acquire()
        except self._not_acquired:
            return None

    def release(self, handle: Any) -> None:
        handle.release()

    def acquire_blocking(self, name: str, ttl: float, timeout: float) -> Any | None:
        try:
            return self._lock(name, ttl=ttl, timeout=timeout).acquire()
        except self._not_acquired:
            return None

    def close(self) -> None:
        from distlocks.handler import backends

        backends.reset()


class BackendLevel(Implementation):
    """distlocks called one layer down, on the backend of ``backend_alias``: no Lease,
    no signals, no renewal. Blocking is the public API's job, so these rows take part
    in the non-blocking workloads only."""

    backend_alias = "default"

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        from distlocks import get_backend
        from distlocks.locks import current_holder

        self.backend = get_backend(self.backend_alias)
        self._holder = current_holder

    def try_acquire(self, name: str, ttl: float) -> tuple[str, str] | None:
        owner = uuid.uuid4().hex
        if self.backend.acquire(name, owner, ttl, self._holder()).acquired:
            return name, owner
        return None

    def release(self, handle: tuple[str, str]) -> None:
        self.backend.release(*handle)

    def acquire_blocking(self, name: str, ttl: float, timeout: float) -> tuple[str, str] | None:
        raise NotImplementedError(f"{self.name} does not take part in blocking workloads")

    def close(self) -> None:
        from distlocks.handler import backends

        backends.reset()


@implementation
class DistlocksBackend(BackendLevel):
    """distlocks one layer down: ``RedisBackend.acquire`` / ``release``, no Lease, no signals.

    The gap between this row and ``distlocks`` is the cost of the public API layer;
    the gap between this row and ``floor`` is the cost of the richer Redis scripts.
    """

    name = "distlocks-backend"
    label = "distlocks RedisBackend.acquire/release"
    role = "distlocks"
    family = "redis"
    servers = frozenset({"redis"})
    distribution = "distlocks"
    key_patterns = ("distlocks-bench:*",)
    # Blocking is the public API's job; measuring it here would repeat the distlocks row.
    workloads = frozenset({"cycle", "throughput-threads", "throughput-processes"})

    backend_alias = "default"


@implementation
class RedisPyLock(RedisImplementation):
    """redis-py's own ``Lock`` (``client.lock()``): polls every 0.1 s while blocked."""

    name = "redis-py"
    label = "redis-py Lock"
    role = "peer"
    distribution = "redis"

    def try_acquire(self, name: str, ttl: float) -> Any | None:
        lock = self.client.lock(name, timeout=ttl)
        return lock if lock.acquire(blocking=False) else None

    def release(self, handle: Any) -> None:
        handle.release()

    def acquire_blocking(self, name: str, ttl: float, timeout: float) -> Any | None:
        lock = self.client.lock(name, timeout=ttl, blocking_timeout=timeout)
        return lock if lock.acquire() else None


@implementation
class PythonRedisLock(RedisImplementation):
    """python-redis-lock's ``redis_lock.Lock``: waiters BLPOP a signal list pushed on release."""

    name = "python-redis-lock"
    label = "python-redis-lock Lock"
    role = "peer"
    distribution = "python-redis-lock"
    key_patterns = ("lock:bench:*", "lock-signal:bench:*")

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        import redis_lock

        self._cls = redis_lock.Lock

    def try_acquire(self, name: str, ttl: float) -> Any | None:
        # Its expiry is whole seconds.
        lock = self._cls(self.client, name, expire=max(1, round(ttl)))
        return lock if lock.acquire(blocking=False) else None

    def release(self, handle: Any) -> None:
        handle.release()

    def acquire_blocking(self, name: str, ttl: float, timeout: float) -> Any | None:
        expire = max(1, round(ttl))
        lock = self._cls(self.client, name, expire=expire)
        # It refuses a timeout longer than the expiry.
        return lock if lock.acquire(timeout=max(1, min(round(timeout), expire))) else None


@implementation
class PotteryRedlock(RedisImplementation):
    """pottery's ``Redlock`` with one master: retries after a random 0-0.2 s sleep."""

    name = "pottery"
    label = "pottery Redlock (1 master)"
    role = "peer"
    distribution = "pottery"
    key_patterns = ("redlock:bench:*",)

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        from pottery import Redlock

        self._cls = Redlock

    def _new(self, name: str, ttl: float) -> Any:
        return self._cls(key=name, masters={self.client}, auto_release_time=ttl)

    def try_acquire(self, name: str, ttl: float) -> Any | None:
        lock = self._new(name, ttl)
        return lock if lock.acquire(blocking=False) else None

    def release(self, handle: Any) -> None:
        handle.release()

    def acquire_blocking(self, name: str, ttl: float, timeout: float) -> Any | None:
        lock = self._new(name, ttl)
        return lock if lock.acquire(timeout=timeout) else None
