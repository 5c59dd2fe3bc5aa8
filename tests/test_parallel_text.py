"""A long run's result files rendered by forked workers are the files rendered in one process,
byte for byte, and a worker's failure leaves no file behind."""

from __future__ import annotations

import os

import pytest
from hydra import compose, initialize_config_dir

from experiments import parallel_text, request_times, result_files
from experiments.run import CONF_DIR, run

RUN = ["backend=sim", "workload=synthetic", "workload.num_prompts=60", "model=tiny",
       "hardware=cpu", "overhead=none", "progress=false", "metrics.save_per_request=true",
       "cluster.num_replicas=2", "router=round_robin"]


def _files(path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in ("requests.csv", "steps.csv")}


def _run(tmp_path, name: str) -> tuple[dict, dict[str, bytes]]:
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=RUN)
    result = run(cfg, tmp_path / name)
    text = (tmp_path / name / "result.json").read_text()
    lists = text[text.index('"input_lens"'):text.index('"schedlab"')]  # not the date
    return result, {**_files(tmp_path / name), "lists": lists}


def test_forked_workers_write_the_files_one_process_writes(tmp_path, monkeypatch):
    if not parallel_text.num_workers():
        pytest.skip("needs fork and two CPUs")
    monkeypatch.setattr(request_times, "CHUNK_REQUESTS", 7)  # many chunks, some empty lists
    _, here = _run(tmp_path, "here")
    monkeypatch.setattr(parallel_text, "PARALLEL_MIN_ROWS", 1)
    rendered_here = []
    real_text = result_files._RequestRows.text

    def text(self, start, end):
        rendered_here.append(start)  # a worker appends to its own copy of the list
        return real_text(self, start, end)

    monkeypatch.setattr(result_files._RequestRows, "text", text)
    _, there = _run(tmp_path, "forked")
    # this process rendered its share of requests.csv's 9 chunks, a worker the rest
    assert 0 < len(rendered_here) < 9, rendered_here
    assert there == here
    assert here["steps.csv"].count(b"\n") > 10 and '"itls": [[' in here["lists"]


def test_a_chunk_failing_in_a_worker_is_raised_and_leaves_no_file(tmp_path, monkeypatch):
    if not parallel_text.num_workers():
        pytest.skip("needs fork and two CPUs")
    monkeypatch.setattr(request_times, "CHUNK_REQUESTS", 7)
    monkeypatch.setattr(parallel_text, "PARALLEL_MIN_ROWS", 1)
    real_text = result_files._RequestRows.text

    def broken(self, start, end):
        if start >= 21:
            raise ValueError(f"row {start} cannot be written")
        return real_text(self, start, end)

    monkeypatch.setattr(result_files._RequestRows, "text", broken)
    with pytest.raises(ValueError, match="row 21 cannot be written"):
        _run(tmp_path, "broken")
    assert not any(n.endswith((".csv", ".json", ".tmp")) for n in os.listdir(tmp_path / "broken"))
