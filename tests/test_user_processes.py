"""A user's own SimPy processes beside a simulation's (simulator/processes.py,
``backend.processes``): the documented example (docs/examples/replica_outage.py) runs and does
what it says, a process that only reads changes nothing, and bad entries are one-line errors."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from common.model_spec import ModelSpec
from policies import SchedulerConfig, make_scheduler
from policies.request import Request
from simulator.engine import simulate
from simulator.hardware import HardwareSpec
from simulator.overhead import OverheadSpec
from simulator.processes import user_processes

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "replica_outage.py"


def _example():
    spec = importlib.util.spec_from_file_location("replica_outage_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_outage_example_takes_its_replica_down_and_back():
    ex = _example()
    runs = ex.main()
    start, end = ex.START, ex.START + ex.DOWN
    down = ex.REPLICA
    with_, without = runs["with"], runs["without"]
    # no window of the replica starts while it is down, and it serves again afterwards
    starts = [row["t_start"] for row in with_["result"].total.steps if row["replica"] == down]
    assert not [t for t in starts if start < t < end]
    assert any(t >= end for t in starts) and any(t <= start for t in starts)
    # what was sent to it meanwhile waits for it; the router sends the other replica more
    where = with_["result"].replica_of
    stranded = [r for r, i in zip(with_["requests"], where, strict=True)
                if i == down and start < r.arrival_time < end]
    assert stranded and all(r.token_times[0] >= end for r in stranded)
    assert with_["routed"][down] < without["routed"][down]
    assert with_["p99_ttft_ms"] > without["p99_ttft_ms"]
    # the monitor saw its queue grow while it was down
    assert max(w[down] for t, w in runs["samples"] if start < t < end) > 0
    # without the outage, every request is served as if no process had been added
    assert all(r.finish_time is not None for r in without["requests"])


@pytest.mark.slow
def test_the_example_runs_from_the_command_line(tmp_path):
    """``backend.processes`` names the example's function: the run takes replica 0 down; a bad
    entry is the run's one-line error. The run with the example from the command line; the run
    without it and the bad entry through run() in this process (the same run; the command's
    error line is the message run() raises)."""
    from hydra import compose, initialize_config_dir

    from experiments.run import CONF_DIR, run

    settings = ["workload=synthetic", "workload.num_prompts=200", "workload.request_rate=40",
                "cluster.num_replicas=2", "router=least_outstanding", "progress=false"]

    def composed(*extra: str):
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            return compose("config", overrides=[*settings, *extra])

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "with"
    p = subprocess.run([sys.executable, "-m", "experiments.run", *settings,
                        f'backend.processes=["{EXAMPLE}:outage"]', f"hydra.run.dir={out}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    routed = {"with": [r["requests"] for r in json.loads((out / "result.json").read_text())[
        "replicas"]]}
    run(composed(), tmp_path / "without")
    routed["without"] = [r["requests"] for r in json.loads(
        (tmp_path / "without" / "result.json").read_text())["replicas"]]
    assert routed["with"][0] < routed["without"][0]
    with pytest.raises(ValueError) as err:
        run(composed("backend.processes=[outage]"), tmp_path / "bad")
    assert f"error: {err.value}".splitlines() == [
        "error: backend.processes[0] must be 'module:function' (a module name or a .py file, "
        "then the function's name), got 'outage'"]


def _not_a_generator(env, sim):
    return 42


@pytest.mark.parametrize("entry, message", [
    ("outage", r"^backend\.processes\[0\] must be 'module:function' \(a module name or a \.py "
               r"file, then the function's name\), got 'outage'$"),
    (f"{EXAMPLE}:nowhere", r"^backend\.processes\[0\] .*replica_outage\.py:nowhere: .* has no "
                           r"function 'nowhere'$"),
    ("no_such_module_here:outage", r"^backend\.processes\[0\] no_such_module_here failed to "
                                   r"import: ModuleNotFoundError"),
    (3, r"^backend\.processes\[0\] must be a function fn\(env, sim\) that returns a generator, "
        r"got 3$"),
])
def test_a_bad_entry_is_one_line_naming_it(entry, message):
    with pytest.raises(ValueError, match=message) as err:
        user_processes([entry])
    assert "\n" not in str(err.value)


def test_a_bad_list_and_a_function_without_yield_are_one_line():
    with pytest.raises(ValueError, match=r"^backend\.processes must be a list of functions or "
                                         r"'module:function' names, got 'a:b'$"):
        user_processes("a:b")
    with pytest.raises(ValueError, match=r"^backend\.processes\[0\] _not_a_generator\(env, sim\) "
                                         r"must return a generator \(a function with a yield, "
                                         r"e\.g\. 'yield env\.timeout\(1\.0\)'\), got 42$"):
        _simulate([_not_a_generator])


def _simulate(processes):
    model = ModelSpec.from_dict(_conf("model", "llama3_8b"))

    def make(num_blocks):
        return make_scheduler("multi_step", {"num_steps": 4}, SchedulerConfig(), num_blocks,
                              model.max_model_len)

    requests = [Request(i, 0.1 * i, 100, 20) for i in range(10)]
    return simulate(requests, make, model, HardwareSpec.from_dict(_conf("hardware", "h100_sxm")),
                    OverheadSpec.from_dict(_conf("overhead", "vllm_v0_5")), progress=False,
                    processes=processes)


def _conf(group: str, name: str) -> dict:
    return yaml.safe_load((ROOT / "conf" / group / f"{name}.yaml").read_text())


def test_a_process_sees_the_simulation_and_ends_with_it():
    """A process is given the environment and the handles, starts at time 0 and is left
    waiting when the simulation's own processes end; its error is the run's."""
    seen = []

    def watcher(env, sim):
        seen.append((env.now, len(sim.replicas), len(sim.requests), sim.client.num_unsent))
        while True:
            yield env.timeout(0.25)
            seen.append((env.now, sum(s.num_running for s in sim.replicas[0].schedulers)))

    res = _simulate([watcher])
    assert seen[0] == (0, 1, 10, 9)  # after the simulation's own: the request due at 0 is sent
    assert res.num_finished == 10 and seen[-1][0] <= res.duration + 0.25
    assert max(n for _, n in seen[1:]) > 0

    def failing(env, sim):
        yield env.timeout(0.5)
        raise KeyError("my process")

    with pytest.raises(KeyError, match="my process"):
        _simulate([failing])
