"""Inspecting and listing the Redis backend's locks: one lock's details, a walk
over every lock (SCAN), and the listing index that spares that walk.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import redis
import redis.cluster
from distlocks.backends.base import (
    RWLOCK,
    SEMAPHORE,
    LockInfo,
    holder_details,
    moment,
)
from distlocks.backends.redis.permits import RedisPermits
from distlocks.backends.redis.scripts import _FIELDS, _WIDTH
from distlocks.exceptions import LockError

logger = logging.getLogger("distlocks.backends.redis")

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_MILLISECOND = dt.timedelta(milliseconds=1)
#: Milliseconds since the epoch that make a date (years 1 to 9999).
_MIN_MS = (dt.datetime.min.replace(tzinfo=dt.UTC) - _EPOCH) // _MILLISECOND
_MAX_MS = (dt.datetime.max.replace(tzinfo=dt.UTC) - _EPOCH) // _MILLISECOND


def _decoded(values: list[Any]) -> list[Any]:
    """``values`` with bytes decoded (the client may or may not decode replies)."""
    return [value.decode() if type(value) is bytes else value for value in values]


def _decode(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def _summaries(values: list[Any], now_ms: int, texts: dict[Any, Any]) -> Iterator[tuple[Any, ...]]:
    """The tuples of :meth:`RedisBackend.iter_lock_summaries` for ``values`` (the LIST
    script's reply, not decoded), read at ``now_ms``: the values
    :meth:`RedisBackend._info` makes of them, without datetimes or parsed JSON. The
    texts most locks share (host, thread, details, ttl) are decoded once, through
    ``texts``."""
    for at in range(0, len(values), _WIDTH):
        owner, name, token, host, pid, thread, acquired, ttl, renewals, extra, pttl, waiters = (
            values[at : at + _WIDTH]
        )
        shared = texts.get((host, thread, extra, ttl))
        if shared is None:
            shared = texts[host, thread, extra, ttl] = (
                _decode(host), _decode(thread), _decode(extra), int(ttl or 0) / 1000 or None
            )  # fmt: skip
        acquired = int(acquired) if acquired else None
        if acquired is not None and not _MIN_MS <= acquired <= _MAX_MS:
            acquired = None  # no date (see moment())
        expires = now_ms + pttl if pttl >= 0 else None
        if expires is not None and not _MIN_MS <= expires <= _MAX_MS:
            expires = None
        yield (
            name.decode() if type(name) is bytes else name or "",
            owner.decode() if type(owner) is bytes else owner,
            int(token or 0), shared[0], int(pid) if pid and pid.isdigit() else None,
            shared[1], acquired, expires, shared[3], int(renewals or 0), int(waiters),
            shared[2],
        )  # fmt: skip


class RedisListing(RedisPermits):
    """Inspection and listing of locks (the permits' part is
    :class:`~distlocks.backends.redis.permits.RedisPermits`)."""

    #: Keys one SCAN call walks on the server (it returns those that match). The server
    #: serves nobody else during a call: 1,000 keys (with MATCH and TYPE) take about
    #: 2 ms of it, 10,000 took 50 ms and more, so a listing takes more round trips of a
    #: bounded cost rather than a few long ones.
    SCAN_COUNT = 1_000
    #: Locks read by one listing script (or one pipeline, on a cluster): 250 take about
    #: 4 ms of server time, 1,000 took 30 ms and more.
    LIST_BATCH = 250

    def _info(self, values: Sequence[Any], at: int, now: dt.datetime) -> LockInfo:
        """The lock described by ``values[at:at + _WIDTH]`` (the layout of INSPECT, with
        the strings decoded)."""
        owner, name, token, host, pid, thread, acquired, ttl, renewals, extra, pttl, waiters = (
            values[at : at + _WIDTH]
        )
        details = holder_details(extra)
        return LockInfo(
            name=name or "",
            backend=self.alias,
            owner=owner,
            fencing_token=int(token or 0),
            host=host or "",
            pid=int(pid) if pid and pid.isdigit() else None,
            thread=thread or "",
            acquired_at=moment(_EPOCH, int(acquired)) if acquired else None,
            expires_at=moment(now, pttl) if pttl >= 0 else None,
            ttl=int(ttl or 0) / 1000 or None,
            renewals=int(renewals or 0),
            # Lapsed registrations are pruned at every release, so ZCARD is close enough.
            waiters=int(waiters),
            extra=details,
        )

    def inspect(self, name: str) -> LockInfo | None:
        keys = self.all_keys(name)
        with self._errors("inspect", name):
            values = _decoded(self._run("inspect", [keys.lock, keys.waiters], []))
        return self._info(values, 0, dt.datetime.now(dt.UTC)) if values else None

    def iter_locks(self) -> Iterator[LockInfo]:
        """Every lock, then every semaphore permit and read-write lease, found by one
        walk over this backend's hashes (one per lock, semaphore or read-write lock)."""
        for locks, permits in self._walk():
            for start in range(0, len(locks), self.LIST_BATCH):
                yield from self._describe(locks[start : start + self.LIST_BATCH])
            if permits is not None:
                yield from self.permits_at(permits)

    def iter_lock_summaries(self) -> Iterator[tuple[Any, ...] | LockInfo | str]:
        """What :meth:`iter_locks` lists, in the cheaper form a listing of many locks
        reads (:func:`distlocks.livelocks.collect` uses this method when a backend has
        it): the same walk and the same server reads, but each lock as one tuple of
        plain values, without the datetimes and the parsed holder details of a
        :class:`LockInfo`, which a page of live locks needs for its shown rows only::

            (name, owner, fencing_token, host, pid, thread, acquired_ms, expires_ms,
             ttl, renewals, waiters, extra)

        ``acquired_ms`` and ``expires_ms`` are milliseconds since the epoch (None where
        :meth:`iter_locks` has no date), ``extra`` the holder's details as the JSON text
        stored (:func:`~distlocks.backends.base.holder_details` reads it); the other
        values are those of the :class:`LockInfo` fields of the same names. Repeated
        texts (host, thread, details) are shared between tuples. Permits come after the
        locks as :class:`LockInfo` objects, as :meth:`iter_locks` yields them.

        With the listing index (:attr:`listing_index`, see :meth:`rebuild_listing_index`)
        the locks are read from it, and their ``waiters`` are None (a page's shown rows
        read theirs in full). A listing that finds the index lost says so with a str,
        a note for the operator, among the items (the locks are listed all the same).

        A subclass that overrides :meth:`iter_locks` is listed through it instead."""
        if type(self).iter_locks is not RedisListing.iter_locks:
            yield from self.iter_locks()
            return
        if self.listing_index:
            yield from self._indexed_summaries()
            return
        texts: dict[Any, Any] = {}  # (host, thread, details, ttl) as stored -> as listed
        for locks, permits in self._walk():
            for start in range(0, len(locks), self.LIST_BATCH):
                values, now = self._list_values(locks[start : start + self.LIST_BATCH], False)
                yield from _summaries(values, (now - _EPOCH) // _MILLISECOND, texts)
            if len(texts) > 10_000:
                texts.clear()  # many different holders: start again
            if permits is not None:
                yield from self.permits_at(permits)

    # -- the listing index -------------------------------------------------------

    #: Entries whose expiry is within this many milliseconds of the server's clock
    #: (either way) when the index was read are checked against their lock's hash.
    INDEX_MARGIN_MS = 1000
    #: Entries whose expiry is past checked (and dropped, or corrected) per listing; any
    #: more are left out of it as expired and checked by the next listings.
    INDEX_SETTLE_LIMIT = 10_000
    #: Index fields one listing call reads (``HSCAN ... COUNT``): the server's time for
    #: one call grows with it (about 1.5 ms per 1,000; 10-35 ms at 10,000), and other
    #: clients wait that long; a listing of 100,000 locks is then 100 round trips.
    INDEX_CHUNK = 1_000
    #: The field of the index hash that holds its epoch (no lock name has a control
    #: character, so no lock has this name); see :meth:`rebuild_listing_index`.
    INDEX_EPOCH_FIELD = "\x00epoch"

    def rebuild_listing_index(self) -> bool:
        """Build the listing index from a walk over the lock hashes (``SCAN``); True if
        it is whole afterwards, False if it was lost again meanwhile (the next listing
        then builds it again).

        The index is one hash per key prefix, ``{prefix}:listing``: a field per held
        lock (its name), whose value holds what a listing shows of it. The acquire,
        extend, release and force release scripts write it in the same step as the
        lock, so a listing reads that one key (``HSCAN``) instead of every lock. An
        entry stays after its lock expired: a listing leaves out the entries whose
        expiry is past, and drops them after checking (in a script) that the lock is
        gone, correcting those whose lock is still held. The semaphores and read-write
        locks with permits are in a set, ``{prefix}:listing:permits`` (their info
        hashes), each read in full by a listing.

        The index carries an epoch (:attr:`INDEX_EPOCH_FIELD`, a field of the hash and
        a member of the permits set), set by this method when it is done, and the
        marker ``{prefix}:listing:built``. A key of the index can be lost on its own (a
        ``DEL``, eviction under an ``allkeys-*`` policy) and made again, partly, by the
        next lock taken: without its epoch. A listing that finds the index without its
        epoch or marker (a new server, an upgrade from a version without the index, a
        lost key), or finds the epoch changed between two of its chunks, lists by a
        walk over every key instead, which calls this on the way, and says so. This
        indexes every lock and permit found, corrects or drops the entries not found,
        then sets the epoch and the marker. Locks taken or released by a process that
        does not write the index (an older version, ``listing_index`` off) are not in
        it, or shown until their expiry: once every process writes it, delete the
        marker to have the next listing build it again."""
        if not self.listing_index:
            raise LockError(f"backend {self.alias!r} keeps no listing index")
        done = True
        for item in self._rebuilding_summaries(set(), {}):
            if type(item) is str:
                done = False
        return done

    def _rebuilding_summaries(
        self, seen: set[str], texts: dict[Any, Any]
    ) -> Iterator[tuple[Any, ...] | LockInfo | str]:
        """:meth:`iter_lock_summaries` from a walk over every key (``SCAN``), which
        rebuilds the index on the way (see :meth:`rebuild_listing_index`): the locks
        whose names are not in ``seen`` (each added), the permits, then a note (a
        str) if the index was lost again meanwhile."""
        epoch = str(uuid.uuid4())
        index = [self.index_key, self.index_permits_key]
        with self._errors("list", self.key_prefix):
            self._run("index_begin", index, [self.INDEX_EPOCH_FIELD, "~" + epoch])
        for locks, permits in self._walk():
            for start in range(0, len(locks), self.LIST_BATCH):
                values = self._index_run(locks[start : start + self.LIST_BATCH], [])
                now_ms = (dt.datetime.now(dt.UTC) - _EPOCH) // _MILLISECOND
                yield from self._unseen(_summaries(values, now_ms, texts), seen)
            if permits:
                members = [f"{base}:sem:info" for base in permits[SEMAPHORE]]
                members += [f"{base}:rw:info" for base in permits[RWLOCK]]
                with self._errors("list", self.key_prefix):
                    for start in range(0, len(members), self.LIST_BATCH):
                        self.client.sadd(
                            self.index_permits_key, *members[start : start + self.LIST_BATCH]
                        )
                yield from self.permits_at(permits)
        # Entries the walk did not find: of locks gone (dropped), or taken since their
        # key's turn in the walk (rewritten, and listed).
        unseen: list[Any] = []
        for names in self._index_names():
            unseen += [name for name in names if _decode(name) not in seen]
            while len(unseen) >= self.LIST_BATCH or (unseen and not names):
                batch, unseen = unseen[: self.LIST_BATCH], unseen[self.LIST_BATCH :]
                values = self._settle(batch)
                now_ms = (dt.datetime.now(dt.UTC) - _EPOCH) // _MILLISECOND
                yield from self._unseen(_summaries(values, now_ms, texts), seen)
        with self._errors("list", self.key_prefix):
            done = self._run(
                "index_done",
                [*index, self.index_marker_key],
                [self.INDEX_EPOCH_FIELD, "~" + epoch, epoch],
            )
        if not done:
            note = (
                f"The listing index of backend {self.alias!r} was lost again while it was "
                f"rebuilt, so the rebuild could not be finished; this listing read every "
                f"key all the same, and the next one rebuilds the index."
            )
            logger.warning("%s", note)
            yield note

    @staticmethod
    def _unseen(summaries: Iterator[tuple[Any, ...]], seen: set[str]) -> Iterator[tuple[Any, ...]]:
        for summary in summaries:
            if summary[0] not in seen:
                seen.add(summary[0])
                yield summary

    def _index_names(self) -> Iterator[list[Any]]:
        """The lock names in the listing index, a chunk (``HSCAN``) at a time, then an
        empty list."""
        cursor = 0
        epoch_field = self.INDEX_EPOCH_FIELD.encode()
        while True:
            with self._errors("list", self.key_prefix):
                cursor, found = self.client.hscan(self.index_key, cursor, count=self.INDEX_CHUNK)
            names = [name for name in found if name not in (epoch_field, self.INDEX_EPOCH_FIELD)]
            if names:
                yield names
            if not cursor:
                yield []
                return

    def _index_run(self, locks: list[str], names: list[Any]) -> list[Any]:
        """The INDEX script on the lock hashes ``locks`` (with their ``names``, or
        none): what LIST returns of the held ones, not decoded."""
        keys = [self.index_key]
        for key in locks:
            keys += (key, key.removesuffix(":lock") + ":waiters")
        with self._errors("list", self.key_prefix):
            return list(self._run("index", keys, names))

    def _settle(self, names: list[Any]) -> list[Any]:
        """Check the index entries of ``names`` against their locks (one script): drop
        those of free locks, rewrite the others. What LIST returns of the held ones."""
        decoded = [_decode(name) for name in names]
        return self._index_run([self.all_keys(name).lock for name in decoded], decoded)

    def _indexed_summaries(self) -> Iterator[tuple[Any, ...] | LockInfo | str]:
        """:meth:`iter_lock_summaries` from the listing index, a chunk (``HSCAN`` of
        :attr:`INDEX_CHUNK` fields) at a time: each read in one transaction with the
        server's clock, which tells the entries of held locks (expiry after that
        moment) from those to check, and with the index's epoch and marker, which tell
        a whole index from one lost (before the listing, between two of its chunks, or
        its permits set before they are read): the listing then goes on by a walk over
        every key, and says so."""
        doubtful: list[Any] = []
        expired: list[Any] = []
        texts: dict[Any, Any] = {}
        # Names listed or to be checked: HSCAN may return a field twice, and a listing
        # that goes on by a walk skips those it listed.
        seen: set[str] = set()
        epoch: Any = None
        cursor = 0
        while True:
            with self._errors("list", self.key_prefix):
                # MULTI/EXEC: the epoch, the marker and the chunk are of one moment.
                pipe = self.client.pipeline(transaction=True)
                pipe.hget(self.index_key, self.INDEX_EPOCH_FIELD)
                pipe.exists(self.index_marker_key)
                pipe.hscan(self.index_key, cursor, count=self.INDEX_CHUNK)
                pipe.time()
                found, marked, (cursor, entries), (seconds, micros) = pipe.execute()
            built = found is not None or marked
            if found is not None and (not marked or _decode(found).startswith("~")):
                found = None  # not whole: marker lost, or a rebuild not finished
            if not found and epoch is None and not built:
                # Never built here (a new server or prefix, an upgrade), or every trace
                # of it lost: built now, by the walk that lists the locks.
                logger.info("Building the listing index of backend %r", self.alias)
                yield from self._rebuilding_summaries(seen, texts)
                return
            if not found or (epoch is not None and found != epoch):
                if epoch is None:
                    note = (
                        f"The listing index of backend {self.alias!r} was not found whole "
                        f"(never built, or a key of it deleted or evicted): this listing "
                        f"read every key instead, and rebuilt the index."
                    )
                else:
                    note = (
                        f"The listing index of backend {self.alias!r} changed during the "
                        f"listing (a key of it deleted or evicted, or rebuilt): the rest "
                        f"of this listing read every key instead, and rebuilt the index."
                    )
                logger.warning("%s", note)
                yield note
                # Entries read but not listed yet: the walk lists those held.
                seen.difference_update(_decode(name) for name in doubtful + expired)
                yield from self._rebuilding_summaries(seen, texts)
                return
            epoch = found
            now = dt.datetime.now(dt.UTC)
            server_ms = int(seconds) * 1000 + int(micros) // 1000
            shift = (now - _EPOCH) // _MILLISECOND - server_ms  # server clock -> ours
            due, past = server_ms + self.INDEX_MARGIN_MS, server_ms - self.INDEX_MARGIN_MS
            for raw_name, value in entries.items():
                name = raw_name.decode() if type(raw_name) is bytes else raw_name
                if name in seen or name == self.INDEX_EPOCH_FIELD:
                    continue
                parts = value.split(b"\0" if type(value) is bytes else "\0", 9)
                if len(parts) != 10:
                    seen.add(name)
                    doubtful.append(name)  # '': fields holding a NUL; or not an entry
                    continue
                owner, token, host, pid, thread, acquired, expires, ttl, renewals, extra = parts
                try:
                    if expires:
                        expires = int(expires)
                        if expires <= due:
                            if expires >= past:
                                seen.add(name)
                                doubtful.append(name)
                            elif len(expired) < self.INDEX_SETTLE_LIMIT:
                                # Beyond the limit, left out as expired (and not kept:
                                # memory stays bounded); later listings check them.
                                seen.add(name)
                                expired.append(name)
                            continue
                        expires += shift
                        if not _MIN_MS <= expires <= _MAX_MS:
                            expires = None
                    else:
                        expires = None
                    shared = texts.get((host, thread, extra, ttl))
                    if shared is None:
                        if len(texts) > 10_000:
                            texts.clear()  # many different holders: start again
                        shared = texts[host, thread, extra, ttl] = (
                            _decode(host), _decode(thread), _decode(extra),
                            int(ttl or 0) / 1000 or None,
                        )  # fmt: skip
                    acquired = int(acquired) if acquired else None
                    if acquired is not None and not _MIN_MS <= acquired <= _MAX_MS:
                        acquired = None
                    summary = (
                        name,
                        owner.decode() if type(owner) is bytes else owner,
                        int(token or 0), shared[0],
                        int(pid) if pid and pid.isdigit() else None, shared[1], acquired,
                        expires, shared[3], int(renewals or 0), None, shared[2],
                    )  # fmt: skip
                except ValueError:  # not numbers where numbers belong: the lock says
                    seen.add(name)
                    doubtful.append(name)
                    continue
                seen.add(name)
                yield summary
            if not cursor:
                break
        # Entries due now are checked; so are those whose expiry is past, up to a limit
        # (those left are of locks that expired: the next listings drop them).
        check = doubtful + expired
        for start in range(0, len(check), self.LIST_BATCH):
            values = self._settle(check[start : start + self.LIST_BATCH])
            now = dt.datetime.now(dt.UTC)
            yield from _summaries(values, (now - _EPOCH) // _MILLISECOND, texts)
        with self._errors("list", self.key_prefix):
            whole = self.client.sismember(
                self.index_permits_key, f"{self.INDEX_EPOCH_FIELD}:{_decode(epoch)}"
            )
        if not whole:
            note = (
                f"The permits set of the listing index of backend {self.alias!r} was lost "
                f"(deleted or evicted): this listing read every key for them instead, and "
                f"rebuilt the index."
            )
            logger.warning("%s", note)
            yield note
            yield from self._rebuilding_summaries(seen, texts)
            return
        yield from self.indexed_permits()

    def count_waiters(self, names: Sequence[str]) -> list[int]:
        """How many waiters are registered on each lock of ``names`` (in one round
        trip): what a listing read from the index leaves out, for the rows shown."""
        with self._errors("list", self.key_prefix):
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.zcard(self.all_keys(name).waiters)
            return [int(count) for count in pipe.execute()]

    def _walk(self) -> Iterator[tuple[list[str], dict[str, list[str]] | None]]:
        """The lock hashes of this backend, a SCAN batch at a time, then (with the last,
        empty batch) the bases of its semaphores and read-write locks."""
        permits: dict[str, list[str]] = {SEMAPHORE: [], RWLOCK: []}
        for batch in self._scan_batches(self._hash_pattern(), kind="hash"):
            locks = []
            for key in batch:
                if key.endswith(":lock"):
                    locks.append(key)
                elif key.endswith(":sem:info"):
                    permits[SEMAPHORE].append(key.removesuffix(":sem:info"))
                elif key.endswith(":rw:info"):
                    permits[RWLOCK].append(key.removesuffix(":rw:info"))
            yield locks, None
        yield [], permits

    def _hash_pattern(self) -> str:
        """A SCAN pattern for this backend's keys, and no other prefix's."""
        # Glob characters in the prefix must match themselves.
        prefix = re.sub(r"([*?\[\]\\])", r"\\\1", self.key_prefix)
        return f"{prefix}:{{*}}:*"

    def _describe(self, locks: list[str]) -> Iterator[LockInfo]:
        """The live ones of the lock hashes ``locks``, read in one round trip."""
        values, now = self._list_values(locks)
        for at in range(0, len(values), _WIDTH):
            yield self._info(values, at, now)

    def _list_values(self, locks: list[str], decode: bool = True) -> tuple[list[Any], dt.datetime]:
        """What INSPECT reads of each live one of the lock hashes ``locks``, one after
        the other (strings decoded, unless ``decode`` is false), read in one round trip;
        and when they were read."""
        with self._errors("list", self.key_prefix):
            if self.mode == "cluster":
                # Keys of many slots: a pipeline, which sends each node the keys it serves.
                pipe = self.client.pipeline(transaction=False)
                for key in locks:
                    pipe.hmget(key, _FIELDS)
                    pipe.pttl(key)
                    pipe.zcard(key.removesuffix(":lock") + ":waiters")
                replies = pipe.execute()
                values: list[Any] = []
                for at in range(0, len(replies), 3):
                    if replies[at][0] is not None:
                        values += [*replies[at], replies[at + 1], replies[at + 2]]
            else:
                keys: list[str] = []
                for key in locks:
                    keys += (key, key.removesuffix(":lock") + ":waiters")
                values = self._run("list", keys, [])
        return _decoded(values) if decode else values, dt.datetime.now(dt.UTC)

    def _scan_batches(self, pattern: str, *, kind: str | None = None) -> Iterator[list[str]]:
        """The keys matching ``pattern`` (of the type ``kind``, if given), in batches:
        SCAN, so the server is never blocked for long."""
        size = self.SCAN_COUNT
        with self._errors("list", pattern):
            if self.mode == "cluster":
                # Each primary holds only its own slots' keys: scan every one of them.
                batch: list[str] = []
                for key in self.client.scan_iter(
                    match=pattern,
                    count=size,
                    _type=kind,
                    target_nodes=redis.cluster.RedisCluster.PRIMARIES,
                ):
                    batch.append(_decode(key))
                    if len(batch) >= size:
                        yield batch
                        batch = []
                if batch:
                    yield batch
                return
            cursor = 0
            while True:
                cursor, keys = self.client.scan(
                    cursor=cursor, match=pattern, count=size, _type=kind
                )
                if keys:
                    yield [_decode(key) for key in keys]
                if cursor == 0:
                    break
