"""Workload input a user gets wrong: trace times, columns and encodings, settings of the wrong
type, and workloads too large for memory. Each is a one-line error naming the file or setting."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from experiments.workload import build_workload, footprint, read_trace, to_request
from experiments.workload.footprint import run_bytes

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data"
HEADER = "arrival_time,prompt_len,output_len\n"


def trace(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "t.csv"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def one_line_error(path_or_cfg, match: str, **kw) -> str:
    with pytest.raises(ValueError, match=match) as err:
        if isinstance(path_or_cfg, Path):
            read_trace(path_or_cfg)
        else:
            build_workload(path_or_cfg, **kw)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


# --------------------------------------------------------------------------- trace times

def test_epoch_stamped_trace_replays_from_its_first_arrival():
    specs = build_workload({"kind": "trace", "trace_path": str(DATA / "trace_epoch.csv")})
    assert [(s.arrival_time, s.prompt_len, s.output_len) for s in specs] == [
        (0.0, 64, 16), (0.5, 128, 32), (2.25, 32, 8)]


def test_trace_starting_late_is_shifted_to_zero(tmp_path):
    rows = read_trace(trace(tmp_path, HEADER + "7.5,10,2\n5,10,1\n"))
    assert [r[:3] for r in rows] == [(0.0, 10, 1), (2.5, 10, 2)]


@pytest.mark.parametrize("text, match", [
    (HEADER + "0,10,5\n1e300,10,5\n", r"t\.csv:3: arrival_time 1e\+300 is beyond 1e\+12 s"),
    # Epoch milliseconds: a unit error, not a time in seconds.
    (HEADER + "1717171717250,10,5\n", r"t\.csv:2: arrival_time 1717171717250\.0 is beyond"),
    (HEADER + "0,10,5\n20000000,10,5\n1,10,5\n",
     r"t\.csv:3: arrival_time 20000000\.0 is 2e\+07 s after the first arrival \(line 2\); a "
     r"trace may span at most 1e\+07 s"),
    (HEADER + "0,10,5\ninf,10,5\n", r"t\.csv:3: arrival_time must be finite, got 'inf'"),
])
def test_absurd_trace_times_are_refused_naming_file_and_line(tmp_path, text, match):
    path = trace(tmp_path, text)
    assert str(path) in one_line_error(path, match)


# --------------------------------------------------------------------------- trace files

@pytest.mark.parametrize("header, column", [
    ("arrival_time,prompt_len,output_len,prompt_len", "prompt_len"),
    ("arrival_time,arrival_time ,prompt_len,output_len", "arrival_time"),
    ("note,arrival_time,prompt_len,output_len,note", "note"),
])
def test_duplicate_trace_column_is_refused(tmp_path, header, column):
    path = trace(tmp_path, header + "\n" + ",".join(["1"] * len(header.split(","))) + "\n")
    msg = one_line_error(path, rf"t\.csv:1: trace header has column '{column}' twice")
    assert str(path) in msg


def test_byte_order_mark_is_accepted():
    rows = read_trace(DATA / "trace_bom.csv")
    assert [r[:3] for r in rows] == [(0.0, 64, 16), (0.5, 128, 32)]


@pytest.mark.parametrize("content, match", [
    (b"\x89PNG\r\n\x1a\n" + bytes(range(256)), r"t\.csv: not a UTF-8 text file \(byte 0x89"),
    (HEADER.encode() + b"0,10,5\n" + b"\xff\xfe" * 5000, r"t\.csv: not a UTF-8 text file"),
    (b"\x00" * 64, r"t\.csv:1: NUL byte in a text field"),
    (HEADER.encode() + b"0,1\x00,5\n", r"t\.csv:2: NUL byte in a text field"),
    (HEADER.encode() + b'0,"' + b"x" * 200_000 + b'",5\n', r"t\.csv: unreadable CSV: field"),
])
def test_binary_trace_is_a_one_line_error_naming_the_file(tmp_path, content, match):
    path = trace(tmp_path, content)
    assert str(path) in one_line_error(path, match)


# --------------------------------------------------------------------------- settings

SYN = {"kind": "synthetic", "num_prompts": 4,
       "lengths": {"dist": "fixed", "prompt_len": 8, "output_len": 4}}
TRACE = {"kind": "trace", "trace_path": str(DATA / "trace_small.csv")}


@pytest.mark.parametrize("cfg, match", [
    ({**SYN, "request_rate": float("nan")}, r"workload\.request_rate must be > 0 \(or inf\)"),
    ({**SYN, "request_rate": "nan"}, r"workload\.request_rate must be > 0 \(or inf\)"),
    ({**SYN, "request_rate": "-inf"}, r"workload\.request_rate must be > 0"),
    ({**SYN, "request_rate": True}, r"workload\.request_rate must be a number"),
    ({**SYN, "burstiness": -1}, r"workload\.burstiness must be > 0, got -1"),
    ({**SYN, "burstiness": "inf"}, r"workload\.burstiness must be > 0, got inf"),
    ({**SYN, "burstiness": float("nan")}, r"workload\.burstiness must be > 0, got nan"),
    # a clock beyond 2^32 s: an OverflowError, or gigabytes for the peaks, after the run
    ({**SYN, "request_rate": 1e-300},
     r"workload\.request_rate must be >= 2\.33e-10 requests/s .* got 1e-300: .*2\^32 s"),
    ({**SYN, "request_rate": 1e-9, "num_prompts": 50},
     r"workload\.request_rate = 1e-09 \(burstiness 1\.0\) sends the last of 50 requests at "
     r"[0-9.e+]+ s: .*2\^32 s"),
    ({**SYN, "request_rate": 1.0, "burstiness": 1e-320},
     r"workload\.request_rate = 1\.0 \(burstiness 1e-320\) sends the last of 4 requests"),
    ({**SYN, "num_prompts": True}, r"workload\.num_prompts must be an integer"),
    ({**SYN, "num_prompts": "10"}, r"workload\.num_prompts must be an integer"),
    ({**SYN, "num_prompts": float("inf")}, r"workload\.num_prompts must be an integer"),
    ({**SYN, "seed": 1.5}, r"workload\.seed must be an integer"),
    # np.random.RandomState would say "Seed must be between 0 and 2**32 - 1" without the name.
    ({**SYN, "request_rate": 5, "seed": 2**32}, r"workload\.seed must be <= 4294967295"),
    ({**SYN, "lengths": {"dist": "fixed", "prompt_len": 2.5, "output_len": 4}},
     r"workload\.lengths\.prompt_len must be an integer, got 2\.5"),
    ({**SYN, "lengths": {"dist": "lognormal", "prompt_mean": 10, "prompt_sigma": float("nan"),
                         "output_mean": 5, "output_sigma": 1}},
     r"workload\.lengths\.prompt_sigma must be >= 0, got nan"),
    ({**SYN, "lengths": {"dist": "lognormal", "prompt_mean": "big", "prompt_sigma": 1,
                         "output_mean": 5, "output_sigma": 1}},
     r"workload\.lengths\.prompt_mean must be a number"),
    ({**TRACE, "num_prompts": 2.5}, r"workload\.num_prompts must be an integer, got 2\.5"),
    ({**TRACE, "seed": "x"}, r"workload\.seed must be an integer"),
    ({**TRACE, "time_scale": 1e300},
     r"workload\.time_scale must be > 0 and keep the replay's 1\.25 s within 2\^32 s, "
     r"got 1e\+300: "),
])
def test_settings_of_the_wrong_type_or_range(cfg, match):
    one_line_error(cfg, match)


# --------------------------------------------------------------------------- size guard

def available(monkeypatch, nbytes: int | None) -> None:
    monkeypatch.setattr(footprint, "available_memory", lambda: nbytes)


def test_huge_num_prompts_is_refused_before_anything_is_drawn():
    # 10^9 requests take at least 2 TB: no machine this runs on has that much free.
    cfg = {**SYN, "num_prompts": 10**9, "request_rate": 10}
    tracemalloc.start()
    try:
        msg = one_line_error(cfg, r"workload\.num_prompts: 1000000000 requests would take at "
                                  r"least 1929\.7 GiB, more than the .* GiB of memory "
                                  r"available; lower workload\.num_prompts")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, msg  # refused up front, not after drawing 10^9 lengths


def test_output_tokens_count_once_the_lengths_are_known(monkeypatch):
    available(monkeypatch, 100 << 20)  # 100 MiB
    short = {**SYN, "num_prompts": 10_000,
             "lengths": {"dist": "fixed", "prompt_len": 8, "output_len": 1}}
    assert len(build_workload(short)) == 10_000  # ~20 MiB
    long = {**short, "lengths": {"dist": "fixed", "prompt_len": 8, "output_len": 1000}}
    one_line_error(long, r"workload\.num_prompts: 10000 requests and 10000000 output tokens "
                         r"would take about 0\.2 GiB, more than the 0\.1 GiB")
    # The real backend's prompt token ids count too.
    ids = {**short, "lengths": {"dist": "fixed", "prompt_len": 400, "output_len": 1}}
    assert len(build_workload(ids)) == 10_000
    one_line_error(ids, r"would take about 0\.2 GiB with prompt token ids", vocab_size=100)


def test_sharegpt_is_guarded_too(monkeypatch):
    available(monkeypatch, 1 << 20)
    one_line_error({"kind": "sharegpt", "num_prompts": 1000},
                   r"workload\.num_prompts: 1000 requests would take at least")


def test_trace_rows_beyond_memory_are_refused_while_reading(monkeypatch):
    # room for the first 3 rows of the file and their run, not the 4th
    available(monkeypatch, sum(footprint.trace_row_bytes(p, o, 0, with_token_ids=False)
                               for p, o in ((128, 32), (64, 16), (512, 128))))
    one_line_error(TRACE, r"trace_small\.csv:5: the trace has more than 3 requests, the most "
                          r"whose replay fits in the memory available")
    available(monkeypatch, None)  # memory unknown: nothing is refused
    assert len(build_workload(TRACE)) == 4


@pytest.mark.parametrize("with_ids", [False, True])
def test_estimate_covers_what_the_requests_hold(with_ids):
    """run_bytes bounds the specs and Requests of a workload with every output token's
    delivery time recorded, as a run leaves them (the run's other per-request state, metrics
    rows, is what the margin per request is for)."""
    n, plen, olen = 1000, 100, 50  # per request: held / bound is the same at 5000
    cfg = {**SYN, "num_prompts": n, "request_rate": 100,
           "lengths": {"dist": "fixed", "prompt_len": plen, "output_len": olen}}
    tracemalloc.start()
    try:
        specs = build_workload(cfg, vocab_size=128256 if with_ids else None)
        requests = [to_request(s, i, with_token_ids=with_ids) for i, s in enumerate(specs)]
        for r in requests:
            for t in range(olen):
                r.token_times.append(r.arrival_time + t * 0.01)
                if with_ids:
                    r.output_token_ids.append(100_000 + t)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held <= run_bytes(n, n * plen, n * olen, with_token_ids=with_ids)


def test_cli_refuses_a_huge_synthetic_workload_quickly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.run", "workload=synthetic",
         "workload.num_prompts=1000000000", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "workload.num_prompts" in lines[0] and "GiB of memory available" \
        in lines[0], proc.stderr
