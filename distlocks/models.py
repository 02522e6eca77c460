"""Models of the distlocks app.

* :class:`FencedModel`: an abstract base whose saves carry a fencing token and
  are rejected when a newer lock holder has already written the row.
* :class:`LockRegistry`: the PostgreSQL backend's name registry and per-name
  fencing counter (advisory locks know only a 64-bit key); UNLOGGED on PostgreSQL.
* :class:`LockFence` and :class:`LockEpoch`: the token ceiling and the server
  lifetime marker that keep that counter's tokens increasing across a server crash.
* :class:`LiveLock`: unmanaged, no table; the admin page of live locks and its
  permissions.

Why this is one module of over 600 lines (issue 28's size rule): Django looks for an
app's models in ``models.py``, and most of it is :class:`FencedModel` with its
QuerySet: every way Django writes a row is fenced here, and those paths are checked
against each other (the write-path matrix in docs/fencing.md follows this file).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from asgiref.sync import sync_to_async
from django.db import DatabaseError, connections, models, router, transaction
from django.db.models.signals import post_save, pre_save
from django.utils.translation import gettext_lazy as _

from distlocks import fencing, signals
from distlocks.exceptions import FencedRowDeleted, FencingTokenRequired, StaleFencingToken

if TYPE_CHECKING:
    from distlocks.lease import BaseLease
    from distlocks.locks import Lock


def _token(value: Any, what: str) -> int:
    """An int token from an int or a lease (a lease known to be lost raises LockLost)."""
    from distlocks.lease import BaseLease

    if isinstance(value, BaseLease):
        value.ensure_held()
        return int(value.fencing_token)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{what} must be an int fencing token or a Lease, not {type(value).__name__}."
        )
    if not 0 <= value <= MAX_TOKEN:
        raise ValueError(
            f"{what} must be from 0 to {MAX_TOKEN:,} (2**53 - 1, the largest token a "
            f"distlocks backend issues), not {value}."
        )
    return value


#: The largest fencing token a backend issues, and so the largest a fenced row
#: accepts: every backend keeps its tokens below 2**53 (exact in Lua's doubles and
#: in JSON numbers; clock-floored tokens reach it in the year 2255). A row holding a
#: larger one could never be written again by any lock holder.
MAX_TOKEN = fencing.MAX_TOKEN

# Instance attribute: the primary key of the row an object was loaded from or last
# saved to (see FencedModel.from_db).
_ROW_PK = "_distlocks_row_pk"

# The fenced UPDATE of one row, by (model, database alias, columns written): its SQL
# text, built once, since building it through the ORM costs more than running it.
_statements: dict[tuple[type[models.Model], str, tuple[str, ...]], str] = {}


def _fenced_statement(model: type[models.Model], using: str, fields: list[Any]) -> str:
    key = (model, using, tuple(f.attname for f in fields))
    sql = _statements.get(key)
    if sql is None:
        meta = model._meta
        quote = connections[using].ops.quote_name
        token_column = quote(str(getattr(meta.get_field("fencing_token"), "column", "")))
        assignments = ", ".join(
            [f"{token_column} = %s", *(f"{quote(f.column)} = %s" for f in fields)]
        )
        sql = (
            f"UPDATE {quote(meta.db_table)} SET {assignments} "
            f"WHERE {quote(str(meta.pk.column))} = %s AND {token_column} <= %s"
        )
        if len(_statements) >= 1024:
            _statements.clear()
        _statements[key] = sql
    return sql


def _update_row(
    instance: models.Model, using: str, token: int, fields: list[Any], values: list[Any]
) -> int | None:
    """Run the fenced UPDATE of ``instance``'s row with ``values`` (one per field, as
    ``pre_save()`` gave them) through Django's cursor, as the ORM would write it: each
    value prepared by its field for this connection. The rows it changed, or None when
    a value needs the ORM (an expression, a field with its own SQL placeholder)."""
    connection = connections[using]
    params: list[Any] = [token]
    for field, value in zip(fields, values, strict=True):
        if hasattr(value, "resolve_expression") or hasattr(field, "get_placeholder"):
            return None
        params.append(field.get_db_prep_save(value, connection=connection))
    meta = type(instance)._meta
    params.append(meta.pk.get_db_prep_value(instance.pk, connection))
    params.append(token)
    sql = _fenced_statement(type(instance), using, fields)
    with transaction.mark_for_rollback_on_error(using), connection.cursor() as cursor:
        cursor.execute(sql, params)
        return int(cursor.rowcount)


def _multi_table(model: type[models.Model]) -> bool:
    """True for a multi-table-inheritance child (a proxy has no parent link)."""
    return any(link is not None for link in model._meta.parents.values())


@dataclass(frozen=True)
class FencedUpdate:
    """What :meth:`FencedQuerySet.fenced_update` did."""

    updated: int
    stale: int


class FencedQuerySet(models.QuerySet):
    """QuerySet of a :class:`FencedModel`: bulk writes carry a fencing token."""

    def fenced_update(self, fencing_token: int | BaseLease, **values: Any) -> FencedUpdate:
        """``update(**values)`` on the rows whose stored token is not above
        ``fencing_token``, storing that token; reports how many rows were stale
        (left unchanged because a newer holder had written them)."""
        token = _token(fencing_token, "fencing_token")
        if "fencing_token" in values:
            raise TypeError("Pass the token as fencing_token=..., not among the values.")
        updated = models.QuerySet.update(
            self.filter(fencing_token__lte=token), fencing_token=token, **values
        )
        stale = self.filter(fencing_token__gt=token).count()
        if stale:
            signals.fencing_rejected.send(
                sender=self.model, model=self.model, pk=None, offered=token, stored=None
            )
        return FencedUpdate(updated=updated, stale=stale)

    def __or__(self, other: Any) -> Any:
        return self._fenced_combination(super().__or__(other))

    def __xor__(self, other: Any) -> Any:
        return self._fenced_combination(super().__xor__(other))

    def _fenced_combination(self, combined: Any) -> Any:
        # Django rebuilds a sliced left operand from the model's base manager, a plain
        # QuerySet: its update() would write the rows with no token. Keep this class
        # (all else as Django built it), and this queryset's database (the base
        # manager's is the default one).
        if not isinstance(combined, FencedQuerySet):
            combined.__class__ = type(self)
            if combined._db is None:
                combined._db = getattr(self, "_db", None)  # _db: not in the stubs
        return combined

    def update(self, **kwargs: Any) -> int:
        if fencing.is_unfenced():
            return models.QuerySet.update(self, **kwargs)
        raise FencingTokenRequired(
            f"{self.model.__name__} rows are fenced: use "
            f".fenced_update(fencing_token, ...) with the token of the lock you hold, or "
            f"wrap a maintenance write in distlocks.fencing.unfenced()."
        )

    def bulk_create(
        self,
        objs: Any,
        batch_size: int | None = None,
        ignore_conflicts: bool = False,
        update_conflicts: bool = False,
        update_fields: Any = None,
        unique_fields: Any = None,
        *,
        fencing_token: int | BaseLease | None = None,
    ) -> list[Any]:
        """Django's ``bulk_create``, with fenced rows' tokens checked.

        A plain insert stores each object's ``fencing_token`` (0 unless set), which
        must be one a backend can issue. An upsert (``update_conflicts=True``) would
        overwrite existing rows: it needs ``fencing_token=`` (a lease or an int),
        stored in every row it writes; the database's trigger then refuses the
        whole statement (:class:`StaleFencingToken`, nothing written) if any existing
        row holds a newer token. Inside :func:`~distlocks.fencing.unfenced` it is
        Django's own upsert.
        """
        objs = list(objs)
        kwargs: dict[str, Any] = {
            "batch_size": batch_size,
            "ignore_conflicts": ignore_conflicts,
            "update_conflicts": update_conflicts,
            "update_fields": update_fields,
            "unique_fields": unique_fields,
        }
        if fencing_token is None:
            if update_conflicts and not fencing.is_unfenced():
                raise FencingTokenRequired(
                    f"bulk_create(update_conflicts=True) overwrites existing "
                    f"{self.model.__name__} rows, which are fenced: pass "
                    f"fencing_token=lease (stored in every row; the statement is refused "
                    f"if a row holds a newer token), use .fenced_update(fencing_token, ...) "
                    f"for existing rows and bulk_create() without update_conflicts for new "
                    f"ones, or wrap a maintenance write in distlocks.fencing.unfenced()."
                )
            for obj in objs:
                _token(obj.fencing_token, "fencing_token")
            return models.QuerySet.bulk_create(self, objs, **kwargs)
        token = _token(fencing_token, "fencing_token")
        if update_conflicts:
            connection = connections[self.db]
            if not fencing.enforces(connection):
                # Only the trigger compares the tokens of the rows an upsert overwrites.
                raise FencingTokenRequired(
                    f"A fenced bulk_create(update_conflicts=True) needs the fencing trigger, "
                    f"which distlocks does not install on {connection.vendor}: use "
                    f".fenced_update(fencing_token, ...) for existing rows."
                )
            # Once: a column assigned twice is an error on PostgreSQL.
            named = [f for f in update_fields or () if f != "fencing_token"]
            kwargs["update_fields"] = [*named, "fencing_token"]
        previous = [obj.fencing_token for obj in objs]
        for obj in objs:
            obj.fencing_token = token
        try:
            return models.QuerySet.bulk_create(self, objs, **kwargs)
        except BaseException:
            for obj, value in zip(objs, previous, strict=True):
                obj.fencing_token = value
            raise

    bulk_create.alters_data = True  # type: ignore[attr-defined]

    async def abulk_create(
        self,
        objs: Any,
        batch_size: int | None = None,
        ignore_conflicts: bool = False,
        update_conflicts: bool = False,
        update_fields: Any = None,
        unique_fields: Any = None,
        *,
        fencing_token: int | BaseLease | None = None,
    ) -> list[Any]:
        """:meth:`bulk_create`, from async code (it takes ``fencing_token`` too)."""
        from asgiref.sync import sync_to_async

        return await sync_to_async(self.bulk_create)(
            objs,
            batch_size,
            ignore_conflicts,
            update_conflicts,
            update_fields,
            unique_fields,
            fencing_token=fencing_token,
        )

    abulk_create.alters_data = True  # type: ignore[attr-defined]

    def delete(self) -> tuple[int, dict[str, int]]:
        if fencing.is_unfenced():
            return models.QuerySet.delete(self)
        raise FencingTokenRequired(
            f"{self.model.__name__} rows are fenced: use .fenced_delete(fencing_token) with "
            f"the token of the lock you hold (rows a newer holder wrote are kept), or wrap "
            f"a maintenance delete in distlocks.fencing.unfenced()."
        )

    delete.alters_data = True  # type: ignore[attr-defined]
    delete.queryset_only = True  # type: ignore[attr-defined]

    def fenced_delete(self, fencing_token: int | BaseLease) -> FencedUpdate:
        """``delete()`` of the rows whose stored token is not above ``fencing_token``;
        reports how many rows were stale (kept because a newer holder wrote them).
        ``updated`` counts the rows deleted (cascades not included)."""
        token = _token(fencing_token, "fencing_token")
        with transaction.atomic(using=self.db):
            # Writing the token first locks the rows it matches (the whole database on
            # SQLite) until COMMIT: no newer holder can write one of them between this
            # check and the delete, and rows above the token can only go higher.
            models.QuerySet.update(self.filter(fencing_token__lte=token), fencing_token=token)
            _, per_model = models.QuerySet.delete(self.filter(fencing_token__lte=token))
            stale = self.filter(fencing_token__gt=token).count()
        if stale:
            signals.fencing_rejected.send(
                sender=self.model, model=self.model, pk=None, offered=token, stored=None
            )
        return FencedUpdate(updated=per_model.get(self.model._meta.label, 0), stale=stale)

    # As Django's delete(): not on the manager, so that deleting every row takes .all().
    fenced_delete.alters_data = True  # type: ignore[attr-defined]
    fenced_delete.queryset_only = True  # type: ignore[attr-defined]


def _refuse_bulk_add(add: Any) -> Any:
    """``add`` of a related manager, refusing ``bulk=True`` outside ``unfenced()``."""

    @functools.wraps(add)
    def fenced_add(self: Any, *objs: Any, bulk: bool = True) -> Any:
        if bulk and not fencing.is_unfenced():
            raise FencingTokenRequired(
                f"{self.model.__name__} rows are fenced: add() with bulk=True (Django's "
                f"default) would update them with QuerySet.update() and no token. Pass "
                f"bulk=False inside each row's lock (each row's save then carries its "
                f"lease's token), or wrap a maintenance write in "
                f"distlocks.fencing.unfenced()."
            )
        return add(self, *objs, bulk=bulk)

    return fenced_add


class FencedManager(models.Manager[Any]):
    """Base class of the managers of a :class:`FencedModel`, whose related managers do
    not write fenced rows without a token. ``FencedModel.objects`` is built on it;
    build a custom one with ``FencedManager.from_queryset(MyFencedQuerySet)()``
    (``MyFencedQuerySet.as_manager()`` is built on Django's plain ``Manager``).

    Django derives the manager of a reverse foreign key (``account.parcel_set``) and
    of a generic relation from the related model's default manager. Their ``add()``
    (and ``set()``, built on it) updates the rows through the model's *base* manager,
    a plain ``QuerySet``, where no refusal applies; the trigger does not see it
    either, since the token column is not written. So the related managers derived
    from this class refuse ``add(bulk=True)``; ``bulk=False`` saves each row, which
    carries the token of the row's lock.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        add = cls.__dict__.get("add")
        # Only the add() that takes bulk= updates the related rows themselves; a
        # many-to-many add() writes rows of the through table.
        if add is not None and "bulk" in inspect.signature(add).parameters:
            setattr(cls, "add", _refuse_bulk_add(add))  # noqa: B010 (not in the stubs)


#: The manager of ``FencedModel.objects``.
FencedObjectsManager = FencedManager.from_queryset(FencedQuerySet)


class FencedModel(models.Model):
    """Abstract model whose writes are fenced by lock tokens.

    ``obj.save(fencing_token=lease_or_int)`` inserts the row with that token, or
    updates it in one statement ``... WHERE pk = %s AND fencing_token <= %s``.
    If no row matched because a newer holder wrote it, :class:`StaleFencingToken`
    is raised, nothing is written, and the instance is left as it was.

    Without ``fencing_token``, a save inside ``with obj.fenced_lock(...)`` (or any
    ``with lock(name)`` whose name is this row's :attr:`fencing_lock_name`) uses
    that lease's token; otherwise :class:`FencingTokenRequired` is raised, unless
    inside :func:`distlocks.fencing.unfenced`.
    """

    fencing_token = models.BigIntegerField(
        _("fencing token"),
        default=0,
        editable=False,
        help_text=_("Token of the last lock holder that wrote this row."),
    )

    #: Lock name of one row, formatted with the row's attributes plus app_label and
    #: model_name.
    fencing_lock_name: ClassVar[str] = "{app_label}.{model_name}:{pk}"

    objects = FencedObjectsManager()

    class Meta:
        abstract = True

    # -- saving -------------------------------------------------------------------

    def save(self, *args: Any, fencing_token: Any = None, **kwargs: Any) -> None:
        if _multi_table(type(self)):
            # One UPDATE covers one table; a child's parent fields would be dropped.
            raise TypeError(
                f"{type(self).__name__} uses multi-table inheritance, which FencedModel does "
                f"not support (distlocks.E010); make the parent abstract."
            )
        new_row = (
            fencing_token is None
            and self._state.adding
            and not kwargs.get("force_update")
            and kwargs.get("update_fields") is None
            and not fencing.is_unfenced()
        )
        if new_row:
            # A new row (create(), get_or_create(), a factory, an admin add form): an
            # INSERT overwrites nothing, so it needs no token. It stores the one of the
            # row's lock if held in this context, else the field's own value (0 unless
            # given). With a primary key set it is an INSERT only: a row that already
            # exists is not overwritten without a token (an IntegrityError instead).
            if args:
                raise TypeError("FencedModel.save() takes keyword arguments only.")
            self._fenced_insert(self._insert_token(), **kwargs)
            return
        token = self._resolve_fencing_token(fencing_token)
        if token is None:  # unfenced: a plain save that leaves the token as it is
            if self._state.adding:
                # A new row takes only a token a backend can issue (its trigger too).
                _token(self.fencing_token, "fencing_token")
            super().save(*args, **kwargs)
            self.__dict__[_ROW_PK] = self.pk
            return
        if args:
            raise TypeError("FencedModel.save() takes keyword arguments only.")
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        forced_update = kwargs.get("force_update") or kwargs.get("update_fields")
        if self.pk is None and not kwargs.get("force_insert") and forced_update:
            raise ValueError("Cannot force an update in save() with no primary key.")
        if self.pk is None or kwargs.get("force_insert"):
            self._fenced_insert(token, **kwargs)
            return
        self._fenced_update(token, using, kwargs.get("update_fields"), kwargs)

    async def asave(self, *args: Any, fencing_token: Any = None, **kwargs: Any) -> None:
        """:meth:`save` from async code, ``fencing_token`` included."""
        await sync_to_async(self.save)(*args, fencing_token=fencing_token, **kwargs)

    async def adelete(
        self, using: str | None = None, keep_parents: bool = False, *, fencing_token: Any = None
    ) -> tuple[int, dict[str, int]]:
        """:meth:`delete` from async code, ``fencing_token`` included."""
        return await sync_to_async(self.delete)(
            using=using, keep_parents=keep_parents, fencing_token=fencing_token
        )

    def delete(
        self, using: str | None = None, keep_parents: bool = False, *, fencing_token: Any = None
    ) -> tuple[int, dict[str, int]]:
        """Django's delete, fenced: with ``fencing_token`` (or inside the row's lock)
        the row is deleted only if its stored token is not above it, else
        :class:`StaleFencingToken` and nothing is deleted. Without a token it is
        refused (:class:`FencingTokenRequired`) unless inside ``unfenced()``."""
        if self.pk is None:
            return super().delete(using=using, keep_parents=keep_parents)
        token = self._resolve_fencing_token(fencing_token)
        if token is None:  # unfenced
            return super().delete(using=using, keep_parents=keep_parents)
        using = using or router.db_for_write(type(self), instance=self)
        origin: type[models.Model] = type(self)
        with transaction.atomic(using=using):
            manager = origin._base_manager.using(using)
            # Writing the token locks the row until COMMIT: no newer holder writes it
            # between this check and the delete.
            rows = models.QuerySet.update(
                manager.filter(pk=self.pk, fencing_token__lte=token), fencing_token=token
            )
            if rows == 0:
                stored = manager.filter(pk=self.pk).values_list("fencing_token", flat=True).first()
                if stored is None:  # already gone: what was asked
                    return 0, {}
                signals.fencing_rejected.send(
                    sender=origin, model=origin, pk=self.pk, offered=token, stored=stored
                )
                raise StaleFencingToken(
                    f"{origin.__name__} {self.pk!r} was not deleted: its stored fencing "
                    f"token {stored} is newer than the offered {token}. Another lock holder "
                    f"wrote it after this one lost the lock.",
                    model=origin,
                    pk=self.pk,
                    offered=token,
                    stored=stored,
                )
            return super().delete(using=using, keep_parents=keep_parents)

    # -- locks --------------------------------------------------------------------

    @classmethod
    def from_db(  # newer Django passes fetch_mode=: taken through **kwargs
        cls, db: str | None, field_names: Any, values: Any, **kwargs: Any
    ) -> Any:
        instance = super().from_db(db, field_names, values, **kwargs)
        # The key of the row the object came from: a fenced save that finds no row
        # tells a key changed in memory (Django's save inserts a copy) from that row
        # having been deleted (never inserted again).
        instance.__dict__[_ROW_PK] = instance.pk
        return instance

    def get_fencing_lock_name(self) -> str:
        """The lock name that fences this row."""
        meta = self._meta
        fields = {"app_label": meta.app_label, "model_name": meta.model_name, "pk": self.pk}

        class _Lookup(dict[str, Any]):
            def __missing__(inner, key: str) -> Any:
                return getattr(self, key)

        return self.fencing_lock_name.format_map(_Lookup(fields))

    def fenced_lock(self, **kwargs: Any) -> Lock:
        """``lock(self.get_fencing_lock_name(), **kwargs)``: saves inside use its token."""
        from distlocks.locks import lock

        if self.pk is None:
            raise ValueError("A row without a primary key has no lock name yet; save it first.")
        return lock(self.get_fencing_lock_name(), **kwargs)

    def _resolve_fencing_token(self, fencing_token: Any) -> int | None:
        if fencing_token is not None:
            return _token(fencing_token, "fencing_token")
        if fencing.is_unfenced():
            return None
        if self.pk is not None:
            lease = fencing.active_lease(self.get_fencing_lock_name())
            if lease is not None:
                return _token(lease, "the active lease")
        raise FencingTokenRequired(
            f"Saving {type(self).__name__} {self.pk!r} needs a fencing token: "
            f"save(fencing_token=lease) with the lease of the lock you hold, save inside "
            f"`with obj.fenced_lock(...)`, or use distlocks.fencing.unfenced() for "
            f"maintenance writes."
        )

    def _insert_token(self) -> int:
        """The token a new row is inserted with when save() was given none: the one of
        the row's lock held in this context, else the ``fencing_token`` field's value."""
        if self.pk is not None:
            lease = fencing.active_lease(self.get_fencing_lock_name())
            if lease is not None:
                return _token(lease, "the active lease")
        return _token(self.fencing_token, "fencing_token")

    def _fenced_insert(self, token: int, **kwargs: Any) -> None:
        previous = self.fencing_token
        self.fencing_token = token
        try:
            super().save(**{**kwargs, "force_insert": True})
        except BaseException:
            self.fencing_token = previous
            raise
        self.__dict__[_ROW_PK] = self.pk

    def _key_changed(self) -> bool:
        """Whether this object, loaded or saved, now has another primary key than the
        row it came from (unknown, as for objects from ``bulk_create()``: False)."""
        if _ROW_PK not in self.__dict__:
            return False
        pk = self._meta.pk
        try:
            # One key spelled another way ("7" for 7) is not a new key.
            return bool(pk.to_python(self.pk) != pk.to_python(self.__dict__[_ROW_PK]))
        except Exception:
            return True

    def _fenced_update(
        self, token: int, using: str, update_fields: Any, kwargs: dict[str, Any]
    ) -> None:
        meta = self._meta
        if update_fields is None and using == self._state.db:
            # Loaded with only()/defer(): write the loaded fields only, as Django's save
            # does; loading each deferred one to write it back could revert a change.
            deferred = self.get_deferred_fields()
            if deferred:
                loaded = {f.attname for f in meta.concrete_fields if not f.primary_key} - deferred
                if loaded:
                    update_fields = frozenset(loaded)
        if update_fields is not None:
            update_fields = frozenset(update_fields)
            if not update_fields:
                return
            known = {f.name for f in meta.concrete_fields} | {
                f.attname for f in meta.concrete_fields
            }
            unknown = update_fields - known
            if unknown:
                raise ValueError(
                    f"The following fields do not exist in this model, are m2m fields, or "
                    f"are non-concrete fields: {', '.join(sorted(unknown))}"
                )
        # The concrete model's columns: a proxy has none of its own (Django's save
        # does the same), and an UPDATE of a proxy would write the token alone.
        concrete = meta.concrete_model or type(self)
        fields = [
            f
            for f in concrete._meta.local_concrete_fields
            if not f.primary_key
            and f.attname != "fencing_token"
            and not getattr(f, "generated", False)
            and (update_fields is None or f.name in update_fields or f.attname in update_fields)
        ]
        # Signals name the class the caller used (a proxy too), as Django's save does.
        origin: type[models.Model] = type(self)
        pre_save.send(
            sender=origin, instance=self, raw=False, using=using, update_fields=update_fields
        )
        # pre_save() may change the instance (auto_now); keep what to restore.
        before = {f.attname: getattr(self, f.attname) for f in fields}
        values = [f.pre_save(self, False) for f in fields]
        manager = type(self)._base_manager.using(using)
        rows = _update_row(self, using, token, fields, values)
        if rows is None:  # a value only the ORM can write (an F() expression...)
            rows = models.QuerySet.update(
                manager.filter(pk=self.pk, fencing_token__lte=token),
                fencing_token=token,
                **{f.attname: value for f, value in zip(fields, values, strict=True)},
            )
        if rows == 0:
            stored = manager.filter(pk=self.pk).values_list("fencing_token", flat=True).first()
            for attname, value in before.items():
                setattr(self, attname, value)
            moved = self._key_changed()
            if stored is None and not self._state.adding and using == self._state.db and not moved:
                # Loaded from this database, and deleted since (by a newer holder, or
                # by anyone): inserting it again would undo that delete. Saved to
                # another database, it is copied there, as Django's save does.
                signals.fencing_rejected.send(
                    sender=origin, model=origin, pk=self.pk, offered=token, stored=None
                )
                raise FencedRowDeleted(
                    f"{origin.__name__} {self.pk!r} was not saved: its row was deleted "
                    f"after this object was loaded, and a fenced save never inserts it "
                    f"again. Create a new object if the row should exist.",
                    model=origin,
                    pk=self.pk,
                    offered=token,
                    stored=None,
                )
            # A new object with its pk set, or a loaded one given another key: an
            # INSERT, as Django's save (a copy; the row it was loaded from is left).
            if stored is None:
                if kwargs.get("force_update"):
                    raise DatabaseError("Forced update did not affect any rows.")
                if update_fields is not None:
                    raise DatabaseError("Save with update_fields did not affect any rows.")
                self._fenced_insert(token, **kwargs)
                return
            signals.fencing_rejected.send(
                sender=origin, model=origin, pk=self.pk, offered=token, stored=stored
            )
            raise StaleFencingToken(
                f"{origin.__name__} {self.pk!r} was not saved: its stored fencing token "
                f"{stored} is newer than the offered {token}. Another lock holder wrote it "
                f"after this one lost the lock.",
                model=origin,
                pk=self.pk,
                offered=token,
                stored=stored,
            )
        self.fencing_token = token
        self._state.adding = False
        self._state.db = using
        self.__dict__[_ROW_PK] = self.pk
        post_save.send(
            sender=origin,
            instance=self,
            created=False,
            update_fields=update_fields,
            raw=False,
            using=using,
        )


class LockRegistry(models.Model):
    """One row per lock name ever taken through the PostgreSQL backend.

    ``key`` is the advisory-lock key (a cryptographic hash of prefix and name);
    ``fencing_token`` only ever grows. On PostgreSQL the table is UNLOGGED (migration
    0003): a server crash empties it, and :class:`LockFence` keeps the tokens above
    the ones issued before. The holder columns describe the latest
    acquisition; whether it is still held is told by ``pg_locks``, not by this row.
    """

    key = models.BigIntegerField(primary_key=True)
    name = models.CharField(max_length=200, db_index=True)
    fencing_token = models.BigIntegerField(default=0)
    owner = models.CharField(max_length=32, blank=True)
    host = models.CharField(max_length=255, blank=True)
    pid = models.IntegerField(null=True)
    thread = models.CharField(max_length=255, blank=True)
    backend_pid = models.IntegerField(null=True)
    acquired_at = models.DateTimeField(null=True)
    ttl = models.FloatField(null=True)
    renewals = models.IntegerField(default=0)
    extra = models.JSONField(default=dict, blank=True)

    class Meta:
        db_table = "distlocks_lockregistry"
        verbose_name = _("lock registry entry")
        verbose_name_plural = _("lock registry")

    def __str__(self) -> str:
        return self.name


class LockFence(models.Model):
    """The PostgreSQL backend's token ceiling: one row (``id`` 1), at or above every
    fencing token ever issued, for any key.

    The registry is UNLOGGED (no WAL per acquisition; a crash truncates it, and ends
    every advisory lock with it); this table is logged and written only when a token
    passes the ceiling (about once per 10 minutes for the whole server), durably, so a
    token minted after a crash is above every one minted before it (docs/safety.md).
    """

    id = models.PositiveSmallIntegerField(primary_key=True)
    ceiling = models.BigIntegerField()

    class Meta:
        db_table = "distlocks_lockfence"
        verbose_name = _("lock fence")
        verbose_name_plural = _("lock fences")

    def __str__(self) -> str:
        return f"ceiling {self.ceiling}"


class LockEpoch(models.Model):
    """The PostgreSQL backend's server lifetime marker: one row (``id`` 1) in an
    UNLOGGED table, so it exists only if no crash truncated the unlogged tables since
    it was written. ``floor`` was the ceiling plus one then: every token issued before
    that crash is below it, so a key with no registry row gets a token of at least
    ``floor`` with no durable write (docs/safety.md).
    """

    id = models.PositiveSmallIntegerField(primary_key=True)
    floor = models.BigIntegerField()

    class Meta:
        db_table = "distlocks_lockepoch"
        verbose_name = _("lock epoch")
        verbose_name_plural = _("lock epochs")

    def __str__(self) -> str:
        return f"floor {self.floor}"


class LiveLock(models.Model):
    """No table: the admin's entry for the live locks of every backend, and its
    permissions (``view_livelock`` to see them, ``force_release_livelock`` to free one).

    The locks themselves are read from the backends (see :mod:`distlocks.livelocks`).
    """

    class Meta:
        managed = False
        default_permissions = ("view",)
        permissions = [("force_release_livelock", _("Can force-release a live lock"))]
        verbose_name = _("live lock")
        verbose_name_plural = _("live locks")

    def __str__(self) -> str:
        return str(self._meta.verbose_name)
