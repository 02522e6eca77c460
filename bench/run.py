"""``python -m bench``: start the servers, run the workloads, write the report."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench.registry import (
    DURABLE_DATABASE_ENV,
    ETCD_ENV,
    IMPLEMENTATIONS,
    OPT_IN_WORKLOADS,
    WORKLOADS,
    ZOOKEEPER_ENV,
    Env,
    Implementation,
    RunOptions,
    load_opt_in,
    load_registry,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    load_registry()
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark distlocks against the raw Redis and PostgreSQL floors and peer "
        "lock libraries, in one run on the same throwaway servers.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny counts: checks that everything runs"
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="WORKLOAD",
        choices=[*WORKLOADS, *OPT_IN_WORKLOADS],
        help=f"run only this workload (repeatable): {', '.join(WORKLOADS)}; and, only when "
        f"named here, {', '.join(OPT_IN_WORKLOADS)} (they need a ZooKeeper or an etcd server)",
    )
    parser.add_argument(
        "--iterations",
        type=int,
        metavar="N",
        help="cycles per implementation in 'cycle' and saves in the 'fenced-save' "
        "workloads (default 5000); 'handoff' measures N/20 hand-offs; the throughput "
        "workloads are timed",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=RESULTS_DIR,
        metavar="DIR",
        help="where to write <timestamp>.json, latest.json, latest.md, latest.png "
        "(default: bench/results)",
    )
    parser.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="measure nothing: print the table of a saved run and redraw latest.md and the "
        "charts (latest-<workload>.png)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="report every round")
    args = parser.parse_args(argv)
    if args.iterations is not None and args.iterations < 1:
        parser.error("--iterations must be at least 1")
    load_opt_in(args.only or [])
    return args


def _missing_servers(impl_classes: list[type[Implementation]]) -> dict[str, str]:
    """The servers these implementations need that cannot run here, and why."""
    needed = set().union(*(cls.servers for cls in impl_classes))
    missing = {}
    if "zookeeper" in needed:
        from bench.zookeeper import missing as zookeeper_missing

        reason = zookeeper_missing()
        if reason:
            missing["zookeeper"] = reason
    if "postgres-durable" in needed:
        from bench.pg_durable import missing as durable_missing

        reason = durable_missing()
        if reason:
            missing["postgres-durable"] = reason
    if "etcd" in needed:
        from bench.etcd import missing as etcd_missing

        reason = etcd_missing()
        if reason:
            missing["etcd"] = reason
    return missing


def _start(impl_classes: list[type[Implementation]], started: list[Any] | None = None) -> Env:
    """Start the servers the implementations need, then configure Django.

    Servers started for this run only (ZooKeeper, etcd) are appended to ``started``
    (the caller stops them), or stopped at exit when no list is given.
    """
    if started is None:
        import atexit

        started = []
        atexit.register(lambda: [server.close() for server in started])
    from distlocks.testing.servers import ensure_test_servers

    needed = set().union(*(cls.servers for cls in impl_classes))
    if needed & {"redis", "postgres"}:
        ensure_test_servers(redis="redis" in needed, postgres="postgres" in needed)
    if "zookeeper" in needed:
        from bench.zookeeper import start_server

        server = start_server()
        started.append(server)
        # Read by bench.settings (the "zk" backend alias) and by Env.from_environ().
        os.environ[ZOOKEEPER_ENV] = server.location
    if "etcd" in needed:
        from bench.etcd import start_server as start_etcd

        server = start_etcd()
        started.append(server)
        # Read by bench.settings (the "etcd" backend alias) and by Env.from_environ().
        os.environ[ETCD_ENV] = server.location
    if "postgres-durable" in needed:
        from bench.pg_durable import start_server as start_durable

        durable = start_durable()
        started.append(durable)
        # Read by bench.settings (the "durable" database, the "pg-durable*" aliases).
        os.environ[DURABLE_DATABASE_ENV] = durable.location
    env = Env.from_environ()
    if "postgres" in needed:
        from bench.postgres import prepare_database

        prepare_database(env)
    if "postgres-durable" in needed:
        from bench.pg_durable import durable_env

        prepare_database(durable_env())
    # Forced, not defaulted: a caller such as the test suite may have its own settings set.
    os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
    import django

    django.setup()
    if "postgres" in needed:
        from bench.postgres import migrate

        migrate()
    if "postgres-durable" in needed:
        from bench.pg_durable import DATABASE_ALIAS

        migrate(DATABASE_ALIAS)
    return env


def _clean_redis(env: Env, impls: list[Implementation]) -> None:
    """Remove the keys the run left (fencing counters, wake-up lists)."""
    if not env.redis_url:
        return
    import redis

    patterns = sorted({p for impl in impls if "redis" in impl.servers for p in impl.key_patterns})
    client = redis.Redis.from_url(env.redis_url)
    try:
        for pattern in patterns:
            keys = list(client.scan_iter(match=pattern, count=1000))
            for start in range(0, len(keys), 500):
                client.delete(*keys[start : start + 500])
    finally:
        client.close()


def _measure(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    """Run the selected workloads and return the report (not yet written anywhere)."""
    from bench.machine import load_average, machine_info
    from bench.report import evaluate_targets, workload_result

    options = RunOptions(quick=args.quick, iterations=args.iterations)
    selected = [
        WORKLOADS[name]
        for name in WORKLOADS
        if (name in args.only if args.only else name not in OPT_IN_WORKLOADS)
    ]
    skipped: dict[str, str] = {}
    for wl in list(selected):
        taking_part = [cls for cls in IMPLEMENTATIONS.values() if wl.supports(cls)]
        missing = _missing_servers(taking_part)
        if missing:
            skipped[wl.name] = "; ".join(f"no {server}: {why}" for server, why in missing.items())
            print(f"{wl.name}: skipped, {skipped[wl.name]}", file=sys.stderr, flush=True)
            selected.remove(wl)
    impl_classes = [
        cls for cls in IMPLEMENTATIONS.values() if any(wl.supports(cls) for wl in selected)
    ]

    def progress(message: str) -> None:
        print(f"  {message}", file=sys.stderr, flush=True)

    def _quiet(message: str) -> None:
        pass

    started = dt.datetime.now(dt.UTC)
    began = time.monotonic()
    run_servers: list[Any] = []
    try:
        env = _start(impl_classes, run_servers) if impl_classes else Env.from_environ()
    except BaseException:
        for server in run_servers:
            server.close()
        raise
    load_before = load_average()
    impls: list[Implementation] = []
    sections: dict[str, dict[str, Any]] = {}
    try:
        impls = [cls(env) for cls in impl_classes]
        for wl_cls in selected:
            workload = wl_cls(options)
            running = [impl for impl in impls if workload.supports(type(impl))]
            print(f"{workload.name}: {len(running)} implementations", file=sys.stderr, flush=True)
            samples = workload.run(running, progress if args.verbose else _quiet)
            sections[workload.name] = workload_result(workload, samples)
    finally:
        from bench.workers import close_quick_pools

        close_quick_pools()
        for impl in impls:
            impl.close()
        _clean_redis(env, impls)
        if any("postgres" in impl.servers for impl in impls):
            from bench.postgres import clean_database

            clean_database(env)
        if any("postgres-durable" in impl.servers for impl in impls):
            from bench.pg_durable import durable_env

            clean_database(durable_env())
        machine = {
            **machine_info(env),
            "load_average_before": load_before,
            "load_average_after": load_average(),
        }
        for server in run_servers:
            server.close()

    command = "python -m bench" + "".join(f" {shlex.quote(a)}" for a in (argv or sys.argv[1:]))
    return {
        "schema": 1,
        "started_at": started.isoformat(timespec="seconds").replace("+00:00", "Z"),
        "duration_s": round(time.monotonic() - began, 1),
        "command": command,
        "options": {"quick": args.quick, "only": args.only, "iterations": args.iterations},
        "machine": machine,
        "implementations": {
            impl.name: {
                "label": impl.label,
                "role": impl.role,
                "family": impl.family,
                "version": impl.version(),
                "doc": (type(impl).__doc__ or "").strip().splitlines()[0],
            }
            for impl in impls
        },
        "workloads": sections,
        "skipped": skipped,
        "targets": evaluate_targets(sections),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench.report import draw_chart, format_markdown, format_text, write_json

    out_dir: Path = args.output
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.render:
        report = json.loads(args.render.read_text())
        written = []
    else:
        report = _measure(args, argv)
        stamp = report["started_at"].replace("-", "").replace(":", "")
        for name in (f"{stamp}.json", "latest.json"):
            write_json(report, out_dir / name)
        written = [f"{stamp}.json", "latest.json"]
    print(format_text(report))
    (out_dir / "latest.md").write_text(format_markdown(report))
    charts = draw_chart(report, out_dir / "latest.png")
    written += ["latest.md"] + [chart.name for chart in charts]
    print(f"\nWrote {', '.join(written)} in {out_dir}.")
    return 0
