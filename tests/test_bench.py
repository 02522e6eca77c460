"""The benchmark harness keeps working: a smoke run with tiny counts.

Nothing here looks at how fast anything is; speed is the benchmark's business,
reported as ratios, never asserted.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.registry import IMPLEMENTATIONS, WORKLOADS, Samples, load_registry
from bench.stats import percentile, summarize

ROOT = Path(__file__).resolve().parent.parent

load_registry()

#: The workloads that save rows instead of taking locks, and what their rows are compared with.
SAVE_WORKLOADS = ("fenced-save", "fenced-save-fields")
LOCK_FLOORS = {"redis": "floor", "postgres": "pg-floor"}
LOCK_REFERENCES = {"redis": "distlocks", "postgres": "distlocks-pg"}
SAVE_FLOORS = {"postgres": "plain-save"}
SAVE_REFERENCES = {"postgres": "fenced-save"}
#: The workloads that run Celery tasks; a plain task is their floor.
CELERY_WORKLOADS = ("celery-run", "celery-enqueue", "celery-cycle", "celery-e2e")
CELERY_FLOORS = {"celery": "celery-plain"}
CELERY_REFERENCES = {"celery": "celery-single"}
#: The admin page of live locks: a raw client reading every lock once is its floor.
ADMIN_WORKLOADS = ("admin-list",)
ADMIN_FLOORS = {"redis": "admin-redis-raw", "postgres": "admin-pg-raw"}
ADMIN_REFERENCES = {"redis": "admin-redis-first", "postgres": "admin-pg-first"}
#: The same page with 100,000 live locks, Redis only, every view cold.
#: Two floors: every lock read once (SCAN + hashes), and the listing index read once.
ADMIN_100K_FLOORS = {"redis": "admin100k-redis-raw", "redis-index": "admin100k-index-raw"}
ADMIN_100K_REFERENCES = {"redis": "admin100k-cold", "redis-index": None}


#: The asyncio workloads: a raw redis.asyncio client is their floor, alock() their reference.
ASYNC_WORKLOADS = ("async-cycle", "async-tasks")
ASYNC_FLOORS = {"redis": "async-floor"}
ASYNC_REFERENCES = {"redis": "async-distlocks"}


#: The cycle on the fast PostgreSQL and on a durable one: each server has its own floor.
DURABLE_WORKLOADS = ("pg-cycle-durable",)
DURABLE_FLOORS = {"postgres": "pg-floor", "postgres-durable": "durable-pg-floor"}
DURABLE_REFERENCES = {"postgres": "distlocks-pg", "postgres-durable": "durable-distlocks-pg"}


#: Workloads of distlocks alone (no floor, no peer): what they report is in their params.
OWN_WORKLOADS = ("renewal",)
OWN_REFERENCES = {"redis": "distlocks", "postgres": "distlocks-pg"}


def _floors_and_references(workload: str) -> tuple[dict[str, Any], dict[str, str]]:
    if workload in OWN_WORKLOADS:
        return {"redis": None, "postgres": None}, OWN_REFERENCES
    if workload in ADMIN_WORKLOADS:
        return ADMIN_FLOORS, ADMIN_REFERENCES
    if workload == "admin-list-100k":
        return ADMIN_100K_FLOORS, ADMIN_100K_REFERENCES
    if workload in ASYNC_WORKLOADS:
        return ASYNC_FLOORS, ASYNC_REFERENCES
    if workload in DURABLE_WORKLOADS:
        return DURABLE_FLOORS, DURABLE_REFERENCES
    if workload in SAVE_WORKLOADS:
        return SAVE_FLOORS, SAVE_REFERENCES
    if workload in CELERY_WORKLOADS:
        return CELERY_FLOORS, CELERY_REFERENCES
    return LOCK_FLOORS, LOCK_REFERENCES


def _expected_rows() -> dict[str, list[str]]:
    return {
        name: [impl for impl, cls in IMPLEMENTATIONS.items() if wl.supports(cls)]
        for name, wl in WORKLOADS.items()
    }


def _table_sections(stdout: str) -> dict[str, list[str]]:
    """Workload name -> first cell of every row of its printed table."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in stdout.splitlines():
        heading = re.match(r"== .* \[(?P<name>[\w-]+)\]$", line)
        if heading:
            current = sections.setdefault(heading["name"], [])
        elif not line.strip():
            current = None
        elif current is not None and not line.startswith((" ", "-", "implementation")):
            current.append(line.split()[0])
    return sections


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("bench")
    # The servers of the test session are reused through the DISTLOCKS_TEST_* variables.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--output", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        # Generous: the machine runs other test suites beside this one.
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout, out


def test_table_has_a_row_for_every_implementation(smoke_run: tuple[str, Path]) -> None:
    stdout, _ = smoke_run
    assert _table_sections(stdout) == _expected_rows()
    assert "== Targets" in stdout


def test_json_has_the_expected_structure(smoke_run: tuple[str, Path]) -> None:
    _, out = smoke_run
    stamped = [p for p in out.glob("*.json") if p.name != "latest.json"]
    assert len(stamped) == 1
    assert re.fullmatch(r"\d{8}T\d{6}Z\.json", stamped[0].name)
    report: dict[str, Any] = json.loads((out / "latest.json").read_text())
    assert report == json.loads(stamped[0].read_text())

    assert report["schema"] == 1
    assert report["options"]["quick"] is True
    machine = report["machine"]
    assert machine["cpu_model"]
    assert machine["cores"] >= 1
    assert machine["python"].split()[-1].startswith("3.")
    assert re.fullmatch(r"\d+\.\d+\.\d+", machine["redis_server"])
    assert re.fullmatch(r"\d+\.\d+", machine["postgres_server"])
    assert set(report["implementations"]) == set(IMPLEMENTATIONS)

    assert list(report["workloads"]) == list(WORKLOADS)
    assert set(SAVE_WORKLOADS) | set(CELERY_WORKLOADS) <= set(WORKLOADS)
    for name, section in report["workloads"].items():
        assert section["metric"] in ("latency", "throughput")
        assert section["params"]["rounds"] >= 1
        # Every row is compared with the floor and the distlocks row of its own server;
        # in the save workloads, the floor is a plain save and distlocks' row a fenced one,
        # in the Celery workloads a plain task and a single_execution one.
        floors, references = _floors_and_references(name)
        assert section["floor"] == floors
        assert section["reference"] == references
        assert list(section["results"]) == _expected_rows()[name]
        # The floor of a family without a distlocks row is compared with nothing.
        alone = {f for family, f in floors.items() if f and references.get(family, "") is None}
        for impl, row in section["results"].items():
            assert row["n"] > 0, (name, impl)
            keys = ["median_us", "p99_us", "ops_per_s"]
            if impl in alone:
                assert row["distlocks_over_it"] is None, (name, impl)
            else:
                keys.append("distlocks_over_it")
            keys += [] if name in OWN_WORKLOADS else ["x_floor"]
            for key in keys:
                assert isinstance(row[key], float) and row[key] > 0, (name, impl, key)
        if name in OWN_WORKLOADS:
            continue
        for family, floor in section["floor"].items():
            assert section["results"][floor]["x_floor"] == 1.0
            reference = section["reference"][family]
            if reference is not None:  # a floor of its own, with no distlocks row beside it
                assert section["results"][reference]["distlocks_over_it"] == 1.0

    targets = {target["id"]: target for target in report["targets"]}
    assert {
        "redis-cycle-vs-floor",
        "redis-cycle-vs-peers",
        "redis-handoff-p50",
        "pg-cycle-vs-floor",
        "pg-handoff-p50",
        "fenced-save-vs-plain",
        "fenced-save-fields-vs-plain",
        "redis-renewal",
        "pg-renewal",
    } <= set(targets)
    # The renewal rows account for every lease they took (whether one was lost on a
    # loaded machine is the benchmark's finding, not this test's).
    for impl in ("distlocks", "distlocks-pg"):
        details = report["workloads"]["renewal"]["params"][impl]
        assert details["leases"] >= 10 and 0 <= details["lost"] <= details["leases"], details
        held = report["workloads"]["renewal"]["results"][impl]["ops"]
        assert held == details["leases"] - details["lost"]
    assert all(isinstance(target["met"], bool) for target in targets.values())
    assert {
        "pg-durable-cycle-vs-floor",
        "pg-cycle-vs-peers",
        "pg-durable-cycle-vs-peers",
        "admin-100k-cold",
    } <= set(targets)
    # The second server really ran with production settings, and distlocks ran on it
    # both with its default synchronous_commit=off and with "on".
    durable = report["workloads"]["pg-cycle-durable"]
    assert durable["params"]["durable_server"]["fsync"] == "on"
    assert durable["params"]["durable_server"]["synchronous_commit"] == "on"
    assert durable["params"]["durable_server"]["full_page_writes"] == "on"
    assert {"durable-distlocks-pg", "durable-distlocks-pg-sync"} <= set(durable["results"])
    # The 100,000-lock admin rows report the memory of one view.
    scale = report["workloads"]["admin-list-100k"]["params"]
    for impl in ("admin100k-cold", "admin100k-cold-search", "admin100k-cold-status"):
        assert scale[impl]["tracemalloc_peak_mib"] > 0, impl
    # A Redis target never weighs a PostgreSQL peer, and the reverse.
    for target, workload in (
        ("redis-cycle-vs-peers", "cycle"),
        ("redis-async-cycle-vs-peers", "async-cycle"),
        ("redis-async-tasks-vs-peers", "async-tasks"),
    ):
        assert set(targets[target]["value"]) == {
            name
            for name, cls in IMPLEMENTATIONS.items()
            if cls.role == "peer" and cls.family == "redis" and WORKLOADS[workload].supports(cls)
        }, target
    assert targets["redis-async-cycle-vs-peers"]["value"].keys() == {"async-redis-py"}


def test_postgres_runs_in_its_own_migrated_database(smoke_run: tuple[str, Path]) -> None:
    import psycopg
    from psycopg.conninfo import make_conninfo

    from bench.postgres import NAME_PATTERN
    from bench.settings import BENCH_DATABASE
    from distlocks.backends.postgres import TABLE
    from distlocks.testing.servers import DATABASE_URL_ENV

    url = make_conninfo(os.environ[DATABASE_URL_ENV], dbname=BENCH_DATABASE)
    with psycopg.connect(url, autocommit=True) as conn:
        # The registry table exists: the migrations ran into the benchmark's database...
        rows = conn.execute(f"SELECT count(*) FROM {TABLE} WHERE name LIKE %s", (NAME_PATTERN,))
        # ...and the run dropped the rows of its lock names afterwards.
        assert rows.fetchone() == (0,)


def test_fenced_save_workloads_save_rows(smoke_run: tuple[str, Path]) -> None:
    stdout, out = smoke_run
    report: dict[str, Any] = json.loads((out / "latest.json").read_text())
    rows = {"plain-save", "fenced-save", "fenced-table-django-save"}
    for name in SAVE_WORKLOADS:
        section = report["workloads"][name]
        # Only the save implementations take part in them, and they in no lock workload.
        assert set(section["results"]) == rows
    assert report["workloads"]["fenced-save"]["params"]["update_fields"] is None
    assert report["workloads"]["fenced-save-fields"]["params"]["update_fields"] == [
        "number",
        "label",
    ]
    for name in set(WORKLOADS) - set(SAVE_WORKLOADS):
        assert not rows & set(report["workloads"][name]["results"]), name
    assert "Fenced save median <= 1.1x a plain save() of the same row" in stdout


def test_bench_tables_are_migrated_fenced_and_left_empty(smoke_run: tuple[str, Path]) -> None:
    import psycopg
    from psycopg.conninfo import make_conninfo

    from bench.settings import BENCH_DATABASE
    from distlocks.fencing import TRIGGER_NAME
    from distlocks.testing.servers import DATABASE_URL_ENV

    url = make_conninfo(os.environ[DATABASE_URL_ENV], dbname=BENCH_DATABASE)
    with psycopg.connect(url, autocommit=True) as conn:
        for table in ("benchapp_plainrow", "benchapp_fencedrow"):
            # Migrated, and the workloads deleted the rows they saved.
            assert conn.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)
        triggers = conn.execute(
            "SELECT tgrelid::regclass::text FROM pg_trigger WHERE tgname = %s", (TRIGGER_NAME,)
        ).fetchall()
        # migrate installed the fencing trigger on the fenced table only.
        assert triggers == [("benchapp_fencedrow",)]


def _celery_workers_of(redis_url: str) -> list[int]:
    """Pids of benchmark Celery workers whose broker is the server at ``redis_url``."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if b"bench.celery_app" in cmdline and f"={redis_url}\0".encode() in environ:
            pids.append(int(proc.name))
    return pids


def test_celery_workloads_run_every_task_and_leave_nothing(smoke_run: tuple[str, Path]) -> None:
    import redis

    from distlocks.testing.servers import REDIS_URL_ENV

    _, out = smoke_run
    report: dict[str, Any] = json.loads((out / "latest.json").read_text())
    sections = report["workloads"]
    assert set(sections["celery-run"]["results"]) == {
        "celery-plain", "celery-single", "celery-single-unique", "celery-once", "celery-singleton",
    }  # fmt: skip
    assert set(sections["celery-enqueue"]["results"]) == {
        *sections["celery-run"]["results"], "celery-single-queued",
    }  # fmt: skip
    # Enqueue and run of one task, every row (the peers' and a "queued" marker's too).
    assert set(sections["celery-cycle"]["results"]) == set(sections["celery-enqueue"]["results"])
    # Issue 29's Celery targets are evaluated on the run, each on its own row.
    targets = {target["id"]: target for target in report["targets"]}
    overhead = targets["celery-run-overhead"]
    run = sections["celery-run"]["results"]
    assert overhead["value"] == pytest.approx(
        run["celery-single"]["median_us"] - run["celery-plain"]["median_us"]
    )
    assert overhead["met"] == (overhead["value"] <= 450.0)
    cycle = targets["celery-queued-cycle-vs-peers"]
    rows = sections["celery-cycle"]["results"]
    for peer in ("celery-once", "celery-singleton"):
        expected = rows["celery-single-queued"]["median_us"] / rows[peer]["median_us"]
        assert cycle["value"][peer] == pytest.approx(expected)
    assert cycle["met"] == all(v <= 1.0 for v in cycle["value"].values())
    e2e = sections["celery-e2e"]
    assert set(e2e["results"]) == {"celery-plain", "celery-single"}
    assert (e2e["params"]["pool"], e2e["params"]["concurrency"]) == ("prefork", 2)
    # The worker ran every task published, and each reported its finish.
    assert all(row["n"] == e2e["params"]["tasks"] for row in e2e["results"].values())
    celery_rows = set().union(*(sections[name]["results"] for name in CELERY_WORKLOADS))
    for name in set(WORKLOADS) - set(CELERY_WORKLOADS):
        assert not celery_rows & set(sections[name]["results"]), name

    url = os.environ[REDIS_URL_ENV]
    # The worker was shut down with the run...
    if sys.platform.startswith("linux"):
        assert _celery_workers_of(url) == []
    # ...and the queue, the markers, the run locks and the peers' keys were removed.
    client = redis.Redis.from_url(url)
    try:
        for pattern in (
            "distlocks-bench-celery:*",
            "distlocks-bench:*",
            "qo_bench.celery.*",
            "bench:celery-*",
        ):
            assert list(client.scan_iter(match=pattern, count=1000)) == [], pattern
    finally:
        client.close()


def test_markdown_and_chart_are_written(smoke_run: tuple[str, Path]) -> None:
    _, out = smoke_run
    markdown = (out / "latest.md").read_text()
    for name in WORKLOADS:
        assert f"(`{name}`)" in markdown
    # One chart per workload, each narrow enough to be read at the width of a docs page.
    for name in WORKLOADS:
        chart = out / f"latest-{name}.png"
        head = chart.read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n", name
        width = int.from_bytes(head[16:20], "big")
        assert 600 <= width <= 800, (name, width)
    assert not (out / "latest.png").exists()


def test_percentile_interpolates() -> None:
    assert percentile([10, 20, 30, 40], 50) == 25
    assert percentile([10, 20, 30, 40], 100) == 40
    assert percentile([7], 99) == 7
    assert math.isnan(percentile([], 50))


def test_summary_reports_microseconds_and_rate() -> None:
    samples = Samples(latencies_ns=[1000, 2000, 3000], ops=3, seconds=0.5)
    summary = summarize(samples)
    assert summary["median_us"] == 2.0
    assert summary["ops_per_s"] == 6.0


def test_compare_marks_a_row_slower_only_beyond_its_rounds_spread() -> None:
    from bench.compare import compare

    def report(ratio: float, rounds: list[float]) -> dict[str, Any]:
        row = {"role": "distlocks", "x_floor": ratio, "x_floor_by_round": rounds}
        floor = {"role": "floor", "x_floor": 1.0, "x_floor_by_round": [1.0] * 4}
        return {"workloads": {"cycle": {"results": {"floor": floor, "distlocks": row}}}}

    steady = [1.0, 1.0, 1.0, 1.0]
    assert compare(report(1.0, steady), report(1.3, steady))[0][-1] == "slower"
    assert compare(report(1.3, steady), report(1.0, steady))[0][-1] == "faster"
    noisy = [0.6, 0.8, 1.2, 1.4]
    assert compare(report(1.0, noisy), report(1.3, noisy))[0][-1] == "same"
    # The floor is never compared with itself.
    assert [line[1] for line in compare(report(1.0, steady), report(1.0, steady))] == [
        "distlocks"
    ]
