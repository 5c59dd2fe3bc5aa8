"""A Mooncake trace's block hashes reach the scheduler's Request, and count against memory for
the whole run."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from experiments.workload import build_workload, footprint, to_request
from experiments.workload.footprint import run_bytes
from policies.request import Request

N, HASHES = 10, 200


def mooncake(tmp_path: Path, hashes: int = HASHES) -> dict:
    """A workload of N requests from a Mooncake trace, each with ``hashes`` block hashes."""
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": i, "input_length": 512 * hashes or 10, "output_length": 1}
            for i in range(N)]
    for i, row in enumerate(rows):
        if hashes:  # one hash per 512-token block, as Mooncake's traces give them
            row["hash_ids"] = list(range(1000 * i, 1000 * i + hashes))
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {"kind": "trace", "trace_path": str(path), "format": "mooncake", "num_prompts": N}


def test_requests_carry_the_block_hashes_of_their_specs(tmp_path):
    specs = build_workload(mooncake(tmp_path, hashes=3))
    requests = [to_request(s, i, with_token_ids=False) for i, s in enumerate(specs)]
    assert [r.hash_ids for r in requests] == [(1000 * i, 1000 * i + 1, 1000 * i + 2)
                                              for i in range(N)]
    assert requests[0].hash_ids is specs[0].hash_ids  # shared, not copied
    # built by position (as the tests and benchmarks do), a Request has none
    assert Request(0, 0.0, 4, 2).hash_ids is None


def test_block_hashes_count_against_memory_for_the_whole_run(tmp_path, monkeypatch):
    """num_prompts streams the trace (no row budget), so only the run's own check can see the
    hashes: enough memory for the requests alone is not enough with 200 hashes each."""
    without = run_bytes(N, N * 10, N, with_token_ids=False)
    monkeypatch.setattr(footprint, "available_memory", lambda: without + 1000)
    assert len(build_workload(mooncake(tmp_path, hashes=0))) == N
    with pytest.raises(ValueError, match=f"{N * HASHES} block hashes would take") as err:
        build_workload(mooncake(tmp_path))
    assert "workload.num_prompts" in str(err.value) and "\n" not in str(err.value)


def test_estimate_covers_the_hashes_the_requests_hold(tmp_path):
    cfg = mooncake(tmp_path)
    tracemalloc.start()
    try:
        specs = build_workload(cfg)
        requests = [to_request(s, i, with_token_ids=False) for i, s in enumerate(specs)]
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(requests) == N
    hashes = N * HASHES
    assert held <= run_bytes(N, N * 10, N, with_token_ids=False, hash_ids=hashes)
    # and the hashes are a real part of it: without them the estimate would fall short
    assert held > run_bytes(N, N * 10, N, with_token_ids=False)
