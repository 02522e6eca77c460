"""Fencing support shared by the models, the admin and the lock API.

* Which leases the current context holds through ``with lock(...)`` (so a save
  inside the block can use its token without passing it).
* :func:`unfenced`, the explicit escape hatch for data migrations and scripts.
* The triggers that reject, inside PostgreSQL, SQLite and MySQL/MariaDB, any
  UPDATE lowering a row's token, and the translation of their errors into
  :class:`~distlocks.exceptions.StaleFencingToken`.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.db.backends.utils import truncate_name

from distlocks.exceptions import StaleFencingToken

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

    from distlocks.lease import BaseLease

#: SQLSTATE raised by the PostgreSQL trigger (a custom class, so nothing else can match it).
STALE_SQLSTATE = "DLS01"
TRIGGER_FUNCTION = "distlocks_reject_stale_token"
#: The trigger's name on PostgreSQL (per table); SQLite and MySQL name triggers per
#: schema, so there it is followed by the table name (see :func:`trigger_name`).
TRIGGER_NAME = "distlocks_fencing"
#: Django database vendors whose engine refuses a token-lowering UPDATE.
ENFORCING_VENDORS = frozenset({"postgresql", "sqlite", "mysql"})
#: Start of every trigger's error message: what turns it into StaleFencingToken.
STALE_MESSAGE = "distlocks: stale fencing token"
#: The column the triggers guard (distlocks.E010 keeps FencedModel's field on it).
TOKEN_COLUMN = "fencing_token"
#: The largest token a backend issues (all keep them below 2**53: exact in Lua's
#: doubles and in JSON). The triggers refuse to store a larger one, or a negative one.
MAX_TOKEN = 2**53 - 1
#: Start of the triggers' error message for a token out of that range.
RANGE_MESSAGE = "distlocks: fencing_token out of range"

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


#: Kinds of lease that several holders have at once (token 0): no licence to write.
SHARED_KINDS = frozenset({"semaphore", "read"})


def active_lease(name: str) -> BaseLease | None:
    """The innermost exclusive lease on ``name`` (a lock or the write side of a
    read-write lock) held by the current context, if any."""
    for lease in reversed(_active.get()):
        if lease.name == name and getattr(lease, "kind", "lock") not in SHARED_KINDS:
            return lease
    return None


@contextlib.contextmanager
def unfenced() -> Iterator[None]:
    """Let FencedModel saves and ``QuerySet.update()`` run without a token.

    For fixtures and maintenance scripts, where no lock holder can race the write.
    Saves inside are plain Django saves: they write the token the instance holds
    (loaded with the row), so where the database enforces fencing (PostgreSQL,
    SQLite, MySQL/MariaDB) its trigger still refuses a stale
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


# -- enforcement inside the database ---------------------------------------------
#
# One BEFORE UPDATE trigger per FencedModel table refuses a new fencing_token below
# the stored one (an equal one is allowed: a holder writes several times with its
# token). Each engine reports it with a message starting with STALE_MESSAGE, which
# translate_errors() turns into StaleFencingToken on Django's connections.

PG_FUNCTION_SQL = f"""
CREATE OR REPLACE FUNCTION {TRIGGER_FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (NEW.{TOKEN_COLUMN} < 0 OR NEW.{TOKEN_COLUMN} > {MAX_TOKEN})
       AND (TG_OP = 'INSERT' OR NEW.{TOKEN_COLUMN} IS DISTINCT FROM OLD.{TOKEN_COLUMN}) THEN
        RAISE EXCEPTION USING
            ERRCODE = '22003',
            MESSAGE = format('{RANGE_MESSAGE} %s on %s: tokens are from 0 to {MAX_TOKEN}',
                             NEW.{TOKEN_COLUMN}, TG_TABLE_NAME);
    END IF;
    -- A stored token out of range (written before distlocks checked it) may be
    -- lowered: that is the repair of a row no holder could write any more.
    IF TG_OP = 'UPDATE' AND NEW.{TOKEN_COLUMN} < OLD.{TOKEN_COLUMN}
       AND OLD.{TOKEN_COLUMN} <= {MAX_TOKEN} THEN
        RAISE EXCEPTION USING
            ERRCODE = '{STALE_SQLSTATE}',
            MESSAGE = format('{STALE_MESSAGE} %s for %s (stored %s)',
                             NEW.{TOKEN_COLUMN}, TG_TABLE_NAME, OLD.{TOKEN_COLUMN}),
            DETAIL = format('table=%s offered=%s stored=%s',
                            TG_TABLE_NAME, NEW.{TOKEN_COLUMN}, OLD.{TOKEN_COLUMN});
    END IF;
    RETURN NEW;
END
$$
"""
#: Kept under its former name for code that imported it.
FUNCTION_SQL = PG_FUNCTION_SQL


def trigger_sql(table: str, quote: Callable[[str], str]) -> list[str]:
    """Statements that (re)install the fencing trigger on PostgreSQL ``table``."""
    return [
        PG_FUNCTION_SQL,
        f"DROP TRIGGER IF EXISTS {TRIGGER_NAME} ON {quote(table)}",
        f"CREATE TRIGGER {TRIGGER_NAME} BEFORE INSERT OR UPDATE OF {TOKEN_COLUMN}"
        f" ON {quote(table)}"
        f" FOR EACH ROW EXECUTE FUNCTION {TRIGGER_FUNCTION}()",
    ]


def drop_trigger_sql(table: str, quote: Callable[[str], str]) -> list[str]:
    """Statements that remove the fencing trigger from PostgreSQL ``table``."""
    return [f"DROP TRIGGER IF EXISTS {TRIGGER_NAME} ON {quote(table)}"]


def enforces(connection: BaseDatabaseWrapper) -> bool:
    """Whether distlocks installs a fencing trigger on ``connection``'s database."""
    return connection.vendor in ENFORCING_VENDORS


def trigger_name(connection: BaseDatabaseWrapper, table: str, *, insert: bool = False) -> str:
    """The trigger's name on ``table``: SQLite and MySQL name triggers per schema, so
    the table is part of it (shortened with a hash where MySQL's 64 characters end).
    There, inserts have a trigger of their own (``insert=True``); on PostgreSQL one
    trigger covers both."""
    if connection.vendor == "postgresql":
        return TRIGGER_NAME
    prefix = f"{TRIGGER_NAME}_insert" if insert else TRIGGER_NAME
    return truncate_name(f"{prefix}_{table}", connection.ops.max_name_length())


def _string_literal(value: str, *, backslash_escapes: bool = False) -> str:
    if backslash_escapes:
        value = value.replace("\\", "\\\\")
    return "'" + value.replace("'", "''") + "'"


def _sqlite_trigger_sql(connection: BaseDatabaseWrapper, table: str) -> list[str]:
    quote = connection.ops.quote_name
    name, column = quote(trigger_name(connection, table)), quote(TOKEN_COLUMN)
    insert_name = quote(trigger_name(connection, table, insert=True))
    # RAISE() takes a literal only (SQLite < 3.47), so the message cannot carry the
    # tokens. SQLite would store a text or real value in an integer column as it is,
    # and text sorts above every integer: it would fence the row out for good.
    stale = _string_literal(f"{STALE_MESSAGE} on {table}")
    not_integer = _string_literal(f"distlocks: {TOKEN_COLUMN} must be an integer on {table}")
    out_of_range = _string_literal(f"{RANGE_MESSAGE} on {table}: tokens are from 0 to {MAX_TOKEN}")
    new, old = f"NEW.{column}", f"OLD.{column}"
    bad_new = f"(typeof({new}) <> 'integer' OR {new} < 0 OR {new} > {MAX_TOKEN})"
    refusal = (
        f"BEGIN SELECT CASE WHEN typeof({new}) <> 'integer' THEN RAISE(ABORT, {not_integer})"
        f" WHEN {new} < 0 OR {new} > {MAX_TOKEN} THEN RAISE(ABORT, {out_of_range})"
        f" ELSE RAISE(ABORT, {stale}) END; END"
    )
    # A stored token out of range (or not an integer, from before these checks) may be
    # lowered: that repairs a row no holder could write any more. One that is left as
    # it is stays writable by other columns' updates.
    return [
        f"DROP TRIGGER IF EXISTS {name}",
        f"DROP TRIGGER IF EXISTS {insert_name}",
        f"CREATE TRIGGER {name} BEFORE UPDATE OF {column} ON {quote(table)} FOR EACH ROW"
        f" WHEN {new} IS NOT NULL AND (({bad_new} AND {new} IS NOT {old})"
        f" OR ({new} < {old} AND typeof({old}) = 'integer' AND {old} <= {MAX_TOKEN}))"
        f" {refusal}",
        f"CREATE TRIGGER {insert_name} BEFORE INSERT ON {quote(table)} FOR EACH ROW"
        f" WHEN {new} IS NOT NULL AND {bad_new} {refusal}",
    ]


def _mysql_trigger_sql(connection: BaseDatabaseWrapper, table: str) -> list[str]:
    quote = connection.ops.quote_name
    name, column = quote(trigger_name(connection, table)), quote(TOKEN_COLUMN)
    insert_name = quote(trigger_name(connection, table, insert=True))
    where = _string_literal(table, backslash_escapes=True)
    new, old = f"NEW.{column}", f"OLD.{column}"

    def out_of_range(condition: str) -> str:
        return (
            f"  IF {condition} THEN\n"
            f"    SET message = LEFT(CONCAT('{RANGE_MESSAGE} ', {new}, ' on ', {where},\n"
            f"      ': tokens are from 0 to {MAX_TOKEN}'), 128);\n"
            f"    SIGNAL SQLSTATE '22003' SET MYSQL_ERRNO = 1264, MESSAGE_TEXT = message;\n"
            f"  END IF;\n"
        )

    bad_new = f"({new} < 0 OR {new} > {MAX_TOKEN})"
    # A NULL is refused as the NOT NULL column would in strict mode (error 1048): a
    # non-strict session would otherwise store 0 after this trigger has run. A stored
    # token out of range (from before these checks) may be lowered: the repair of a
    # row no holder could write any more.
    update_body = (
        f"BEGIN\n"
        f"  DECLARE message VARCHAR(160);\n"
        f"  IF {new} IS NULL AND {old} IS NOT NULL THEN\n"
        f"    SIGNAL SQLSTATE '23000' SET MYSQL_ERRNO = 1048,\n"
        f"      MESSAGE_TEXT = 'Column ''{TOKEN_COLUMN}'' cannot be null';\n"
        f"  END IF;\n"
        + out_of_range(f"{bad_new} AND {new} <> {old}")
        + f"  IF {new} < {old} AND {old} <= {MAX_TOKEN} THEN\n"
        f"    SET message = LEFT(CONCAT('{STALE_MESSAGE} ', {new},\n"
        f"      ' (stored ', {old}, ') on ', {where}), 128);\n"
        f"    SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = message;\n"
        f"  END IF;\n"
        f"END"
    )
    insert_body = "BEGIN\n  DECLARE message VARCHAR(160);\n" + out_of_range(bad_new) + "END"
    update_head = f"TRIGGER {name} BEFORE UPDATE ON {quote(table)} FOR EACH ROW\n"
    insert_head = f"TRIGGER {insert_name} BEFORE INSERT ON {quote(table)} FOR EACH ROW\n"
    if getattr(connection, "mysql_is_mariadb", False):
        # One atomic step each.
        return [
            f"CREATE OR REPLACE {update_head}{update_body}",
            f"CREATE OR REPLACE {insert_head}{insert_body}",
        ]
    return [
        f"DROP TRIGGER IF EXISTS {name}",
        f"CREATE {update_head}{update_body}",
        f"DROP TRIGGER IF EXISTS {insert_name}",
        f"CREATE {insert_head}{insert_body}",
    ]


def install_statements(connection: BaseDatabaseWrapper, table: str) -> list[str]:
    """Statements that (re)install the fencing trigger on ``table`` (none where the
    database is not one distlocks enforces fencing in)."""
    if connection.vendor == "postgresql":
        return trigger_sql(table, connection.ops.quote_name)
    if connection.vendor == "sqlite":
        return _sqlite_trigger_sql(connection, table)
    if connection.vendor == "mysql":
        return _mysql_trigger_sql(connection, table)
    return []


def drop_statements(connection: BaseDatabaseWrapper, table: str) -> list[str]:
    """Statements that remove the fencing trigger from ``table``."""
    if connection.vendor == "postgresql":
        return drop_trigger_sql(table, connection.ops.quote_name)
    if connection.vendor in ENFORCING_VENDORS:
        quote = connection.ops.quote_name
        return [
            f"DROP TRIGGER IF EXISTS {quote(trigger_name(connection, table, insert=insert))}"
            for insert in (False, True)
        ]
    return []


# MySQL/MariaDB errors that mean the user may not create the trigger.
_MYSQL_PRIVILEGE_HINTS = {
    # ER_TABLEACCESS_DENIED_ERROR: "TRIGGER command denied to user ..."
    1142: "Grant the TRIGGER privilege on the database to the user Django connects as "
    "(GRANT TRIGGER ON `<database>`.* TO '<user>'@'<host>'), then run migrate again.",
    # ER_BINLOG_CREATE_ROUTINE_NEED_SUPER, and ER_SPECIFIC_ACCESS_DENIED_ERROR (SUPER)
    1419: "Binary logging is on, and then creating a trigger needs the SUPER privilege "
    "or log_bin_trust_function_creators = 1 (SET GLOBAL, and in the server's "
    "configuration so that it lasts); then run migrate again.",
    1227: "Binary logging is on, and then creating a trigger needs the SUPER privilege "
    "or log_bin_trust_function_creators = 1 (SET GLOBAL, and in the server's "
    "configuration so that it lasts); then run migrate again.",
}


def run_statements(
    connection: BaseDatabaseWrapper,
    table: str,
    statements: list[str],
    execute: Callable[[str], Any],
) -> None:
    """Run trigger statements with ``execute``; a missing privilege becomes
    ImproperlyConfigured saying what to grant."""
    from django.db import DatabaseError

    try:
        for sql in statements:
            execute(sql)
    except DatabaseError as exc:
        cause = exc.__cause__ or exc
        code = cause.args[0] if cause.args else None
        hint = (
            _MYSQL_PRIVILEGE_HINTS.get(code)
            if connection.vendor == "mysql" and isinstance(code, int)
            else None
        )
        if hint is None:
            raise
        raise ImproperlyConfigured(
            f"distlocks could not install or remove the fencing trigger on table {table!r} "
            f"({_driver_message(cause)}). {hint}"
        ) from exc


def install_trigger(connection: BaseDatabaseWrapper, table: str) -> None:
    """Install the trigger on ``table`` where ``connection``'s database enforces
    fencing (a no-op elsewhere). Idempotent: an existing one is replaced."""
    from django.db import transaction

    statements = install_statements(connection, table)
    if not statements:
        return
    # PostgreSQL and SQLite run DDL in transactions: no moment without the trigger.
    atomic = (
        transaction.atomic(using=connection.alias)
        if connection.features.can_rollback_ddl
        else contextlib.nullcontext()
    )
    with atomic, connection.cursor() as cursor:
        run_statements(connection, table, statements, cursor.execute)


def _driver_message(cause: BaseException) -> str:
    """The text of a driver error: MySQL drivers give (errno, text), sqlite3 (text,)."""
    args = getattr(cause, "args", ())
    return str(args[-1]) if args else str(cause)


# A table name may hold spaces: the values are read from the end.
_DETAIL = re.compile(
    r"table=(?P<table>.+) offered=(?P<offered>-?\d+) stored=(?P<stored>-?\d+)\Z", re.DOTALL
)
_MESSAGE = re.compile(
    re.escape(STALE_MESSAGE)
    + r" (?:(?P<offered>-?\d+) \(stored (?P<stored>-?\d+)\) )?on (?P<table>.*)\Z",
    re.DOTALL,
)


def stale_error(exc: BaseException) -> StaleFencingToken | None:
    """The StaleFencingToken a database error stands for, if it is the trigger's."""
    cause = exc.__cause__ or exc
    diag = getattr(cause, "diag", None)
    offered = stored = None
    table: str | None = None
    if diag is not None:  # psycopg: the SQLSTATE says it, the DETAIL has the values
        if getattr(diag, "sqlstate", None) != STALE_SQLSTATE:
            return None
        match = _DETAIL.search(getattr(diag, "message_detail", "") or "")
    else:  # sqlite3, MySQL drivers: the message says it
        match = _MESSAGE.match(_driver_message(cause))
        if match is None:
            return None
    if match is not None:
        table = match["table"]
        offered = int(match["offered"]) if match["offered"] is not None else None
        stored = int(match["stored"]) if match["stored"] is not None else None
    values = f": offered {offered}, stored {stored}" if offered is not None else ""
    return StaleFencingToken(
        f"The database refused to lower the fencing token of a row of {table}{values}. "
        f"A newer lock holder has written it.",
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
    if enforces(connection) and translate_errors not in connection.execute_wrappers:
        connection.execute_wrappers.append(translate_errors)
