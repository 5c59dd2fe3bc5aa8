"""A long run's result files rendered by worker processes beside the run's own are the files
rendered in one process, byte for byte, and a worker's failure is raised and leaves no file."""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor

import pytest
from hydra import compose, initialize_config_dir

from experiments import parallel_text, request_times, result_files
from experiments.run import CONF_DIR, run

RUN = ["backend=sim", "workload=synthetic", "workload.num_prompts=60", "model=tiny",
       "hardware=cpu", "overhead=none", "progress=false", "metrics.save_per_request=true",
       "cluster.num_replicas=2", "router=round_robin"]

needs_workers = pytest.mark.skipif(not parallel_text.num_workers(),
                                   reason="needs two CPUs and a forkserver")


def _run(tmp_path, name: str) -> dict[str, str]:
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=RUN)
    run(cfg, tmp_path / name)
    files = {f: (tmp_path / name / f).read_text() for f in ("requests.csv", "steps.csv")}
    text = (tmp_path / name / "result.json").read_text()
    return {**files, "lists": text[text.index('"input_lens"'):text.index('"schedlab"')]}


class _Counting(ProcessPoolExecutor):
    submitted = 0

    def submit(self, *args, **kwargs):
        _Counting.submitted += 1
        return super().submit(*args, **kwargs)


@needs_workers
def test_workers_write_the_files_one_process_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(request_times, "CHUNK_REQUESTS", 7)  # many chunks, some empty lists
    here = _run(tmp_path, "here")
    monkeypatch.setattr(parallel_text, "PARALLEL_MIN_ROWS", 1)
    monkeypatch.setattr(parallel_text, "ProcessPoolExecutor", _Counting)
    there = _run(tmp_path, "workers")
    # 9 chunks of requests.csv, steps.csv's and 8 lists' of 9: the workers took their share
    assert 0 < _Counting.submitted < 9 * 9 + 1
    assert there == here
    assert here["steps.csv"].count("\n") > 10 and '"itls": [[' in here["lists"]
    # a time as the request holds it: the first scheduled at the t = 0 clock's int 0 reads 0
    assert here["requests.csv"].splitlines()[1].split(",")[4] == "0"


@needs_workers
def test_a_job_failing_in_a_worker_is_raised_there(monkeypatch):
    monkeypatch.setattr(parallel_text, "PARALLEL_MIN_ROWS", 1)
    jobs = [(str, (1,)), (int, ("not a number",)), (str, (3,))]  # the second goes to a worker
    with pytest.raises(ValueError, match="not a number"):
        list(parallel_text.rendered(jobs, rows=3))
    assert list(parallel_text.rendered([(str, (i,)) for i in range(5)], rows=5)) == \
        ["0", "1", "2", "3", "4"]


@needs_workers
def test_a_failing_chunk_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(request_times, "CHUNK_REQUESTS", 7)
    monkeypatch.setattr(parallel_text, "PARALLEL_MIN_ROWS", 1)
    real_job = result_files.RequestRows.job

    def broken(self, start, end):  # the worker is given a job that fails
        return (int, (f"row {start}",)) if start >= 21 else real_job(self, start, end)

    monkeypatch.setattr(result_files.RequestRows, "job", broken)
    with pytest.raises(ValueError, match="row 2[18]"):
        _run(tmp_path, "broken")
    assert not any(n.endswith((".csv", ".json", ".tmp")) for n in os.listdir(tmp_path / "broken"))
