"""Review 7: holders with old and new tokens interleave writes to one fenced row through
random write paths, on PostgreSQL and SQLite, with tokens from a real Redis lock.

A new holder takes the lock after a force release of the current one (which leaves
that holder paused but unaware, holding an outdated token). Each write goes through
one of Django's paths: ``save()``, ``save(update_fields=)``, a save of an instance
loaded with ``only()``, ``refresh_from_db()`` then ``save()``, ``fenced_update()``
(also with ``F()``), an upsert with ``bulk_create(update_conflicts=True)``, a claim,
raw SQL carrying the token, ``delete()``, ``fenced_delete()`` and an ``unfenced()``
save of the instance the holder loaded. The model of the row says what each write
must do; after every step the row must be what the model says, and:

* the row's token never goes down;
* a write whose token is below the stored one never lands (it raises
  ``StaleFencingToken``, or ``LockLost`` for a lease already known to be lost, and
  changes nothing);
* a fenced save never brings a deleted row back (``FencedRowDeleted``).
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from django.db import connections
from django.db.models import F
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from distlocks import get_backend, lock
from distlocks.exceptions import FencedRowDeleted, LockLost, StaleFencingToken
from distlocks.fencing import unfenced
from distlocks.lease import BaseLease
from tests.testapp.models import Account

PATHS = [
    "save",
    "save_update_fields",
    "save_only",
    "refresh_then_save",
    "save_with_lease",
    "fenced_update",
    "fenced_update_f",
    "upsert",
    "claim",
    "raw_sql",
    "delete",
    "fenced_delete",
]

_DATABASES = [
    pytest.param("default", marks=pytest.mark.django_db(transaction=True), id="postgresql"),
    pytest.param(
        "sqlite", marks=pytest.mark.django_db(databases=["sqlite"], transaction=True), id="sqlite"
    ),
]


@dataclass
class Holder:
    lease: BaseLease
    token: int
    #: The instance this holder loaded when it took the lock (None: no row then).
    loaded: Account | None


class RowMachine(RuleBasedStateMachine):
    alias = "default"

    def __init__(self) -> None:
        super().__init__()
        self.name = f"review7-row:{uuid.uuid4().hex}"
        self.backend = get_backend("default")
        self.holders: list[Holder] = []
        row = Account(owner="m", balance=0)
        row.save(using=self.alias)  # an insert: token 0
        self.pk = row.pk
        #: The model: the row's token and balance, or None once deleted.
        self.row: tuple[int, int] | None = (0, 0)
        self.highest = 0

    def teardown(self) -> None:
        for holder in self.holders:
            holder.lease.release()
        Account._base_manager.using(self.alias).filter(pk=self.pk).delete()

    # -- helpers ----------------------------------------------------------------

    def rows(self) -> Any:
        return Account.objects.using(self.alias).filter(pk=self.pk)

    def load(self) -> Account | None:
        return Account.objects.using(self.alias).filter(pk=self.pk).first()

    def loaded(self, holder: Holder) -> Account | None:
        """A copy of what the holder loaded (a delete sets the pk of its instance to
        None; every write starts again from the holder's snapshot)."""
        return copy.deepcopy(holder.loaded)

    def accepts(self, token: int) -> bool:
        return self.row is not None and token >= self.row[0]

    # -- rules ------------------------------------------------------------------

    @rule()
    def take_over(self) -> None:
        """The current holder is force-released (it does not know yet); a new one
        takes the lock, with a higher token, and loads the row."""
        if self.holders:
            assert self.backend.force_release(self.name, self.holders[-1].token)
        lease = lock(self.name, backend="default", ttl=60, timeout=0, auto_renew=False).acquire()
        assert lease.fencing_token > max((h.token for h in self.holders), default=0)
        self.holders.append(Holder(lease, lease.fencing_token, self.load()))

    @precondition(lambda self: self.holders)
    @rule(i=st.integers(0, 99), path=st.sampled_from(PATHS), value=st.integers(1, 10**6))
    def write(self, i: int, path: str, value: int) -> None:
        holder = self.holders[i % len(self.holders)]
        token = holder.token
        accepted = self.accepts(token)
        gone = self.row is None
        try:
            outcome = self.run(path, holder, value)
        except LockLost:
            # The lease of a force-released holder may already be known lost: refused
            # before any SQL, as a stale token would be.
            assert holder is not self.holders[-1], path
            return
        except FencedRowDeleted:
            assert gone and path.startswith("save"), path
            return
        except StaleFencingToken:
            assert not accepted and not gone, (path, token, self.row)
            return
        except Account.DoesNotExist:  # refresh_from_db() or a claim of a deleted row
            assert gone and path in {"refresh_then_save", "claim"}, path
            return
        if path == "upsert":
            # An insert of the missing row, or an overwrite checked by the trigger.
            assert accepted or gone, (path, token, self.row)
            self.row = (token, value)
        elif path in {"delete", "fenced_delete"}:
            if gone:
                assert outcome == 0
            elif accepted:
                assert outcome == 1
                self.row = None
                self.highest = 0  # a row inserted again may carry any token
            else:
                assert outcome == 0 and path == "fenced_delete"
        elif path in {"fenced_update", "fenced_update_f", "claim"}:
            assert outcome == (1 if accepted else 0), (path, token, self.row, outcome)
            if accepted:
                assert self.row is not None
                balance = {
                    "fenced_update": value,
                    "fenced_update_f": self.row[1] + 1,
                    "claim": self.row[1],
                }[path]
                self.row = (token, balance)
        elif path == "raw_sql":
            # The trigger compares the tokens; a missing row matches nothing.
            assert accepted or gone, (path, token, self.row)
            if not gone:
                self.row = (token, value)
        else:
            assert accepted, (path, token, self.row)
            self.row = (token, value)

    def run(self, path: str, holder: Holder, value: int) -> int | None:
        token = holder.token
        if path in {"save", "save_with_lease"}:
            obj = self.loaded(holder) or self.load()
            if obj is None:
                raise FencedRowDeleted("no row to load")  # nothing to save
            obj.balance = value
            obj.save(fencing_token=holder.lease if path == "save_with_lease" else token)
        elif path == "save_update_fields":
            obj = self.loaded(holder) or self.load()
            if obj is None:
                raise FencedRowDeleted("no row to load")
            obj.balance = value
            obj.owner = "ignored"  # not in update_fields: must not be written
            obj.save(fencing_token=token, update_fields=["balance"])
        elif path == "save_only":
            obj = Account.objects.using(self.alias).only("balance").filter(pk=self.pk).first()
            if obj is None:
                raise FencedRowDeleted("no row to load")
            obj.balance = value
            obj.save(fencing_token=token)
        elif path == "refresh_then_save":
            obj = self.loaded(holder) or Account(pk=self.pk, owner="m")
            obj.refresh_from_db(using=self.alias)
            obj.balance = value
            obj.save(fencing_token=token)
        elif path == "fenced_update":
            return self.rows().fenced_update(token, balance=value).updated
        elif path == "fenced_update_f":
            return self.rows().fenced_update(token, balance=F("balance") + 1).updated
        elif path == "claim":
            if self.row is None:
                raise Account.DoesNotExist
            claimed = holder.lease.claim(Account.objects.using(self.alias).filter(pk=self.pk))
            return 1 if claimed else 0
        elif path == "upsert":
            Account.objects.using(self.alias).bulk_create(
                [Account(pk=self.pk, owner="m", balance=value)],
                update_conflicts=True,
                update_fields=["balance"],
                unique_fields=["id"],
                fencing_token=token,
            )
        elif path == "raw_sql":
            connection = connections[self.alias]
            quote = connection.ops.quote_name
            with connection.cursor() as cursor:
                cursor.execute(
                    f"UPDATE {quote(Account._meta.db_table)} SET fencing_token = %s, "
                    f"balance = %s WHERE id = %s",
                    [token, value, self.pk],
                )
        elif path == "delete":
            obj = self.loaded(holder) or Account(pk=self.pk, owner="m")
            obj._state.db = self.alias
            deleted, _ = obj.delete(using=self.alias, fencing_token=token)
            return deleted
        elif path == "fenced_delete":
            return self.rows().fenced_delete(token).updated
        return None

    @precondition(lambda self: self.holders)
    @rule(i=st.integers(0, 99), value=st.integers(1, 10**6))
    def unfenced_save_of_the_loaded_instance(self, i: int, value: int) -> None:
        """An unfenced save writes the token the instance holds: the trigger refuses
        it if that is below the stored one; a row gone is inserted again (a bypass)."""
        holder = self.holders[i % len(self.holders)]
        obj = self.loaded(holder)
        if obj is None:
            return
        mine = obj.fencing_token
        obj.balance = value
        try:
            with unfenced():
                obj.save(using=self.alias)
        except StaleFencingToken:
            assert self.row is not None and mine < self.row[0]
            return
        assert self.row is None or mine >= self.row[0]
        if self.row is None:
            self.highest = 0  # inserted again: the bypass the docs name
        self.row = (mine, value)

    @invariant()
    def the_row_is_what_the_model_says(self) -> None:
        found = self.rows().values_list("fencing_token", "balance", "owner").first()
        if self.row is None:
            assert found is None
            return
        assert found is not None and found[:2] == self.row, (found, self.row)
        assert found[2] == "m"
        if found[0] < self.highest:
            raise AssertionError(f"token went down: {found[0]} < {self.highest}")
        self.highest = found[0]


@pytest.mark.usefixtures("pg_ready")
@pytest.mark.parametrize("alias", _DATABASES)
def test_stale_holders_never_land_a_write(alias: str) -> None:
    machine = type(f"RowMachine_{alias}", (RowMachine,), {"alias": alias})
    machine.TestCase.settings = settings(
        max_examples=30,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    machine.TestCase().runTest()
