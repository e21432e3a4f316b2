"""What a list of timing samples says: median, spread, paired ratios between arms, and % of a roof."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def summarize(samples: Sequence[float]) -> dict:
    """Median, p10/p90, quartiles, IQR, min/max, mean and n of a list of samples (empty -> n 0 and None)."""
    x = np.asarray([float(s) for s in samples], dtype=np.float64)
    if x.size == 0:
        return {"n": 0, "median": None, "p10": None, "p90": None, "q1": None, "q3": None, "iqr": None,
                "min": None, "max": None, "mean": None}
    p10, q1, med, q3, p90 = np.percentile(x, [10, 25, 50, 75, 90])
    return {"n": int(x.size), "median": float(med), "p10": float(p10), "p90": float(p90), "q1": float(q1),
            "q3": float(q3), "iqr": float(q3 - q1), "min": float(x.min()), "max": float(x.max()),
            "mean": float(x.mean())}


def paired_ratios(faster: Sequence[float], slower: Sequence[float]) -> dict:
    """Per-round ratios slower_i / faster_i (rounds are interleaved, so each pair saw the same card state)."""
    return summarize([b / a for a, b in zip(faster, slower) if a > 0])


def pct_of_roof(nbytes: int, us: float | None, roof_gbps: float | None) -> float | None:
    """100 * (bytes / time) / roof, with time in µs and the roof in GB/s (1e9 bytes/s)."""
    if not us or not roof_gbps:
        return None
    return 100.0 * nbytes / (us * 1e-6) / (roof_gbps * 1e9)
