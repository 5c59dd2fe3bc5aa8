"""The figures' properties, not their pixels: no series hides another, human names, what the
bars are, the CPU-overhead profile in the title, and a readable validation scatter."""

from __future__ import annotations

import math
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from experiments import plot  # noqa: E402
from experiments.labels import human, metric_label  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KS = (1, 2, 4, 8)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def sim_table() -> pd.DataFrame:
    """A steps sweep as the aggregate writes it: 3 policies x overlap off/on x 2 GPUs; at k=1
    cp1 and cp2 are one policy, so their values are equal (the case where one line hid another)."""
    rows = []
    for hw, scale in (("h100_sxm", 1.0), ("h200", 1.1)):
        for pol, slope in (("multi_step", 1.0), ("cp1", 0.8), ("cp2", 0.9)):
            for ov in (False, True):
                for k in KS:
                    tput = scale * (30 + (0 if k == 1 else slope * k) + (15 if ov else 0))
                    rows.append({"backend": "sim", "model": "llama3_8b", "workload": "sharegpt",
                                 "request_rate": math.inf, "overhead": "vllm_v0_5",
                                 "num_prompts": 1000, "seed": 0, "burstiness": 1.0,
                                 "hardware": hw, "policy": pol, "k": k, "overlap": ov,
                                 "request_throughput": tput, "median_ttft_ms": 5000 / tput,
                                 "median_tpot_ms": 600 / tput})
    return pd.DataFrame(rows)


def real_table() -> pd.DataFrame:
    """Measured runs, two of each, on one GPU: single-step and chunked prefill only at k=1,
    beside multi-step at k=1 with the same throughput."""
    rows = []
    for pol, ks in (("single_step", (1,)), ("chunked_prefill", (1,)), ("multi_step", KS),
                    ("cp1", (8,))):
        for k in ks:
            for rep in (0, 1):
                rows.append({"backend": "real", "model": "llama3_8b", "workload": "sharegpt",
                             "request_rate": math.inf, "overhead": None, "num_prompts": 1000,
                             "hardware": "NVIDIA H200", "policy": pol, "k": k, "overlap": None,
                             "request_throughput": 45.0 + k / 4 + rep,
                             "median_ttft_ms": 5000.0 - k + 10 * rep,
                             "median_tpot_ms": 20.0 - k / 8 + 0.1 * rep})
    return pd.DataFrame(rows)


def series_of(fig) -> list[tuple]:
    """(label, colour, line style, marker, x values) of every series drawn in ``fig``."""
    out = []
    for ax in fig.axes:
        for c in ax.containers:
            line = c.lines[0]
            out.append((c.get_label(), to_rgba(line.get_color()), line.get_linestyle(),
                        line.get_marker(), tuple(line.get_xdata()), ax,
                        to_rgba(line.get_markerfacecolor())))
    return out


def legend_texts(fig) -> list[str]:
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    return [t.get_text() for leg in legends for t in [*leg.get_texts(), leg.get_title()]]


def all_text(fig) -> str:
    titles = [fig.get_suptitle()] + [ax.get_title() for ax in fig.axes]
    labels = [ax.get_xlabel() + " " + ax.get_ylabel() for ax in fig.axes]
    return "\n".join(titles + labels + legend_texts(fig))


def test_every_series_of_a_k_figure_has_its_own_look_and_is_seen():
    figs = plot.steps_figures(sim_table())
    assert [stem.split("_sim_")[0] for stem, _ in figs] == ["reqs_vs_k", "latency_vs_k"]
    for _, fig in figs:
        series = series_of(fig)
        assert all(len([s for s in series if s[5] is ax]) == 6 for ax in fig.axes)  # per GPU
        labels = {s[0]: s[1:4] for s in series}
        assert len(labels) == 12 and len(set(labels.values())) == 12  # no two alike
        # one colour per policy, whatever the GPU or overlap; overlap on is dashed
        by_policy = {}
        for label, (colour, style, _marker) in labels.items():
            by_policy.setdefault(label.split(" ")[0].rstrip(","), set()).add(colour)
            assert style == ("--" if "+ overlap" in label else "-"), label
        for s in series:  # overlap on: open markers, so a point drawn alone still says so
            assert s[6] == (to_rgba("white") if "+ overlap" in s[0] else s[1]), s[0]
        assert all(len(c) == 1 for c in by_policy.values()) and len(by_policy) == 3
        # equal values (cp1 and cp2 at k=1) are drawn side by side, not on top of each other
        for ax in fig.axes:
            firsts = [s[4][0] for s in series if s[5] is ax]
            assert len(set(firsts)) == len(firsts)


def test_k_figure_names_titles_and_bars_are_for_readers():
    fig = dict(plot.steps_figures(sim_table()))[
        "reqs_vs_k_sim_llama3_8b_sharegpt_inf_vllm_v0_5_1000_0_1.0_h100_sxm+h200"]
    title = fig.get_suptitle()
    assert "vLLM v0.5 CPU overheads" in title and "Llama-3-8B" in title and "simulated" in title
    assert {ax.get_title() for ax in fig.axes} == {"H100 SXM", "H200"}
    legend = legend_texts(fig)
    for name in ("multi-step", "CP1", "CP2", "H100 SXM", "H200", "overlap on", "overlap off"):
        assert name in legend, name
    assert len(fig.legends) == 1  # one legend for the figure, not one per panel
    assert not re.search(r"h100_sxm|multi_step|llama3_8b|vllm_v0_5|_ms\b", all_text(fig))
    assert any("one run per point" in t for t in legend)  # says why there are no bars
    assert any("shifted sideways" in t for t in legend)  # says why points sit off their k


def test_real_engine_figure_shows_every_policy_and_says_what_its_bars_are():
    figs = dict(plot.steps_figures(real_table()))
    fig = figs["reqs_vs_k_real_llama3_8b_sharegpt_inf_1000_NVIDIA_H200"]
    series = series_of(fig)
    assert {s[0] for s in series} == {"single-step, H200", "chunked prefill, H200",
                                      "multi-step, H200", "CP1, H200"}
    assert len({s[1:4] for s in series}) == len(series)
    at_k1 = [s[4][0] for s in series if len(s[4]) and s[4][0] < 1.5]
    assert len(at_k1) == 3 and len(set(at_k1)) == 3  # three policies at k=1, all in sight
    assert "real engine on H200" in fig.get_suptitle()
    assert any("mean of 2 runs" in t and "min-max" in t for t in legend_texts(fig))
    assert all(c.has_yerr for ax in fig.axes for c in ax.containers)


def test_overlap_note_and_time_scale_repeats():
    assert plot.repeats_note([1, 1]) == "one run per point, so no bars"
    assert plot.repeats_note([2, 3]).startswith("points: mean of 2-3 runs")
    df = sim_table()
    df = pd.concat([df.assign(time_scale=0.99), df.assign(time_scale=1.01)])
    fig = dict(plot.steps_figures(df))[
        "latency_vs_k_sim_llama3_8b_sharegpt_inf_vllm_v0_5_1000_0_1.0_h100_sxm+h200"]
    assert any("mean of 2 runs at time_scale 0.99-1.01" in t for t in legend_texts(fig))


def test_rates_figure_series_differ_and_title_has_the_overhead():
    rows = [{"backend": "sim", "model": "llama3_8b", "hardware": "h200", "workload": "sharegpt",
             "overhead": "vllm_v0_6", "policy": pol, "k": k, "overlap": ov, "request_rate": r,
             "request_throughput": r * 0.9, "median_ttft_ms": 10 + r, "median_tpot_ms": 5 + r}
            for pol, k in (("multi_step", 4), ("multi_step", 8), ("cp2", 8))
            for ov in (False, True) for r in (10.0, 20.0)]
    (stem, fig), = plot.rates_figures(pd.DataFrame(rows))
    assert stem.startswith("latency_vs_rate_")
    series = series_of(fig)
    assert len({s[0] for s in series}) == 6 and len({s[1:4] for s in series}) == 6
    assert "vLLM v0.6 CPU overheads" in fig.get_suptitle() and "H200" in fig.get_suptitle()
    assert "multi-step k=8 + overlap" in legend_texts(fig)


def validation_table() -> pd.DataFrame:
    rows = []
    for metric, base in (("request_throughput", 40.0), ("median_ttft_ms", 50.0),
                         ("p99_tpot_ms", 20.0), ("mean_e2el_ms", 4000.0), ("median_itl_ms", 9.0)):
        for pol in ("multi_step", "cp1"):
            for rate in (math.inf, 20.0, 40.0):
                measured = base * (100 if math.isinf(rate) and "ttft" in metric else 1)
                rows.append({"policy": pol, "k": 8, "request_rate": rate, "metric": metric,
                             "predicted": measured * 1.05, "measured": measured,
                             "repeats": 2 if math.isinf(rate) else 6,
                             "measured_spread": 0.04, "predicted_spread": 0.02})
    return pd.DataFrame(rows)


def test_validation_scatter_is_readable():
    fig = plot.validation_figure(validation_table(), plot.validation_title("llama3_8b",
                                                                           "h200_calibrated"))
    assert fig.get_suptitle() == "Simulator versus measurement: Llama-3-8B, H200 (calibrated)"
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["request throughput", "median TTFT",
                                                 "p99 TPOT", "mean end-to-end latency",
                                                 "median ITL"]
    # one legend for the whole figure, none per panel
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    assert len(legends) == 1 and not any(ax.get_legend() for ax in panels)
    texts = legend_texts(fig)
    for name in ("multi-step", "CP1", "all at t=0", "20 req/s", "40 req/s"):
        assert name in texts, name
    assert any(t.startswith("bars: ") and "2-6 runs" in t for t in texts)
    # load levels by marker: one policy's points at each load look different
    markers = {}
    for ax in panels:
        for c in ax.containers:
            markers.setdefault(c.get_label(), set()).add(c.lines[0].get_marker())
    by_load = {lbl.split(", ")[1]: m for lbl, m in markers.items() if lbl.startswith("CP1")}
    assert len(by_load) == 3 and len(set().union(*by_load.values())) == 3
    # the same scale everywhere: log-log, x and y over one range (y = x on the diagonal)
    for ax in panels:
        assert ax.get_xscale() == ax.get_yscale() == "log"
        assert ax.get_xlim() == pytest.approx(ax.get_ylim())
        assert "_" not in ax.get_xlabel() + ax.get_ylabel()


def test_validation_scatter_without_spread_says_so(tmp_path):
    """(plot_table draws a validation table's scatter)"""
    df = validation_table().drop(columns=["measured_spread", "predicted_spread", "repeats"])
    df.to_csv(tmp_path / "validation.csv", index=False)
    made = plot.plot_table(tmp_path / "validation.csv", tmp_path)
    assert sorted(p.name for p in made) == ["validation_scatter.png", "validation_scatter.svg"]
    fig = plot.validation_figure(df)
    assert "one run per side, so no bars" in legend_texts(fig)


def test_human_names():
    assert human("hardware", "h100_sxm") == "H100 SXM"
    assert human("hardware", "NVIDIA H200") == "H200"
    assert human("model", "llama3_8b") == "Llama-3-8B"
    assert human("policy", "multi_step") == "multi-step" and human("policy", "cp1") == "CP1"
    assert human("overhead", "vllm_v0_5") == "vLLM v0.5 CPU overheads"
    assert human("policy", "my_policy") == "my_policy"  # unknown: as it is, never dropped
    assert human("model", float("nan")) == "" and human("model", None) == ""
    assert metric_label("median_ttft_ms") == ("median TTFT", "ms")
    assert metric_label("p99_e2el_ms") == ("p99 end-to-end latency", "ms")
    assert metric_label("request_throughput") == ("request throughput", "req/s")


def test_every_policy_and_conf_name_has_a_human_name():
    from experiments.labels import HUMAN_NAMES
    from policies import POLICIES  # the package registers every policy

    built_in = {n for n, c in POLICIES.items() if c.__module__.startswith("policies.")}
    assert built_in <= set(HUMAN_NAMES["policy"])
    for group in ("hardware", "model", "overhead", "workload"):
        names = {p.stem for p in (ROOT / "conf" / group).glob("*.yaml")}
        assert names <= set(HUMAN_NAMES[group]), (group, names - set(HUMAN_NAMES[group]))


def test_steps_sweep_sweeps_overlap():
    params = OmegaConf.load(ROOT / "conf/experiment/steps_sweep.yaml").hydra.sweeper.params
    assert str(params["scheduler.overlap"]).replace(" ", "") == "false,true"


def test_the_readme_figures_exist():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    shown = re.findall(r"\]\((docs/figures/[^)]+\.png)\)", readme)
    shown += ["docs/" + p for p in re.findall(r"\]\((figures/[^)]+\.png)\)",
                                              (ROOT / "docs" / "running.md").read_text())]
    assert len(shown) >= 3
    for png in shown:
        assert (ROOT / png).is_file() and (ROOT / png).with_suffix(".svg").is_file(), png


def test_runs_at_another_max_concurrency_are_another_figure():
    df = sim_table()
    df = pd.concat([df.assign(max_concurrency=4), df.assign(max_concurrency=float("nan"))])
    figs = dict(plot.steps_figures(df))
    assert len(figs) == 4  # req/s and latency, each with and without the limit
    titled = [f.get_suptitle() for f in figs.values() if "at most 4 in flight" in f.get_suptitle()]
    assert len(titled) == 2


def test_overlap_on_and_off_are_two_series_without_a_gpu_column():
    rows = [{"backend": "sim", "model": "llama3_8b", "workload": "sharegpt",
             "request_rate": math.inf, "policy": "multi_step", "k": k, "overlap": ov,
             "request_throughput": 10.0 * k + (5 if ov else 0), "median_ttft_ms": 1.0,
             "median_tpot_ms": 1.0} for k in (1, 2, 4) for ov in ("False", "True")]  # CSV text
    (_, fig), _ = plot.steps_figures(pd.DataFrame(rows))
    series = {s[0]: s[2] for s in series_of(fig)}
    assert series == {"multi-step": "-", "multi-step + overlap": "--"}


def test_drawing_a_table_twice_gives_the_same_files(tmp_path):
    first = plot.plot_steps(real_table(), tmp_path / "a")
    second = plot.plot_steps(real_table(), tmp_path / "b")
    assert {p.suffix for p in first} == {".png", ".svg"}
    for a, b in zip(first, second, strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_rates_legend_lists_k_in_numeric_order():
    rows = [{"backend": "sim", "model": "llama3_8b", "hardware": "h200", "workload": "sharegpt",
             "policy": "multi_step", "k": k, "request_rate": r, "request_throughput": r,
             "median_ttft_ms": 1.0, "median_tpot_ms": 1.0} for k in (1, 16, 2) for r in (10.0, 20.0)]
    (_, fig), = plot.rates_figures(pd.DataFrame(rows))
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        "multi-step k=1", "multi-step k=2", "multi-step k=16"]
