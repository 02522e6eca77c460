"""Fenced save against a plain ``save()`` of the same row: implementations and workloads.

Issue 5's benchmark. Two tables with the same columns live in the benchmark's
database (:mod:`bench.benchapp`): ``PlainRow``, a plain Django model, and
``FencedRow``, a :class:`~distlocks.models.FencedModel` (one more column, and the
fencing trigger that ``migrate`` installs on PostgreSQL). Each implementation
keeps one existing row and saves it again and again, changing its integer before
every save, as an application updating a record would:

* ``plain-save``: ``row.save()`` of a ``PlainRow``, Django's own UPDATE (the floor
  of these workloads: what fencing is compared with);
* ``fenced-save``: ``row.save(fencing_token=N)`` of a ``FencedRow`` with a constant,
  valid token: distlocks' path, one ``UPDATE ... WHERE pk AND fencing_token <= N``
  through ``QuerySet.update`` plus the ``pre_save``/``post_save`` signals;
* ``fenced-table-django-save``: Django's own ``Model.save()`` called on the
  ``FencedRow`` (bypassing ``FencedModel.save``, so no token is checked): the same
  table and trigger through Django's save path, which splits the gap between the two
  others into "the table and its trigger" and "distlocks' save path".

The workloads are latency workloads like ``cycle``: one thread, many rounds of a
small batch each, the implementations interleaved round by round.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any, ClassVar

from bench.base import (
    Env,
    Implementation,
    Measurement,
    RunOptions,
    Workload,
    implementation,
    workload,
)

#: The token every fenced save offers: constant, so every save is accepted.
TOKEN = 1_000
#: The columns saved by the ``update_fields`` workload: every column but the token.
UPDATE_FIELDS = ("number", "label")
SAVE_WORKLOADS = frozenset({"fenced-save", "fenced-save-fields"})


class RowSave(Implementation):
    """Saves one existing row of one table; takes part only in the save workloads."""

    family = "postgres"
    servers = frozenset({"postgres"})
    workloads = SAVE_WORKLOADS
    key_patterns = ()
    distribution = "Django"
    #: ``"PlainRow"`` or ``"FencedRow"`` (imported late: Django is set up after the registry).
    model_name: ClassVar[str]

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self.row: Any = None

    def model(self) -> Any:
        from bench.benchapp import models

        return getattr(models, self.model_name)

    def create_row(self) -> None:
        """Insert the row the workload saves (untimed)."""
        self.row = self.model().objects.create(number=0, label="benchmark row")

    def delete_row(self) -> None:
        if self.row is not None:
            self.model()._base_manager.filter(pk=self.row.pk).delete()
            self.row = None

    def saver(self, update_fields: tuple[str, ...] | None) -> Callable[[], None]:
        """A callable that saves ``self.row`` once, the way this implementation does."""
        if update_fields is None:
            return functools.partial(self.row.save)
        return functools.partial(self.row.save, update_fields=update_fields)

    # Not a lock: the lock workloads never run these implementations.
    def try_acquire(self, name: str, ttl: float) -> Any | None:
        raise NotImplementedError(f"{self.name} saves rows; it takes no lock")

    def release(self, handle: Any) -> None:
        raise NotImplementedError(f"{self.name} saves rows; it takes no lock")

    def acquire_blocking(self, name: str, ttl: float, timeout: float) -> Any | None:
        raise NotImplementedError(f"{self.name} saves rows; it takes no lock")

    def close(self) -> None:
        self.delete_row()


@implementation
class PlainSave(RowSave):
    """Django's ``Model.save()`` of an existing row of a plain model (``PlainRow``)."""

    name = "plain-save"
    label = "Django Model.save() of a plain row"
    role = "floor"
    model_name = "PlainRow"


@implementation
class FencedSave(RowSave):
    """``FencedModel.save(fencing_token=N)`` of an existing row, N constant and valid."""

    name = "fenced-save"
    label = "distlocks FencedModel.save(fencing_token=N)"
    role = "distlocks"
    reference = True
    distribution = "distlocks"
    model_name = "FencedRow"

    def create_row(self) -> None:
        row = self.model()(number=0, label="benchmark row")
        row.save(fencing_token=TOKEN)  # the fenced INSERT
        self.row = row

    def saver(self, update_fields: tuple[str, ...] | None) -> Callable[[], None]:
        if update_fields is None:
            return functools.partial(self.row.save, fencing_token=TOKEN)
        return functools.partial(self.row.save, fencing_token=TOKEN, update_fields=update_fields)


@implementation
class DjangoSaveFencedTable(FencedSave):
    """Django's own ``Model.save()`` on the fenced table: no token checked or written.

    ``FencedModel.save`` is bypassed (``models.Model.save(row)``), so this is Django's
    UPDATE of the same ``FencedRow`` table, trigger included; the gap to ``plain-save``
    is the table (one more column, the trigger), the gap to ``fenced-save`` is
    distlocks' save path (its Python and its ``WHERE ... fencing_token <= N``).
    """

    name = "fenced-table-django-save"
    label = "Django Model.save() on the fenced table (no token)"
    role = "distlocks"
    reference = False

    def saver(self, update_fields: tuple[str, ...] | None) -> Callable[[], None]:
        from django.db import models

        return functools.partial(models.Model.save, self.row, update_fields=update_fields)


class _SaveWorkload(Workload):
    """Save one existing row per implementation, again and again, one thread."""

    metric = "latency"
    update_fields: ClassVar[tuple[str, ...] | None] = None

    def __init__(self, options: RunOptions) -> None:
        super().__init__(options)
        self.iterations = options.iterations or (40 if options.quick else 5000)
        # Small batches, many rounds: the implementations alternate often, so a change
        # in the machine's state (see the caveats in docs/benchmarks.md) hits them alike.
        self.rounds = 1 if options.quick else 20
        self.batch = max(1, math.ceil(self.iterations / self.rounds))
        self.warm_up_iterations = 5 if options.quick else 300
        self._impls: list[RowSave] = []

    @classmethod
    def supports(cls, impl: type[Implementation]) -> bool:
        return issubclass(impl, RowSave) and super().supports(impl)

    def params(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "iterations": self.batch * self.rounds,
            "per_round": self.batch,
            "warm_up": self.warm_up_iterations,
            "update_fields": list(self.update_fields) if self.update_fields else None,
            "token": TOKEN,
        }

    def setup(self, impls: list[Implementation]) -> None:
        for impl in impls:
            assert isinstance(impl, RowSave)
            impl.create_row()
            self._impls.append(impl)

    def teardown(self) -> None:
        impls, self._impls = self._impls, []
        for impl in impls:
            impl.delete_row()

    def measure(self, impl: Implementation, round_no: int) -> Measurement:
        assert isinstance(impl, RowSave)
        count = self.warm_up_iterations if round_no < 0 else self.batch
        row = impl.row
        save = impl.saver(self.update_fields)
        clock = time.perf_counter_ns
        latencies = [0] * count
        began = clock()
        for i in range(count):
            # A new value every time: each save writes a change, as an application's would.
            row.number += 1
            started = clock()
            save()
            latencies[i] = clock() - started
        return Measurement(latencies, count, (clock() - began) / 1e9)


@workload
class FencedSaveWorkload(_SaveWorkload):
    name = "fenced-save"
    title = "Fenced save against a plain save() of the same row"
    description = (
        "One thread saves an existing row (an integer that changes every time, and a short "
        "text) again and again: a plain model's save() (the floor here), a FencedModel's "
        "save(fencing_token=N) with a constant valid token, and Django's own save() on the "
        "fenced table. The time of each save() call is one sample."
    )


@workload
class FencedSaveFieldsWorkload(_SaveWorkload):
    name = "fenced-save-fields"
    title = "Fenced save against a plain save(), with update_fields"
    description = (
        "The same with save(update_fields=['number', 'label']) in every implementation "
        "(every column but the token)."
    )
    update_fields = UPDATE_FIELDS
