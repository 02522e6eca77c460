"""Fencing support shared by the models, the admin and the lock API.

* Which leases the current context holds through ``with lock(...)`` (so a save
  inside the block can use its token without passing it).
* :func:`unfenced`, the explicit escape hatch for data migrations and scripts.
* The PostgreSQL trigger that rejects any UPDATE lowering a row's token, and
  the translation of its error into :class:`~distlocks.exceptions.StaleFencingToken`.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from distlocks.exceptions import StaleFencingToken

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

    from distlocks.lease import BaseLease

#: SQLSTATE raised by the trigger (a custom class, so nothing else can match it).
STALE_SQLSTATE = "DLS01"
TRIGGER_FUNCTION = "distlocks_reject_stale_token"
TRIGGER_NAME = "distlocks_fencing"

_active: contextvars.ContextVar[tuple[BaseLease, ...]] = contextvars.ContextVar(
    "distlocks_active_leases", default=()
)
_unfenced: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "distlocks_unfenced", default=False
)


def enter(lease: BaseLease) -> contextvars.Token[tuple[BaseLease, ...]]:
    """Record ``lease`` as held by the current context (a ``with`` block)."""
    return _active.set((*_active.get(), lease))


def leave(token: contextvars.Token[tuple[BaseLease, ...]]) -> None:
    _active.reset(token)


def active_lease(name: str) -> BaseLease | None:
    """The innermost lease on ``name`` held by the current context, if any."""
    for lease in reversed(_active.get()):
        if lease.name == name:
            return lease
    return None


@contextlib.contextmanager
def unfenced() -> Iterator[None]:
    """Let FencedModel saves and ``QuerySet.update()`` run without a token.

    For fixtures and maintenance scripts, where no lock holder can race the write.
    Saves inside are plain Django saves: they write the token the instance holds
    (loaded with the row), so on PostgreSQL the trigger still refuses a stale
    instance that would lower it. Models from ``apps.get_model()`` in a data
    migration are plain historical models and need no escape hatch.
    """
    token = _unfenced.set(True)
    try:
        yield
    finally:
        _unfenced.reset(token)


def is_unfenced() -> bool:
    return _unfenced.get()


# -- PostgreSQL enforcement ----------------------------------------------------

FUNCTION_SQL = f"""
CREATE OR REPLACE FUNCTION {TRIGGER_FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.fencing_token < OLD.fencing_token THEN
        RAISE EXCEPTION USING
            ERRCODE = '{STALE_SQLSTATE}',
            MESSAGE = format('distlocks: stale fencing token %s for %s (stored %s)',
                             NEW.fencing_token, TG_TABLE_NAME, OLD.fencing_token),
            DETAIL = format('table=%s offered=%s stored=%s',
                            TG_TABLE_NAME, NEW.fencing_token, OLD.fencing_token);
    END IF;
    RETURN NEW;
END
$$
"""


def trigger_sql(table: str, quote: Callable[[str], str]) -> list[str]:
    """Statements that (re)install the fencing trigger on ``table``."""
    return [
        FUNCTION_SQL,
        f"DROP TRIGGER IF EXISTS {TRIGGER_NAME} ON {quote(table)}",
        f"CREATE TRIGGER {TRIGGER_NAME} BEFORE UPDATE OF fencing_token ON {quote(table)}"
        f" FOR EACH ROW EXECUTE FUNCTION {TRIGGER_FUNCTION}()",
    ]


def drop_trigger_sql(table: str, quote: Callable[[str], str]) -> list[str]:
    return [f"DROP TRIGGER IF EXISTS {TRIGGER_NAME} ON {quote(table)}"]


def install_trigger(connection: BaseDatabaseWrapper, table: str) -> None:
    """Install the trigger on ``table`` if ``connection`` is PostgreSQL (no-op elsewhere)."""
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        for sql in trigger_sql(table, connection.ops.quote_name):
            cursor.execute(sql)


_DETAIL = re.compile(r"table=(?P<table>\S+) offered=(?P<offered>-?\d+) stored=(?P<stored>-?\d+)")


def stale_error(exc: BaseException) -> StaleFencingToken | None:
    """The StaleFencingToken a database error stands for, if it is the trigger's."""
    cause = exc.__cause__ or exc
    diag = getattr(cause, "diag", None)
    if getattr(diag, "sqlstate", None) != STALE_SQLSTATE:
        return None
    match = _DETAIL.search(getattr(diag, "message_detail", "") or "")
    offered = int(match["offered"]) if match else None
    stored = int(match["stored"]) if match else None
    table = match["table"] if match else None
    return StaleFencingToken(
        f"The database refused to lower the fencing token of a row of {table}: "
        f"offered {offered}, stored {stored}. A newer lock holder has written it.",
        model=table,
        offered=offered,
        stored=stored,
    )


def translate_errors(
    execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict[str, Any]
) -> Any:
    """A database execute wrapper turning the trigger's error into StaleFencingToken,
    whatever path (ORM, raw cursor) the statement took."""
    from django.db import DatabaseError

    try:
        return execute(sql, params, many, context)
    except DatabaseError as exc:
        stale = stale_error(exc)
        if stale is None:
            raise
        raise stale from exc


def install_error_translation(
    sender: object, connection: BaseDatabaseWrapper, **kwargs: Any
) -> None:
    """``connection_created`` receiver: add :func:`translate_errors` once per connection."""
    if connection.vendor == "postgresql" and translate_errors not in connection.execute_wrappers:
        connection.execute_wrappers.append(translate_errors)
