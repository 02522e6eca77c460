"""Turning samples into the report: ratios, targets, the table, JSON, Markdown and a chart.

Ratios are always "time per operation" ratios, so that one reading fits every
workload: ``x floor`` > 1 means slower than the raw floor, and ``distlocks / it``
< 1 means distlocks is faster than that implementation. For throughput
workloads, time per operation is the inverse of operations per second.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.base import IMPLEMENTATIONS, Samples, Workload, floor_of, reference_of
from bench.stats import ratio, summarize

SCHEMA_VERSION = 1

#: How the families (the server an implementation runs on) are shown.
FAMILY_NAMES = {
    "redis": "Redis",
    "postgres": "PostgreSQL",
    "postgres-durable": "PostgreSQL, durable",
    "celery": "Redis",
    "zookeeper": "ZooKeeper",
    "etcd": "etcd",
}


def _time_per_op(row: dict[str, Any], metric: str) -> float:
    """The figure ratios are taken of: median latency, or 1 / throughput."""
    if metric == "throughput":
        rate = row["ops_per_s"]
        return 1e6 / rate if rate and not math.isnan(rate) else math.nan
    return float(row["median_us"])


def _round_costs(collected: Samples, metric: str) -> list[float]:
    """Per-round time per operation, aligned by round (every round measures everyone)."""
    if metric == "throughput":
        return [1e6 / rate if rate else math.nan for rate in collected.round_rates]
    return [value / 1000 for value in collected.round_medians_ns]


def workload_result(wl: Workload, samples: dict[str, Samples]) -> dict[str, Any]:
    """The JSON section of one workload, with ratios to the floor and to distlocks."""
    rows: dict[str, dict[str, Any]] = {}
    for name, collected in samples.items():
        cls = IMPLEMENTATIONS[name]
        rows[name] = {
            "name": name,
            "label": cls.label,
            "role": cls.role,
            "family": cls.family,
            **summarize(collected),
        }
    floors: dict[str, str | None] = {}
    references: dict[str, str | None] = {}
    for row in rows.values():
        family = row["family"]
        if family not in floors:
            floors[family] = floor_of(family, rows)
            references[family] = reference_of(family, rows)
        floor, reference = floors[family], references[family]
        cost = _time_per_op(row, wl.metric)
        row["x_floor"] = ratio(cost, _time_per_op(rows[floor], wl.metric)) if floor else math.nan
        row["x_floor_p99"] = ratio(row["p99_us"], rows[floor]["p99_us"]) if floor else math.nan
        # Paired by round, the spread of the ratio shows how far the machine's noise moves it.
        row["x_floor_by_round"] = (
            [
                ratio(mine, theirs)
                for mine, theirs in zip(
                    _round_costs(samples[row["name"]], wl.metric),
                    _round_costs(samples[floor], wl.metric),
                    strict=False,
                )
            ]
            if floor
            else []
        )
        row["distlocks_over_it"] = (
            ratio(_time_per_op(rows[reference], wl.metric), cost) if reference else math.nan
        )
    return {
        "title": wl.title,
        "description": wl.description,
        "metric": wl.metric,
        "unit": wl.unit,
        "params": wl.params(),
        "floor": floors,
        "reference": references,
        "results": rows,
    }


@dataclass(frozen=True)
class Target:
    """One goal from the benchmark issue, evaluated on every run (never asserted in tests)."""

    id: str
    workload: str
    kind: str  # "floor_ratio" | "beats_peers" | "median_at_most_us"
    limit: float
    text: str
    family: str = "redis"
    #: What ``floor_ratio`` compares with, in the target's detail.
    versus: str = "the floor"
    #: ``beats_peers``: met at ``limit`` too ("no slower than"), not only below it.
    at_most: bool = False
    #: The implementation the target is about, when not the family's reference row.
    row: str | None = None


TARGETS = [
    Target("redis-cycle-vs-floor", "cycle", "floor_ratio", 1.1,
           "Redis cycle median <= 1.10x the raw floor"),
    Target("redis-cycle-vs-peers", "cycle", "beats_peers", 1.0,
           "Redis cycle faster than every peer (redis-py's Lock included)"),
    Target("redis-threads-vs-peers", "throughput-threads", "beats_peers", 1.0,
           "Redis throughput (threads) higher than every peer"),
    Target("redis-processes-vs-peers", "throughput-processes", "beats_peers", 1.0,
           "Redis throughput (processes) higher than every peer"),
    Target("redis-handoff-vs-floor", "handoff", "floor_ratio", 1.15,
           "Redis contended hand-off median <= 1.15x the raw floor"),
    Target("redis-handoff-vs-peers", "handoff", "beats_peers", 1.0,
           "Redis contended hand-off faster than every peer"),
    Target("redis-handoff-p50", "handoff", "median_at_most_us", 1000.0,
           "Redis hand-off p50 <= 1 ms"),
    Target("redis-async-cycle-vs-floor", "async-cycle", "floor_ratio", 1.1,
           "asyncio cycle (alock) median <= 1.10x the raw redis.asyncio floor"),
    Target("redis-async-cycle-vs-peers", "async-cycle", "beats_peers", 1.0,
           "asyncio cycle (alock) faster than redis.asyncio's Lock"),
    Target("redis-async-tasks-vs-peers", "async-tasks", "beats_peers", 1.0,
           "asyncio, 1,000 concurrent tasks on distinct names: alock's throughput above "
           "redis.asyncio's Lock"),
    Target("redis-contended-threads-vs-peers", "contended-threads", "beats_peers", 1.0,
           "Redis contended throughput (8 threads, one lock, 1 ms hold) above every peer"),
    Target("redis-contended-threads-fair", "contended-threads", "fair_at_least", 0.5,
           "... with the slowest thread getting at least half the fastest one's acquisitions"),
    Target("redis-contended-processes-vs-peers", "contended-processes", "beats_peers", 1.0,
           "Redis contended throughput (4 processes, one lock, 1 ms hold) above every peer"),
    Target("redis-contended-processes-fair", "contended-processes", "fair_at_least", 0.5,
           "... with the slowest process getting at least half the fastest one's acquisitions"),
    Target("redis-renewal", "renewal", "none_lost", 0.01,
           "Redis: 10,000 leases (ttl=2 s) held 30 s, none lost, renewals batched "
           "(<= 0.01 server calls per lease renewal)"),
    Target("pg-renewal", "renewal", "none_lost", 1.0,
           "PostgreSQL: 250 leases (ttl=2 s, one pooled connection each) held 30 s, none lost",
           family="postgres"),
    Target("pg-cycle-vs-floor", "cycle", "floor_ratio", 1.15,
           "PostgreSQL lock() cycle median <= 1.15x the raw floor (registry and fencing "
           "included)", family="postgres"),
    Target("pg-cycle-vs-peers", "cycle", "beats_peers", 1.0,
           "PostgreSQL lock() cycle faster than django-pglock", family="postgres"),
    Target("pg-durable-cycle-vs-floor", "pg-cycle-durable", "floor_ratio", 1.2,
           "PostgreSQL lock() cycle on a durable server (fsync=on) <= 1.2x its raw floor",
           family="postgres-durable"),
    Target("pg-durable-cycle-vs-peers", "pg-cycle-durable", "beats_peers", 1.0,
           "PostgreSQL lock() cycle on a durable server faster than django-pglock",
           family="postgres-durable"),
    Target("pg-handoff-p50", "handoff", "median_at_most_us", 1000.0,
           "PostgreSQL hand-off p50 <= 1 ms", family="postgres"),
    Target("admin-100k-cold", "admin-list-100k", "median_at_most_us", 1_000_000.0,
           "Admin page with 100,000 live locks (Redis): cold first page < 1 s"),
    Target("zk-cycle-vs-peers", "zk-cycle", "beats_peers", 1.0,
           "ZooKeeper try-once cycle faster than kazoo's Lock", family="zookeeper"),
    # "No slower than": at or below kazoo's time.
    Target("zk-handoff-vs-peers", "zk-handoff", "beats_peers", 1.0,
           "ZooKeeper waiting hand-off no slower than kazoo's Lock", family="zookeeper",
           at_most=True),
    # Issue 29: the run lock's overhead over a plain task halved (it was about 900 us).
    Target("celery-run-overhead", "celery-run", "overhead_at_most_us", 450.0,
           "Celery: single_execution's run lock adds at most 450 us to a plain task's run "
           "(half of the 900 us measured before issue 29)", family="celery"),
    Target("celery-queued-cycle-vs-peers", "celery-cycle", "beats_peers", 1.0,
           "Celery: enqueue plus run with unique_while=\"queued\" no slower than "
           "celery-once's and celery-singleton's", family="celery", at_most=True,
           row="celery-single-queued"),
    Target("fenced-save-vs-plain", "fenced-save", "floor_ratio", 1.1,
           "Fenced save median <= 1.1x a plain save() of the same row",
           family="postgres", versus="the plain save"),
    Target("fenced-save-fields-vs-plain", "fenced-save-fields", "floor_ratio", 1.1,
           "Fenced save(update_fields=...) median <= 1.1x the plain one",
           family="postgres", versus="the plain save"),
]  # fmt: skip

#: Latency workloads whose chart panels show their floor-ratio budget as a line.
_BUDGET_LINES = frozenset(
    {"cycle", "async-cycle", "pg-cycle-durable", "fenced-save", "fenced-save-fields"}
)


def _missing(value: float | None) -> bool:
    """No figure: NaN in a fresh report, null in one read back from JSON."""
    return value is None or math.isnan(value)


def _fmt_ratio(value: float | None) -> str:
    return "n/a" if _missing(value) else f"{value:.2f}x"


def evaluate_target(target: Target, section: dict[str, Any]) -> dict[str, Any] | None:
    reference = target.row or section["reference"].get(target.family)
    rows = section["results"]
    if reference is None or reference not in rows:
        return None
    ref = rows[reference]
    out: dict[str, Any] = {"id": target.id, "workload": target.workload, "target": target.text}
    if target.kind == "floor_ratio":
        value = ref["x_floor"]
        met = value <= target.limit
        out.update(value=value, limit=target.limit, met=met)
        over = (value / target.limit - 1) * 100
        out["detail"] = f"{_fmt_ratio(value)} {target.versus}" + (
            "" if met else f", {over:.0f}% over the {target.limit}x budget"
        )
    elif target.kind == "beats_peers":
        mine = _time_per_op(ref, section["metric"])
        peers = {
            n: (
                ratio(mine, _time_per_op(r, section["metric"]))
                if target.row
                else r["distlocks_over_it"]
            )
            for n, r in rows.items()
            if r["role"] == "peer" and r["family"] == target.family
        }
        slower = {
            n: v
            for n, v in peers.items()
            if not (v <= target.limit if target.at_most else v < target.limit)
        }
        out.update(value=peers, limit=target.limit, met=not slower and bool(peers))
        parts = [f"{n} {_fmt_ratio(v)}" for n, v in peers.items()]
        out["detail"] = "distlocks time / peer time: " + ", ".join(parts)
        if slower:
            out["detail"] += "; slower than " + ", ".join(sorted(slower))
    elif target.kind == "median_at_most_us":
        value = ref["median_us"]
        met = value <= target.limit
        out.update(value=value, limit=target.limit, met=met)
        out["detail"] = f"p50 {value:,.0f} us" + (
            "" if met else f", {value / target.limit:.1f}x the {target.limit:,.0f} us target"
        )
    elif target.kind == "overhead_at_most_us":
        floor = section["floor"].get(target.family)
        value = ref["median_us"] - rows[floor]["median_us"] if floor else math.nan
        met = not _missing(value) and value <= target.limit
        out.update(value=value, limit=target.limit, met=met)
        out["detail"] = f"{_num(value, 0)} us over {floor}" + (
            "" if met else f", {value / target.limit:.1f}x the {target.limit:,.0f} us budget"
        )
    elif target.kind == "fair_at_least":
        fairness = section["params"].get(reference, {}).get("fairness_by_round", [])
        value = min(fairness) if fairness else math.nan
        met = bool(fairness) and value >= target.limit
        out.update(value=value, limit=target.limit, met=met)
        out["detail"] = f"slowest worker / fastest, worst round: {value:.2f}"
    elif target.kind == "none_lost":
        details = section["params"].get(reference, {})
        lost, leases = details.get("lost"), details.get("leases")
        per_lease = details.get("server_calls_per_lease_renewal")
        met = lost == 0 and (per_lease is None or per_lease <= target.limit)
        out.update(value=lost, limit=target.limit, met=met)
        out["detail"] = f"{lost} of {leases:,} leases lost" + (
            "" if per_lease is None else f", {per_lease:.4f} server calls per lease renewal"
        )
    else:
        raise ValueError(f"unknown target kind {target.kind!r}")
    return out


def evaluate_targets(workloads: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for target in TARGETS:
        section = workloads.get(target.workload)
        if section is not None:
            evaluated = evaluate_target(target, section)
            if evaluated is not None:
                results.append(evaluated)
    return results


# -- text -----------------------------------------------------------------------


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if _missing(value) else f"{value:,.{digits}f}"


def _table_rows(section: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    throughput = section["metric"] == "throughput"
    header = ["implementation", "server", "n", "median us", "p99 us"]
    if throughput:
        header.append("ops/s")
    header += ["x floor", "rounds' range", "distlocks / it"]
    body = []
    for name, row in section["results"].items():
        cells = [
            name,
            FAMILY_NAMES.get(row["family"], row["family"]),
            f"{row['n']:,}",
            _num(row["median_us"]),
            _num(row["p99_us"]),
        ]
        if throughput:
            cells.append(_num(row["ops_per_s"], 0))
        by_round = [v for v in row["x_floor_by_round"] if not _missing(v)]
        spread = f"{min(by_round):.2f}-{max(by_round):.2f}" if len(by_round) > 1 else "-"
        cells += [_fmt_ratio(row["x_floor"]), spread, _fmt_ratio(row["distlocks_over_it"])]
        body.append(cells)
    return header, body


def _params_line(section: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value}" for key, value in section["params"].items())


def format_text(report: dict[str, Any]) -> str:
    lines = []
    for name, section in report["workloads"].items():
        header, body = _table_rows(section)
        widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

        def line(cells: list[str], widths: list[int] = widths) -> str:
            first = cells[0].ljust(widths[0])
            rest = [cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True)]
            return "  ".join([first, *rest])

        lines += [f"== {section['title']} [{name}]", f"   {_params_line(section)}"]
        lines += [line(header), line(["-" * w for w in widths])]
        lines += [line(cells) for cells in body]
        lines.append("")
    for name, why in report.get("skipped", {}).items():
        lines += [f"== {name}: skipped, {why}", ""]
    if report["targets"]:
        lines.append("== Targets")
        for target in report["targets"]:
            mark = "MET   " if target["met"] else "MISSED"
            lines.append(f"{mark} {target['target']}: {target['detail']}")
        lines.append("")
    lines.append(
        "x floor: time per operation / the raw floor's of the same server (>1 = slower; in "
        "the fenced-save workloads the floor is plain-save);\nrounds' range: the same ratio "
        "round by round. distlocks / it: distlocks time on that server / this row's time "
        "(<1 = distlocks faster)."
    )
    return "\n".join(lines)


def _servers(machine: dict[str, Any]) -> str:
    """The versions of the servers the run used, for a header line."""
    servers = [
        ("redis-server", machine.get("redis_server")),
        ("PostgreSQL", machine.get("postgres_server")),
        ("ZooKeeper", machine.get("zookeeper_server")),
        ("etcd", machine.get("etcd_server")),
    ]
    return ", ".join(f"{label} {found}" for label, found in servers if found) or "no server"


def format_markdown(report: dict[str, Any]) -> str:
    machine = report["machine"]
    lines = [
        f"Run {report['started_at']} (`{report['command']}`), "
        f"{machine['cpu_model']}, {machine['cores']} cores, {machine['python']}, "
        f"{_servers(machine)}.",
        "",
    ]
    lines += ["| implementation | what is measured | version |", "|---|---|---|"]
    for name, impl in report["implementations"].items():
        lines.append(f"| `{name}` | {impl['label']} | {impl['version']} |")
    lines.append("")
    for name, section in report["workloads"].items():
        header, body = _table_rows(section)
        lines += [f"### {section['title']} (`{name}`)", "", _params_line(section), ""]
        lines.append("| " + " | ".join(header) + " |")
        # Names and servers left-aligned, figures right-aligned.
        lines.append("|" + "|".join(["---", "---"] + ["---:"] * (len(header) - 2)) + "|")
        for cells in body:
            lines.append("| " + " | ".join([f"`{cells[0]}`", *cells[1:]]) + " |")
        lines.append("")
    for name, why in report.get("skipped", {}).items():
        lines += [f"### `{name}`: skipped", "", why, ""]
    if report["targets"]:
        lines += ["### Targets", "", "| target | met | measured |", "|---|---|---|"]
        for target in report["targets"]:
            met = "yes" if target["met"] else "**no**"
            lines.append(f"| {target['target']} | {met} | {target['detail']} |")
        lines.append("")
    return "\n".join(lines)


# -- files ----------------------------------------------------------------------


def _json_safe(value: Any) -> Any:
    """NaN is not JSON: write null instead."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(item) for item in value]
    return value


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(_json_safe(report), indent=2, allow_nan=False) + "\n")


_COLORS = {"floor": "#8c8c8c", "distlocks": "#1f77b4", "peer": "#ff7f0e"}


def _reference_lines(name: str, family: str, section: dict[str, Any]) -> list[tuple[float, str]]:
    """The targets of one panel as vertical lines: ``(microseconds, label)``."""
    lines = []
    for target in TARGETS:
        if target.workload != name or target.family != family:
            continue
        if target.kind == "median_at_most_us":
            lines.append((target.limit, f"{target.limit / 1000:g} ms target"))
        elif target.kind == "floor_ratio" and name in _BUDGET_LINES:
            floor = section["floor"].get(family)
            if floor:
                budget = section["results"][floor]["median_us"] * target.limit
                lines.append((budget, f"{target.limit:g}x {floor}"))
    return lines


def chart_paths(report: dict[str, Any], path: Path) -> dict[str, Path]:
    """Workload name -> the file of its chart: ``<stem>-<workload>.png`` beside ``path``."""
    return {name: path.with_name(f"{path.stem}-{name}.png") for name in report["workloads"]}


def draw_chart(report: dict[str, Any], path: Path) -> list[Path]:
    """One chart per workload (``<stem>-<workload>.png`` beside ``path``), one panel per
    server in it: median (bar) and p99 (tick) per implementation. Each is drawn at the
    width of a documentation page (about 700 px), so its text stays readable there.
    Returns the files written; ``path`` itself (the combined chart of earlier versions,
    unreadable at page width) is removed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.unlink(missing_ok=True)
    quick = bool(report.get("options", {}).get("quick"))
    machine = report["machine"]
    caption = (
        f"{report['started_at'][:19]}Z, {machine['cpu_model']} x{machine['cores']}, "
        f"{machine['python']}"
    )
    written = []
    for name, out in chart_paths(report, path).items():
        section = report["workloads"][name]
        families = dict.fromkeys(row["family"] for row in section["results"].values())
        panels = [
            (family, [(n, r) for n, r in section["results"].items() if r["family"] == family])
            for family in families
        ]
        if not panels:
            continue
        heights = [1.1 + 0.32 * len(rows) for _, rows in panels]
        fig, axes = plt.subplots(
            len(panels),
            1,
            figsize=(7, sum(heights) + 0.4),
            squeeze=False,
            gridspec_kw={"height_ratios": heights},
        )
        for ax, (family, rows) in zip(axes.flat, panels, strict=True):
            _draw_panel(ax, name, family, section, rows)
        fig.text(0.99, 0.005, caption, ha="right", va="bottom", fontsize=7, color="#555555")
        # The layout pass draws the whole figure once more (a third of a chart's cost);
        # a --quick run's charts only show that drawing works, at the same width.
        if not quick:
            fig.tight_layout(rect=(0, 0.03, 1, 1))
        fig.savefig(out, dpi=100)
        plt.close(fig)
        written.append(out)
    return written


def _draw_panel(
    ax: Any, name: str, family: str, section: dict[str, Any], rows: list[tuple[str, Any]]
) -> None:
    from matplotlib.ticker import FuncFormatter, NullFormatter

    labels = [impl for impl, _ in rows]
    colors = [_COLORS.get(row["role"], "#999999") for _, row in rows]
    positions = list(range(len(rows)))
    if section["metric"] == "throughput":
        values = [row["ops_per_s"] or 0 for _, row in rows]
        ax.barh(positions, values, color=colors)
        unit = section.get("unit", "acquire+release")
        ax.set_xlabel(f"{unit} per second (higher is better)", fontsize=9)
        for pos, value in zip(positions, values, strict=True):
            ax.text(value, pos, f" {value:,.0f}", va="center", fontsize=9)
        ax.set_xlim(0, max(values) * 1.3 if any(values) else 1)
    else:
        medians = [row["median_us"] or 0 for _, row in rows]
        p99s = [row["p99_us"] or 0 for _, row in rows]
        ax.barh(positions, medians, color=colors)
        ax.scatter(p99s, positions, marker="|", s=200, color="black", label="p99", zorder=3)
        ax.set_xlabel("microseconds (lower is better; bar = median, | = p99)", fontsize=9)
        positive = [v for v in medians if v > 0]
        if positive and min(positive) * 20 < max(p99s):
            ax.set_xscale("log")
            # Plain microseconds on the decades only: minor labels would overlap.
            ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
        for pos, value in zip(positions, medians, strict=True):
            ax.text(value, pos, f" {value:,.0f}", va="bottom", fontsize=9)
        for value, label in _reference_lines(name, family, section):
            ax.axvline(value, color="red", linestyle="--", linewidth=1, label=label)
        ax.legend(loc="lower right", fontsize=8)
    ax.set_yticks(positions, labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_title(f"{FAMILY_NAMES.get(family, family)}: {section['title']}", fontsize=10, wrap=True)
    ax.grid(axis="x", alpha=0.3)
