"""result.json and the summary as vLLM benchmark_serving (v0.6) writes and prints them: the
--save-result header, generated_texts, goodput, --percentile-metrics / --metric-percentiles,
the per-request lists switched off; the run's files, run.log, summary.txt and its last line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments import run as run_module
from experiments.aggregate import aggregate
from experiments.metrics import (
    PER_REQUEST_KEYS,
    ResultSettings,
    format_summary,
    result_settings,
    save_result_metadata,
    summarize,
)
from experiments.run import CONF_DIR, generated_texts, run
from experiments.workload import load_tokenizer
from policies.request import Request

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["workload=synthetic", "workload.num_prompts=12", "model=tiny", "hardware=cpu",
         "overhead=none", "progress=false"]


def req(rid, arrival, token_times, *, finished=True):
    r = Request(rid, arrival, 10, max(len(token_times), 1))
    r.token_times = list(token_times)
    r.num_output_tokens = len(token_times)
    r.finish_time = token_times[-1] if finished and token_times else None
    return r


def hand_requests():
    # ttft 1.0 s, tpot 333 ms, e2el 2.0 s | one token: ttft = e2el = 0.2 s, tpot 0 | unfinished
    return [req(0, 0.0, [1.0, 1.5, 1.5, 2.0]), req(1, 1.0, [1.2]),
            req(2, 2.0, [2.5, 2.6], finished=False)]


def composed(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=list(overrides))


# --- settings ----------------------------------------------------------------------------------

def test_defaults_are_benchmark_serving_s():
    cfg = composed()
    s = result_settings(cfg.metrics, cfg.goodput)
    assert s == ResultSettings(("ttft", "tpot", "itl"), (99.0,), True, {})
    assert s.percentiles == {m: [99.0] for m in ("ttft", "tpot", "itl", "e2el")}


def test_comma_strings_and_lists_both_work():
    s = result_settings({"percentile_metrics": "e2el,ttft", "metric_percentiles": "50,90,99.9"},
                        {"ttft_ms": 200, "tpot_ms": None, "e2el_ms": 1500.5})
    assert s.percentile_metrics == ("e2el", "ttft") and s.metric_percentiles == (50, 90, 99.9)
    assert s.goodput == {"ttft": 200.0, "e2el": 1500.5}
    assert s.percentiles["ttft"] == [50, 90, 99, 99.9] and s.percentiles["itl"] == [99.0]
    assert result_settings({"percentile_metrics": ["itl"], "metric_percentiles": [25]},
                           {}).shown == {"itl": (25.0,)}


@pytest.mark.parametrize(("metrics", "goodput", "message"), [
    ({"percentile_metric": "ttft"}, {}, "metrics has no setting 'percentile_metric'"),
    ({"percentile_metrics": "ttft,latency"}, {}, "'latency' is not one of ttft, tpot, itl, e2el"),
    ({"percentile_metrics": ""}, {}, "metrics.percentile_metrics must name at least one"),
    ({"metric_percentiles": "99,101"}, {}, "metric_percentiles: '101' is not a number in"),
    ({"metric_percentiles": ["p99"]}, {}, "metric_percentiles: 'p99' is not a number in"),
    ({"save_per_request": "no"}, {}, "metrics.save_per_request must be true or false"),
    ({}, {"itl_ms": 5}, "goodput has no setting 'itl_ms'"),
    ({}, {"ttft_ms": -1}, r"goodput.ttft_ms must be a number of milliseconds >= 0"),
    ({}, {"tpot_ms": "fast"}, r"goodput.tpot_ms must be a number of milliseconds >= 0"),
    ({}, {"e2el_ms": True}, r"goodput.e2el_ms must be a number of milliseconds >= 0"),
    ({}, {"e2el_ms": float("nan")}, r"goodput.e2el_ms must be a number of milliseconds >= 0"),
])
def test_bad_settings_are_one_line_errors_naming_them(metrics, goodput, message):
    with pytest.raises(ValueError, match=message) as err:
        result_settings(metrics, goodput)
    assert "\n" not in str(err.value)


# --- metrics -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("slos", "good"), [
    ({"ttft": 500}, 1),  # request 0's TTFT is 1 s
    ({"ttft": 1000}, 2),  # an SLO is met at equality
    ({"tpot": 100}, 1),  # a one-token request has TPOT 0 for goodput (benchmark_serving)
    ({"tpot": 400}, 2),
    ({"ttft": 1000, "e2el": 1999}, 1),  # every SLO given must be met
    ({"ttft": 1000, "tpot": 400, "e2el": 2000}, 2),
    ({"ttft": 0}, 0),
])
def test_goodput_counts_completed_requests_meeting_every_slo(slos, good):
    s = summarize(hand_requests(), duration=4.0, goodput=slos)
    assert s["request_goodput"] == pytest.approx(good / 4.0)
    keys = list(s)
    assert keys.index("request_goodput") == keys.index("request_throughput") + 1
    # vllm bench serve writes the key always, null without an SLO
    assert summarize(hand_requests(), duration=4.0)["request_goodput"] is None


def test_per_request_lists_can_be_left_out():
    full = summarize(hand_requests(), duration=4.0, generated_texts=["a", "b", ""])
    assert full["generated_texts"] == ["a", "b", ""]
    bare = summarize(hand_requests(), duration=4.0, per_request=False)
    assert not set(PER_REQUEST_KEYS) & set(bare)
    assert bare == {k: v for k, v in full.items() if k not in PER_REQUEST_KEYS}
    with pytest.raises(ValueError, match="2 generated texts for 3 requests"):
        summarize(hand_requests(), duration=4.0, generated_texts=["a", "b"])


def test_per_metric_percentiles():
    s = summarize(hand_requests(), duration=4.0, percentiles={"ttft": [50, 99], "itl": [99]})
    assert s["p50_ttft_ms"] == pytest.approx(600) and "p99_itl_ms" in s
    assert "p50_itl_ms" not in s and "p99_e2el_ms" not in s
    assert "mean_e2el_ms" in s  # mean, median and std of every metric


def test_save_result_header_is_benchmark_serving_s():
    head = save_result_metadata(backend="schedlab-sim", model_id="llama3_8b",
                                tokenizer_id="meta-llama/Meta-Llama-3-8B", num_prompts=3,
                                request_rate=float("inf"), burstiness=1.0, max_concurrency=None,
                                date=datetime(2026, 12, 4, 1, 2, 3))
    assert list(head) == ["date", "endpoint_type", "backend", "label", "model_id",
                          "tokenizer_id", "num_prompts", "request_rate", "burstiness",
                          "max_concurrency"]
    assert head["endpoint_type"] == head["backend"] == "schedlab-sim" and head["label"] is None
    assert head["date"] == "20261204-010203"


def test_summary_prints_benchmark_serving_s_lines():
    s = {**save_result_metadata(backend="schedlab-sim", model_id="m", tokenizer_id=None,
                                num_prompts=3, request_rate=20, burstiness=0.5,
                                max_concurrency=8),
         **summarize(hand_requests(), duration=4.0, goodput={"ttft": 500},
                     percentiles={"ttft": [50, 99], "tpot": [99], "itl": [99], "e2el": [99]},
                     per_request=False)}
    text = format_summary(s, {"num_wasted_steps": 3}, shown={"ttft": (99.0, 50.0), "itl": (99,)})
    lines = text.splitlines()
    assert lines[:4] == ["Traffic request rate: 20.0",
                         "Burstiness factor: 0.5 (Gamma distribution)",
                         "Maximum request concurrency: 8",
                         "{:=^50}".format(" Serving Benchmark Result ")]
    assert f"{'Unfinished requests:':<40} 1" in lines  # from num_prompts, with no lists
    i = lines.index(f"{'Request throughput (req/s):':<40} 0.50")
    assert lines[i + 1] == f"{'Request goodput (req/s):':<40} 0.25"
    ttft = lines.index("{:-^50}".format("Time to First Token"))
    assert [line.split(":")[0] for line in lines[ttft + 1:ttft + 5]] == \
        ["Mean TTFT (ms)", "Median TTFT (ms)", "P99 TTFT (ms)", "P50 TTFT (ms)"]
    assert not any("TPOT" in line or "E2EL" in line for line in lines)  # not chosen
    assert any(line.startswith("num_wasted_steps (decode slots):") for line in lines)
    rate_inf = {**s, "request_rate": float("inf"), "burstiness": 1.0, "max_concurrency": None}
    assert format_summary(rate_inf).splitlines()[:3] == [
        "Traffic request rate: inf", "Burstiness factor: 1.0 (Poisson process)",
        "Maximum request concurrency: None"]


def test_generated_texts_decode_what_decodes():
    enc = load_tokenizer("meta-llama/Meta-Llama-3-8B")
    hello = list(enc.encode_ordinary("Hello, world"))
    done, unfinished = req(0, 0.0, [1.0]), req(1, 0.0, [1.0], finished=False)
    # an end-of-text token and an id past the tokenizer's vocabulary are skipped
    done.output_token_ids = hello[:2] + [128001, 300_000] + hello[2:]
    unfinished.output_token_ids = hello
    assert generated_texts([done, unfinished], enc) == ["Hello, world", ""]


# --- a run's files and lines -------------------------------------------------------------------

def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_run_writes_vllm_fields_summary_txt_and_run_log_and_says_where(tmp_path):
    p = cli(*SMALL, "workload.request_rate=40", "workload.max_concurrency=3",
            "goodput.ttft_ms=50", "goodput.e2el_ms=2000", "metrics.metric_percentiles=[50,99]",
            "metrics.percentile_metrics=[ttft,e2el]", "metrics.save_per_request=false",
            f"hydra.run.dir={tmp_path}")
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert re.fullmatch(r"\d{8}-\d{6}", res["date"])
    assert {k: res[k] for k in ("backend", "model_id", "tokenizer_id", "num_prompts",
                                "request_rate", "burstiness", "max_concurrency")} == {
        "backend": "schedlab-sim", "model_id": "tiny",
        "tokenizer_id": "meta-llama/Meta-Llama-3-8B", "num_prompts": 12, "request_rate": 40.0,
        "burstiness": 1.0, "max_concurrency": 3}
    assert 0 <= res["request_goodput"] <= res["request_throughput"]
    assert res["schedlab"]["goodput_slo_ms"] == {"ttft": 50.0, "e2el": 2000.0}
    for key in ("p50_ttft_ms", "p50_e2el_ms", "p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms",
                "mean_itl_ms", "std_e2el_ms"):  # chosen, and today's keys all kept
        assert key in res, key
    assert "p50_itl_ms" not in res and not set(PER_REQUEST_KEYS) & set(res)
    summary = (tmp_path / "summary.txt").read_text()
    assert "Request goodput (req/s):" in summary and "Maximum request concurrency: 3" in summary
    assert summary in p.stdout  # the printout is the file
    out = p.stdout.strip().splitlines()
    assert out[-1] == (f"results: {tmp_path}{os.sep} (result.json, requests.csv, steps.csv, "
                       "summary.txt, run.log)")
    log = (tmp_path / "run.log").read_text()
    assert "Serving Benchmark Result" in log and "Request goodput (req/s):" in log
    bad = cli(*SMALL, "goodput.tpot_ms=-5", f"hydra.run.dir={tmp_path / 'bad'}")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "error: goodput.tpot_ms must be a number of milliseconds >= 0 (or null), got -5"]
    assert "goodput.tpot_ms" in (tmp_path / "bad" / "run.log").read_text()  # in the log too

    # the aggregate table carries goodput, the limit and the chosen percentiles
    df = aggregate(tmp_path)
    assert df.loc[0, "max_concurrency"] == 3
    assert df.loc[0, "request_goodput"] == pytest.approx(res["request_goodput"])
    assert df.loc[0, "p50_e2el_ms"] == pytest.approx(res["p50_e2el_ms"])


def test_a_long_write_is_announced(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_module, "LONG_WRITE_REQUESTS", 12)
    run(composed(*SMALL), tmp_path)
    out = capsys.readouterr().out.splitlines()
    i = out.index(f"writing results to {tmp_path} ...")
    assert i < out.index("{:=^50}".format(" Serving Benchmark Result "))
    monkeypatch.setattr(run_module, "LONG_WRITE_REQUESTS", 13)
    run(composed(*SMALL), tmp_path)
    assert "writing results" not in capsys.readouterr().out


def test_a_long_run_ends_its_process_without_freeing_its_objects(tmp_path):
    """The command line's long run leaves its objects to the OS at exit: its files are whole,
    the atexit handlers run, stdout is flushed and the status is 0; a run inside a program that
    goes on (run() called) keeps nothing."""
    code = (
        "import atexit, sys\n"
        "import experiments.run as r\n"
        "r.LONG_WRITE_REQUESTS = 12\n"
        "atexit.register(lambda: print('left', len(r._left_to_exit)))\n"
        f"sys.argv = ['run', *{SMALL!r}, 'hydra.run.dir={tmp_path}']\n"
        "r.main()\n"
        "print('not reached')\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.endswith("left 1\n") and "not reached" not in p.stdout
    assert f"results: {tmp_path}" in p.stdout
    assert json.loads((tmp_path / "result.json").read_text())["completed"] == 12
    assert "results:" in (tmp_path / "run.log").read_text()


def test_only_a_long_single_run_of_the_command_line_is_left_to_exit(tmp_path, monkeypatch):
    """run() keeps nothing unless the command line will end the process after it: not in a
    program that goes on, not a run of a sweep, not a short run."""
    monkeypatch.setattr(run_module, "LONG_WRITE_REQUESTS", 12)
    run(composed(*SMALL), tmp_path / "a")
    assert not run_module._left_to_exit  # main() was not called
    monkeypatch.setattr(run_module, "LEAVE_TO_EXIT", True)
    monkeypatch.setattr(run_module, "_left_to_exit", [])
    run(composed(*SMALL), tmp_path / "b", sweep_label="x=1")
    run(composed(*SMALL, "workload.num_prompts=11"), tmp_path / "c")
    assert not run_module._left_to_exit
    run(composed(*SMALL), tmp_path / "d")
    assert len(run_module._left_to_exit) == 1


@pytest.mark.parametrize("watch", ["cProfile", "trace"])
def test_a_profiled_run_exits_normally(watch):
    """Under a profiler or tracer (python -m cProfile, coverage, pdb) the process exits as
    usual: the profiler writes its report at exit."""
    start, stop = {"cProfile": ("import cProfile; p = cProfile.Profile(); p.enable()",
                                "p.disable()"),
                   "trace": ("sys.settrace(lambda *args: None)", "sys.settrace(None)")}[watch]
    code = ("import sys\n"
            "from experiments.run import exit_leaving_objects\n"
            f"{start}\n"
            "exit_leaving_objects()\n"
            f"{stop}\n"
            "print('went on')\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert (p.returncode, p.stdout) == (0, "went on\n"), p.stderr[-2000:]


def test_a_thread_still_running_keeps_the_normal_exit():
    code = ("import threading, time\n"
            "from experiments.run import exit_leaving_objects\n"
            "done = threading.Event()\n"
            "t = threading.Thread(target=lambda: (done.wait(), print('thread ended')))\n"
            "t.start()\n"
            "exit_leaving_objects()\n"
            "print('went on')\n"
            "done.set()\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert (p.returncode, p.stdout) == (0, "went on\nthread ended\n"), p.stderr[-2000:]


def test_vllm_files_goodput_key_is_read(tmp_path):
    """vLLM writes 'request_goodput:' (its key has a colon); the table reads it."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "result.json").write_text(json.dumps({
        "backend": "vllm", "model_id": "m", "request_rate": 10.0, "burstiness": 1.0,
        "max_concurrency": 16, "num_prompts": 5, "completed": 5, "request_throughput": 2.0,
        "request_goodput:": 1.5, "p90_ttft_ms": 12.0}))
    df = aggregate(tmp_path)
    assert df.loc[0, "request_goodput"] == 1.5 and df.loc[0, "max_concurrency"] == 16
    assert df.loc[0, "p90_ttft_ms"] == 12.0


def test_progress_bar_counts_requests_finished_not_a_rate(capsys):
    from policies import ModelSpec, SchedulerConfig, make_scheduler
    from simulator import OverheadSpec, simulate
    from simulator.hardware import HardwareSpec

    cfg = composed(*SMALL)
    model = ModelSpec.from_dict(run_module.plain(cfg.model))
    requests = [Request(i, 0.0, 16, 4) for i in range(5)]
    simulate(requests, lambda n: make_scheduler("single_step", {}, SchedulerConfig(), n, 4096),
             model, HardwareSpec.from_dict(run_module.plain(cfg.hardware)),
             OverheadSpec.from_dict(run_module.plain(cfg.overhead)), progress=True)
    bar = capsys.readouterr().err
    assert "5/5 requests finished" in bar and "/s" not in bar


def _guidellm_request(start, first, last, chunks, prompt, output):
    return {"info": {"timings": {"request_start": start, "first_token_iteration": first,
                                 "last_token_iteration": last, "request_end": last,
                                 "token_iterations": chunks}},
            "input_metrics": {"text_tokens": prompt}, "output_metrics": {"text_tokens": output}}


def test_loadgen_result_uses_vllm_s_names():
    """experiments.loadgen's result: failed (not num_failed), latencies and start_times, goodput
    null without an SLO, and vLLM's peaks; the same names the simulator writes."""
    from experiments.loadgen import summarize_report

    report = {"benchmarks": [{"requests": {
        "successful": [_guidellm_request(100.0, 100.5, 101.5, 3, 10, 3),
                       _guidellm_request(100.25, 101.0, 101.0, 1, 20, 1)],
        "errored": [{"info": {"timings": {"request_start": 100.1}}}], "incomplete": []}}]}
    s = summarize_report(report, num_prompts=3)
    assert s["failed"] == 1 and "num_failed" not in s and s["completed"] == 2
    assert s["request_goodput"] is None
    assert s["latencies"] == s["e2els"] == pytest.approx([1.5, 0.75])
    assert s["start_times"] == pytest.approx([0.0, 0.25])  # after the first send
    # chunks at 0.5, 1.0, 1.5 (request 0) and 1.0 (request 1) after the first send: seconds
    # 0 and 1 hold 1 and 3; both requests are active in seconds 0 and 1
    assert s["max_output_tokens_per_s"] == 3.0 and s["max_concurrent_requests"] == 2


def test_a_run_asks_numpy_for_no_huge_pages_unless_the_environment_says(monkeypatch):
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # numpy 2, numpy 1
    setting = core.multiarray._set_madvise_hugepage  # returns the setting it replaces
    before = setting(True)
    try:
        monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", "1")
        run_module.no_huge_pages()
        assert setting(True) is True  # the user's choice kept
        monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE")
        run_module.no_huge_pages()
        assert setting(True) is False
    finally:
        setting(before)
