"""Runs compared side by side (experiments.compare) from real small simulated runs, and the
aggregate table's columns it reads: the prefix cache hit rate, the offered rate, the number of
replicas, the goodput targets and the per-class goodput."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from experiments.aggregate import aggregate, row_of
from experiments.compare import compare, main
from experiments.run import CONF_DIR, run

# Two classes with targets, a shared system prompt (prefix cache hits), Poisson arrivals.
SMALL = ["workload=synthetic", "workload.num_prompts=40", "workload.request_rate=40",
         "workload.shared_prefix_len=64", "model=tiny", "hardware=cpu", "overhead=none",
         "progress=false", "goodput.ttft_ms=20",
         "+workload.classes={a:{share:0.5,priority:0,ttft_ms:10,tpot_ms:1},"
         "b:{share:0.5,priority:1,ttft_ms:100,tpot_ms:5}}"]


def _run(run_dir: Path, *overrides: str) -> dict:
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=list(overrides))
    run(cfg, run_dir)
    return json.loads((run_dir / "result.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """base (multi_step), cp1 (the same but the policy), and a 2-replica cluster of conversations."""
    root = tmp_path_factory.mktemp("runs")
    _run(root / "base", *SMALL)
    _run(root / "cp1", *SMALL, "policy=cp1")
    _run(root / "conv", "workload=sharegpt_multiturn", "workload.num_conversations=6",
         "workload.request_rate=4", "progress=false", "cluster.num_replicas=2",
         "goodput.ttft_ms=500", "goodput.tpot_ms=50")
    return root


def _offered(result: dict) -> float:
    starts = np.asarray(result["start_times"])
    return (len(starts) - 1) / (starts.max() - starts.min())


def test_the_aggregate_table_has_hit_rate_offered_rate_replicas_targets_and_class_goodput(runs):
    df = aggregate(runs)
    by = {Path(d).name: row for d, row in zip(df["run_dir"], df.to_dict("records"), strict=True)}
    base = json.loads((runs / "base" / "result.json").read_text())
    conv = json.loads((runs / "conv" / "result.json").read_text())
    assert by["base"]["prefix_cache_hit_rate"] == base["schedlab"]["prefix_cache_hit_rate"] > 0
    assert by["base"]["num_replicas"] == 1 and by["conv"]["num_replicas"] == 2
    assert by["base"]["ttft_slo_ms"] == 20 and np.isnan(by["base"]["tpot_slo_ms"])
    assert (by["conv"]["ttft_slo_ms"], by["conv"]["tpot_slo_ms"]) == (500, 50)
    # requests sent per second; a conversation workload's rate (4) starts conversations
    assert by["base"]["offered_rate"] == pytest.approx(_offered(base))
    assert by["conv"]["offered_rate"] == pytest.approx(_offered(conv))
    assert by["conv"]["request_rate"] == 4 and by["conv"]["offered_rate"] != 4
    for name in ("a", "b"):  # per SLO class
        assert by["base"][f"{name}.request_goodput"] == \
            base["schedlab"]["classes"][name]["request_goodput"]


def test_offered_rate_without_send_times_is_the_configured_request_rate(runs):
    base = json.loads((runs / "base" / "result.json").read_text())
    conv = json.loads((runs / "conv" / "result.json").read_text())
    for res in (base, conv):
        del res["start_times"]  # metrics.save_per_request=false writes none
    assert row_of(base, Path("base/result.json"))["offered_rate"] == 40
    assert row_of(conv, Path("conv/result.json"))["offered_rate"] is None  # conversations/s
    at_once = {**base, "start_times": [0.0, 0.0, 0.0]}
    assert row_of(at_once, Path("r/result.json"))["offered_rate"] == float("inf")
    with pytest.raises(ValueError, match="start_times must be a list of numbers"):
        row_of({**base, "start_times": [0.0, "soon"]}, Path("r/result.json"))


def test_compare_puts_runs_side_by_side_with_changes_against_the_first(runs, tmp_path):
    table, text, written = compare([runs / "base", runs / "cp1"], tmp_path / "cmp")
    base = json.loads((runs / "base" / "result.json").read_text())
    cp1 = json.loads((runs / "cp1" / "result.json").read_text())
    rows = table.set_index("metric")
    # the settings they differ in, and only those
    assert list(rows.loc["policy", ["base", "cp1"]]) == ["multi_step", "cp1"]
    assert "model" not in rows.index
    thr = rows.loc["request_throughput"]
    assert (thr["base"], thr["cp1"]) == (base["request_throughput"], cp1["request_throughput"])
    assert thr["cp1 vs base"] == pytest.approx(
        (cp1["request_throughput"] / base["request_throughput"] - 1) * 100)
    hit = rows.loc["prefix_cache_hit_rate"]  # a rate's change in points
    assert hit["cp1 vs base"] == pytest.approx(
        (cp1["schedlab"]["prefix_cache_hit_rate"] - base["schedlab"]["prefix_cache_hit_rate"])
        * 100)
    assert rows.loc["num_preemptions", "change"] == "difference"
    for metric in ("output_throughput", "offered_rate", "request_goodput", "class_goodput",
                   "a.request_goodput", "b.request_goodput", "median_ttft_ms", "p90_ttft_ms",
                   "p99_ttft_ms", "median_tpot_ms", "p99_itl_ms", "median_e2el_ms"):
        assert metric in rows.index, metric
    # the files: the same table as CSV, and the printed Markdown
    assert [p.name for p in written] == ["compare.csv", "compare.md"]
    assert pd.read_csv(written[0])["metric"].tolist() == table["metric"].tolist()
    assert written[1].read_text() == text
    assert "| policy | multi_step | cp1 |  |" in text
    assert "| goodput of class a (req/s) |" in text
    assert "| goodput, TTFT ≤ 20 ms (req/s) |" in text  # the targets it counted against


def test_compare_command_prints_the_table_and_writes_where_told(runs, tmp_path, capsys,
                                                               monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out is below the working directory
    main([str(runs / "base"), str(runs / "cp1")])
    out = capsys.readouterr().out
    assert "| request throughput (req/s) |" in out
    assert out.rstrip().endswith("written: outputs/compare/compare.csv, "
                                 "outputs/compare/compare.md")
    assert (tmp_path / "outputs" / "compare" / "compare.md").is_file()
    assert not list((runs / "base").glob("compare.*"))  # nothing into a run's directory


@pytest.mark.parametrize("args, message", [
    (["{runs}/base"], "error: give two or more run directories to compare"),
    (["{runs}/base", "{runs}/none"], "error: {runs}/none: no such run directory"),
    (["{runs}/base", "{tmp}"], "error: {tmp} has no result.json: not a run directory"),
    (["{runs}", "{runs}/base"], "error: {runs} has no result.json: not a run directory; 3 runs "
                                "below it: name them (e.g. {runs}/*/), or aggregate them with "
                                "python -m experiments.aggregate {runs}"),
    (["{runs}/base", "{tmp}/bad/result.json"], "error: {tmp}/bad/result.json: not valid JSON"),
    (["{runs}/base", "{runs}/cp1", "--out", "{tmp}/bad/result.json"],
     "error: --out {tmp}/bad/result.json is a file, not a directory"),
])
def test_compare_errors_are_one_line(runs, tmp_path, capsys, args, message):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "result.json").write_text("{not json")
    argv = [a.format(runs=runs, tmp=tmp_path) for a in args]
    with pytest.raises(SystemExit) as exit_:
        main(argv + ([] if "--out" in argv else ["--out", str(tmp_path / "cmp")]))
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message.format(runs=runs, tmp=tmp_path)), err
