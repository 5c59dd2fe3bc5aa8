"""benchmarks/allreduce.py's fit: the cost model's all-reduce line recovered from its own times."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from allreduce import fit  # noqa: E402


@pytest.mark.parametrize("ranks", [2, 4])
def test_fit_recovers_the_cost_models_coefficients(ranks):
    latency_us, efficiency, nvlink_gbps = 12.0, 0.6, 450.0
    sizes = [t * 8192 * 2 for t in (1, 8, 128, 1024, 2048)]
    moved = [2 * (ranks - 1) / ranks * b for b in sizes]
    rows = pd.DataFrame({"ranks": ranks, "bytes": sizes,
                         "seconds": [latency_us * 1e-6 + m / (nvlink_gbps * 1e9 * efficiency)
                                     for m in moved]})
    assert fit(rows, nvlink_gbps) == pytest.approx((latency_us, efficiency), rel=1e-6)
