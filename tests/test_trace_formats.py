"""Public trace formats (Azure LLM inference 2023/2024, BurstGPT, Mooncake JSONL): each parsed,
times relative to the first request and scaled, the first num_prompts, BurstGPT's filters and
failed requests, and bad rows as one-line errors naming the file and line. The traces are small
files written here in each format, never copies of the real ones."""

from __future__ import annotations

import json
import logging
import tracemalloc
from pathlib import Path

import pytest

from experiments.workload import build_workload, footprint, read_trace
from experiments.workload.trace_formats import RowFilter

ROOT = Path(__file__).resolve().parent.parent

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZURE_2023 = AZURE_HEADER + (
    "2023-11-16 18:15:46.6805900,374,44\n"
    "2023-11-16 18:15:47.1805900,396,109\n"
    "2023-11-16 18:16:01.0000000,2048,7\n")
# 2024: a UTC offset, six fractional digits or none.
AZURE_2024 = AZURE_HEADER + (
    "2024-05-10 00:00:00.009930+00:00,2162,5\n"
    "2024-05-10 00:00:01+00:00,2399,6\n"
    "2024-05-10 02:00:00.509930+02:00,76,15\n")  # 00:00:00.50993 UTC
BURST_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
BURST = BURST_HEADER + (
    "5,ChatGPT,472,18,490,Conversation log\n"
    "45,ChatGPT,1087,230,1317,Conversation log\n"
    "46,GPT-4,300,0,300,API log\n"  # failed: no response
    "118,GPT-4,417,276,693,Conversation log\n"
    "120,ChatGPT,80,12,92,API log\n")
# One hash a 512-token block of the prompt, as in Mooncake's traces.
MOONCAKE = [
    {"timestamp": 27482, "input_length": 1030, "output_length": 52, "hash_ids": [46, 47, 48]},
    {"timestamp": 30535, "input_length": 512, "output_length": 26, "hash_ids": [46]},
    {"timestamp": 31000, "input_length": 12, "output_length": 3, "hash_ids": [49]},
]


def write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def cfg(path: Path, fmt: str, **kw) -> dict:
    return {"kind": "trace", "trace_path": str(path), "format": fmt, **kw}


def specs_of(path: Path, fmt: str, **kw) -> list[tuple[float, int, int]]:
    return [(s.arrival_time, s.prompt_len, s.output_len)
            for s in build_workload(cfg(path, fmt, **kw))]


def one_line_error(config: dict, match: str) -> str:
    with pytest.raises(ValueError, match=match) as err:
        build_workload(config)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


# --------------------------------------------------------------------------- each format

def test_azure_2023_times_are_seconds_after_the_first_request(tmp_path):
    got = specs_of(write(tmp_path, "code.csv", AZURE_2023), "azure")
    assert [g[1:] for g in got] == [(374, 44), (396, 109), (2048, 7)]
    assert [g[0] for g in got] == pytest.approx([0.0, 0.5, 14.31941], abs=1e-6)


def test_azure_2024_times_with_a_utc_offset(tmp_path):
    got = specs_of(write(tmp_path, "conv.csv", AZURE_2024), "azure")
    # The +02:00 row is 0.5 s after the first in UTC, so it sorts before the 00:00:01 one.
    assert [g[1:] for g in got] == [(2162, 5), (76, 15), (2399, 6)]
    assert [g[0] for g in got] == pytest.approx([0.0, 0.5, 0.99007], abs=1e-6)


def test_burstgpt_drops_failed_requests_and_ignores_other_columns(tmp_path):
    text = BURST.replace("Timestamp,", "Timestamp,Session ID,").replace("\n5,", "\n5,s1,") \
        .replace("\n45,", "\n45,s1,").replace("\n46,", "\n46,s2,").replace("\n118,", "\n118,s3,") \
        .replace("\n120,", "\n120,s4,")
    for path in (write(tmp_path, "b.csv", BURST), write(tmp_path, "s.csv", text)):
        assert specs_of(path, "burstgpt") == [
            (0.0, 472, 18), (40.0, 1087, 230), (113.0, 417, 276), (115.0, 80, 12)]


def test_mooncake_times_are_milliseconds_and_hash_ids_stay_on_the_request(tmp_path):
    path = write(tmp_path, "m.jsonl", jsonl(MOONCAKE))
    specs = build_workload(cfg(path, "mooncake"))
    assert [(s.arrival_time, s.prompt_len, s.output_len) for s in specs] == [
        (0.0, 1030, 52), (3.053, 512, 26), (3.518, 12, 3)]
    assert [s.hash_ids for s in specs] == [(46, 47, 48), (46,), (49,)]
    # Without hash_ids (aiperf writes some traces so) a request carries none.
    bare = [{k: v for k, v in r.items() if k != "hash_ids"} for r in MOONCAKE]
    path = write(tmp_path, "bare.jsonl", jsonl(bare))
    assert [s.hash_ids for s in build_workload(cfg(path, "mooncake"))] == [None] * 3
    # Other kinds carry none either.
    assert build_workload(cfg(write(tmp_path, "b.csv", BURST), "burstgpt"))[0].hash_ids is None


def test_a_bom_blank_lines_and_equal_times(tmp_path):
    text = "\ufeff" + jsonl(MOONCAKE[:1]) + "\n  \n" + jsonl([{**MOONCAKE[1], "timestamp": 27482}])
    got = specs_of(write(tmp_path, "m.jsonl", text), "mooncake")
    assert got == [(0.0, 1030, 52), (0.0, 512, 26)]  # ties keep file order


@pytest.mark.parametrize("fmt, name, text", [
    ("azure", "a.csv", AZURE_HEADER + "2023-11-16 18:16:00.5,20,2\n2023-11-16 18:15:59.5,10,1\n"
     "2023-11-16 18:16:00.5,30,3\n"),
    ("burstgpt", "b.csv", BURST_HEADER + "9,M,20,2,22,L\n8,M,10,1,11,L\n9,M,30,3,33,L\n"),
    ("mooncake", "m.jsonl", jsonl([{"timestamp": 9000, "input_length": 20, "output_length": 2},
                                   {"timestamp": 8000, "input_length": 10, "output_length": 1},
                                   {"timestamp": 9000, "input_length": 30, "output_length": 3}])),
])
def test_unsorted_rows_replay_in_time_order_from_the_first(tmp_path, fmt, name, text):
    got = specs_of(write(tmp_path, name, text), fmt)
    assert got == [(0.0, 10, 1), (1.0, 20, 2), (1.0, 30, 3)]


# --------------------------------------------------------------------------- time_scale, num_prompts

@pytest.mark.parametrize("fmt, name, text", [
    ("csv", "t.csv", "arrival_time,prompt_len,output_len\n3,10,1\n5,10,2\n9,10,3\n"),
    ("azure", "a.csv", AZURE_2023),
    ("burstgpt", "b.csv", BURST),
    ("mooncake", "m.jsonl", jsonl(MOONCAKE)),
])
def test_time_scale_stretches_the_gaps(tmp_path, fmt, name, text):
    path = write(tmp_path, name, text)
    plain = specs_of(path, fmt)
    for scale in (2, 0.25, "0.5"):
        scaled = specs_of(path, fmt, time_scale=scale)
        assert [s[0] for s in scaled] == pytest.approx([p[0] * float(scale) for p in plain])
        assert [s[1:] for s in scaled] == [p[1:] for p in plain]


@pytest.mark.parametrize("scale", [0, -1, "fast", float("nan"), float("inf"), True])
def test_bad_time_scale_is_refused(tmp_path, scale):
    one_line_error(cfg(write(tmp_path, "b.csv", BURST), "burstgpt", time_scale=scale),
                   r"workload\.time_scale must be a number")


@pytest.mark.parametrize("fmt, name, text", [
    ("azure", "a.csv", AZURE_2024),
    ("burstgpt", "b.csv", BURST),
    ("mooncake", "m.jsonl", jsonl(MOONCAKE)),
])
def test_num_prompts_takes_the_first_requests_by_arrival(tmp_path, fmt, name, text):
    path = write(tmp_path, name, text)
    every = specs_of(path, fmt)
    for n in range(1, len(every) + 1):
        assert specs_of(path, fmt, num_prompts=n) == every[:n]
    one_line_error(cfg(path, fmt, num_prompts=len(every) + 1),
                   rf"workload\.num_prompts = {len(every) + 1}, but .*{name} has only "
                   rf"{len(every)} requests$")


def test_num_prompts_on_a_shuffled_trace_matches_a_full_sort(tmp_path):
    # Many ties and a shuffled order: the streamed first N equal the first N of the sorted file.
    rows = [(t % 37, i + 1, i % 5 + 1) for i, t in enumerate(range(0, 4000, 7))]
    text = BURST_HEADER + "".join(f"{t},M,{p},{o},0,L\n" for t, p, o in rows)
    path = write(tmp_path, "b.csv", text)
    every = specs_of(path, "burstgpt")
    assert [s[1] for s in every[:3]] == [1, 38, 75]  # time 0, in file order
    for n in (1, 17, 300, len(rows)):
        assert specs_of(path, "burstgpt", num_prompts=n) == every[:n]


def test_num_prompts_holds_only_those_requests(tmp_path, monkeypatch):
    text = BURST_HEADER + "".join(f"{i},M,10,1,11,L\n" for i in range(50_000))
    path = write(tmp_path, "big.csv", text)
    tracemalloc.start()
    try:
        assert len(build_workload(cfg(path, "burstgpt", num_prompts=10))) == 10
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # all 50k rows held would take ~10 MB
    # With memory for 20 rows and their run, the whole trace is refused while it is read; its
    # first 2 are not.
    row = footprint.trace_row_bytes(10, 1, 0, with_token_ids=False)
    monkeypatch.setattr(footprint, "available_memory", lambda: 20 * row)
    one_line_error(cfg(path, "burstgpt"), r"big\.csv:22: the trace has more than 20 requests, "
                                          r"the most whose replay fits in the memory available")
    assert len(build_workload(cfg(path, "burstgpt", num_prompts=2))) == 2


def test_mooncake_block_hashes_count_against_memory(tmp_path, monkeypatch):
    # Enough for 10 trace rows without hashes and their run (~23 KiB), for 2 with 50 each
    # (a hash and the prompt segment made of it).
    row = footprint.trace_row_bytes(10, 1, 0, with_token_ids=False)
    monkeypatch.setattr(footprint, "available_memory", lambda: 10 * row + 1000)
    small = [{"timestamp": i, "input_length": 10, "output_length": 1} for i in range(10)]
    assert len(build_workload(cfg(write(tmp_path, "s.jsonl", jsonl(small)), "mooncake"))) == 10
    big = [{**r, "input_length": 50 * 512, "hash_ids": list(range(1000, 1050))} for r in small]
    one_line_error(cfg(write(tmp_path, "b.jsonl", jsonl(big)), "mooncake"),
                   r"b\.jsonl:3: the trace has more than 2 requests")


# --------------------------------------------------------------------------- BurstGPT's filters

@pytest.mark.parametrize("settings, lines", [
    ({"model_filter": "ChatGPT"}, [472, 1087, 80]),
    ({"model_filter": "GPT-4"}, [417]),
    ({"model_filter": ["GPT-4", "ChatGPT"]}, [472, 1087, 417, 80]),
    ({"log_type": "API log"}, [80]),
    ({"log_type": "Conversation log", "model_filter": "GPT-4"}, [417]),
    ({"keep_failed": True}, [472, 1087, 300, 417, 80]),
    ({"keep_failed": True, "model_filter": "GPT-4"}, [300, 417]),
])
def test_burstgpt_filters_and_keep_failed(tmp_path, settings, lines):
    got = specs_of(write(tmp_path, "b.csv", BURST), "burstgpt", **settings)
    assert [g[1] for g in got] == lines
    assert got[0][0] == 0.0  # relative to the first request kept
    if settings.get("keep_failed"):
        assert dict((g[1], g[2]) for g in got)[300] == 1  # a failed request asks for one token


def test_the_log_says_what_was_dropped(tmp_path, caplog, monkeypatch):
    path = write(tmp_path, "b.csv", BURST)
    # a logging config applied by another test of this process may have disabled the logger
    monkeypatch.setattr(logging.getLogger("experiments.workload.trace"), "disabled", False)
    with caplog.at_level("INFO", logger="experiments.workload.trace"):
        specs_of(path, "burstgpt", model_filter="ChatGPT")
    assert caplog.messages == [
        f"{path}: 3 of its 5 requests pass the filters; dropped: 2 of other models or log types"]
    caplog.clear()
    with caplog.at_level("INFO", logger="experiments.workload.trace"):
        specs_of(path, "burstgpt")
    assert caplog.messages == [
        f"{path}: 4 of its 5 requests pass the filters; dropped: 1 failed (no output tokens; "
        f"workload.keep_failed=true keeps them)"]


def test_azure_rows_without_output_are_failed_requests(tmp_path):
    path = write(tmp_path, "a.csv", AZURE_2023.replace(",109\n", ",0\n"))
    assert [g[1:] for g in specs_of(path, "azure")] == [(374, 44), (2048, 7)]
    assert [g[1:] for g in specs_of(path, "azure", keep_failed=True)] == [
        (374, 44), (396, 1), (2048, 7)]


def test_num_prompts_counts_requests_after_the_filters(tmp_path):
    path = write(tmp_path, "b.csv", BURST)
    assert [g[1] for g in specs_of(path, "burstgpt", model_filter="ChatGPT", num_prompts=2)] \
        == [472, 1087]
    one_line_error(cfg(path, "burstgpt", model_filter="GPT-4", num_prompts=2),
                   r"workload\.num_prompts = 2, but .*b\.csv has only 1 requests that pass the "
                   r"filters")


@pytest.mark.parametrize("settings, match", [
    ({"model_filter": "gpt-4"}, r"workload\.model_filter: no request of .*b\.csv has 'gpt-4'; "
                                r"it has 'ChatGPT', 'GPT-4'$"),
    ({"log_type": ["Chat log"]}, r"workload\.log_type: no request of .*b\.csv has 'Chat log'; "
                                 r"it has 'API log', 'Conversation log'$"),
    ({"model_filter": "GPT-4", "log_type": "API log"},
     r"b\.csv: none of its 5 requests is left: 4 of other models or log types, 1 failed \(no "
     r"output tokens; workload\.keep_failed=true keeps them\)"),
    ({"model_filter": []}, r"workload\.model_filter must be null, a name or a list of names"),
    ({"model_filter": 4}, r"workload\.model_filter must be null, a name or a list of names"),
    ({"keep_failed": "yes"}, r"workload\.keep_failed must be true or false, got 'yes'"),
])
def test_filters_that_leave_nothing_or_are_malformed(tmp_path, settings, match):
    one_line_error(cfg(write(tmp_path, "b.csv", BURST), "burstgpt", **settings), match)


@pytest.mark.parametrize("fmt, name, text, settings, match", [
    ("csv", "t.csv", "arrival_time,prompt_len,output_len\n0,1,1\n", {"model_filter": "GPT-4"},
     r"workload\.model_filter applies to workload\.format=burstgpt only, not csv"),
    ("azure", "a.csv", AZURE_2023, {"log_type": "API log"},
     r"workload\.log_type applies to workload\.format=burstgpt only, not azure"),
    ("mooncake", "m.jsonl", jsonl(MOONCAKE), {"keep_failed": True},
     r"workload\.keep_failed applies to workload\.format=azure or burstgpt only, not mooncake"),
    ("parquet", "b.csv", BURST, {},
     r"workload\.format must be one of csv, azure, burstgpt, mooncake, timed_trace, got 'parquet'"),
    ("burstgpt", "b.csv", BURST, {"format_version": 2},
     r"workload\.format_version is not a setting of kind=trace"),
])
def test_settings_of_another_format_are_refused(tmp_path, fmt, name, text, settings, match):
    one_line_error(cfg(write(tmp_path, name, text), fmt, **settings), match)


# --------------------------------------------------------------------------- bad rows

@pytest.mark.parametrize("fmt, text, match", [
    ("azure", AZURE_2023 + "2023-11-16 18:17:00.0000000,0,7\n",
     r"t:5: ContextTokens must be >= 1, got 0"),
    ("azure", AZURE_2023 + "2023-11-16 18:17:00.0,12,-1\n",
     r"t:5: GeneratedTokens must be >= 0, got -1"),
    ("azure", AZURE_2023 + "1700158546.5,12,1\n",
     r"t:5: TIMESTAMP is not a date and time: '1700158546\.5' \(expected e\.g\. 2023-11-16 "),
    ("azure", AZURE_2023 + "2023-13-16 18:17:00.0,12,1\n", r"t:5: TIMESTAMP is not a date"),
    ("azure", AZURE_2023 + "2023-11-16 18:17:75.0,12,1\n", r"t:5: TIMESTAMP is not a date"),
    ("azure", AZURE_2023 + "2023-11-16 18:17:00.0,12.5,1\n",
     r"t:5: ContextTokens must be an integer, got '12\.5'"),
    # A cut last line.
    ("azure", AZURE_2023 + "2023-11-16 18:1", r"t:5: expected 3 fields, got 1"),
    ("azure", AZURE_2023 + "2023-11-16 18:17:00.0,12,", r"t:5: GeneratedTokens is not a number"),
    ("azure", "TIMESTAMP,ContextTokens\n2023-11-16 18:17:00.0,12\n",
     r"t:1: trace header lacks column 'GeneratedTokens' \(format=azure needs TIMESTAMP, "
     r"ContextTokens, GeneratedTokens; got TIMESTAMP, ContextTokens\)$"),
    ("azure", "", r"t: empty trace, expected a header 'TIMESTAMP,ContextTokens,GeneratedTokens'"),
    ("azure", AZURE_HEADER, r"t: trace has a header but no requests"),
    # Two years apart: a span no trace has.
    ("azure", AZURE_2023 + "2025-11-16 18:17:00.0,12,1\n",
     r"t:5: TIMESTAMP 1763317020\.0 is 6\.316e\+07 s after the first arrival \(line 2\); a trace "
     r"may span at most 1e\+07 s"),
    ("burstgpt", BURST + "130,ChatGPT,0,5,5,Conversation log\n",
     r"t:7: Request tokens must be >= 1, got 0"),
    ("burstgpt", BURST + "130,ChatGPT,x,5,5,Conversation log\n",
     r"t:7: Request tokens is not a number: 'x'"),
    ("burstgpt", BURST + "-1,ChatGPT,4,5,9,Conversation log\n", r"t:7: Timestamp must be >= 0"),
    ("burstgpt", BURST + "nan,ChatGPT,4,5,9,Conversation log\n", r"t:7: Timestamp must be finite"),
    ("burstgpt", BURST + "130,ChatGPT,47", r"t:7: expected 6 fields, got 3"),
    # Milliseconds in the seconds column: a span of ~4 years.
    ("burstgpt", BURST_HEADER + "5000,M,1,1,2,L\n120000000,M,1,1,2,L\n",
     r"t:3: Timestamp 120000000\.0 is 1\.2e\+08 s after the first arrival \(line 2\)"),
    ("burstgpt", BURST_HEADER.replace("Model,", "Model,Model,") + "5,M,M,1,1,2,L\n",
     r"t:1: trace header has column 'Model' twice"),
    ("csv", AZURE_2023,
     r"t:1: trace header lacks column 'arrival_time' \(format=csv needs .*\); it looks like "
     r"workload\.format=azure$"),
    ("azure", BURST, r"t:1: .*; it looks like workload\.format=burstgpt$"),
    ("burstgpt", b"\x89PNG\r\n\x1a\n" + bytes(range(256)), r"t: not a UTF-8 text file"),
])
def test_bad_csv_rows_name_the_file_and_line(tmp_path, fmt, text, match):
    msg = one_line_error(cfg(write(tmp_path, "t", text), fmt), match)
    assert str(tmp_path / "t") in msg


ROW = '{"timestamp": 0, "input_length": 5, "output_length": 2}\n'


@pytest.mark.parametrize("text, match", [
    (ROW + '{"timestamp": 10, "input_length": 5, "output_le',
     r"t:2: the last line is cut short \(incomplete JSON, no newline\)"),
    (ROW + '{"timestamp": 10, "input_length": 5,\n' + ROW, r"t:2: not a JSON object \("),
    (ROW + "[1, 2]\n", r"t:2: a JSON list, expected an object with timestamp, input_length"),
    (ROW + '{"timestamp": 10, "input_length": 5}\n',
     r"t:2: no 'output_length' \(a Mooncake request needs timestamp, input_length, "
     r"output_length; got timestamp, input_length\)"),
    (ROW + '{"timestamp": 10, "input_length": 0, "output_length": 2}\n',
     r"t:2: input_length must be >= 1, got 0"),
    (ROW + '{"timestamp": 10, "input_length": 5, "output_length": 0}\n',
     r"t:2: output_length must be >= 1, got 0"),
    (ROW + '{"timestamp": "10", "input_length": 5, "output_length": 2}\n',
     r"t:2: timestamp must be a number, got '10'"),
    (ROW + '{"timestamp": 10, "input_length": 5.5, "output_length": 2}\n',
     r"t:2: input_length must be an integer, got 5\.5"),
    (ROW + '{"timestamp": 10, "input_length": true, "output_length": 2}\n',
     r"t:2: input_length must be a number, got True"),
    (ROW + '{"timestamp": -3, "input_length": 5, "output_length": 2}\n',
     r"t:2: timestamp must be >= 0, got -3"),
    (ROW + '{"timestamp": 10, "input_length": 5, "output_length": 2, "hash_ids": [1, "a"]}\n',
     r"t:2: hash_ids must be a list of integers"),
    (ROW + '{"timestamp": 10, "input_length": 5, "output_length": 2, "hash_ids": 7}\n',
     r"t:2: hash_ids must be a list of integers"),
    # Microseconds in the milliseconds column.
    (ROW + '{"timestamp": 1.7e18, "input_length": 5, "output_length": 2}\n',
     r"t:2: timestamp 1\.7e\+18 is beyond 1e\+15 ms \(times are milliseconds\)"),
    (ROW.replace("0,", "1717171717250,", 1) + ROW.replace("0,", "1737171717250,", 1),
     r"t:2: timestamp 1737171717250\.0 is 2e\+07 s after the first arrival \(line 1\)"),
    (ROW.encode() + b'{"timestamp": 1, "x": "\xff"}\n', r"t:2: not UTF-8 text \(byte 0xff\)"),
    (b"\x00" * 64, r"t:1: NUL byte; a Mooncake trace is JSON lines text"),
    ("\n\n", r"t: trace has no JSON lines"),
])
def test_bad_mooncake_lines_name_the_file_and_line(tmp_path, text, match):
    msg = one_line_error(cfg(write(tmp_path, "t", text), "mooncake"), match)
    assert str(tmp_path / "t") in msg


def test_read_trace_takes_the_same_settings(tmp_path):
    path = write(tmp_path, "b.csv", BURST)
    got = read_trace(path, format="burstgpt", num_prompts=2, time_scale=0.5,
                     row_filter=RowFilter(models=frozenset({"ChatGPT"}), keep_failed=True))
    assert [tuple(r)[:4] for r in got] == [(0.0, 472, 18, None), (20.0, 1087, 230, None)]


# --------------------------------------------------------------------------- through the CLI

def test_cli_replays_a_burstgpt_trace(tmp_path):
    """The command line's settings, composed as Hydra composes them and run in this process."""
    rows = [f"{i * 0.25},{'GPT-4' if i % 3 else 'ChatGPT'},{20 + i},{(i % 4) * 3},0,"
            f"Conversation log\n" for i in range(40)]
    path = write(tmp_path, "burst.csv", BURST_HEADER + "".join(rows))
    from hydra import compose, initialize_config_dir

    from experiments.run import CONF_DIR, run

    run_dir = tmp_path / "run"
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=["workload=trace", "workload.format=burstgpt",
                                           f"workload.trace_path={path}",
                                           "workload.num_prompts=20", "progress=false"])
    run(cfg, run_dir)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["completed"] == 20
    assert result["schedlab"]["workload"]["format"] == "burstgpt"
    # Rows with no response (i % 4 == 0) are failed requests; the first 20 others replay.
    kept = [i for i in range(40) if i % 4][:20]
    assert result["total_input_tokens"] == sum(20 + i for i in kept)
