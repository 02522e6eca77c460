"""Requests to etcd's JSON gateway as protocol generators (sans I/O): which member to
ask, what to retry (an idle connection the server closed, a member without a leader),
authentication, what an error answer means; the transaction and lease requests every
recipe is built of, and the keys of a plain lock. Each ``_<name>_g`` generator has a
blocking ``_<name>`` twin that runs it on the blocking driver.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.parse
from collections.abc import Callable, Generator, Sequence
from typing import Any, NoReturn, TypeVar

from distlocks.backends.etcd.protocol import (
    _BASE_DIGITS,
    _IDLE_DEATHS,
    _NOT_FOUND,
    _UNAUTHENTICATED,
    _UNAVAILABLE_CODES,
    ELECTION_RETRY_FIRST,
    ELECTION_RETRY_MAX,
    _b64,
    _Discard,
    _int,
    _LeaseGone,
    _new_lease_id,
    _Pause,
    _Post,
    _prefix_end,
    _ReAuth,
    _ServerSaid,
    _unavailable_answer,
    _watch_result,
    lease_seconds,
)
from distlocks.backends.etcd.transport import EtcdTransport
from distlocks.exceptions import LockBackendUnavailable, LockError
from distlocks.redaction import redact

#: The backend's one logger, whichever module logs.
logger = logging.getLogger("distlocks.backends.etcd")
T = TypeVar("T")


class EtcdGateway(EtcdTransport):
    """The gateway's requests, above the transport."""

    # -- requests ------------------------------------------------------------------------

    def _call(self, path: str, body: Any, action: str, name: str, *, raw: bool = False) -> Any:
        """POST ``body`` to the gateway; the decoded answer (see :meth:`_call_g`)."""
        return self._sync(self._call_g(path, body, action, name, raw=raw))

    def _call_g(
        self, path: str, body: Any, action: str, name: str, *, raw: bool = False
    ) -> Generator[Any, Any, Any]:
        """POST ``body`` to the gateway; the decoded answer. A kept-alive connection is
        used first; one that the server closed while it was idle is replaced once,
        transparently (the request never reached the server). A member that cannot be
        reached, or answers UNAVAILABLE (no leader, leader changed: an election in
        progress; a learner), is passed over for the next endpoint, each tried once;
        LockBackendUnavailable once none answers."""
        if self._creds and not self._auth_token and not path.startswith("/v3/auth/"):
            yield from self._authenticate_g(action, name)
        text = body if raw else json.dumps(body, separators=(",", ":"))
        payload = text.encode()
        headers = self._headers()
        last: BaseException | None = None
        count = len(self.endpoints)
        tried: set[int] = set()
        fresh = False
        answered = False  # a member answered that it cannot serve now (an election)
        while True:
            index: int | None = None
            if fresh:
                order = ((self._preferred + k) % count for k in range(count))
                index = next((i for i in order if i not in tried), None)
                if index is None:
                    break
                tried.add(index)
            reply = yield _Post(path, payload, headers, index)
            if reply is None:
                fresh = True  # no kept-alive connection: a new one
                continue
            if reply.error is not None:
                last, fresh = reply.error, True
                if reply.reused and not isinstance(reply.error, _IDLE_DEATHS):
                    tried.add(reply.index)
                # else: a kept-alive connection the server had closed: once more
                continue
            if not reply.reused:
                self._preferred = reply.index
            status, data = reply.status, reply.data
            if status != 200:
                refused = _unavailable_answer(status, data)
                if refused is not None:
                    # This member cannot serve now: the next one may (the request was
                    # not applied, or is retry-safe like a timeout: see docs).
                    yield _Discard(reply.conn)
                    tried.add(reply.index)
                    last, fresh, answered = refused, True, True
                    continue
                try:
                    self._raise_answer(status, data, action, name, path, body)
                except _ReAuth:
                    return (yield from self._call_g(path, body, action, name, raw=raw))
            if raw:
                return data
            try:
                answer = json.loads(data)
                if not isinstance(answer, dict):
                    raise ValueError("not a JSON object")
                header = answer.get("header")
                if path.startswith("/v3/kv/") and not (
                    isinstance(header, dict) and _int(header.get("revision")) > 0
                ):
                    raise ValueError("no header revision")
            except ValueError as exc:
                raise self._unavailable(
                    action,
                    name,
                    ValueError(
                        f"backend answered something that is not etcd's JSON gateway ({exc})"
                    ),
                ) from exc
            return answer
        assert last is not None
        error = self._unavailable(action, name, last)
        error.election = answered  # type: ignore[attr-defined]
        raise error from last

    def _raise_answer(
        self, status: int, data: bytes, action: str, name: str, path: str, body: Any
    ) -> NoReturn:
        try:
            answer = json.loads(data)
            code, message = int(answer.get("code", 0)), str(answer.get("message", ""))
        except (ValueError, AttributeError, TypeError):
            code, message = 0, data[:200].decode(errors="replace")
        if code == _NOT_FOUND and "lease not found" in message:
            raise _LeaseGone(message)
        if code == _UNAUTHENTICATED and self._creds and "invalid auth token" in message:
            self._auth_token = ""
            raise _ReAuth(message)
        if code in _UNAVAILABLE_CODES or status in (502, 503, 504):
            exc = _ServerSaid(code, message)
            raise self._unavailable(action, name, exc) from exc
        raise LockError(
            f"etcd refused to {action} {name!r} on backend {self.alias!r} "
            f"(HTTP {status}, code {code}): {redact(message)}"
        ) from _ServerSaid(code, message)

    def _authenticate_g(self, action: str, name: str) -> Generator[Any, Any, None]:
        assert self._creds is not None
        user, password = self._creds
        try:
            answer = yield from self._call_g(
                "/v3/auth/authenticate", {"name": user, "password": password}, action, name
            )
        except LockBackendUnavailable:
            raise
        except LockError as exc:
            # etcd's message names neither the password nor the user; keep it so.
            raise LockError(
                f"etcd refused the credentials of backend {self.alias!r} (to {action} "
                f"{name!r}): check OPTIONS['user'] / ['password'] or the LOCATION's user"
            ) from exc.__cause__
        self._auth_token = str(answer.get("token", ""))

    def _retrying_g(
        self,
        deadline: float,
        make: Callable[[], Generator[Any, Any, T]],
        action: str,
        name: str,
    ) -> Generator[Any, Any, T]:
        """Run the steps ``make()`` builds, again after a pause (0.1 s doubling to 1 s)
        while the cluster is electing a leader (a member answered that it cannot serve
        now) and ``deadline`` (monotonic) leaves time for it; the steps must be safe to
        repeat. A cluster nobody answers for fails at once, as before."""
        pause = ELECTION_RETRY_FIRST
        while True:
            try:
                return (yield from make())
            except LockBackendUnavailable as exc:
                if not getattr(exc, "election", False) or time.monotonic() + pause >= deadline:
                    raise
                logger.info(
                    "etcd %s has no leader now (%s %r); trying again within the timeout",
                    self.location,
                    action,
                    name,
                )
            yield _Pause(pause)
            pause = min(ELECTION_RETRY_MAX, pause * 2)

    def _unavailable(self, action: str, name: str, exc: BaseException) -> LockBackendUnavailable:
        detail = redact(f"{type(exc).__name__}: {exc}")
        return LockBackendUnavailable(
            self.alias, f"{action} {name!r} on etcd {self.location}: {detail}"
        )

    # -- keys and small requests ---------------------------------------------------

    def _quoted(self, name: str) -> str:
        return urllib.parse.quote(name, safe="")

    def lock_key(self, name: str) -> str:
        return f"{self.prefix}/lock/{self._quoted(name)}"

    def fence_key(self, name: str) -> str:
        return f"{self.prefix}/fence/{self._quoted(name)}"

    def wait_prefix(self, name: str) -> str:
        return f"{self.prefix}/wait/{self._quoted(name)}/"

    def wait_key(self, name: str, owner: str) -> str:
        return self.wait_prefix(name) + urllib.parse.quote(owner, safe="")

    def _txn(
        self,
        action: str,
        name: str,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        return self._sync(self._txn_g(action, name, compare, success, failure))

    def _txn_g(
        self,
        action: str,
        name: str,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]] | None = None,
    ) -> Generator[Any, Any, dict[str, Any]]:
        body: dict[str, Any] = {"compare": compare, "success": success}
        if failure:
            body["failure"] = failure
        return dict((yield from self._call_g("/v3/kv/txn", body, action, name)))

    def _grant(self, ttl: float, action: str, name: str) -> tuple[int, int]:
        """A new lease of at least ``ttl`` seconds: (id, seconds granted)."""
        return self._sync(self._grant_g(ttl, action, name))

    def _grant_g(
        self, ttl: float, action: str, name: str, lease: int = 0
    ) -> Generator[Any, Any, tuple[int, int]]:
        """:meth:`_grant` of the lease id ``lease`` (a new random one when 0). The id is
        chosen here, not by the server, so that a caller interrupted before the answer
        still knows which lease to revoke; a grant repeated after a lost answer finds
        its own lease there."""
        lease = lease or _new_lease_id()
        try:
            answer = yield from self._call_g(
                "/v3/lease/grant", {"TTL": lease_seconds(ttl), "ID": str(lease)}, action, name
            )
        except LockError as exc:
            said = exc.__cause__
            if not (isinstance(said, _ServerSaid) and "lease already exists" in str(said)):
                raise
            # Ours, granted by an attempt whose answer was lost (or, once in 2**62, a
            # lease of somebody else's id: its time to live says it is live either way).
            left, granted = yield from self._time_to_live_g(lease, action, name)
            if left <= 0:
                raise
            return lease, granted
        return _int(answer.get("ID")), _int(answer.get("TTL"))

    def _keepalive(self, leases: Sequence[int], action: str, name: str) -> list[int]:
        """Renew each lease (one request for all); the seconds each now has, 0 if gone."""
        return self._sync(self._keepalive_g(leases, action, name))

    def _keepalive_g(
        self, leases: Sequence[int], action: str, name: str
    ) -> Generator[Any, Any, list[int]]:
        if not leases:
            return []
        body = "\n".join(json.dumps({"ID": str(lease)}) for lease in leases)
        data = yield from self._call_g("/v3/lease/keepalive", body, action, name, raw=True)
        ttls: dict[int, int] = {}
        for line in data.splitlines():
            if not line.strip():
                continue
            try:
                result = _watch_result(line)
            except ValueError as exc:
                raise self._unavailable(action, name, exc) from exc
            ttls[_int(result.get("ID"))] = _int(result.get("TTL"))
        return [ttls.get(lease, 0) for lease in leases]

    def _revoke_quietly(self, lease: int) -> None:
        """Revoke a lease this process no longer needs: a failure is harmless (it
        expires by itself within its ttl)."""
        self._sync(self._revoke_quietly_g(lease))

    def _revoke_quietly_g(self, lease: int) -> Generator[Any, Any, None]:
        try:
            yield from self._call_g(
                "/v3/lease/revoke", {"ID": str(lease)}, "revoke the lease of", ""
            )
        except LockError:
            logger.debug("Could not revoke etcd lease %x", lease, exc_info=True)

    def _time_to_live(self, lease: int, action: str, name: str) -> tuple[int, int]:
        """(seconds left, seconds granted) of ``lease``; (-1, 0) if it is gone."""
        return self._sync(self._time_to_live_g(lease, action, name))

    def _time_to_live_g(
        self, lease: int, action: str, name: str
    ) -> Generator[Any, Any, tuple[int, int]]:
        if not lease:
            return -1, 0
        answer = yield from self._call_g("/v3/lease/timetolive", {"ID": str(lease)}, action, name)
        return _int(answer.get("TTL")), _int(answer.get("grantedTTL"))

    def _clock_us(self) -> int:
        """The clock for a new fence's base: this host's, in microseconds."""
        return time.time_ns() // 1000

    def _fence_at_floor(self, fence: str) -> dict[str, Any]:
        """The comparison that the fence key ``fence`` (base64) exists with a base at
        least the floor (a lock's, or a read-write lock's write fence)."""
        fence_cmp: dict[str, Any] = {
            "target": "VERSION",
            "key": fence,
            "result": "GREATER",
            "version": "0",
        }
        if self.token_floor > 0:
            # Fixed-width digits compare as numbers, byte by byte.
            fence_cmp = {
                "target": "VALUE",
                "key": fence,
                "result": "GREATER",
                "value": _b64(str(self.token_floor - 1).zfill(_BASE_DIGITS)),
            }
        return fence_cmp

    def _queue_range(self, prefix: str) -> dict[str, Any]:
        return {
            "requestRange": {
                "key": _b64(prefix),
                "range_end": _prefix_end(prefix),
                "sort_order": "ASCEND",
                "sort_target": "CREATE",
                "keys_only": True,
            }
        }
