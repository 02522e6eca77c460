"""Claims: a lock holder writes its fencing token into the rows it will change
*before* it reads them.

A fenced save refuses a token older than the row's. That alone does not stop a lost
update: a holder paused past its lease (A) and its successor (B) both read the row
with its old token; A wakes and saves first, which the row accepts (A's token is
still the newest the row has seen), then B saves a value computed from the read it
made before A's write. A claim closes that gap::

    with lock("account:42", ttl=30) as lease:
        account = Account.objects.get(pk=42)
        lease.claim(account)          # the row now holds this lease's token
        account.balance += 10         # ...read after the claim, under it
        account.save(fencing_token=lease)

Once B has claimed the row, A's late save finds a newer token and is refused
(:class:`~distlocks.exceptions.StaleFencingToken`); B reads only after its claim, so
it computes from what is stored under it.

Targets are :class:`~distlocks.models.FencedModel` instances (refreshed from the
database after the claim) and querysets of a FencedModel (every row they match). Each
model and database gets one UPDATE ``SET fencing_token = <token> WHERE ... AND
fencing_token <= <token>``, all in one transaction per database: if any targeted row
holds a newer token, nothing is claimed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from django.db import models, router, transaction

from distlocks import signals
from distlocks.exceptions import StaleFencingToken

if TYPE_CHECKING:
    from distlocks.lease import BaseLease

__all__ = ["claim"]


def claim(lease: BaseLease | int, *targets: Any) -> int:
    """Write ``lease``'s fencing token into every row of ``targets``; return how many
    rows were claimed.

    ``lease`` is the lease of the lock you hold (its ``ensure_held()`` runs first, so a
    lease known to be lost raises :class:`~distlocks.exceptions.LockLost`) or an int
    token. Each target is a saved :class:`~distlocks.models.FencedModel` instance, or a
    QuerySet of a FencedModel (its rows as it filters them; an empty one claims
    nothing). To claim one row by primary key without loading it first, pass
    ``Model.objects.filter(pk=pk)``.

    All or none: if any targeted row stores a newer token than ``lease``'s,
    :class:`~distlocks.exceptions.StaleFencingToken` is raised and no row is claimed
    (the UPDATEs run in one ``transaction.atomic`` per database); the
    ``fencing_rejected`` signal is sent first. An instance whose row is gone raises the
    model's ``DoesNotExist``, and nothing is claimed either.

    After the claim each instance is reloaded with ``refresh_from_db()``: its fields
    are what the database stores under this claim, its ``fencing_token`` the lease's.
    Claim right after the lock is granted and read afterwards: values read before the
    claim may predate a paused earlier holder's last write.
    """
    from distlocks.models import _token

    if not targets:
        raise TypeError(
            "claim() needs at least one target: a FencedModel instance or a QuerySet of one."
        )
    token = _token(lease, "claim()'s lease")
    groups: dict[tuple[type[models.Model], str], dict[Hashable, list[models.Model]]] = {}
    querysets: list[tuple[models.QuerySet[Any], str]] = []
    for target in targets:
        if isinstance(target, models.QuerySet):
            _check_model(target.model, target)
            if target.query.is_sliced:
                raise TypeError(
                    f"claim() cannot claim a sliced queryset of {target.model.__name__} "
                    f"(an UPDATE takes no LIMIT): filter it instead, e.g. by pk__in."
                )
            # The alias the queryset's own update() would write to.
            db = getattr(target, "_db", None) or router.db_for_write(target.model)
            querysets.append((target, db))
        elif isinstance(target, models.Model):
            model = type(target)
            _check_model(model, target)
            if target.pk is None:
                raise ValueError(
                    f"claim() needs saved rows: this {model.__name__} has no primary key yet "
                    f"(save it first; a new row is inserted with the token anyway)."
                )
            db = target._state.db or router.db_for_write(model, instance=target)
            rows = groups.setdefault((model, db), {})
            rows.setdefault(target.pk, []).append(target)
        else:
            raise TypeError(
                f"claim() takes FencedModel instances and querysets of a FencedModel, not "
                f"{type(target).__name__}."
            )
    aliases = sorted({db for _, db in groups} | {db for _, db in querysets})
    claimed = 0
    with contextlib.ExitStack() as stack:
        # One transaction per database: a refusal anywhere rolls back every claim.
        for alias in aliases:
            stack.enter_context(transaction.atomic(using=alias))
        for (model, db), rows in groups.items():
            claimed += _claim_rows(model, db, list(rows), token)
        for queryset, db in querysets:
            claimed += _claim_queryset(queryset, db, token)
    for (_model, db), rows in groups.items():
        for instances in rows.values():
            for instance in instances:
                instance.refresh_from_db(using=db)
    return claimed


def _check_model(model: type[models.Model], target: Any) -> None:
    from distlocks.models import FencedModel, _multi_table

    if not issubclass(model, FencedModel):
        raise TypeError(
            f"claim() takes rows of a FencedModel; {model.__name__} is not one "
            f"(it has no fencing_token to claim)."
        )
    if _multi_table(model):
        raise TypeError(
            f"{model.__name__} uses multi-table inheritance, which FencedModel does not "
            f"support (distlocks.E010); make the parent abstract."
        )


def _update(queryset: models.QuerySet[Any], token: int) -> int:
    # The plain QuerySet.update: FencedQuerySet's own refuses writes without a token.
    return models.QuerySet.update(queryset.filter(fencing_token__lte=token), fencing_token=token)


def _claim_rows(model: type[models.Model], db: str, pks: list[Hashable], token: int) -> int:
    manager = model._base_manager.using(db)
    claimed = _update(manager.filter(pk__in=pks), token)
    if claimed == len(pks):
        return claimed
    stored = dict(manager.filter(pk__in=pks).values_list("pk", "fencing_token"))
    newer = {pk: value for pk, value in stored.items() if value > token}
    if newer:
        pk, value = next(iter(newer.items()))
        raise _stale(model, pk, token, value, len(newer))
    missing = [pk for pk in pks if pk not in stored]
    raise model.DoesNotExist(  # type: ignore[attr-defined]
        f"claim() found no {model.__name__} row with pk "
        f"{', '.join(map(repr, missing))} (deleted since it was loaded); nothing was claimed."
    )


def _claim_queryset(queryset: models.QuerySet[Any], db: str, token: int) -> int:
    rows = queryset.using(db)
    claimed = _update(rows, token)
    newer = list(rows.filter(fencing_token__gt=token).values_list("pk", "fencing_token")[:2])
    if newer:
        count = rows.filter(fencing_token__gt=token).count()
        pk, value = newer[0]
        raise _stale(queryset.model, pk, token, value, count)
    return claimed


def _stale(model: type[models.Model], pk: Any, token: int, stored: int, count: int) -> Exception:
    signals.fencing_rejected.send(sender=model, model=model, pk=pk, offered=token, stored=stored)
    more = f" (and {count - 1} more)" if count > 1 else ""
    return StaleFencingToken(
        f"Could not claim {model.__name__} {pk!r}{more}: its stored fencing token {stored} "
        f"is newer than the offered {token}. Another lock holder claimed or wrote it after "
        f"this one lost the lock; nothing was claimed.",
        model=model,
        pk=pk,
        offered=token,
        stored=stored,
    )
