"""Tensor parallelism on the CPU (gloo, 2 ranks): greedy ids through every kind of window, with
overlap and without, equal one process's, KV heads replicated too; the ranks' shares put together are the
whole model, from random weights and from a checkpoint; bad settings are one line; a run ended
early (SIGTERM, a worker killed, rank 0 killed) ends in one line and leaves no process or
rendezvous directory."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rb_util import load_spec

from common.parallel import ParallelConfig
from policies import ModelSpec, Request, SchedulerConfig, make_scheduler
from real_backend import run_real
from real_backend.config import BackendConfig
from real_backend.parallel import TPGroup, Workers, remove_stale_rendezvous
from real_backend.weights import load_hf_model, random_model, save_hf_model

ROOT = Path(__file__).resolve().parents[2]
SPEC = load_spec("tiny")
BLOCK_SIZE = 4
NUM_BLOCKS = 24  # every policy preempts (as in test_overlap_engine.py)
CPU = BackendConfig(device="cpu")

# Every kind of window the ranks run: single steps, k-step decodes, chunked prefills, prefills
# inside k-step windows, k changing from window to window. (cp1's windows are chunked_prefill's
# and multi_step's kinds, cp_promote's cp2's; test_real_engine.py runs every policy.)
POLICIES = [
    ("single_step", {}, None),
    ("multi_step", {"num_steps": 4}, None),
    ("chunked_prefill", {}, 16),
    ("cp2", {"num_steps": 4}, 16),
    ("adaptive", {"num_steps": 8, "overhead_steps": 3.0}, None),
]


def make_requests(n: int = 8, seed: int = 1) -> list[Request]:
    """Eight requests: every policy preempts at least once, with overlap and without."""
    r = random.Random(seed)
    return [Request(i, 0.0, 0, r.randint(4, 24),
                    prompt_token_ids=[r.randrange(SPEC.vocab_size) for _ in range(r.randint(1, 40))])
            for i in range(n)]


def serve(policy: str, params: dict, budget: int | None, *, overlap: bool = False, tp: int = 1,
          workers: Workers | None = None, spec: ModelSpec = SPEC, **backend):
    cfg = SchedulerConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=budget, overlap=overlap)
    backend = {"device": "cpu", "num_blocks": NUM_BLOCKS, "save_token_ids": True, **backend}
    return run_real(make_requests(),
                    lambda n: make_scheduler(policy, params, cfg, n, spec.max_model_len),
                    spec, backend, progress=False,
                    parallel=ParallelConfig(tensor_parallel_size=tp), workers=workers)


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    """One process, single_step: the ids every tensor-parallel run must give."""
    return serve("single_step", {}, None).token_ids


class TestTwoRanks:
    """Runs sharing two ranks (starting a rank's process takes seconds); they stop with the
    class, before the tests that start ranks of their own."""

    @pytest.fixture(scope="class")
    @staticmethod
    def workers():
        with Workers(2, CPU) as w:
            yield w

    @pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
    @pytest.mark.parametrize(("policy", "params", "budget"), POLICIES,
                             ids=[p for p, _, _ in POLICIES])
    def test_greedy_ids_equal_one_process(self, reference, workers, policy, params, budget,
                                          overlap) -> None:
        res = serve(policy, params, budget, overlap=overlap, tp=2, workers=workers)
        assert res.stats["tensor_parallel_size"] == 2
        assert res.stats["num_preemptions"] > 0
        assert res.token_ids == reference

    def test_ranks_outnumbering_kv_heads_replicate_them(self, workers) -> None:
        """One KV head, two ranks: both hold it (their query heads both read it)."""
        spec = load_spec("tiny", num_kv_heads=1)
        assert [TPGroup(r, 2).kv_head_start(spec) for r in range(2)] == [0, 0]
        assert [TPGroup(r, 4).kv_head_start(SPEC) for r in range(4)] == [0, 0, 1, 1]
        one = serve("multi_step", {"num_steps": 4}, None, spec=spec)
        two = serve("multi_step", {"num_steps": 4}, None, spec=spec, tp=2, workers=workers)
        assert two.token_ids == one.token_ids

    def test_one_group_of_ranks_at_a_time(self, workers) -> None:
        with pytest.raises(ValueError, match="^tensor-parallel ranks are running in this "
                                             "process already"):
            Workers(2, CPU)
        with pytest.raises(ValueError, match="^the workers given are 2 cpu ranks, the run "
                                             "needs 4 cpu ranks$"):
            serve("single_step", {}, None, tp=4, workers=workers)


@pytest.mark.parametrize("size", [2, 4])
def test_rank_shares_put_together_are_the_whole_model(tmp_path, size) -> None:
    """Random weights and a checkpoint's tensors: q/k/v and gate/up rows, o/down columns and
    vocabulary rows of the ranks, concatenated, are the one-process model's (KV heads once
    each when replicated)."""
    whole = random_model(SPEC, "cpu", torch.float32, seed=3)
    save_hf_model(whole, tmp_path, num_shards=2)
    for load in (lambda tp: random_model(SPEC, "cpu", torch.float32, seed=3, tp=tp),
                 lambda tp: load_hf_model(SPEC, tmp_path, "cpu", torch.float32, tp=tp)):
        shares = [load(TPGroup(r, size)) for r in range(size)]
        local = shares[0].spec
        ql, kvl, il = local.q_size, local.kv_size, local.intermediate_size
        step = max(1, size // SPEC.num_kv_heads)  # ranks sharing one KV head
        for i, w in enumerate(whole.layers):
            parts = [s.layers[i] for s in shares]
            q = torch.cat([p.qkv[:ql] for p in parts])
            k = torch.cat([p.qkv[ql:ql + kvl] for p in parts[::step]])
            v = torch.cat([p.qkv[ql + kvl:] for p in parts[::step]])
            assert torch.equal(torch.cat([q, k, v]), w.qkv)
            assert torch.equal(torch.cat([p.o for p in parts], dim=1), w.o)
            assert torch.equal(torch.cat([p.gate_up[:il] for p in parts]
                                         + [p.gate_up[il:] for p in parts]), w.gate_up)
            assert torch.equal(torch.cat([p.down for p in parts], dim=1), w.down)
            assert all(torch.equal(p.input_norm, w.input_norm) for p in parts)
        for name in ("embed", "lm_head"):
            rows = torch.cat([getattr(s, name) for s in shares])
            assert torch.equal(rows[:SPEC.vocab_size], getattr(whole, name))


def test_bad_parallel_settings_are_one_line_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="^parallel.pipeline_parallel_size=2: the real engine "
                                         "has no pipeline parallelism"):
        run_real([], lambda n: None, SPEC, {"device": "cpu"},
                 parallel=ParallelConfig(pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="^parallel.tensor_parallel_size=3 must divide "
                                         "model.num_heads=4 of tiny$"):
        serve("single_step", {}, None, tp=3)
    with pytest.raises(ValueError, match="^backend.keep_runner keeps one process's runner"):
        serve("single_step", {}, None, tp=2, keep_runner=True)
    # every rank fails to load the checkpoint: one line, and no rank is left waiting
    with pytest.raises(ValueError, match=f"^backend.weights {tmp_path} has no config.json$"):
        serve("single_step", {}, None, tp=2, weights=str(tmp_path))


# A KV cache of 20 MiB a rank rather than 1 GiB (zeroing it is most of a rank's setup), and
# short requests: the runs below check how ranks start and end, not how much they serve.
SMALL = ["backend.cpu_kv_cache_gib=0.02", "workload.lengths.prompt_max=64",
         "workload.lengths.output_max=32"]


@pytest.mark.slow
def test_the_run_command_starts_its_ranks(tmp_path) -> None:
    """python -m experiments.run with parallel.tensor_parallel_size=2 runs the ranks itself and
    records the split (docs/parallel.md's command, on the CPU)."""
    p = subprocess.run([sys.executable, "-m", "experiments.run", "backend=real", "model=tiny",
                        "backend.device=cpu", "parallel.tensor_parallel_size=2",
                        "workload=synthetic", "workload.num_prompts=4", "progress=false",
                        *SMALL, f"hydra.run.dir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["completed"] == 4 and res["schedlab"]["tensor_parallel_size"] == 2


# ---------------------------------------------------------------------- ending a run early

TP_RUN = [sys.executable, "-m", "experiments.run", "backend=real", "model=tiny",
          "backend.device=cpu", "parallel.tensor_parallel_size=2", "workload=synthetic",
          "workload.num_prompts=2000", "progress=false", *SMALL]


def _worker_pids(pid: int) -> list[int]:
    """The spawned worker ranks among ``pid``'s children (from /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        if ppid == pid and b"spawn_main" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_tp_run(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    """The CLI's tensor-parallel run, once its worker rank is serving windows: its rendezvous
    directory under ``tmp_path`` (TMPDIR), so that what it leaves is seen."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([*TP_RUN, f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not ((workers := _worker_pids(proc.pid))
               and list(tmp_path.glob("schedlab-tp-*/rendezvous"))):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    # the ranks join, build their shares (a tiny model, a small cache) and serve: a small part
    # of this wait, even on a busy machine
    time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()
    return proc, workers


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_sigterm_ends_the_run_as_ctrl_c_does(tmp_path) -> None:
    """kill/timeout/scancel: one line, exit 143, no traceback (from either rank), the worker
    ended and the rendezvous directory removed."""
    proc, workers = _start_tp_run(tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=15)
    assert (proc.returncode, err) == (143, "interrupted: no result written\n")
    assert not list(tmp_path.glob("schedlab-tp-*"))
    assert not any(_running(w) for w in workers)
    assert not (tmp_path / "run" / "result.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_worker_that_dies_ends_the_run_naming_its_rank(tmp_path) -> None:
    proc, workers = _start_tp_run(tmp_path)
    os.kill(workers[0], signal.SIGKILL)
    out, err = proc.communicate(timeout=15)
    assert (proc.returncode, err) == (
        2, "error: tensor-parallel rank 1 was killed by SIGKILL during the run\n")
    assert not list(tmp_path.glob("schedlab-tp-*"))


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_workers_end_with_a_killed_rank_0(tmp_path) -> None:
    """kill -9 of the run runs no cleanup of its own: its worker still ends at once, quietly,
    and the next run removes the rendezvous directory it left."""
    proc, workers = _start_tp_run(tmp_path)
    proc.kill()
    out, err = proc.communicate(timeout=15)
    deadline = time.monotonic() + 5
    while any(_running(w) for w in workers):
        assert time.monotonic() < deadline, f"worker ranks {workers} outlived rank 0"
        time.sleep(0.1)
    assert err == ""
    (left,) = tmp_path.glob("schedlab-tp-*")
    remove_stale_rendezvous(tmp_path)
    assert not left.exists()


def test_only_rendezvous_directories_of_killed_runs_of_this_host_are_removed(tmp_path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = os.uname().nodename
    owners = {"killed": f"{host} {dead.pid}", "live": f"{host} {os.getpid()}",
              "other-host": f"{host}.elsewhere {dead.pid}", "unowned": None}
    for name, owner in owners.items():
        (tmp_path / f"schedlab-tp-{name}").mkdir()
        if owner is not None:
            (tmp_path / f"schedlab-tp-{name}" / "owner").write_text(owner)
    remove_stale_rendezvous(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "schedlab-tp-live", "schedlab-tp-other-host", "schedlab-tp-unowned"]


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_worker_ends_when_rank_0_is_killed_outside_any_collective() -> None:
    """On NCCL a worker waiting in a collective sees no closed connection: it ends because its
    parent did (a parent here that starts one watched child and is killed)."""
    child = ("import sys, time; from real_backend.parallel import exit_with_parent; "
             "exit_with_parent(int(sys.argv[1])); print('watching', flush=True); time.sleep(60)")
    parent = ("import os, subprocess, sys, time; "
              f"c = subprocess.Popen([sys.executable, '-c', {child!r}, str(os.getpid())]); "
              "print(c.pid, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    worker = int(proc.stdout.readline())
    assert proc.stdout.readline() == "watching\n"
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    while _running(worker):
        assert time.monotonic() < deadline, f"pid {worker} outlived its parent"
        time.sleep(0.05)
    proc.stdout.close()
