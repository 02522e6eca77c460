"""Inspecting and listing Redlock locks: each master's view of a name, and the lock
as the quorum sees it."""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
from collections.abc import Iterator, Sequence

from distlocks.backends.base import LockInfo
from distlocks.backends.redlock.masters import RedlockMasters


class RedlockListing(RedlockMasters):
    """``inspect`` and ``iter_locks``: what a quorum of masters agrees is held."""

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
