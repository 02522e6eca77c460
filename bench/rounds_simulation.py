"""How many rounds the one-thread cycle workloads need: ``python -m bench.rounds_simulation``.

A model of the benchmark machine, which runs in one of two speeds and switches between
them every second or few (see the caveats in docs/benchmarks.md: client and server on
one vCPU or on two). Ten rows take turns round by round, as :meth:`bench.base.Workload.run`
runs them; one of them costs 1.03x the floor. For each interleaving it prints what the
table would show for that row over 40 simulated runs: its pooled median over the
floor's (the ``x floor`` column), and the median of its per-round ratios. Nothing is
measured; it shows how much of a row's ratio the interleaving alone can move.
"""

from __future__ import annotations

import math
import random
import statistics

FAST_US, SLOW_US = 220.0, 300.0  # the floor's round medians in the 2026-11-27 run
TRUE_RATIO = 1.03
ROWS = 10
RUNS = 40


def _run(
    rng: random.Random, rounds: int, per_round: int, mean_mode_s: float
) -> tuple[float, float]:
    """One simulated run: (pooled ratio, median of per-round ratios) of the 1.03x row."""
    costs = [1.0, TRUE_RATIO] + [
        rng.choice([1.05, 1.1, 1.2, 1.3, 1.4, 3.6]) for _ in range(ROWS - 2)
    ]
    now, slow = 0.0, rng.random() < 0.5
    switch_at = rng.expovariate(1 / mean_mode_s)
    samples: list[list[float]] = [[] for _ in range(ROWS)]
    medians: list[list[float]] = [[] for _ in range(ROWS)]
    for round_no in range(rounds):
        shift = round_no % ROWS
        for row in [*range(shift, ROWS), *range(shift)]:
            block = []
            for _ in range(per_round):
                while now >= switch_at:
                    slow = not slow
                    switch_at += rng.expovariate(1 / mean_mode_s)
                base = (SLOW_US if slow else FAST_US) * 1e-6
                value = base * costs[row] * math.exp(rng.gauss(0, 0.12))
                now += value
                block.append(value)
            samples[row] += block
            medians[row].append(statistics.median(block))
    pooled = statistics.median(samples[1]) / statistics.median(samples[0])
    paired = statistics.median(a / b for a, b in zip(medians[1], medians[0], strict=True))
    return pooled, paired


def main() -> None:
    rng = random.Random(1)
    print(f"a row {TRUE_RATIO}x the floor, {ROWS} rows, {RUNS} runs each:")
    for rounds, per_round in ((10, 500), (25, 200), (50, 100)):
        for mean_mode_s in (1.0, 3.0):
            runs = [_run(rng, rounds, per_round, mean_mode_s) for _ in range(RUNS)]
            pooled = [p for p, _ in runs]
            paired = [q for _, q in runs]
            spread = statistics.pstdev(pooled)
            print(
                f"  {rounds:2d} rounds of {per_round:3d}, modes of {mean_mode_s:.0f} s: "
                f"x floor {min(pooled):.2f}-{max(pooled):.2f} (sd {spread:.3f}), "
                f"per-round median {min(paired):.2f}-{max(paired):.2f}"
            )


if __name__ == "__main__":
    main()
