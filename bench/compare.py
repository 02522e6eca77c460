"""Compare two saved runs row by row: each row's ratio to its own run's floor.

    python -m bench.compare OLD.json NEW.json

Absolute times move between runs with the machine's load; a row's ratio to the floor
measured in the same run moves much less, so that is what is compared. A row whose
ratio grew by more than the spread of its own rounds in both runs is marked "slower";
the rest is noise on this machine. Prints a Markdown table."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any


def _spread(row: dict[str, Any]) -> float:
    """Half the interquartile range of the row's per-round ratios (0 with few rounds)."""
    rounds = [r for r in row.get("x_floor_by_round") or [] if r and not math.isnan(r)]
    if len(rounds) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(rounds, n=4)
    return (q3 - q1) / 2


def compare(old: dict[str, Any], new: dict[str, Any]) -> list[list[str]]:
    lines = []
    for name, section in new["workloads"].items():
        before = old["workloads"].get(name)
        if before is None:
            continue
        for impl, row in section["results"].items():
            was = before["results"].get(impl)
            if was is None or row["role"] == "floor":
                continue
            a, b = was.get("x_floor"), row.get("x_floor")
            if a is None or b is None or math.isnan(a) or math.isnan(b):
                continue
            noise = _spread(was) + _spread(row)
            verdict = "slower" if b - a > noise else ("faster" if a - b > noise else "same")
            lines.append([name, impl, f"{a:.2f}x", f"{b:.2f}x", f"±{noise:.2f}", verdict])
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    args = parser.parse_args(argv)
    old, new = (json.loads(p.read_text()) for p in (args.old, args.new))
    print(f"Old: {old.get('started_at')}; new: {new.get('started_at')}.\n")
    print("| workload | implementation | x floor, old | x floor, new | noise | verdict |")
    print("|---|---|---:|---:|---:|---|")
    for line in compare(old, new):
        print("| " + " | ".join(f"`{c}`" if i < 2 else c for i, c in enumerate(line)) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
