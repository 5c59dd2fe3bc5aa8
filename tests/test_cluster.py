"""Clusters: replicas behind a router on one event heap (simulator/engine.py simulate_cluster,
policies/routers.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from common.model_spec import ModelSpec
from experiments.run import CONF_DIR
from experiments.workload import build_workload, to_request
from policies import SchedulerConfig, make_policy
from policies.request import Request
from policies.routers import ROUTERS, make_router
from policies.scheduler import Scheduler
from simulator.engine import simulate, simulate_cluster
from simulator.hardware import HardwareSpec
from simulator.memory import blocks_per_engine
from simulator.outcome import ReplicaSpec
from simulator.overhead import OverheadSpec


def _conf(group: str, name: str) -> dict:
    return yaml.safe_load((Path(CONF_DIR) / group / f"{name}.yaml").read_text())


MODEL = ModelSpec.from_dict(_conf("model", "llama3_8b"))


def _requests(n: int, rate: float, seed: int = 3) -> list[Request]:
    lengths = {**_conf("workload", "synthetic")["lengths"], "dist": "lognormal",
               "prompt_mean": 400, "output_mean": 120, "prompt_max": 1500, "output_max": 300}
    specs = build_workload({"kind": "synthetic", "num_prompts": n, "seed": seed,
                            "request_rate": rate, "burstiness": 1.0, "lengths": lengths},
                           max_model_len=MODEL.max_model_len)
    return [to_request(s, i, with_token_ids=False) for i, s in enumerate(specs)]


def _spec(policy: str = "multi_step", params: dict | None = None, hardware: str = "h100_sxm",
          overhead: str = "vllm_v0_6", num_blocks: int | None = 2000, group: int = 0,
          overlap: bool = False) -> ReplicaSpec:
    def new_scheduler(blocks: int) -> Scheduler:
        return Scheduler(make_policy(policy, **(params or {})),
                         SchedulerConfig(max_num_seqs=64, overlap=overlap), blocks,
                         MODEL.max_model_len)

    return ReplicaSpec(new_scheduler, MODEL, HardwareSpec.from_dict(_conf("hardware", hardware)),
                       OverheadSpec.from_dict(_conf("overhead", overhead)),
                       num_blocks=num_blocks, group=group)


def _times(reqs: list[Request]) -> list[tuple]:
    return [(r.arrival_time, tuple(r.token_times), r.finish_time, r.first_scheduled_time,
             r.num_preemptions) for r in reqs]


@pytest.mark.parametrize("overlap", [False, True])
def test_round_robin_cluster_is_its_replicas_alone(overlap):
    """N replicas behind round_robin == N single-replica runs on the round-robin split, exactly."""
    n = 3
    reqs = _requests(150, 40.0)
    params = {"num_steps": 4}
    res = simulate_cluster(reqs, [_spec(params=params, overlap=overlap) for _ in range(n)],
                           make_router("round_robin"), progress=False)
    assert res.replica_of == [i % n for i in range(len(reqs))]  # sent in arrival order
    for i in range(n):
        alone = _requests(150, 40.0)[i::n]
        spec = _spec(params=params, overlap=overlap)
        one = simulate(alone, spec.make_scheduler, MODEL, spec.hw, spec.overhead,
                       num_blocks=spec.num_blocks, progress=False)
        assert _times(reqs[i::n]) == _times(alone)
        assert res.replicas[i].num_windows == one.num_windows
        assert res.replicas[i].duration == one.duration
    assert res.total.num_finished == len(reqs)
    assert res.total.duration == max(r.duration for r in res.replicas)


def _recording(router):
    """The router, with every routing instant's outstanding counts and choice recorded."""
    seen = []
    route = router.route

    def recorded(req, replicas, now):
        before = [r.outstanding for r in replicas]
        i = route(req, replicas, now)
        seen.append((before, i))
        return i

    router.route = recorded
    return router, seen


@pytest.mark.parametrize("rate", [float("inf"), 60.0])
def test_least_outstanding_keeps_equal_replicas_within_one(rate):
    router, seen = _recording(make_router("least_outstanding"))
    reqs = _requests(200, rate)
    simulate_cluster(reqs, [_spec() for _ in range(4)], router, progress=False)
    assert len(seen) == len(reqs)
    for before, i in seen:
        assert i == before.index(min(before))  # the least loaded, the lowest index on a tie
        if rate == float("inf"):  # nothing finishes between routing instants
            assert max(before) - min(before) <= 1


def _conversations(turns: int = 4, convs: int = 24) -> list[Request]:
    """convs conversations of turns turns each, a turn every ~0.2 s, interleaved."""
    reqs = []
    for c in range(convs):
        for t in range(turns):
            req = Request(len(reqs), 0.05 * c + 0.2 * t, 200 + 150 * t, 60)
            req.conversation_id = f"c{c}"
            reqs.append(req)
    return reqs


def test_prefix_affinity_keeps_a_conversation_on_one_replica():
    reqs = _conversations()
    res = simulate_cluster(reqs, [_spec() for _ in range(4)],
                           make_router("prefix_affinity", load_cap_abs=10_000), progress=False)
    where: dict[str, set[int]] = {}
    for r, i in zip(reqs, res.replica_of, strict=True):
        where.setdefault(r.conversation_id, set()).add(i)
    assert all(len(s) == 1 for s in where.values())
    assert len(set(res.replica_of)) == 4  # the first turns spread by load


def test_prefix_affinity_moves_a_conversation_only_past_the_load_cap():
    router = make_router("prefix_affinity", load_cap_abs=1, load_cap_rel=1.0)
    capped = router.capped
    hits = []
    router.capped = lambda target, replicas: hits.append(capped(target, replicas)) or hits[-1]
    reqs = _conversations(turns=5)
    res = simulate_cluster(reqs, [_spec() for _ in range(3)], router, progress=False)
    last: dict[str, int] = {}
    moves = 0
    cap_iter = iter(hits)  # one check per turn after a conversation's first
    for r, i in zip(sorted(reqs, key=lambda r: r.arrival_time),
                    [res.replica_of[r.request_id] for r in sorted(reqs, key=lambda r: r.arrival_time)],
                    strict=True):
        if r.conversation_id in last:
            hit = next(cap_iter)
            if i != last[r.conversation_id]:
                assert hit, f"request {r.request_id} moved without the cap being hit"
                moves += 1
            else:
                assert not hit
        last[r.conversation_id] = i
    assert moves > 0  # a cap this tight is hit


def test_prefix_affinity_follows_mooncake_block_hashes():
    reqs = []
    for i in range(40):
        req = Request(i, 0.03 * i, 1024, 40)
        req.hash_ids = (i % 5, 100 + i)  # five shared first blocks
        reqs.append(req)
    res = simulate_cluster(reqs, [_spec() for _ in range(4)],
                           make_router("prefix_affinity", load_cap_abs=10_000), progress=False)
    for prefix in range(5):
        assert len({res.replica_of[i] for i in range(prefix, 40, 5)}) == 1


def test_heterogeneous_groups_keep_their_own_profiles():
    specs = [_spec("multi_step", {"num_steps": 8}, "h200", num_blocks=None, group=0)
             for _ in range(2)]
    specs += [_spec("chunked_prefill", {}, "h100_sxm", num_blocks=None, group=1)
              for _ in range(2)]
    reqs = _requests(160, 50.0)
    res = simulate_cluster(reqs, specs, make_router("least_outstanding"), progress=False)
    for i, rep in enumerate(res.replicas):
        spec = specs[i]
        assert rep.num_blocks == blocks_per_engine(MODEL, spec.hw)
        rows = [row for row in res.total.steps if row["replica"] == i]
        assert rows and len(rows) == rep.num_windows
        ks = {row["k"] for row in rows}
        if spec.group == 0:
            assert 8 in ks
        else:
            assert ks == {1}
    assert res.replicas[0].num_blocks != res.replicas[2].num_blocks  # H200 holds more KV
    assert all(sched.policy.name == "chunked_prefill" for sched in
               [s.make_scheduler(100) for s in specs[2:]])


def test_random_and_power_of_two_are_seeded():
    def run(name, seed):
        return simulate_cluster(_requests(60, 30.0), [_spec() for _ in range(4)],
                                make_router(name, seed=seed), progress=False).replica_of
    for name in ("random", "power_of_two"):
        assert run(name, 1) == run(name, 1)
        assert run(name, 1) != run(name, 2)


def test_least_kv_prefers_the_replica_with_the_least_kv_load():
    router, seen = _recording(make_router("least_kv"))
    reqs = _requests(100, float("inf"))
    res = simulate_cluster(reqs, [_spec() for _ in range(3)], router, progress=False)
    # at t=0 nothing is admitted yet: queued prompt tokens alone balance the replicas
    tokens = [0, 0, 0]
    for r, i in zip(reqs, res.replica_of, strict=True):
        assert tokens[i] == min(tokens)
        tokens[i] += r.prompt_len


def test_router_errors_are_one_line():
    with pytest.raises(ValueError, match=r"unknown router 'nope' \(router.name\); choose one of"):
        make_router("nope")
    with pytest.raises(ValueError, match="router random"):
        make_router("random", sed=1)
    with pytest.raises(ValueError, match="router.module nowhere.py: no such file"):
        make_router("mine", module="nowhere.py")


def test_a_router_module_that_does_not_parse_is_one_line_naming_its_line(tmp_path):
    """The syntax error's own file and line, not a frame of Python's import machinery."""
    (tmp_path / "typo_router.py").write_text("def route(:\n    pass\n")
    with pytest.raises(ValueError) as err:
        make_router("typo", module=str(tmp_path / "typo_router.py"))
    assert str(err.value) == (f"router.module {tmp_path / 'typo_router.py'} failed to import: "
                              "SyntaxError: invalid syntax (typo_router.py, line 1)")


def test_a_router_of_your_own(tmp_path):
    (tmp_path / "my_router.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        from policies.routers import Router, register_router

        @register_router
        @dataclass
        class LastReplica(Router):
            name = "last_replica"

            def route(self, req, replicas, now):
                return len(replicas) - 1
    '''))
    router = make_router("last_replica", module=str(tmp_path / "my_router.py"))
    assert "last_replica" in ROUTERS
    res = simulate_cluster(_requests(20, 30.0), [_spec() for _ in range(3)], router,
                           progress=False)
    assert set(res.replica_of) == {2}


# A router written outside schedlab that answers ``value``, or raises where value says so.
BAD_ROUTER = '''
    from dataclasses import dataclass
    from typing import Any

    from policies.routers import Router, register_router


    @register_router
    @dataclass
    class BadRouter(Router):
        name = "bad_router"
        value: Any = 0

        def __post_init__(self):
            if self.value == "fail to build":
                raise KeyError("replicas")

        def route(self, req, replicas, now):
            if self.value == "divide by zero":
                return len(replicas) // 0
            return self.value
'''


@pytest.fixture
def bad_router(tmp_path) -> Path:
    path = tmp_path / "bad_router.py"
    path.write_text(textwrap.dedent(BAD_ROUTER))
    return path


@pytest.mark.parametrize("value", [-1, True, 3, 99, 2.5, None, "1"])
def test_a_routers_answer_outside_the_replicas_is_one_line(bad_router, value):
    """A replica's index is an int in range(num_replicas): -1 was taken as the last replica
    (requests.csv said -1), True as 1; 99, 2.5, None and '1' were tracebacks."""
    router = make_router("bad_router", module=str(bad_router), value=value)
    with pytest.raises(ValueError) as err:
        simulate_cluster(_requests(6, 30.0), [_spec() for _ in range(3)], router, progress=False)
    assert str(err.value) == (f"router BadRouter.route returned {value!r} for request 0; it must "
                              "return a replica's index: an int in range(3)")


def test_a_routers_exception_names_the_router_and_the_users_line(bad_router):
    router = make_router("bad_router", module=str(bad_router), value="divide by zero")
    with pytest.raises(ValueError) as err:
        simulate_cluster(_requests(6, 30.0), [_spec() for _ in range(3)], router, progress=False)
    line = textwrap.dedent(BAD_ROUTER).splitlines().index("            return len(replicas) // 0")
    assert str(err.value) == ("router BadRouter.route raised ZeroDivisionError: integer division "
                              f"or modulo by zero ({bad_router}:{line + 1})")


def test_an_exception_building_a_users_router_names_it_and_the_users_line(bad_router):
    with pytest.raises(ValueError) as err:
        make_router("bad_router", module=str(bad_router), value="fail to build")
    line = textwrap.dedent(BAD_ROUTER).splitlines().index('            raise KeyError("replicas")')
    assert str(err.value) == ("router BadRouter raised KeyError: 'replicas' "
                              f"({bad_router}:{line + 1})")


def test_a_routers_numpy_index_is_taken(bad_router):
    """An index numpy computed (np.argmin's) is an int in range like any other."""
    import numpy as np

    router = make_router("bad_router", module=str(bad_router), value=np.int64(1))
    res = simulate_cluster(_requests(6, 30.0), [_spec() for _ in range(3)], router,
                           progress=False)
    assert res.replica_of == [1] * 6 and all(type(i) is int for i in res.replica_of)


@pytest.mark.parametrize(("value", "message"), [
    ("-1", "router BadRouter.route returned -1 for request 0; it must return a replica's index: "
           "an int in range(2)"),
    ("'divide by zero'", "router BadRouter.route raised ZeroDivisionError: integer division or "
                         "modulo by zero ({}:"),
])
def test_a_run_whose_router_breaks_its_contract_ends_in_one_line(tmp_path, bad_router, value,
                                                                  message):
    """Through the command line (the first case): exit code 2, the one line on stderr, no
    requests.csv saying replica -1; the other through run() in this process (the command's line
    is the message of the error run() raises)."""
    import subprocess
    import sys

    out = tmp_path / "run"
    settings = ["model=tiny", "hardware=cpu", "overhead=none", "workload=synthetic",
                "workload.num_prompts=8", "progress=false", "cluster.num_replicas=2",
                "router.name=bad_router", f"router.module={bad_router}", f"+router.value={value}"]
    if value == "-1":
        proc = subprocess.run(
            [sys.executable, "-m", "experiments.run", *settings, f"hydra.run.dir={out}"],
            cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
            timeout=300)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
    else:
        from hydra import compose, initialize_config_dir

        from experiments.run import CONF_DIR, run

        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = compose("config", overrides=settings)
        with pytest.raises(ValueError) as err:
            run(cfg, out)
        lines = f"error: {err.value}".splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: " + message.format(bad_router)), \
        lines
    assert not (out / "requests.csv").exists()


def _run(tmp_path, *overrides: str) -> dict:
    import contextlib
    import io
    import json

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from experiments.run import run

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = OmegaConf.to_container(compose("config", overrides=[
            "workload=synthetic", "workload.num_prompts=120", "workload.request_rate=60",
            "progress=false", *overrides]), resolve=True)
    with contextlib.redirect_stdout(io.StringIO()):
        run(cfg, tmp_path)
    return json.loads((tmp_path / "result.json").read_text())


def test_a_heterogeneous_cluster_run_reports_each_replica(tmp_path):
    import csv

    res = _run(tmp_path, "router=least_outstanding",
               "cluster.groups=[{replicas:2,hardware:h200,policy:{name:multi_step,num_steps:8}},"
               "{replicas:1,hardware:h100_sxm,policy:chunked_prefill}]")
    assert res["schedlab"]["router"] == "least_outstanding"
    assert res["schedlab"]["num_replicas"] == 3
    reps = res["replicas"]
    assert [(r["hardware"], r["policy"], r["k"]) for r in reps] == [
        ("h200", "multi_step", 8), ("h200", "multi_step", 8), ("h100_sxm", "chunked_prefill", 1)]
    assert sum(r["requests"] for r in reps) == res["completed"] == 120
    assert reps[0]["num_blocks"] > reps[2]["num_blocks"]  # each group's own memory model
    with open(tmp_path / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert {int(r["replica"]) for r in rows} == {0, 1, 2}
    assert [sum(int(r["replica"]) == i for r in rows) for i in range(3)] == \
        [r["requests"] for r in reps]
    with open(tmp_path / "steps.csv") as f:
        steps = list(csv.DictReader(f))
    assert {int(s["k"]) for s in steps if s["replica"] == "2"} == {1}


@pytest.mark.parametrize("override,message", [
    ("router.name=nope", "unknown router 'nope' (router.name)"),
    ("cluster.num_replicas=0", "cluster.num_replicas must be an integer >= 1, got 0"),
    ("cluster.groups=oops", "cluster.groups must be a non-empty list of replica groups"),
    ("cluster.groups=[{replicas:2,hardware:nope}]", "cluster.groups: no hardware config 'nope'"),
])
def test_bad_cluster_settings_are_one_line_errors(tmp_path, override, message):
    with pytest.raises(ValueError) as err:
        _run(tmp_path, override)
    assert message in str(err.value) and "\n" not in str(err.value)


def _same_run(a: Path, b: Path) -> bool:
    """Two runs gave the same results: result.json but for its date and wall-clock fields, and
    requests.csv and steps.csv byte for byte."""
    import json

    def outcome(path: Path) -> dict:
        res = json.loads((path / "result.json").read_text())
        res.pop("date")
        for key in ("wall_seconds", "simulated_seconds_per_wall_second", "config_sha256"):
            res["schedlab"].pop(key)
        return res

    return outcome(a) == outcome(b) and all(
        (a / name).read_bytes() == (b / name).read_bytes() for name in ("requests.csv",
                                                                       "steps.csv"))


def test_one_group_of_one_replica_runs_on_its_own_settings(tmp_path):
    """A cluster of one group is that group's engine: cluster.groups=[{replicas:1,hardware:h200}]
    is hardware=h200 (it ran on the default hardware)."""
    grouped = _run(tmp_path / "grouped", "cluster.groups=[{replicas:1,hardware:h200,"
                   "policy:{name:multi_step,num_steps:4}}]")
    _run(tmp_path / "top", "hardware=h200", "policy.num_steps=4")
    _run(tmp_path / "default")
    assert grouped["schedlab"]["hardware"] == "h200" and grouped["schedlab"]["k"] == 4
    assert _same_run(tmp_path / "grouped", tmp_path / "top")
    assert not _same_run(tmp_path / "grouped", tmp_path / "default")


@pytest.mark.parametrize("groups", ["[{replicas:1,%s}]", "[{replicas:1,%s},{replicas:1}]"])
@pytest.mark.parametrize("setting,message", [
    ("num_blocks:-5", "cluster.groups[0].num_blocks must be an integer >= 1, got -5"),
    ("gpu_memory_utilization:1.5",
     "cluster.groups[0].gpu_memory_utilization must be in (0, 1], got 1.5"),
    ("scheduler:{max_num_seqs:0}",
     "cluster.groups[0].scheduler.max_num_seqs must be an integer >= 1, got 0"),
    ("policy:{bogus:3}",
     "cluster.groups[0].policy multi_step has no setting 'bogus'; its settings: num_steps"),
    ("policy:{name:multi_step,num_steps:0}",
     "cluster.groups[0].policy.num_steps must be an integer >= 1, got 0"),
])
def test_a_group_s_bad_settings_are_refused_naming_the_group(tmp_path, groups, setting, message):
    """One group or two, the same checks (one group's were not made), naming the setting where
    it was given."""
    with pytest.raises(ValueError) as err:
        _run(tmp_path, f"cluster.groups={groups % setting}")
    assert str(err.value) == message


def test_groups_are_simulated_only(tmp_path):
    with pytest.raises(ValueError) as err:
        _run(tmp_path, "backend=real", "model=tiny", "cluster.groups=[{replicas:1,model:tiny}]")
    assert str(err.value) == "cluster.groups is simulated only (backend=sim)"


def test_a_group_s_own_tensor_parallel_size_changes_its_replicas_only(tmp_path):
    """cluster.groups[i].parallel is that group's split (its step times, KV blocks and
    GPUs); the other group's replica runs as before, and one group of tp=2 is the run's
    parallel.tensor_parallel_size=2 (the groups shared the run's parallel)."""
    both = "cluster.groups=[{replicas:1%s},{replicas:1}]"
    same = _run(tmp_path / "same", both % "")
    own = _run(tmp_path / "own", both % ",parallel:{tensor_parallel_size:2}")
    mine, other = own["replicas"]
    assert (mine["tensor_parallel_size"], other["tensor_parallel_size"]) == (2, 1)
    assert own["schedlab"]["num_gpus"] == 3 and "num_gpus" not in same["schedlab"]
    assert mine["num_blocks"] > same["replicas"][0]["num_blocks"]
    assert mine["gpu_busy_s"] < same["replicas"][0]["gpu_busy_s"]
    for key in ("num_blocks", "gpu_busy_s", "requests", "median_ttft_ms"):  # round_robin
        assert other[key] == same["replicas"][1][key], key
    one = _run(tmp_path / "one", "cluster.groups=[{replicas:1,parallel:{tensor_parallel_size:2}}]")
    _run(tmp_path / "top", "parallel.tensor_parallel_size=2")
    assert one["schedlab"]["tensor_parallel_size"] == 2
    assert _same_run(tmp_path / "one", tmp_path / "top")


@pytest.mark.parametrize("setting,message", [
    ("parallel:{tensor_parallel_size:0}",
     "cluster.groups[1].parallel.tensor_parallel_size must be an integer >= 1, got 0"),
    ("parallel:{tensor_parallel_size:3}",
     "cluster.groups[1].parallel.tensor_parallel_size=3 must divide model.num_heads=32 of "
     "llama3_8b"),
    ("parallel:{pipeline_parallel_size:64}",
     "cluster.groups[1].parallel.pipeline_parallel_size=64 exceeds model.num_layers=32 of "
     "llama3_8b"),
    ("parallel:{tp:2}", "cluster.groups[1].parallel has no setting 'tp'; its settings: "
     "pipeline_parallel_size, tensor_parallel_size"),
    ("parallel:tp2", "cluster.groups[1].parallel must be a mapping of settings over the run's "
     "parallel, such as {tensor_parallel_size: 2}, got 'tp2'"),
])
def test_a_group_s_bad_parallel_is_refused_naming_the_group(tmp_path, setting, message):
    with pytest.raises(ValueError) as err:
        _run(tmp_path, f"cluster.groups=[{{replicas:1}},{{replicas:1,{setting}}}]")
    assert str(err.value) == message


@pytest.mark.parametrize("cluster,available,message", [
    ("cluster.num_replicas=4096", 16 << 20,
     "cluster.num_replicas: 4096 replicas would take about 32 MiB, more than the 16 MiB of "
     "memory available; lower cluster.num_replicas"),
    ("cluster.num_replicas=1000000", 4 << 30,
     "cluster.num_replicas: 1000000 replicas would take about 7.6 GiB, more than the 4.0 GiB of "
     "memory available; lower cluster.num_replicas"),
    ("cluster.groups=[{replicas:600000},{replicas:400000}]", 4 << 30,
     "cluster.groups' replicas: 1000000 replicas would take about 7.6 GiB, more than the 4.0 GiB "
     "of memory available; lower cluster.groups' replicas"),
    ("cluster.groups=[{replicas:300000,parallel:{pipeline_parallel_size:2}},"
     "{replicas:400000}]", 4 << 30,
     "cluster.groups' replicas: 700000 replicas (1000000 pipeline stages in all) would take "
     "about 7.6 GiB, more than the 4.0 GiB of memory available; lower cluster.groups' "
     "replicas"),
])
def test_more_replicas_than_memory_holds_are_refused_at_once(tmp_path, monkeypatch, cluster,
                                                             available, message):
    """cluster.num_replicas=1000000 grew to 6 GB and kept going: now refused before any
    replica's state is made, while 16 replicas still run."""
    import time

    from experiments.workload import footprint

    monkeypatch.setattr(footprint, "available_memory", lambda: available)
    start = time.perf_counter()
    with pytest.raises(ValueError) as err:
        _run(tmp_path, cluster)
    assert str(err.value) == message
    assert time.perf_counter() - start < 5.0
    if available > 1 << 30:
        assert _run(tmp_path, "cluster.num_replicas=16")["schedlab"]["num_replicas"] == 16


@pytest.mark.parametrize("group,limit,longest", [
    ("model:{max_model_len:512}", "cluster.groups[1].model.max_model_len = 512", 512),
    ("num_blocks:40", "632, what cluster.groups[1]'s KV cache holds (40 blocks of 16 tokens, "
                      "less the watermark and 8 lookahead slots)", 632),
])
def test_a_request_a_group_cannot_hold_names_the_group_and_drop_too_long(tmp_path, group, limit,
                                                                          longest):
    """Any request may be routed to any replica: one longer than a group admits is refused
    up front naming the group (it failed inside the simulation naming neither), or dropped
    with workload.drop_too_long."""
    import csv
    import re

    groups = f"cluster.groups=[{{replicas:1}},{{replicas:1,{group}}}]"
    with pytest.raises(ValueError) as err:
        _run(tmp_path / "refused", groups)
    assert re.fullmatch(rf"workload: request \d+ needs prompt_len \+ output_len = \d+ tokens > "
                        rf"{re.escape(limit)} \(workload.drop_too_long=true drops such "
                        r"requests\)", str(err.value)), err.value
    res = _run(tmp_path / "dropped", groups, "workload.drop_too_long=true")
    with open(tmp_path / "dropped" / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert 0 < res["schedlab"]["num_dropped_too_long"] == 120 - len(rows)
    assert max(int(r["prompt_len"]) + int(r["output_len"]) for r in rows) <= longest


def test_a_group_s_policy_config_is_found_on_hydra_s_search_path(tmp_path):
    """A policy YAML of the user's, found through hydra.searchpath at the top level, is found
    for a replica group too (only conf/ was looked in)."""
    import json
    import subprocess
    import sys

    (tmp_path / "my_conf" / "policy").mkdir(parents=True)
    (tmp_path / "my_conf" / "policy" / "three_steps.yaml").write_text(
        "name: multi_step\nnum_steps: 3\n")
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.run", "workload=synthetic", "workload.num_prompts=20",
         "progress=false", f"hydra.run.dir={tmp_path / 'run'}",
         f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]",
         "cluster.groups=[{replicas:1,policy:three_steps},{replicas:1}]"],
        cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    assert [(r["policy"], r["k"]) for r in res["replicas"]] == [("multi_step", 3),
                                                                ("multi_step", 8)]
