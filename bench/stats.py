"""Summary statistics: percentiles and the per-implementation summary row."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # Only a type here: bench.base imports this module for its percentiles.
    from bench.base import Samples


def percentile(sorted_values: Sequence[float], pct: float) -> float:
    """The ``pct`` percentile of already sorted values, interpolating linearly."""
    if not sorted_values:
        return math.nan
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    rank = (len(sorted_values) - 1) * pct / 100
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    fraction = rank - low
    return float(sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction)


def summarize(samples: Samples) -> dict[str, Any]:
    """Numbers for one implementation in one workload; times in microseconds."""
    values = sorted(samples.latencies_ns)
    rate = samples.ops / samples.seconds if samples.seconds > 0 else math.nan
    rounds = [value / 1000 for value in samples.round_medians_ns]
    return {
        "n": len(values),
        "median_us": percentile(values, 50) / 1000,
        "p90_us": percentile(values, 90) / 1000,
        "p99_us": percentile(values, 99) / 1000,
        "mean_us": statistics.fmean(values) / 1000 if values else math.nan,
        "min_us": values[0] / 1000 if values else math.nan,
        "max_us": values[-1] / 1000 if values else math.nan,
        "ops": samples.ops,
        "seconds": samples.seconds,
        "ops_per_s": rate,
        # The spread of the per-round medians shows how much to trust a small ratio.
        "round_medians_us": rounds,
        "round_ops_per_s": list(samples.round_rates),
    }


def ratio(numerator: float, denominator: float) -> float:
    if not denominator or math.isnan(numerator) or math.isnan(denominator):
        return math.nan
    return numerator / denominator
