"""What a job with parameter-server shards adds to its ``summary.json``, from the shards'
reports (a :class:`~cloudburst.strategies.spec.StrategySpec`'s ``summary``: asgd, EASGD and
async DiLoCo name :func:`server_summary`): the staleness of the applied pushes, the pushes
refused or dropped, and the shards' restarts, failovers and version clocks. A job without
shards has none of these keys. docs/cli.md lists them."""

from __future__ import annotations

import math
from typing import Any


def server_summary(servers: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's fields from every shard's report (``role == "server"``)."""
    mean = mean_staleness(servers)
    staleness = merged_histogram(servers, "staleness_histogram_versions")
    scales = merged_histogram(servers, "push_scale_histogram")

    def total(key: str) -> int:
        return sum(s.get(key, 0) for s in servers)

    return {
        "mean_staleness_versions": None if math.isnan(mean) else mean,
        "max_staleness_versions": max(s["staleness_max_versions"] for s in servers),
        "staleness_compensation": servers[0].get("staleness_compensation", "none"),
        "staleness_quantiles_versions": histogram_quantiles(staleness),
        "staleness_histogram_versions": {str(int(k)): v for k, v in staleness.items()},
        "push_scale_quantiles": histogram_quantiles(scales),
        "push_scale_histogram": {repr(k): v for k, v in scales.items()},
        "compensation_clamped": total("compensation_clamped"),
        "pushes_rejected": total("rejected_nonfinite"),
        # Finite pushes whose update was too large or not finite (--max-push-ratio).
        "pushes_refused": total("refused_pushes"),
        "pushes_dropped_stale": total("dropped_stale"),
        "rejoined_workers": sorted({r for s in servers for r in s.get("rejoined_workers", [])}),
        # Shards restarted in place, and the acknowledged pushes they lost (applied after
        # their last checkpoint).
        "shard_restarts": total("shard_restarts"),
        "pushes_lost": total("pushes_lost"),
        "shard_failovers": total("shard_failovers"),
        # Each shard's version clock (pushes applied) at the end, by shard.
        "shard_versions": [s["version"] for s in sorted(servers, key=lambda s: s.get("shard", 0))],
    }


def merged_histogram(stats: list[dict[str, Any]], key: str) -> dict[float, int]:
    """The shards' histograms under ``key`` added up (keys as numbers)."""
    total: dict[float, int] = {}
    for s in stats:
        for k, v in (s.get(key) or {}).items():
            total[float(k)] = total.get(float(k), 0) + int(v)
    return dict(sorted(total.items()))


def histogram_quantiles(hist: dict[float, int], qs=(0.5, 0.9, 0.99)) -> dict[str, float] | None:
    """Exact quantiles (the smallest value with at least q of the counts at or below it) and
    the maximum of a histogram; None when it is empty."""
    n = sum(hist.values())
    if not n:
        return None
    out: dict[str, float] = {}
    for q in qs:
        need, seen = q * n, 0
        for value, count in hist.items():
            seen += count
            if seen >= need:
                out[f"p{round(q * 100):d}"] = value
                break
    out["max"] = max(hist)
    return out


def mean_staleness(stats: list[dict[str, Any]]) -> float:
    applied = sum(s.get("pushes_applied", 0) for s in stats)
    total = sum(s.get("staleness_sum_versions", 0) for s in stats)
    return total / applied if applied else math.nan
