"""vLLM's timed-trace format (vllm bench serve --dataset-name timed_trace --self-timed): the
Mooncake keys with the timestamp in seconds, replayed as workload.format=timed_trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.workload import build_workload

# vLLM's own test trace shape: seconds, and 16-token hashes (its --timed-trace-chunk-hash-size)
TRACE = [{"hash_ids": [7, 8, 9], "input_length": 40, "output_length": 2, "timestamp": 10.0},
         {"hash_ids": [7, 8, 10], "input_length": 40, "output_length": 3, "timestamp": 12.5},
         {"input_length": 5, "output_length": 1, "timestamp": 11.0}]


def _specs(tmp_path: Path, records: list[dict] | str, **settings):
    path = tmp_path / "trace.jsonl"
    path.write_text(records if isinstance(records, str)
                    else "".join(json.dumps(r) + "\n" for r in records))
    return build_workload({"kind": "trace", "trace_path": str(path), "format": "timed_trace",
                           **settings})


def test_timed_trace_times_are_seconds_after_the_first(tmp_path):
    specs = _specs(tmp_path, TRACE)
    assert [(s.arrival_time, s.prompt_len, s.output_len) for s in specs] == [
        (0.0, 40, 2), (1.0, 5, 1), (2.5, 40, 3)]
    # its hashes are blocks of a size only vLLM's command line knows: not kept as Mooncake's
    assert [s.hash_ids for s in specs] == [None] * 3
    # time_scale is vLLM's --timed-trace-sec-multiplier: 0.5 replays it at twice the rate
    assert [s.arrival_time for s in _specs(tmp_path, TRACE, time_scale=0.5)] == [0.0, 0.5, 1.25]


def test_the_same_file_as_mooncake_reads_milliseconds(tmp_path):
    """The formats differ in their unit: a Mooncake file's 12.5 is 12.5 ms."""
    path = tmp_path / "m.jsonl"
    records = [{k: v for k, v in r.items() if k != "hash_ids"} for r in TRACE]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    specs = build_workload({"kind": "trace", "trace_path": str(path), "format": "mooncake"})
    assert [s.arrival_time for s in specs] == pytest.approx([0.0, 0.001, 0.0025])


@pytest.mark.parametrize("records, match", [
    ([{"timestamp": 0, "input_length": 5}], r"trace.jsonl:1: no 'output_length' \(a vLLM "
                                            r"timed-trace request needs"),
    ([{"timestamp": "x", "input_length": 5, "output_length": 1}], "timestamp must be a number"),
    ([{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}],
     "hash_ids must be a list of integers"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1,',
     r"trace.jsonl:2: the last line is cut short"),
    ("", "trace has no JSON lines"),
])
def test_a_bad_timed_trace_is_one_line_naming_file_and_line(tmp_path, records, match):
    with pytest.raises(ValueError, match=match) as err:
        _specs(tmp_path, records)
    assert "\n" not in str(err.value)
