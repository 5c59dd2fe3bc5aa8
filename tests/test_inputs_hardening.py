"""Input files a user hands the commands (traces, measured results, tables): every mistake in
them is one line naming the file (and line, row or column), never a traceback, a silently
wrong result, or a file read that the input names outside its directory."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from experiments import aggregate, plot, validate  # noqa: E402
from experiments.measured import measured_from_dir  # noqa: E402
from experiments.workload import build_workload, footprint  # noqa: E402

DEEP = 100_000  # past any recursion limit
HUGE = "1" * 5000  # past Python's 4,300-digit limit on int()


def one_line(err: BaseException | str) -> str:
    text = str(err)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def trace_error(tmp_path: Path, text: str, fmt: str, **kw) -> str:
    path = tmp_path / ("t.jsonl" if fmt == "mooncake" else "t.csv")
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        build_workload({"kind": "trace", "trace_path": str(path), "format": fmt}, **kw)
    return one_line(err.value)


# --------------------------------------------------------------------------- Mooncake

MOON = '{"timestamp": 1, "input_length": 10, "output_length": 2, "hash_ids": [7]}\n'


@pytest.mark.parametrize("line, match", [
    ('{"timestamp": 1' + "0" * 400 + ', "input_length": 10, "output_length": 2}\n',
     r"t\.jsonl:2: timestamp must be below 2\*\*63, got an integer of 401 digits"),
    ('{"timestamp": 2, "input_length": 10, "output_length": 2, "hash_ids": '
     + "[" * 3000 + "]" * 3000 + "}\n", r"t\.jsonl:2: JSON nested too deep to read"),
    ('{"timestamp": 2, "input_length": ' + HUGE + ', "output_length": 2}\n',
     r"t\.jsonl:2: a number too long to read \(Exceeds the limit \(4300 digits\)"),
    ('{"timestamp": 2, "input_length": 10, "output_length": 2, "hash_ids": ['
     + ", ".join(["1"] * 500_000) + "]}\n",
     r"t\.jsonl:2: 500000 hash_ids for input_length 10; a Mooncake request has one per "
     r"512-token block of its prompt \(1\)"),
    ('{"timestamp": 2, "input_length": 1025, "output_length": 2, "hash_ids": [1, 2]}\n',
     r"t\.jsonl:2: 2 hash_ids for input_length 1025; .* \(3\)"),
], ids=["400-digit timestamp", "nested 3000 deep", "5000 digits", "500000 hash_ids",
        "too few hash_ids"])
def test_mooncake_rows_past_pythons_limits_are_one_line(tmp_path, line, match):
    assert pytest.importorskip("re").search(match, trace_error(tmp_path, MOON + line,
                                                               "mooncake"))


def test_mooncake_hash_ids_one_per_512_token_block_are_taken(tmp_path):
    rows = [{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]},
            {"timestamp": 1, "input_length": 513, "output_length": 1, "hash_ids": [1, 2]}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    specs = build_workload({"kind": "trace", "trace_path": str(path), "format": "mooncake"})
    assert [s.hash_ids for s in specs] == [(1,), (1, 2)]


def test_sharegpt_style_arrays_past_pythons_limits_are_one_line(tmp_path):
    from experiments.workload import iter_json_array

    for body, match in (("[" * DEEP, "nested too deep"), (HUGE, "number too long")):
        path = tmp_path / "s.json"
        path.write_text(f'[{{"a": 1}}, {{"b": {body}}}]')
        with pytest.raises(ValueError, match=f"s.json at byte 11: .*{match}") as err:
            list(iter_json_array(path))
        one_line(err.value)


# --------------------------------------------------------------------------- Azure

AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46+00:00,10,2\n"


@pytest.mark.parametrize("zone", ["+99:99", "+14:01", "-12:60", "+2400"])
def test_azure_offsets_that_are_no_time_zone_are_refused(tmp_path, zone):
    msg = trace_error(tmp_path, AZURE + f"2023-11-16 18:15:47{zone},10,2\n", "azure")
    assert f"t.csv:3: TIMESTAMP has no such UTC offset: '{zone}'" in msg


def test_azure_offsets_of_real_zones_are_taken(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(AZURE + "2023-11-17 08:15:47+14:00,10,2\n2023-11-16 06:45:48-11:30,10,2\n")
    specs = build_workload({"kind": "trace", "trace_path": str(path), "format": "azure"})
    assert [s.arrival_time for s in specs] == [0.0, 1.0, 2.0]


# --------------------------------------------------------------------------- memory guard

def _csv(tmp_path: Path, rows: int) -> Path:
    path = tmp_path / "big.csv"
    with path.open("w") as f:
        f.write("arrival_time,prompt_len,output_len\n")
        f.writelines(f"{i},200,100\n" for i in range(rows))
    return path


@pytest.mark.parametrize("vocab_size, fits", [(None, 100), (1000, 20)])
def test_a_trace_too_large_is_refused_at_the_first_row_past_memory(tmp_path, monkeypatch,
                                                                    vocab_size, fits):
    """The guard counts each row's run while the file streams (prompt token ids too, for the
    real backend), so a trace whose run cannot fit stops at the first row past it, not after
    the whole file is read."""
    with_ids = vocab_size is not None
    row = footprint.trace_row_bytes(200, 100, 0, with_token_ids=with_ids)
    monkeypatch.setattr(footprint, "available_memory", lambda: fits * row)
    path = _csv(tmp_path, 1500)
    msg = trace_error(tmp_path, path.read_text(), "csv", vocab_size=vocab_size)
    assert f"t.csv:{fits + 2}: the trace has more than {fits} requests" in msg


# --------------------------------------------------------------------------- measured results

def _schedlab(**workload) -> dict:
    return {"request_throughput": 3.0, "median_ttft_ms": 20.0,
            "schedlab": {"backend": "real", "policy": "single_step",
                         "workload": {"kind": "synthetic", "request_rate": "inf",
                                      "num_prompts": 5, "seed": 0, **workload}}}


def _measure(tmp_path: Path, result: dict | str, name: str = "result.json") -> Path:
    meas = tmp_path / "meas"
    (meas / "r").mkdir(parents=True, exist_ok=True)
    (meas / "r" / name).write_text(result if isinstance(result, str) else json.dumps(result))
    return meas


def test_arrivals_outside_the_measured_dir_are_never_read(tmp_path, capsys):
    outside = tmp_path / "outside.csv"
    outside.write_text("arrival_time,prompt_len,output_len\n0,SECRET,1\n")
    meas = _measure(tmp_path, _schedlab(arrivals=str(outside)))
    (meas / "r" / "link.csv").symlink_to(outside)
    for named in (str(outside), "/etc/passwd", "../../outside.csv", "link.csv"):
        _measure(tmp_path, _schedlab(arrivals=named))
        with pytest.raises(ValueError, match="outside the measured directory") as err:
            measured_from_dir(meas)
        assert "SECRET" not in one_line(err.value) and "root:" not in str(err.value)
    # the command: one line, exit code 2, and the file is not replayed
    with pytest.raises(SystemExit) as exc:
        validate.main(["--measured-dir", str(meas), "--runs", str(tmp_path / "runs"),
                       "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "outside the measured" in err[0], err
    assert not (tmp_path / "runs").exists()
    # a file beside the result is the client's own: taken
    (meas / "r" / "arrivals.csv").write_text(outside.read_text())
    _measure(tmp_path, _schedlab(arrivals="arrivals.csv"))
    (row,) = measured_from_dir(meas).values()
    assert row["arrivals"] == str((meas / "r" / "arrivals.csv").resolve())


@pytest.mark.parametrize("result, match", [
    ({**_schedlab(), "schedlab": {**_schedlab()["schedlab"], "policy": ["single_step"]}},
     "policy must be text, got a JSON array"),
    (_schedlab(num_prompts=10**400), "num_prompts must be an integer from 1 to 2\\*\\*63 - 1"),
    ({**_schedlab(), "request_throughput": 10**400}, "request_throughput must be below 2\\*\\*63"),
    ("[" * DEEP + "]" * DEEP, "nested too deep"),
    ('{"request_throughput": ' + HUGE + "}", "a number too long to read"),
    ({"request_throughput": 1.0, "request_rate": "inf", "policy": ["cp1"]}, "policy"),
], ids=["list policy", "huge num_prompts", "huge metric", "deep", "5000 digits",
        "vllm list policy"])
def test_measured_results_past_pythons_limits_are_one_line(tmp_path, capsys, result, match):
    meas = _measure(tmp_path, result)
    with pytest.raises(SystemExit) as exc:
        validate.main(["--measured-dir", str(meas), "--runs", str(tmp_path / "runs"),
                       "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert str(meas / "r" / "result.json") in err[0]
    assert pytest.importorskip("re").search(match, err[0]), err[0]


def test_a_result_without_a_metric_is_skipped_by_name_not_counted_as_a_repeat(tmp_path, capsys):
    meas = _measure(tmp_path, _schedlab())
    nan = {**_schedlab(), "request_throughput": math.nan, "median_ttft_ms": math.nan}
    _measure(tmp_path, nan, "b.json")
    (row,) = measured_from_dir(meas).values()
    assert row["repeats"] == 1 and row["request_throughput"] == 3.0
    assert f"skipped {meas / 'r' / 'b.json'}: no metric is a number" in capsys.readouterr().err


# --------------------------------------------------------------------------- aggregate

def _agg_result(**ext) -> dict:
    res = {"request_throughput": 1.0, "completed": 4,
           "schedlab": {"backend": "sim", "policy": "multi_step", "k": 4, "config_sha256": "ab",
                        "workload": {"kind": "synthetic", "request_rate": 5}}}
    top = {k: ext.pop(k) for k in list(ext) if k in ("completed", "request_throughput")}
    res["schedlab"].update(ext)
    return {**res, **top}


@pytest.mark.parametrize("result, match", [
    (_agg_result(policy=["multi_step"]), "policy must be text, got a JSON array"),
    (_agg_result(config_sha256=["ab"]), "config_sha256 must be text"),
    (_agg_result(num_blocks=10**400), "num_blocks must be below 2\\*\\*63"),
    (_agg_result(completed="four"), "completed must be a number, got 'four'"),
    (_agg_result(policy=5), "policy must be text, got 5"),
    (_agg_result(model="\ud800"), "model holds text that is not UTF-8"),
    (_agg_result(workload={"kind": "synthetic", "request_rate": True}),
     "request_rate must be a number or inf, got True"),
    ("[" * DEEP + "]" * DEEP, "nested too deep"),
    ('{"request_throughput": ' + HUGE + "}", "a number too long to read"),
], ids=["list policy", "list sha", "huge int", "text completed", "int policy", "surrogate",
        "rate true", "deep", "5000 digits"])
def test_aggregate_of_a_result_it_cannot_tabulate_is_one_line_naming_it(
        tmp_path, monkeypatch, capsys, result, match):
    good = tmp_path / "a" / "result.json"
    good.parent.mkdir(parents=True)
    good.write_text(json.dumps(_agg_result()))
    bad = tmp_path / "b" / "result.json"
    bad.parent.mkdir()
    bad.write_text(result if isinstance(result, str) else json.dumps(result))
    monkeypatch.setattr(sys, "argv", ["aggregate", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        aggregate.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert str(bad) in err[0] and pytest.importorskip("re").search(match, err[0]), err[0]
    assert not (tmp_path / "aggregate.csv").exists()


def test_aggregate_reads_the_non_finite_numbers_results_write(tmp_path):
    res = _agg_result(simulated_seconds_per_wall_second="inf")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "result.json").write_text(json.dumps(res))
    df = aggregate.aggregate(tmp_path)
    assert df["simulated_seconds_per_wall_second"].iloc[0] == math.inf


# --------------------------------------------------------------------------- plot

def _table(change: dict | None = None) -> pd.DataFrame:
    rows = [{"backend": "sim", "model": "tiny", "workload": "synthetic", "request_rate": r,
             "policy": "multi_step", "k": k, "seed": 0, "request_throughput": 10.0 * k,
             "median_ttft_ms": 5.0, "median_tpot_ms": 1.0} for k in (1, 2) for r in (5.0, 10.0)]
    df = pd.DataFrame(rows).astype(object)
    for (col, row), value in (change or {}).items():
        df.loc[row, col] = value
    return df


@pytest.mark.parametrize("col, value, want", [
    ("request_rate", "fast", "a number > 0"),
    ("median_ttft_ms", "slow", "a finite number >= 0"),
    ("median_tpot_ms", math.nan, "a finite number >= 0"),
    ("request_throughput", math.inf, "a finite number >= 0"),
    ("median_ttft_ms", -1.0, "a finite number >= 0"),
    ("k", 0, "a number > 0"),
    ("k", -2, "a number > 0"),
    ("request_rate", 0.0, "a number > 0"),
])
def test_plot_refuses_values_no_figure_can_draw(tmp_path, monkeypatch, capsys, col, value, want):
    table = tmp_path / "aggregate.csv"
    _table({(col, 2): value}).to_csv(table, index=False)
    monkeypatch.setattr(sys, "argv", ["plot", str(table)])
    with pytest.raises(SystemExit) as exc:
        plot.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert f"column {col}, row 3:" in err[0] and want in err[0], err[0]
    assert not (tmp_path / "figures").exists()


def test_plot_refuses_a_bad_validation_table(tmp_path):
    table = tmp_path / "validation.csv"
    pd.DataFrame([{"policy": "cp1", "k": 8, "request_rate": math.inf, "metric": "mean_ttft_ms",
                   "predicted": -3.0, "measured": 4.0}]).to_csv(table, index=False)
    with pytest.raises(ValueError, match="column predicted, row 1: -3.0 is not a finite"):
        plot.plot_table(table)


def test_seeds_are_the_spread_of_one_point_and_each_figure_is_closed_once_saved(
        tmp_path, monkeypatch):
    seeds = 30
    df = pd.concat([_table().assign(seed=s, request_throughput=10.0 + s) for s in range(seeds)])
    table = tmp_path / "aggregate.csv"
    df.to_csv(table, index=False)
    plt.close("all")  # figures another test of this process left open are not plot's
    open_at_save = []
    save = plot.save

    def counting_save(fig, out, stem):
        open_at_save.append(len(plt.get_fignums()))
        return save(fig, out, stem)

    monkeypatch.setattr(plot, "save", counting_save)
    made = plot.plot_table(table)
    # a figure per configuration and kind, not per seed: req/s and latency versus k at each
    # of the 2 rates, latency versus load; each as PNG and SVG
    assert len(made) == (2 * 2 + 1) * 2
    assert max(open_at_save) == 1 and plt.get_fignums() == []
    figs = dict(plot.steps_figures(df[df["request_rate"] == 5.0]))
    (stem,) = [s for s in figs if s.startswith("reqs_vs_k")]
    assert f"seeds0-{seeds - 1}" in stem
    fig = figs[stem]
    legend = fig.legends[0].get_title().get_text()
    assert f"mean of {seeds} runs over {seeds} seeds; bars: min-max" in legend
    (bars,) = fig.axes[0].containers
    assert bars.has_yerr
    plt.close("all")
