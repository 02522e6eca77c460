"""What a "strict" fencing trigger would cost: ``python -m bench.strict_fencing``.

Issue 24 item 4 asked whether distlocks should offer a mode in which the database
refuses every UPDATE of a fenced row that does not carry the writer's token (today
it refuses only one that lowers the token). The writer has to tell the database its
token; the trigger compares it with the row's new token. This script times a fenced
save with and without such a check, on the benchmark's throwaway PostgreSQL (the
same server and table as ``python -m bench``) and on a SQLite file, and prints the
figures used in docs/fencing.md ("Strict mode: measured, not shipped"). It asserts
nothing, and the strict triggers it installs are prototypes, not distlocks code.

PostgreSQL variants, each a ``row.save(fencing_token=N)`` of a ``FencedRow``:

* ``today``: distlocks' fenced save (one UPDATE; the trigger checks the token is
  not lowered);
* ``strict-1``: the same save with a second trigger that refuses an UPDATE whose
  new token differs from ``current_setting('distlocks.token')``, the token handed
  over in the same statement (``fencing_token <= distlocks_offer(%s)``, a volatile
  SQL function calling ``set_config(..., true)``): still one round trip;
* ``...-in-tx``: the same saves, all of a block in one transaction (no commit per
  save, so what is left is the statements and the triggers); ``strict-2-in-tx``
  precedes each save by ``SELECT set_config('distlocks.token', %s, true)`` (a
  second statement, as raw SQL or ``QuerySet.update`` would need).

* ``server-today`` / ``server-strict``: the server's planning and execution time of
  the fenced UPDATE alone (triggers included, no network, no client), as ``EXPLAIN
  ANALYZE`` reports it, median of ``n`` runs.

Each line gives the variant's microseconds per save, 10th percentile and median over
all the calls of all rounds, with the difference and ratio to ``today``
(``today-in-tx`` for the ``-in-tx`` ones, ``server-today`` for the server's). On a
busy machine, read the 10th percentile: the cost of a call that did not wait for a
core.

SQLite variants: one autocommit UPDATE of the fenced statement, with distlocks'
triggers, and with in addition a strict trigger calling an application-defined
function that returns the writer's token (SQLite has no session variables);
``synchronous = OFF``, so that no fsync hides the trigger's cost.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import json
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STRICT_FUNCTION = """
CREATE OR REPLACE FUNCTION distlocks_bench_strict() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    offered text := current_setting('distlocks.token', true);
BEGIN
    IF offered IS DISTINCT FROM 'unfenced'
       AND NEW.fencing_token::text IS DISTINCT FROM offered THEN
        RAISE EXCEPTION 'distlocks: strict fencing: this UPDATE carries no token';
    END IF;
    RETURN NEW;
END
$$
"""
OFFER_FUNCTION = """
CREATE OR REPLACE FUNCTION distlocks_offer(token bigint) RETURNS bigint
LANGUAGE sql VOLATILE AS $$ SELECT set_config('distlocks.token', token::text, true)::bigint $$
"""


Variant = tuple[Callable[[], None], Callable[[], Any]]


def _per_call_us(variant: Variant, n: int) -> list[float]:
    """Microseconds of each of ``n`` calls, all inside the variant's context (one
    transaction for the block, or none: each call commits on its own)."""
    call, around = variant
    times = []
    with around():
        for _ in range(n):
            start = time.perf_counter_ns()
            call()
            times.append((time.perf_counter_ns() - start) / 1000)
    return times


def _interleaved(variants: dict[str, Variant], n: int) -> dict[str, list[float]]:
    """Per-call microseconds of each variant, run in turn after a warm-up."""
    for variant in variants.values():  # connections, caches, plans
        _per_call_us(variant, max(n // 10, 10))
    return {name: _per_call_us(variant, n) for name, variant in variants.items()}


def _summary(times: list[float]) -> tuple[float, float]:
    """(10th percentile, median): on a busy machine the low percentile is the cost
    of a call that was not kept waiting for a core."""
    return statistics.quantiles(times, n=10)[0], statistics.median(times)


def postgres(n: int, rounds: int) -> dict[str, tuple[float, float]]:
    from bench.profile_save import _setup

    _setup()
    from django.db import connection, transaction

    from bench.benchapp.models import FencedRow
    from bench.saves import TOKEN
    from distlocks import models as fenced_models

    table = connection.ops.quote_name(FencedRow._meta.db_table)
    row = FencedRow.objects.create(number=0, label="strict bench", fencing_token=TOKEN)
    original = fenced_models._fenced_statement

    def offering(*args: object) -> str:
        return original(*args).replace("<= %s", "<= distlocks_offer(%s)")  # type: ignore[arg-type]

    def save() -> None:
        row.number += 1
        row.save(fencing_token=TOKEN)

    def save_handing_over() -> None:  # a second statement hands the token over
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('distlocks.token', %s, true)", [str(TOKEN)])
        save()

    alone = contextlib.nullcontext
    in_tx = transaction.atomic

    def strict(on: bool) -> None:
        fenced_models._statements.clear()
        fenced_models._fenced_statement = offering if on else original  # type: ignore[assignment]

    with connection.cursor() as cursor:
        cursor.execute(STRICT_FUNCTION)
        cursor.execute(OFFER_FUNCTION)
    try:
        results: dict[str, list[float]] = {}
        refused = ""
        for _ in range(rounds):
            strict(False)
            with connection.cursor() as cursor:
                cursor.execute(f"DROP TRIGGER IF EXISTS distlocks_bench_strict ON {table}")
            today = _interleaved({"today": (save, alone), "today-in-tx": (save, in_tx)}, n)
            with connection.cursor() as cursor:
                cursor.execute(
                    f"CREATE TRIGGER distlocks_bench_strict BEFORE UPDATE ON {table}"
                    f" FOR EACH ROW EXECUTE FUNCTION distlocks_bench_strict()"
                )
            strict(True)
            # The check is live: a write that hands over no token is refused.
            try:
                with transaction.atomic(), connection.cursor() as cursor:
                    cursor.execute(f"UPDATE {table} SET number = 0 WHERE id = %s", [row.pk])
            except Exception as exc:
                refused = str(exc).splitlines()[0]
            else:
                raise SystemExit("the strict prototype let an UPDATE without a token through")
            measured = _interleaved(
                {
                    "strict-1": (save, alone),
                    "strict-1-in-tx": (save, in_tx),
                    "strict-2-in-tx": (save_handing_over, in_tx),
                },
                n,
            )
            for name, values in {**today, **measured}.items():
                results.setdefault(name, []).extend(values)
        print(f"  refused without a token: {refused}")
        figures = {name: _summary(values) for name, values in results.items()}
        # The server's side: planning and execution time of the statement, triggers
        # included, as EXPLAIN ANALYZE reports it (no network, no client).
        update = (
            f"UPDATE {table} SET fencing_token = %s, number = number + 1"
            f" WHERE id = %s AND fencing_token <= {{}}"
        )
        for name, on in (("server-today", False), ("server-strict", True)):
            with connection.cursor() as cursor:
                if not on:
                    cursor.execute(f"DROP TRIGGER IF EXISTS distlocks_bench_strict ON {table}")
                else:
                    cursor.execute(
                        f"CREATE TRIGGER distlocks_bench_strict BEFORE UPDATE ON {table}"
                        f" FOR EACH ROW EXECUTE FUNCTION distlocks_bench_strict()"
                    )
            sql = "EXPLAIN (ANALYZE, FORMAT JSON) " + update.format(
                "distlocks_offer(%s)" if on else "%s"
            )
            times = []
            for _ in range(n):
                with connection.cursor() as cursor:
                    cursor.execute(sql, [TOKEN, row.pk, TOKEN])
                    plan = cursor.fetchone()[0]
                plan = json.loads(plan) if isinstance(plan, str) else plan
                times.append((plan[0]["Planning Time"] + plan[0]["Execution Time"]) * 1000)
            figures[name] = _summary(times)
        return figures
    finally:
        strict(False)
        with connection.cursor() as cursor:
            cursor.execute(f"DROP TRIGGER IF EXISTS distlocks_bench_strict ON {table}")
            cursor.execute("DROP FUNCTION IF EXISTS distlocks_bench_strict()")
            cursor.execute("DROP FUNCTION IF EXISTS distlocks_offer(bigint)")
        FencedRow._base_manager.filter(pk=row.pk).delete()


def sqlite(n: int, rounds: int) -> dict[str, tuple[float, float]]:
    from distlocks.fencing import MAX_TOKEN

    token: contextvars.ContextVar[int | None] = contextvars.ContextVar("token", default=None)
    with tempfile.TemporaryDirectory() as directory:
        con = sqlite3.connect(Path(directory) / "strict.db", isolation_level=None)
        con.execute("PRAGMA journal_mode = WAL")
        # No fsync: what is left is the statement and its triggers.
        con.execute("PRAGMA synchronous = OFF")
        con.create_function("distlocks_token", 0, token.get)
        con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, number INTEGER, fencing_token BIGINT)")
        # distlocks' update trigger, as migrate installs it (same WHEN clause).
        con.execute(
            "CREATE TRIGGER fence BEFORE UPDATE OF fencing_token ON t FOR EACH ROW"
            f" WHEN NEW.fencing_token IS NOT NULL AND ((typeof(NEW.fencing_token) <> 'integer'"
            f" OR NEW.fencing_token < 0 OR NEW.fencing_token > {MAX_TOKEN})"
            " AND NEW.fencing_token IS NOT OLD.fencing_token OR NEW.fencing_token"
            " < OLD.fencing_token) BEGIN SELECT RAISE(ABORT, 'stale'); END"
        )
        con.execute("INSERT INTO t VALUES (1, 0, 1000)")
        sql = (
            "UPDATE t SET fencing_token = ?, number = number + 1"
            " WHERE id = 1 AND fencing_token <= ?"
        )

        def update() -> None:
            token.set(1000)
            con.execute(sql, (1000, 1000))

        results: dict[str, list[float]] = {}
        for _ in range(rounds):
            con.execute("DROP TRIGGER IF EXISTS strict")
            today = _interleaved({"today": (update, contextlib.nullcontext)}, n)
            con.execute(
                "CREATE TRIGGER strict BEFORE UPDATE ON t FOR EACH ROW"
                " WHEN NEW.fencing_token IS NOT distlocks_token()"
                " BEGIN SELECT RAISE(ABORT, 'strict'); END"
            )
            measured = _interleaved({"strict": (update, contextlib.nullcontext)}, n)
            for name, values in {**today, **measured}.items():
                results.setdefault(name, []).extend(values)
        con.close()
        return {name: _summary(values) for name, values in results.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=2000, help="saves per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    for name, measure in (("PostgreSQL", postgres), ("SQLite", sqlite)):
        print(f"{name}: {args.rounds} rounds of {args.n} calls; us per call, p10 and median")
        figures = measure(args.n, args.rounds)
        for variant, (p10, median) in figures.items():
            base = figures[
                "server-today"
                if variant.startswith("server-")
                else "today-in-tx"
                if variant.endswith("-in-tx")
                else "today"
            ]
            print(
                f"  {variant:16} p10 {p10:8.1f} ({p10 - base[0]:+7.1f}, {p10 / base[0]:4.2f}x)"
                f"  median {median:8.1f} ({median - base[1]:+7.1f}, {median / base[1]:4.2f}x)"
            )


if __name__ == "__main__":
    main()
