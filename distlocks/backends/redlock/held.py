"""A held Redlock lease: release, renewal (one lease or the renewer's batch), force
release and the fencing counter, each decided by a quorum of the masters."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from distlocks.backends.redis import RedisBackend
from distlocks.backends.redlock.masters import RedlockMasters
from distlocks.backends.redlock.quorum import _ms, _Replies, spare, verdict
from distlocks.exceptions import LockError


class RedlockHeld(RedlockMasters):
    """What the holder of a lease (or an operator) does with it, by quorum."""

    def _by_quorum(self, action: str, name: str, call: Callable[[int], bool]) -> bool:
        """Run a compare-and-something on every master: True once a quorum confirms,
        False once so many say "not held" that no quorum can hold it, and
        LockBackendUnavailable when the masters that did not answer decide it.

        Not-held answers and failures are not added up: one master without the entry
        (it never confirmed the grant, or restarted empty) and one that does not answer
        in time leave the lease unconfirmed, not lost; the one that did not answer may
        still hold it. Like a single server that times out, that is an outage: the
        lease keeps the validity it had, and a renewal tries again."""
        masters = len(self.masters)

        def decided(replies: _Replies[bool]) -> bool:
            yes = sum(1 for ok in replies.results.values() if ok)
            no = len(replies.results) - yes
            return verdict(yes, no, masters) is not None or len(replies.errors) > spare(masters)

        replies = self._round(call, decided=decided)
        yes = sum(1 for ok in replies.results.values() if ok)
        outcome = verdict(yes, len(replies.results) - yes, masters)
        if outcome is None:
            raise self._unconfirmed(action, name, yes, replies)
        return outcome

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
                # -1: that master's keys of the lease hold values of another type (see
                # EXTEND_MANY): not renewed there, as a master without the entry.
                yes = sum(1 for answers in replies.results.values() if answers[at] == 1)
                outcome = verdict(yes, len(replies.results) - yes, len(self.masters))
                if outcome is None:
                    results.append(self._unconfirmed("renew", chunk[at][0], yes, replies))
                else:
                    results.append(outcome)
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
