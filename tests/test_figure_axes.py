"""The figures' axes as a reader takes them: req/s versus k from 0, validation ticks that a
narrow panel can label (3-4 round values, never one), and "1 run", not "1 runs"."""

from __future__ import annotations

import pandas as pd
import pytest

from experiments.plot import log_ticks, short_number, steps_figures, validation_figure


@pytest.mark.parametrize("lo, hi", [(20, 16000), (76, 190), (95, 130), (8, 12), (4, 30),
                                    (0.5, 2000), (9, 9000), (1e-3, 1e5)])
def test_log_ticks_fit_a_narrow_panel(lo, hi):
    ticks = log_ticks(lo, hi)
    assert 2 <= len(ticks) <= 5 and ticks == sorted(ticks)
    assert all(lo <= t <= hi for t in ticks)
    if hi / lo < 1000:  # a narrow range gets at least three labels (p99 TPOT had one: "100")
        assert len(ticks) >= 3, ticks


def test_long_tick_labels_are_short():
    assert [short_number(v) for v in (5, 100, 5000, 10_000, 20_000)] == [
        "5", "100", "5000", "10k", "20k"]


def test_req_per_s_versus_k_starts_at_zero():
    df = pd.DataFrame({"k": [1, 2, 4] * 2, "policy": ["multi_step"] * 3 + ["cp1"] * 3,
                       "request_throughput": [29.0, 36.0, 43.0, 30.0, 33.0, 40.0],
                       "median_ttft_ms": [5000.0] * 6, "median_tpot_ms": [20.0] * 6,
                       "request_rate": [float("inf")] * 6})
    for stem, fig in steps_figures(df):
        for ax in fig.axes:
            if ax.has_data():
                assert ax.get_ylim()[0] == 0, stem


def test_one_measured_run_is_singular():
    df = pd.DataFrame({"policy": ["single_step"] * 2, "k": [None] * 2,
                       "request_rate": [float("inf")] * 2, "metric": ["p99_ttft_ms"] * 2,
                       "predicted": [100.0, 120.0], "measured": [105.0, 118.0],
                       "repeats": [1, 1], "measured_spread": [float("nan")] * 2,
                       "predicted_spread": [0.01, 0.02]})
    text = " ".join(t.get_text() for t in validation_figure(df).legends[0].texts) + \
        validation_figure(df).legends[0].get_title().get_text()
    assert "measured: 1 run;" in text and "1 runs" not in text
