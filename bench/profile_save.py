"""Where a fenced save spends its time: ``python -m bench.profile_save``.

A companion of the ``fenced-save`` workloads, for the analysis in
docs/benchmarks.md. On the same throwaway PostgreSQL and in the same database as
``python -m bench`` it:

1. prints the SQL of each save path, as Django sends it;
2. times the path layer by layer, interleaved in blocks, wall clock and the client
   thread's CPU time per call: the statements alone through Django's cursor (with
   and without the fencing trigger firing), ``QuerySet.update`` alone, then the saves;
3. times, the same way, other ways of building the same fenced UPDATE (what-ifs for
   the analysis, not distlocks code);
4. counts the Python function calls of one save of each kind (``cProfile``: a
   count does not depend on the machine) and lists the functions that account for
   the difference;
5. asks the server for its side: ``EXPLAIN ANALYZE`` of both statements (trigger
   time included) over many executions.

Nothing is asserted; the figures are printed.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.saves import TOKEN, UPDATE_FIELDS

Layer = tuple[str, Callable[[], None]]
ROOT = Path(__file__).resolve().parent.parent


def _setup() -> None:
    from bench.run import _start
    from bench.saves import PlainSave

    _start([PlainSave])


def _captured(call: Callable[[], None]) -> list[tuple[str, Any]]:
    """The statements ``call`` sends, with their parameters (executed, not faked)."""
    from django.db import connection

    captured: list[tuple[str, Any]] = []

    def spy(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        captured.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(spy):
        call()
    return captured


def _timed(layers: list[Layer], blocks: int, per_block: int, bump: Callable[[], None]) -> Any:
    """Run every layer ``per_block`` times per block, rotating the order each block."""
    wall: dict[str, list[int]] = {name: [] for name, _ in layers}
    cpu: dict[str, list[int]] = {name: [] for name, _ in layers}
    perf, thread = time.perf_counter_ns, time.thread_time_ns
    for _name, call in layers:  # warm-up
        for _ in range(50):
            bump()
            call()
    for block in range(blocks):
        shift = block % len(layers)
        for name, call in layers[shift:] + layers[:shift]:
            w, c = wall[name], cpu[name]
            for _ in range(per_block):
                bump()
                t0, c0 = perf(), thread()
                call()
                c1, t1 = thread(), perf()
                w.append(t1 - t0)
                c.append(c1 - c0)
    return {
        name: (statistics.median(wall[name]) / 1000, statistics.median(cpu[name]) / 1000)
        for name, _ in layers
    }


def _calls_per_save(call: Callable[[], None], count: int) -> tuple[float, pstats.Stats]:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(count):
        call()
    profile.disable()
    stats = pstats.Stats(profile)
    return stats.total_calls / count, stats  # type: ignore[attr-defined]


def _by_function(stats: pstats.Stats, count: int) -> dict[str, tuple[float, float, float]]:
    """function -> (calls, own time in us, cumulative time in us), per save."""
    out: dict[str, tuple[float, float, float]] = {}
    table = stats.stats  # type: ignore[attr-defined]
    for (filename, line, func), (_cc, nc, tt, ct, _callers) in table.items():
        short = filename.split("site-packages/")[-1].split(f"{ROOT}/")[-1]
        key = f"{short}:{line}({func})"
        out[key] = (nc / count, tt / count * 1e6, ct / count * 1e6)
    return out


def _explain(sql: str, params: Any, runs: int) -> list[str]:
    """EXPLAIN ANALYZE of an UPDATE, rolled back; the last of ``runs`` plans."""
    from django.db import connection, transaction

    lines: list[str] = []
    for _ in range(runs):
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("EXPLAIN (ANALYZE, BUFFERS OFF, TIMING ON) " + sql, params)
                lines = [row[0] for row in cursor.fetchall()]
            transaction.set_rollback(True)
    return lines


def _normalized(sql: str) -> tuple[str, frozenset[str]]:
    """An UPDATE as (everything before WHERE, its AND-ed conditions in any order),
    columns with or without their table's name before them."""
    head, _, where = sql.partition(" WHERE ")
    where = re.sub(r'"[^"]+"\.(?=")', "", where)
    return head, frozenset(c.strip("() ") for c in where.split(" AND "))


def _print_layers(results: dict[str, tuple[float, float]]) -> None:
    first = next(iter(results.values()))[0]
    print(f"{'what runs':<52} {'wall us':>9} {'x first':>8} {'client CPU us':>14}")
    for name, (wall, cpu) in results.items():
        print(f"{name:<52} {wall:>9.1f} {wall / first:>7.2f}x {cpu:>14.1f}")


def _fenced_values(row: Any) -> list[tuple[Any, None, Any]]:
    """(field, None, value) for every column of ``row``, the token set to TOKEN."""
    meta = type(row)._meta
    return [
        (f, None, TOKEN if f.attname == "fencing_token" else f.pre_save(row, False))
        for f in meta.local_concrete_fields
        if not f.primary_key
    ]


def _one_filter(row: Any) -> Callable[[], None]:
    """FencedModel.save's statement with one filter() call instead of two."""
    from django.db import models

    def call() -> None:
        qs = type(row)._base_manager.using("default").filter(pk=row.pk, fencing_token__lte=TOKEN)
        models.QuerySet.update(qs, fencing_token=TOKEN, number=row.number, label=row.label)

    return call


def _prebuilt_lookup(row: Any) -> Callable[[], None]:
    """The token condition added to the WHERE as a lookup object (no filter() call),
    the values passed as fields, as Django's own ``Model._do_update`` passes them."""
    from django.db.models import sql
    from django.db.models.lookups import LessThanOrEqual
    from django.db.models.sql.constants import ROW_COUNT
    from django.db.models.sql.where import AND

    token_field = type(row)._meta.get_field("fencing_token")

    def call() -> None:
        query = type(row)._base_manager.using("default").filter(pk=row.pk).query
        update = query.chain(sql.UpdateQuery)
        column = token_field.get_col(update.get_initial_alias())
        update.where.add(LessThanOrEqual(column, TOKEN), AND)
        update.add_update_fields(_fenced_values(row))
        update.get_compiler("default").execute_sql(ROW_COUNT)

    return call


def _cached_sql(row: Any) -> Callable[[], None]:
    """The statement's text built once per model; values prepared by their fields."""
    from django.db import connection

    meta = type(row)._meta
    quote = connection.ops.quote_name
    table = quote(meta.db_table)
    token = meta.get_field("fencing_token")
    fields = [f for f in meta.local_concrete_fields if not f.primary_key and f is not token]
    text = (
        f"UPDATE {table} SET {quote(token.column)} = %s, "
        + ", ".join(f"{quote(f.column)} = %s" for f in fields)
        + f" WHERE ({table}.{quote(meta.pk.column)} = %s"
        f" AND {table}.{quote(token.column)} <= %s)"
    )

    def call() -> None:
        params = [token.get_db_prep_save(TOKEN, connection)]
        params += [f.get_db_prep_save(f.pre_save(row, False), connection) for f in fields]
        params += [meta.pk.get_db_prep_value(row.pk, connection), TOKEN]
        with connection.cursor() as cursor:
            cursor.execute(text, params)

    return call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_save", description=__doc__)
    parser.add_argument("--blocks", type=int, default=30, help="interleaved blocks (30)")
    parser.add_argument("--per-block", type=int, default=200, help="calls per block (200)")
    parser.add_argument("--profile-saves", type=int, default=2000, help="saves profiled (2000)")
    parser.add_argument("--top", type=int, default=20, help="functions listed (20)")
    args = parser.parse_args(argv)

    _setup()
    from django.db import connection, models

    from bench.benchapp.models import FencedRow, PlainRow
    from distlocks.fencing import translate_errors

    plain = PlainRow._default_manager.create(number=0, label="benchmark row")
    fenced = FencedRow(number=0, label="benchmark row")
    fenced.save(fencing_token=TOKEN)
    try:
        save_plain = functools.partial(plain.save)
        save_fenced = functools.partial(fenced.save, fencing_token=TOKEN)
        save_django_fenced_table = functools.partial(models.Model.save, fenced)

        print("== SQL of one save of an existing row (Django's cursor, as sent)\n")
        statements = {}
        paths: list[Layer] = [
            ("plain-save: PlainRow.save()", save_plain),
            ("fenced-save: FencedRow.save(fencing_token=N)", save_fenced),
            ("fenced-table-django-save: Model.save(FencedRow)", save_django_fenced_table),
            (
                "plain-save, update_fields",
                functools.partial(plain.save, update_fields=UPDATE_FIELDS),
            ),
            (
                "fenced-save, update_fields",
                functools.partial(fenced.save, fencing_token=TOKEN, update_fields=UPDATE_FIELDS),
            ),
        ]
        for title, call in paths:
            captured = _captured(call)
            statements[title] = captured
            print(f"{title}: {len(captured)} statement(s)")
            for sql, params in captured:
                print(f"  {sql}\n    params {params!r}")
        wrappers = connection.execute_wrappers
        print(
            f"\nexecute wrappers on Django's connection: {[w.__qualname__ for w in wrappers]} "
            f"(distlocks' translate_errors among them: {translate_errors in wrappers})"
        )

        plain_sql, plain_params = statements["plain-save: PlainRow.save()"][0]
        fenced_sql, fenced_params = statements["fenced-save: FencedRow.save(fencing_token=N)"][0]
        cursor = connection.cursor()

        def bump() -> None:
            plain.number += 1
            fenced.number += 1

        def run_sql(sql: str, params: Any) -> None:
            cursor.execute(sql, params)

        def plain_queryset_update() -> None:
            PlainRow._base_manager.filter(pk=plain.pk).update(
                number=plain.number, label=plain.label
            )

        def fenced_queryset_update() -> None:
            base = FencedRow._base_manager.using("default").filter(pk=fenced.pk)
            models.QuerySet.update(
                base.filter(fencing_token__lte=TOKEN),
                fencing_token=TOKEN,
                number=fenced.number,
                label=fenced.label,
            )

        def fenced_sql_without_token() -> None:
            # The fenced table, same WHERE, but the token column is not SET: the
            # trigger (BEFORE UPDATE OF fencing_token) does not fire.
            cursor.execute(fenced_no_token_sql, fenced_params[1:])

        fenced_no_token_sql = fenced_sql.replace('"fencing_token" = %s, ', "", 1)
        assert fenced_no_token_sql != fenced_sql
        layers: list[Layer] = [
            ("SQL: plain UPDATE", functools.partial(run_sql, plain_sql, plain_params)),
            ("SQL: fenced UPDATE, token not SET (no trigger)", fenced_sql_without_token),
            ("SQL: fenced UPDATE", functools.partial(run_sql, fenced_sql, fenced_params)),
            ("QuerySet.update(), plain row", plain_queryset_update),
            ("QuerySet.update(), fenced, as FencedModel.save", fenced_queryset_update),
            ("plain-save", save_plain),
            ("fenced-table-django-save", save_django_fenced_table),
            ("fenced-save", save_fenced),
        ]
        print(
            f"\n== Layers: {args.blocks} blocks of {args.per_block} calls each, interleaved; "
            "medians per call\n"
        )
        _print_layers(_timed(layers, args.blocks, args.per_block, bump))
        print(
            "\nSQL rows: the statements captured above, run through Django's cursor "
            "(its wrappers, distlocks' execute wrapper, psycopg), no ORM."
        )

        print(
            "\n== What-if: other ways to build the same fenced UPDATE (not distlocks code), "
            "interleaved with the saves\n"
        )
        whatif: list[Layer] = [
            ("plain-save", save_plain),
            ("fenced-save", save_fenced),
            ("one filter(pk=.., fencing_token__lte=..) + update()", _one_filter(fenced)),
            ("prebuilt lookup + QuerySet._update(fields)", _prebuilt_lookup(fenced)),
            ("SQL text cached per model, Django's cursor", _cached_sql(fenced)),
        ]
        for title, call in whatif[2:]:
            captured = _captured(call)
            same = [_normalized(sql) for sql, _ in captured] == [_normalized(fenced_sql)]
            assert same, f"{title} sent {captured}, not the fenced UPDATE"
        _print_layers(_timed(whatif, args.blocks, args.per_block, bump))

        n = args.profile_saves
        print(f"\n== Python function calls per save (cProfile over {n:,} saves each)\n")
        profiled = {}
        for title, call in [
            ("plain-save", save_plain),
            ("fenced-table-django-save", save_django_fenced_table),
            ("fenced-save", save_fenced),
        ]:
            per_save, stats = _calls_per_save(call, n)
            profiled[title] = _by_function(stats, n)
            print(f"{title:<28} {per_save:>7.1f} calls per save")
        fenced_fns, plain_fns = profiled["fenced-save"], profiled["plain-save"]
        none = (0.0, 0.0, 0.0)
        print(
            "\nPython functions (builtins left out) by extra cumulative time per save, "
            "fenced-save against plain-save\n(times under the profiler, which inflates them; "
            "read them as shares):"
        )
        print(
            f"  {'calls: fenced':>13} {'plain':>6}  {'cum us: fenced':>14} {'plain':>7}  function"
        )
        ranked = sorted(
            (k for k in set(fenced_fns) | set(plain_fns) if not k.startswith("~")),
            key=lambda k: fenced_fns.get(k, none)[2] - plain_fns.get(k, none)[2],
            reverse=True,
        )
        for key in ranked[: args.top]:
            f_calls, _, f_cum = fenced_fns.get(key, none)
            p_calls, _, p_cum = plain_fns.get(key, none)
            print(f"  {f_calls:>13.1f} {p_calls:>6.1f}  {f_cum:>14.1f} {p_cum:>7.1f}  {key}")

        print("\n== The server's side: EXPLAIN ANALYZE (rolled back), after 200 runs each\n")
        for title, sql, params in [
            ("plain UPDATE", plain_sql, plain_params),
            ("fenced UPDATE", fenced_sql, fenced_params),
        ]:
            print(title)
            for line in _explain(sql, params, 200):
                print(f"  {line}")
        cursor.close()
    finally:
        PlainRow._base_manager.filter(pk=plain.pk).delete()
        FencedRow._base_manager.filter(pk=fenced.pk).delete()
        connection.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
