"""The rules of etcd semaphores and read-write locks, free of I/O: which requests of a
queue hold (:func:`_judge`), this process's record of a request (:class:`_Permit`), a
request as read back (:class:`_Seen`), and the comparisons and ranges the permit
transactions are built of. The recipe: :mod:`.permit_acquire` and :mod:`.permit_held`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from distlocks.backends.base import (
    READ,
    SEMAPHORE,
    WRITE,
)
from distlocks.backends.etcd import protocol

PERMIT_KINDS = (SEMAPHORE, READ, WRITE)
#: A waiter watches each key that keeps it out, on one stream; past this many (a
#: semaphore of a large limit), it watches every deletion of the name's requests.
MAX_WATCHED = 64


@dataclasses.dataclass
class _Permit:
    """This process's request for one (kind, name, owner)."""

    lease: int
    #: Seconds the server granted (whole, at least its minimum).
    lease_ttl: int
    #: The request key's create_revision (0: not put yet, or not known).
    created: int = 0
    granted: bool = False
    #: A revision at which a try-once semaphore request found room (0: none yet).
    counted: int = 0
    #: The short lease a queued request's key lives on until it holds (0: none), and
    #: its seconds: a waiter that dies goes within seconds, whatever its ttl.
    wait_lease: int = 0
    wait_ttl: int = 0

    def leases(self) -> list[int]:
        return [lease for lease in (self.lease, self.wait_lease) if lease]

    @property
    def on(self) -> int:
        """The lease the request key is on now."""
        return self.wait_lease if self.wait_lease and not self.granted else self.lease


def _range(key: str, end: str, **more: Any) -> dict[str, Any]:
    return {"requestRange": {"key": protocol._b64(key), "range_end": protocol._b64(end), **more}}


def _end_of(prefix: str) -> str:
    """The key just after every key that starts with ``prefix`` (which ends in "/")."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def _created(key: str, revision: int) -> dict[str, Any]:
    return {
        "target": "CREATE",
        "key": protocol._b64(key),
        "result": "EQUAL",
        "create_revision": str(revision),
    }


def _on_lease(key: str, lease: int) -> dict[str, Any]:
    return {"target": "LEASE", "key": protocol._b64(key), "result": "EQUAL", "lease": str(lease)}


def _data(kv: Mapping[str, Any]) -> dict[str, Any]:
    try:
        data = json.loads(protocol._unb64(kv.get("value")))
    except (ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclasses.dataclass
class _Seen:
    """A request key as read from the server, for listing and eviction."""

    kind: str
    owner: str
    kv: dict[str, Any]
    data: dict[str, Any]
    holds: bool = False

    @property
    def created(self) -> int:
        return protocol._int(self.kv.get("create_revision"))

    @property
    def limit(self) -> int:
        limit = self.data.get("limit")
        ok = isinstance(limit, int) and not isinstance(limit, bool) and limit > 0
        return limit if ok else 1  # type: ignore[return-value]


def _judge(seen: list[_Seen]) -> None:
    """Mark which of ``seen`` (create_revision order) hold, by the rules above."""
    write_ahead = False
    for index, node in enumerate(seen):
        if node.kind == SEMAPHORE:
            node.holds = index < node.limit
        elif node.kind == READ:
            node.holds = not write_ahead
        else:
            node.holds = index == 0
        write_ahead = write_ahead or node.kind == WRITE
