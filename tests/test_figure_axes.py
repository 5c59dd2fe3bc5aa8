"""The figures' axes as a reader takes them: req/s versus k from 0, validation ticks that a
narrow panel can label (3-4 round values, never one), and "1 run", not "1 runs"."""

from __future__ import annotations

import matplotlib.pyplot as plt
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


def _rate_table(workload: str, **extra) -> pd.DataFrame:
    """A sweep's table: two routers (or policies) x 2 and 4 replicas x rates 2 and 4, goodput
    against TTFT 1 s and TPOT 100 ms; a conversation sends 3 requests, so 3x the rate."""
    rows = [{"router": router, "policy": policy, "num_replicas": n, "request_rate": rate,
             "request_goodput": rate * 0.9, "workload": workload, "offered_rate": rate * 3.0,
             "ttft_slo_ms": 1000.0, "tpot_slo_ms": 100.0, "p99_ttft_ms": 50.0, **extra}
            for router, policy in (("round_robin", "single_step"), ("least_kv", "cp1"))
            for n in (2, 4) for rate in (2.0, 4.0)]
    return pd.DataFrame(rows)


def _offered_line(ax):
    (line,) = [ln for ln in ax.get_lines() if ln.get_label().startswith("offered load")]
    return list(line.get_xdata()), list(line.get_ydata())


def test_router_figure_names_the_rate_s_unit_the_goodput_targets_and_the_offered_load():
    from experiments.plot_cluster import router_figure

    fig = router_figure(_rate_table("sharegpt"))
    for ax in fig.axes:  # a panel per replica count, each with the offered load, y = x
        assert ax.get_xlabel() == "request rate (req/s)"
        assert _offered_line(ax) == ([2.0, 4.0], [2.0, 4.0])
    assert fig.axes[0].get_ylabel() == "goodput\n(req/s meeting TTFT ≤ 1000 ms, TPOT ≤ 100 ms)"
    plt.close(fig)
    # conversations: the rate starts conversations; the offered load is the requests they sent
    fig = router_figure(_rate_table("sharegpt_multiturn"))
    assert fig.axes[0].get_xlabel() == "conversation rate (conversations/s)"
    assert _offered_line(fig.axes[0]) == ([2.0, 4.0], [6.0, 12.0])
    plt.close(fig)
    # runs with other targets, or none recorded: the label says where the targets are
    mixed = _rate_table("sharegpt")
    mixed.loc[0, "ttft_slo_ms"] = 500.0
    fig = router_figure(mixed)
    assert fig.axes[0].get_ylabel() == "goodput\n(req/s meeting each run's goodput.* targets)"
    plt.close(fig)
    fig = router_figure(_rate_table("sharegpt").drop(columns=["ttft_slo_ms", "tpot_slo_ms"]))
    assert fig.axes[0].get_ylabel() == "goodput\n(req/s meeting goodput.* targets)"
    plt.close(fig)


def test_policy_goodput_figure_on_conversations_names_them_and_their_offered_requests():
    from experiments.plot_policies import policy_figures

    figures = dict(policy_figures(_rate_table("sharegpt_multiturn")))
    ax = figures["goodput_vs_rate"].axes[0]
    assert ax.get_xlabel() == "conversation rate (conversations/s, Poisson)"
    assert ax.get_ylabel() == "goodput (req/s meeting TTFT ≤ 1000 ms, TPOT ≤ 100 ms)"
    assert _offered_line(ax) == ([2.0, 4.0], [6.0, 12.0])
    for fig in figures.values():
        plt.close(fig)
