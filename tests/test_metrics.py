"""Serving metrics: hand-worked TTFT/TPOT/ITL/E2EL, an independent recomputation of every
summary number from the per-request lists, and the atomic result files."""

from __future__ import annotations

import csv
import json
import math
import os
import pickle
import random
import statistics
from dataclasses import dataclass

import numpy as np
import pytest

from experiments import request_times as request_times_module
from experiments import result_files
from experiments.metrics import format_summary, summarize
from experiments.request_times import RequestTimes, TimesRecorder, TimesTable, request_times
from experiments.result_files import REQUEST_CSV_COLUMNS, write_results
from policies.request import Request


def req(rid, arrival, prompt_len, token_times, *, finished=True, first_scheduled=None,
        preemptions=0):
    r = Request(rid, arrival, prompt_len, max(len(token_times), 1))
    r.token_times = list(token_times)
    r.num_output_tokens = len(token_times)
    r.first_scheduled_time = first_scheduled
    r.num_preemptions = preemptions
    r.finish_time = token_times[-1] if finished and token_times else None
    return r


def hand_requests():
    return [
        # Two tokens share the delivery at 1.5 s (one chunk): chunks 1.0, 1.5, 2.0.
        req(0, 0.0, 10, [1.0, 1.5, 1.5, 2.0], first_scheduled=0.25, preemptions=1),
        req(1, 1.0, 20, [1.2], first_scheduled=1.0),  # one token: no TPOT, no ITL
        req(2, 2.0, 30, [2.5, 2.6], finished=False),  # still running when the run ended
    ]


def test_hand_worked_numbers():
    s = summarize(hand_requests(), duration=4.0)
    assert s["completed"] == 2
    assert s["total_input_tokens"] == 30  # completed requests only, as benchmark_serving
    assert s["total_output_tokens"] == 5
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(1.25)
    assert s["total_token_throughput"] == pytest.approx(8.75)
    assert s["input_lens"] == [10, 20, 30]
    assert s["output_lens"] == [4, 1, 0]
    assert s["ttfts"] == pytest.approx([1.0, 0.2, 0.0])
    assert s["e2els"] == pytest.approx([2.0, 0.2, 0.0])
    assert s["itls"][0] == pytest.approx([0.5, 0.5]) and s["itls"][1:] == [[], []]
    assert s["errors"] == ["", "", "unfinished"]
    assert s["failed"] == 1  # vllm bench serve's name for requests that did not complete
    assert s["latencies"] == s["e2els"] and s["start_times"] == [0.0, 1.0, 2.0]
    # vLLM's peaks, by whole seconds from the first send: chunks at 1.0, 1.5 and 1.2 in second
    # 1, at 2.0 in second 2; request 0 active in seconds 0-2, request 1 in second 1
    assert s["max_output_tokens_per_s"] == 3.0 and s["max_concurrent_requests"] == 2
    assert s["request_goodput"] is None  # no SLO given
    # TTFT over {1.0, 0.2} s
    assert s["mean_ttft_ms"] == pytest.approx(600)
    assert s["median_ttft_ms"] == pytest.approx(600)
    assert s["std_ttft_ms"] == pytest.approx(400)  # population std, like np.std
    assert s["p99_ttft_ms"] == pytest.approx(200 + 0.99 * 800)  # linear interpolation
    # TPOT only for request 0: (2.0 - 1.0) / 3
    for stat in ("mean", "median", "p99"):
        assert s[f"{stat}_tpot_ms"] == pytest.approx(1000 / 3)
    assert s["std_tpot_ms"] == pytest.approx(0)
    # ITLs pooled: [0.5, 0.5]
    assert s["mean_itl_ms"] == pytest.approx(500) and s["p99_itl_ms"] == pytest.approx(500)
    # E2EL over {2.0, 0.2}
    assert s["mean_e2el_ms"] == pytest.approx(1100)
    assert s["median_e2el_ms"] == pytest.approx(1100)
    assert s["p99_e2el_ms"] == pytest.approx(200 + 0.99 * 1800)


def test_multi_step_bursts_make_itl_and_tpot_diverge():
    # k = 4: four tokens arrive together every 40 ms.
    times = [0.1 + 0.04 * (i // 4) for i in range(16)]
    t = request_times(req(0, 0.0, 8, times))
    assert t.num_chunks == 4
    assert t.itls == pytest.approx([0.04] * 3)
    assert t.tpot == pytest.approx(0.12 / 15)
    assert t.ttft == pytest.approx(0.1) and t.e2el == pytest.approx(0.22)


def test_empty_lists_report_zero():
    s = summarize([req(0, 0.0, 5, [0.5]), req(1, 0.0, 5, [], finished=False)], duration=1.0)
    for key in ("tpot", "itl"):
        for stat in ("mean", "median", "std", "p99"):
            assert s[f"{stat}_{key}_ms"] == 0.0
    s = summarize([req(0, 0.0, 5, [], finished=False)], duration=1.0)
    assert s["completed"] == 0 and s["mean_ttft_ms"] == 0.0 and s["request_throughput"] == 0.0
    assert summarize([], duration=1.0)["completed"] == 0


def percentile(xs, p):
    """Linear interpolation between closest ranks (numpy's default), written out."""
    xs = sorted(xs)
    h = (len(xs) - 1) * p / 100
    lo = math.floor(h)
    return xs[lo] + (h - lo) * (xs[min(lo + 1, len(xs) - 1)] - xs[lo])


def recompute(s):
    """Every summary number from the per-request lists alone, without numpy."""
    done = [i for i, e in enumerate(s["errors"]) if e == ""]
    out = {"completed": len(done),
           "total_input_tokens": sum(s["input_lens"][i] for i in done),
           "total_output_tokens": sum(s["output_lens"][i] for i in done)}
    d = s["duration"]
    out["failed"] = len(s["errors"]) - len(done)
    out["request_throughput"] = len(done) / d
    out["request_goodput"] = None  # no SLO given
    out["output_throughput"] = out["total_output_tokens"] / d
    out["max_output_tokens_per_s"], out["max_concurrent_requests"] = vllm_peaks(s, done)
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / d
    series = {
        "ttft": [s["ttfts"][i] for i in done],
        "e2el": [s["e2els"][i] for i in done],
        "itl": [x for i in done for x in s["itls"][i]],
        "tpot": [(s["e2els"][i] - s["ttfts"][i]) / (s["output_lens"][i] - 1)
                 for i in done if s["output_lens"][i] > 1],
    }
    for key, xs in series.items():
        xs = xs or [0.0]
        out[f"mean_{key}_ms"] = statistics.fmean(xs) * 1000
        out[f"median_{key}_ms"] = statistics.median(xs) * 1000
        out[f"std_{key}_ms"] = statistics.pstdev(xs) * 1000
        out[f"p99_{key}_ms"] = percentile(xs, 99) * 1000
    return out


def vllm_peaks(s, done):
    """vllm bench serve's calculate_metrics loop for its peaks, written out: second buckets
    from the first send, a token at start + ttft and one more at each ITL after it, a request
    active in every bucket from its send to its end."""
    if not done:
        return 0.0, 0
    t0 = min(s["start_times"][i] for i in done)
    last = max(s["start_times"][i] + s["latencies"][i] for i in done)
    n = math.ceil(last - t0) + 1
    tokens, active = [0] * n, [0] * n
    for i in done:
        t = s["start_times"][i] + s["ttfts"][i]
        times = [t]
        for gap in s["itls"][i]:
            t += gap
            times.append(t)
        for t in times:
            if 0 <= int(t - t0) < n:
                tokens[int(t - t0)] += 1
        for b in range(int(s["start_times"][i] - t0),
                       int(s["start_times"][i] + s["latencies"][i] - t0) + 1):
            active[b] += 1
    return float(max(tokens)), max(active)


def random_requests(seed, n=60):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        arrival = rng.uniform(0, 10)
        t = arrival + rng.uniform(0.01, 2)
        times = []
        for _ in range(rng.choice([1, 1, 2, 5, 17, 40])):
            if times and rng.random() < 0.6:  # often several tokens per chunk
                t += rng.choice([0.0, 0.0, rng.uniform(0.001, 0.2)])
            times.append(t)
        out.append(req(i, arrival, rng.randint(1, 900), times, finished=rng.random() < 0.85))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_summary_number_recomputed_from_the_lists(seed):
    reqs = random_requests(seed)
    s = summarize(reqs, duration=12.5)
    expected = recompute(s)
    for key, value in expected.items():
        if value is None:  # (pytest.approx of None is an error from pytest 9.2)
            assert s[key] is None, key
        else:
            assert s[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key
    keys = set(expected) | {"duration", "input_lens", "output_lens", "ttfts", "itls", "e2els",
                            "latencies", "start_times", "generated_texts", "errors"}
    assert set(s) == keys  # nothing reported that was not checked
    assert s["generated_texts"] == [""] * len(reqs)  # no text: empty, as benchmark_serving's
    # vLLM's names: latencies are the E2ELs (e2els kept for older readers), start_times the sends
    assert s["latencies"] == s["e2els"]
    assert s["start_times"] == [r.arrival_time for r in reqs]
    assert s["max_concurrent_requests"] >= 2 and s["max_output_tokens_per_s"] >= 10
    # And the lists themselves against the requests.
    for r, ttft, e2el, itls in zip(reqs, s["ttfts"], s["e2els"], s["itls"], strict=True):
        if r.finish_time is None:
            continue
        chunks = sorted(set(r.token_times))
        assert ttft == pytest.approx(chunks[0] - r.arrival_time)
        assert e2el == pytest.approx(chunks[-1] - r.arrival_time)
        assert itls == pytest.approx([b - a for a, b in zip(chunks[:-1], chunks[1:], strict=True)])


def test_more_percentiles():
    s = summarize(random_requests(4), duration=3.0, percentiles=(50, 90, 99.9))
    assert s["p50_ttft_ms"] == pytest.approx(s["median_ttft_ms"])
    assert "p90_itl_ms" in s and "p99.9_e2el_ms" in s and "p99_ttft_ms" not in s


@pytest.mark.parametrize("make, match", [
    (lambda: [req(3, 1.0, 5, [2.0, 1.5])], r"request 3: token_times go backwards"),
    (lambda: [req(3, 1.0, 5, [0.5])], r"request 3: first token at 0\.5 is before its arrival"),
    (lambda: [req(3, 1.0, 5, [])], r"request 3 finished but has no token_times"),
    # among others (the times of many requests are checked together): the right one is named
    (lambda: [req(1, 0.0, 5, [1.0, 1.0, 3.0]), req(2, 0.0, 5, [0.5]),
              req(3, 1.0, 5, [2.0, 2.5, 1.5]), req(4, 0.0, 5, [9.0, 1.0])],
     r"request 3: token_times go backwards \(2\.5 then 1\.5\)"),
    (lambda: [req(1, 0.0, 5, [1.0, 2.0]), req(5, 3.0, 5, [3.5]), req(3, 1.0, 5, [0.5])],
     r"request 3: first token at 0\.5 is before its arrival"),
])
def test_inconsistent_requests_are_named(make, match):
    reqs = make()
    for r in reqs:
        if not r.token_times:
            r.finish_time = 2.0
    with pytest.raises(ValueError, match=match):
        summarize(reqs, duration=1.0)


def test_token_count_mismatch_and_bad_duration():
    r = req(4, 0.0, 5, [1.0, 2.0])
    r.num_output_tokens = 3
    with pytest.raises(ValueError, match=r"request 4 has 2 token_times but num_output_tokens"):
        summarize([r], duration=1.0)
    for d in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="duration must be a finite number > 0"):
            summarize(hand_requests(), duration=d)
    with pytest.raises(ValueError, match="percentiles must lie in"):
        summarize(hand_requests(), duration=1.0, percentiles=(101,))


@dataclass
class Step:
    time: float
    num_seqs: int
    num_steps: int


def test_write_results(tmp_path):
    reqs = hand_requests()
    s = summarize(reqs, duration=4.0)
    extra = {"backend": "sim", "policy": "multi_step", "k": 8,
             "workload": {"kind": "sharegpt", "request_rate": float("inf")}}
    out = write_results(tmp_path / "run", s, reqs, extra, steps=[Step(0.1, 3, 8), Step(0.2, 2, 8)])
    assert out == tmp_path / "run" / "result.json"
    text = out.read_text()
    assert "Infinity" not in text  # strict JSON
    result = json.loads(text)
    assert result["schedlab"]["workload"]["request_rate"] == "inf"
    assert {k: result[k] for k in s} == s
    with open(tmp_path / "run" / "requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == REQUEST_CSV_COLUMNS
    assert rows[0]["num_chunks"] == "3" and rows[0]["num_preemptions"] == "1"
    assert float(rows[0]["tpot"]) == pytest.approx(1 / 3)
    assert float(rows[0]["first_scheduled_time"]) == 0.25
    assert rows[1]["tpot"] == "" and rows[2]["ttft"] == "" and rows[2]["finish_time"] == ""
    assert rows[2]["output_len"] == "2"  # generated so far
    steps = (tmp_path / "run" / "steps.csv").read_text().splitlines()
    assert steps == ["time,num_seqs,num_steps", "0.1,3,8", "0.2,2,8"]
    assert sorted(os.listdir(tmp_path / "run")) == ["requests.csv", "result.json", "steps.csv"]


def test_failed_write_leaves_old_files_and_no_temp_files(tmp_path, monkeypatch):
    reqs = hand_requests()
    s = summarize(reqs, duration=4.0)
    write_results(tmp_path, s, reqs, {"k": 1})
    before = {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)}
    with pytest.raises(ValueError, match="cannot be written as JSON"):
        write_results(tmp_path, s, reqs, {"k": 2, "bad": object()})
    assert {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)} == before

    real_replace = os.replace

    def crash_on_result(src, dst):
        if str(dst).endswith("result.json"):
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(result_files.os, "replace", crash_on_result)
    with pytest.raises(OSError, match="disk full"):
        write_results(tmp_path, s, reqs, {"k": 3})
    # neither the old run's files nor part of the new run's (no mix of two runs); no *.tmp
    assert os.listdir(tmp_path) == []


def test_format_summary():
    s = summarize(hand_requests(), duration=4.0)
    text = format_summary(s, {"backend": "sim", "policy": "cp2", "k": 8,
                              "workload": {"kind": "sharegpt", "request_rate": float("inf")}})
    lines = text.splitlines()
    assert lines[0] == "{:=^50}".format(" Serving Benchmark Result ")
    assert lines[-1] == "=" * 50
    assert f"{'Successful requests:':<40} 2" in lines[1]
    assert any(line.startswith("Unfinished requests:") and line.endswith("1") for line in lines)
    assert any(line.startswith("Mean TTFT (ms):") and "600.00" in line for line in lines)
    assert any(line.startswith("P99 E2EL (ms):") for line in lines)
    assert any(line.startswith("Median TPOT (ms):") and "333.33" in line for line in lines)
    assert any(line.startswith("k:") and line.endswith(" 8") for line in lines)
    assert any(line.startswith("workload:") and line.endswith("kind=sharegpt request_rate=inf")
               for line in lines)
    assert len(lines) < 40  # one screen


def test_the_summary_says_what_vllm_counts_where_its_numbers_look_wrong():
    """Multi-step k = 4 (four tokens a chunk, a chunk every 40 ms): the peak counts chunks, so it
    is below the mean, and ITL spans a chunk's four tokens; a line under each says why. A run
    whose tokens stream one a chunk has neither line."""
    from experiments.metrics import ITL_NOTE, PEAK_NOTE

    bursts = [req(i, 0.0, 8, [0.1 + 0.04 * (j // 4) for j in range(64)]) for i in range(4)]
    s = summarize(bursts, duration=0.74)
    assert s["max_output_tokens_per_s"] < s["output_throughput"]
    assert s["mean_itl_ms"] >= 2 * s["mean_tpot_ms"]
    lines = format_summary(s).splitlines()
    peak = next(i for i, line in enumerate(lines) if line.startswith("Peak output token"))
    assert lines[peak + 1] == PEAK_NOTE
    assert lines[lines.index(next(x for x in lines if x.startswith("P99 ITL"))) + 1] == ITL_NOTE
    assert "vLLM counts one token per streamed chunk" in PEAK_NOTE
    assert "gap between streamed chunks" in ITL_NOTE
    steady = [req(i, 0.0, 8, [0.1 + 0.01 * j for j in range(300)]) for i in range(2)]
    lines = format_summary(summarize(steady, duration=3.1)).splitlines()
    assert PEAK_NOTE not in lines and ITL_NOTE not in lines


def test_atomic_writes_get_ordinary_permissions(tmp_path):
    import os
    import stat

    from experiments.files import write_text_atomic

    umask = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "x.txt", "hi")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "x.txt").stat().st_mode) == 0o644


def _same_table(a, b) -> None:
    for name in ("completed", "output_len", "ttft", "e2el", "num_chunks", "itl_start"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    assert np.array_equal(a.tpot, b.tpot, equal_nan=True)
    assert a.itls.tolist() == b.itls.tolist()


def _reference_times(req) -> RequestTimes:
    """request_times as a loop over one request's tokens: the chunks are its distinct times."""
    if req.finish_time is None:
        return RequestTimes(completed=False, output_len=0)
    times = list(req.token_times)
    chunks = list(dict.fromkeys(times))
    ttft, e2el = chunks[0] - req.arrival_time, chunks[-1] - req.arrival_time
    return RequestTimes(True, len(times), ttft, e2el,
                        (e2el - ttft) / (len(times) - 1) if len(times) > 1 else None,
                        [b - a for a, b in zip(chunks, chunks[1:])], len(chunks))


def test_times_recorded_in_any_finish_order_equal_the_times_of_the_whole_run(monkeypatch):
    """The simulator's TimesRecorder, fed requests as they finish (any order, a few at a time
    as windows finish them, the unfinished never), gives the table of each request's times
    taken one at a time, ITLs in request order, also when it works them out and reorders them
    a few requests at a time; so does TimesTable.of_requests."""
    monkeypatch.setattr(request_times_module, "CHUNK_REQUESTS", 7)
    monkeypatch.setattr(TimesRecorder, "PENDING", 6)
    reqs = random_requests(3, n=50)
    recorder = TimesRecorder(len(reqs))
    order = [i for i in random.Random(4).sample(range(len(reqs)), len(reqs))
             if reqs[i].finish_time is not None]
    sizes = random.Random(5)
    while order:
        batch = order[:sizes.randint(1, 5)]
        order = order[len(batch):]
        recorder.record(batch, [reqs[i] for i in batch])
    reference = TimesTable.of([_reference_times(r) for r in reqs])
    _same_table(recorder.table(), reference)
    _same_table(TimesTable.of_requests(reqs), reference)
    assert request_times(reqs[0]) == _reference_times(reqs[0])


def _as_runs(reqs, rng, logs):
    """Each finished request's token times cut where chance says: a head left on the request
    and a run of one of ``logs`` holding the rest (the simulator's decode-group form)."""
    out = []
    for r in reqs:
        times = list(r.token_times)
        cut = rng.choice([0, 0, 1, len(times) // 2, len(times)])
        log = rng.choice(logs)
        # other members' positions (times going back) before it; now and then far back
        log.extend([-1.0] * (rng.randint(0, 2) if rng.random() < 0.9 else 6000))
        start = len(log)
        log.extend(times[cut:])
        # a copy of the request holding its head only
        head = req(r.request_id, r.arrival_time, r.prompt_len, times[:cut], finished=True)
        head.num_output_tokens = len(times)
        out.append((head, start, start + len(times) - cut, log))
    return out


def test_times_recorded_as_runs_of_a_shared_log_equal_the_times_taken_whole(monkeypatch):
    """Requests whose last tokens are runs of a decode group's log (simulator.front_end), fed to
    the TimesRecorder with the log, give the table of their whole times: a head's last time
    equal to its run's first (one chunk) or not, empty heads, empty runs, two logs, and runs
    far apart (taken one by one)."""
    monkeypatch.setattr(request_times_module, "CHUNK_REQUESTS", 7)
    monkeypatch.setattr(TimesRecorder, "PENDING", 9)
    rng = random.Random(7)
    reqs = random_requests(11, n=80)
    done = [r for r in reqs if r.finish_time is not None]
    for r in done[:6]:  # the head's last token and the run's first delivered together
        r.token_times = [r.token_times[0]] * 2 + list(r.token_times[1:])
        r.num_output_tokens = len(r.token_times)
    recorder = TimesRecorder(len(reqs))
    logs: list[list[float]] = [[], []]
    cut = _as_runs(done, rng, logs)
    arrays = [np.array(log) for log in logs]
    for i in range(0, len(cut), 4):
        batch = cut[i:i + 4]
        for which in (0, 1):
            mine = [c for c in batch if c[3] is logs[which]]
            if mine:
                recorder.record([c[0].request_id for c in mine], [c[0] for c in mine],
                                (arrays[which], [(c[1], c[2]) for c in mine]))
    _same_table(recorder.table(), TimesTable.of([_reference_times(r) for r in reqs]))


def test_a_run_that_goes_backwards_is_named():
    r = req(3, 0.0, 10, [0.5], finished=True)
    r.num_output_tokens = 4
    recorder = TimesRecorder(5)
    recorder.record([3], [r], (np.array([9.0, 1.0, 2.0, 1.5, 3.0]), [(1, 4)]))
    with pytest.raises(ValueError, match=r"request 3: token_times go backwards \(2.0 then 1.5\)"):
        recorder.table()
    short = req(4, 0.0, 10, [0.5], finished=True)
    short.num_output_tokens = 5
    recorder = TimesRecorder(5)
    recorder.record([4], [short], (np.array([1.0, 2.0]), [(0, 2)]))
    with pytest.raises(ValueError, match="request 4 has 3 token_times but num_output_tokens = 5"):
        recorder.table()


def test_streamed_result_json_is_the_json_of_the_whole_lists(tmp_path, monkeypatch):
    """result.json written with its per-request lists streamed a few requests at a time holds
    the bytes json.dumps gives for the whole lists (chunks joined, empty ITL lists and all)."""
    monkeypatch.setattr(request_times_module, "CHUNK_REQUESTS", 4)
    reqs = random_requests(5, n=23)
    times = TimesTable.of_requests(reqs)
    whole = summarize(reqs, duration=12.0, times=times)
    streamed = summarize(reqs, duration=12.0, times=times, streamed=True)
    assert streamed["itls"] == whole["itls"] and streamed["ttfts"][-1] == whole["ttfts"][-1]
    write_results(tmp_path / "a", whole, reqs, {"k": 1}, times=times)
    write_results(tmp_path / "b", streamed, reqs, {"k": 1}, times=times)
    text = (tmp_path / "b" / "result.json").read_text()
    assert text == (tmp_path / "a" / "result.json").read_text()
    assert text == json.dumps({**whole, "schedlab": {"k": 1}})
    assert (tmp_path / "a" / "requests.csv").read_text() == \
        (tmp_path / "b" / "requests.csv").read_text()
    # a run's result, lists and all, can be pickled (a launcher may send it between processes)
    assert pickle.loads(pickle.dumps(streamed))["itls"] == whole["itls"]


def test_a_streamed_list_writes_non_finite_numbers_as_the_whole_list_does():
    column = np.array([1.5, np.inf, np.nan, -np.inf])
    assert list(result_files.PerRequest.of(column)) == [1.5, "inf", "nan", "-inf"]
    assert result_files.PerRequest.of(column) == result_files._jsonable(column.tolist())


def test_the_peaks_computed_a_few_requests_at_a_time_are_the_peaks_of_the_whole_run(
        monkeypatch):
    """vLLM's peaks, computed 3 requests at a time (the running sum of ITLs carried over), are
    those of the whole run at once."""
    reqs = random_requests(8, n=90)
    whole = summarize(reqs, duration=12.0)
    monkeypatch.setattr(request_times_module, "CHUNK_REQUESTS", 3)
    chunked = summarize(reqs, duration=12.0)
    assert whole["max_output_tokens_per_s"] > 1
    for key in ("max_output_tokens_per_s", "max_concurrent_requests"):
        assert chunked[key] == whole[key]


def test_the_peaks_of_a_run_spanning_1e9_seconds_take_memory_as_its_tokens_do():
    """A few requests 5e8 s apart (a think time's waits) are counted in the seconds that hold
    their tokens: before, one slot a simulated second (8 GB here, 60 GiB and a MemoryError
    after the simulation at think_time=1e9)."""
    import tracemalloc

    reqs = [req(0, 0.0, 5, [1.0, 1.5, 1.5, 2.0]),  # chunks 1.0, 1.5 | 2.0
            req(1, 5e8, 5, [5e8 + 0.1, 5e8 + 0.4, 5e8 + 0.9, 5e8 + 1.2]),  # 3 in second 5e8
            req(2, 5e8 + 0.5, 5, [5e8 + 0.6]),  # 4 tokens, 2 requests in second 5e8
            req(3, 1e9, 5, [1e9 + 0.2, 1e9 + 3.0])]
    tracemalloc.start()
    try:
        s = summarize(reqs, duration=1e9 + 3.0, per_request=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (s["max_output_tokens_per_s"], s["max_concurrent_requests"]) == (4.0, 2)
    assert peak < 1 << 20


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_peaks_counted_in_occupied_seconds_only_are_those_of_every_second(seed,
                                                                              monkeypatch):
    """A run spanning more seconds than it has tokens has its peaks counted in the seconds
    that hold them; the numbers are those of one slot a second, and vLLM's loop's."""
    from experiments import metrics

    reqs = random_requests(seed)
    for r in reqs[::3]:  # long waits between some requests: seconds with nothing in them
        r.arrival_time += 1000.0
        r.token_times = [t + 1000.0 for t in r.token_times]
        r.finish_time = r.finish_time and r.finish_time + 1000.0
    dense = summarize(reqs, duration=1020.0)
    counted = []

    class Occupied(metrics.PerSecond):
        def __init__(self, buckets, dense):
            counted.append(dense)
            super().__init__(buckets, False)

    monkeypatch.setattr(metrics, "PerSecond", Occupied)
    sparse = summarize(reqs, duration=1020.0)
    assert counted == [True, True]  # a short run's seconds are counted one slot each
    expected = vllm_peaks(dense, [i for i, e in enumerate(dense["errors"]) if e == ""])
    for s in (dense, sparse):
        assert (s["max_output_tokens_per_s"], s["max_concurrent_requests"]) == expected


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 100_003])
def test_a_statistic_is_numpys_to_the_last_bit(n):
    """_stats_ms works np.std out in its own scratch array and partitions a copy for the order
    statistics: the numbers numpy gives, exactly."""
    from experiments.metrics import _stats_ms

    x = np.random.default_rng(n).lognormal(-3, 1.5, n)
    stats = _stats_ms(x, [50, 90, 99.9])
    assert stats == {"mean": float(np.mean(x)) * 1000, "median": float(np.median(x)) * 1000,
                     "std": float(np.std(x)) * 1000, "p50": float(np.percentile(x, 50)) * 1000,
                     "p90": float(np.percentile(x, 90)) * 1000,
                     "p99.9": float(np.percentile(x, 99.9)) * 1000}


def test_a_request_recorded_twice_is_an_error():
    reqs = random_requests(2, n=10)
    done = [i for i, r in enumerate(reqs) if r.finish_time is not None][:2]
    for batches in ([done, done[:1]], [done + done[:1]]):  # in two work-outs, or in one
        recorder = TimesRecorder(len(reqs))
        with pytest.raises(ValueError, match=f"request number {done[0]} was recorded as "
                                             "finished twice"):
            for batch in batches:
                recorder.record(batch, [reqs[i] for i in batch])
                recorder._work_out()
