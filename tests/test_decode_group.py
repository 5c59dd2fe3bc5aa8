"""The simulator's decode group (policies/decode_group.py) against the scheduler's per-sequence
windows: on runs that join, finish, run short of blocks (the members leave, preempt, join
again), switch the group off for prefix caching, and run in a cluster, every window lists the
same sequences, steps.csv is the same, and every request's token times, finish time,
preemptions and waits are the same, exactly (the same arithmetic)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from common.model_spec import ModelSpec
from common.parallel import ParallelConfig
from experiments.result_files import steps_csv
from experiments.run import CONF_DIR
from experiments.workload import build_workload, to_request
from policies import SchedulerConfig, make_policy
from policies.request import Request
from policies.routers import make_router
from policies.scheduler import Scheduler
from simulator.engine import simulate, simulate_cluster
from simulator.hardware import HardwareSpec
from simulator.outcome import ReplicaSpec
from simulator.overhead import OverheadSpec


def _conf(group: str, name: str) -> dict:
    return yaml.safe_load((Path(CONF_DIR) / group / f"{name}.yaml").read_text())


MODEL = ModelSpec.from_dict(_conf("model", "llama3_8b"))

# name: (policy, params, rate, hardware, overhead, pp, stream_per_step, max_concurrency,
#        num_blocks, max_num_batched_tokens, shared_prefix_len, replicas)
CASES = {
    "t0-blocking": ("multi_step", {"num_steps": 8}, "inf", "h100_sxm", "vllm_v0_5", 1, False,
                    None, None, None, 0, 1),
    "poisson-async-short-of-blocks": ("multi_step", {"num_steps": 8}, 25.0, "h200_calibrated",
                                      "schedlab_h200", 1, False, None, 350, None, 0, 1),
    "t0-preempting-k4": ("multi_step", {"num_steps": 4}, "inf", "h100_sxm", "vllm_v0_6", 1,
                         False, None, 400, None, 0, 1),
    "single_step-pp2-stream": ("single_step", {}, 20.0, "h100_sxm", "vllm_v0_6", 2, True, None,
                               None, None, 0, 1),
    "maxconc-deferred": ("multi_step", {"num_steps": 8}, 40.0, "h100_sxm", "vllm_v0_6", 1,
                         False, 24, None, None, 0, 1),
    "sjf-t0-short-of-blocks": ("sjf", {}, "inf", "h100_sxm", "vllm_v0_5", 1, False, None,
                               500, None, 0, 1),
    "edf-prefix-cached": ("edf", {}, 30.0, "h100_sxm", "vllm_v0_5", 1, False, None, None, None,
                          64, 1),
    "cluster-least-outstanding": ("multi_step", {"num_steps": 8}, 60.0, "h100_sxm", "vllm_v0_5",
                                  1, False, None, 600, None, 0, 3),
}


def run(name: str, group: bool) -> dict:
    """Every window (its sequences as the per-sequence scheduler lists them), steps.csv, each
    request's outcome, and how many windows the decode group formed."""
    (policy, params, rate, hardware, overhead, pp, stream, max_conc, blocks, budget, prefix,
     replicas) = CASES[name]
    lengths = {**_conf("workload", "synthetic")["lengths"], "dist": "lognormal",
               "prompt_mean": 300, "output_mean": 120, "prompt_max": 1200, "output_max": 300}
    classes = {"a": {"share": 0.3, "priority": 0, "ttft_ms": 400},
               "b": {"share": 0.7, "priority": 1, "ttft_ms": 3000}}
    specs = build_workload({"kind": "synthetic", "num_prompts": 180, "seed": 7,
                            "request_rate": float(rate), "burstiness": 1.0, "lengths": lengths,
                            "classes": classes, "shared_prefix_len": prefix},
                           max_model_len=MODEL.max_model_len)
    requests = [to_request(s, i, with_token_ids=False) for i, s in enumerate(specs)]
    windows: list = []
    grouped = [0]

    def new_scheduler(num_blocks: int) -> Scheduler:
        sched = Scheduler(make_policy(policy, **params),
                          SchedulerConfig(max_num_seqs=48, max_num_batched_tokens=budget),
                          num_blocks, MODEL.max_model_len)
        schedule = sched.schedule

        def recorded(now: float):
            batch = schedule(now)
            if batch is not None:
                grouped[0] += batch.decodes is not None
                seqs = [(req.request_id, *rest) for req, *rest in sched.window_seqs(batch)]
                windows.append((batch.window_id, batch.num_steps, seqs,
                                [r.request_id for r in batch.preempted]))
            return batch

        sched.schedule = recorded
        return sched

    hw = HardwareSpec.from_dict(_conf("hardware", hardware), ParallelConfig(1, pp))
    oh = OverheadSpec.from_dict(_conf("overhead", overhead))
    if replicas == 1:
        res = simulate(requests, new_scheduler, MODEL, hw, oh, num_blocks=blocks,
                       stream_per_step=stream, max_concurrency=max_conc, progress=False,
                       group_decodes=group)
    else:
        spec = ReplicaSpec(new_scheduler, MODEL, hw, oh, num_blocks=blocks, group_decodes=group)
        res = simulate_cluster(requests, [spec] * replicas, make_router("least_outstanding"),
                               max_concurrency=max_conc, progress=False).total
    outcome = [(r.num_output_tokens, r.num_computed_tokens, list(r.token_times), r.finish_time,
                r.first_scheduled_time, r.max_wait, r.num_preemptions, r.state, r.block_table)
               for r in requests]
    return {"windows": windows, "steps": steps_csv(res.steps), "requests": outcome,
            "stats": res.stats, "duration": res.duration, "grouped": grouped[0]}


@pytest.mark.parametrize("name", list(CASES))
def test_group_windows_equal_the_per_sequence_windows(name):
    alone, grouped = run(name, False), run(name, True)
    assert alone["grouped"] == 0
    assert len(grouped["windows"]) == len(alone["windows"])
    for a, b in zip(alone["windows"], grouped["windows"], strict=True):
        assert a == b
    assert grouped["steps"] == alone["steps"]
    for a, b in zip(alone["requests"], grouped["requests"], strict=True):
        assert a == b
    assert grouped["stats"] == alone["stats"] and grouped["duration"] == alone["duration"]
    if name == "edf-prefix-cached":  # the first request with a shared prefix switches it off
        assert grouped["grouped"] == 0
        return
    decode_windows = sum(1 for w in alone["windows"] if w[2] and not w[2][0][4])
    assert grouped["grouped"] > 0
    if "short-of-blocks" in name or "preempting" in name:
        # the members left the group (a shortage) and joined it again
        assert 0 < grouped["grouped"] < decode_windows
        assert grouped["stats"].num_preemptions > 0


def test_a_member_is_caught_up_where_it_is_read():
    """A member keeps its fields from when it joined and the group's position then; where the
    scheduler reads it one by one (a window short of blocks, an abort) its fields are caught up
    to the counter, its blocks by count picked or given back, the invariants holding."""
    sched = Scheduler(make_policy("multi_step", num_steps=4), SchedulerConfig(block_size=4), 9,
                      4096)
    sched.group_decodes()
    reqs = [Request(i, 0.0, prompt_len=6, max_tokens=12) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    t = 0.0

    def window():
        nonlocal t
        batch = sched.schedule(t)
        seqs = sched.window_seqs(batch)
        times = [t + j + 1 for j in range(batch.num_steps)]
        t = times[-1]
        sched.update(batch, times)
        return batch, seqs

    prefill, _ = window()
    assert prefill.decodes is None and all(r.group_offset == 0 for r in reqs)
    grouped, seqs = window()  # 3 x 6 tokens + 4 slots each: 9 blocks of 4
    assert grouped.decodes is not None and [c for _, _, c, _, _ in seqs] == [6, 6, 6]
    assert all(r.num_computed_tokens == 6 and r.block_table == [] for r in reqs)
    assert sched.block_manager.unassigned == 9 and sched.block_manager.num_free_blocks == 0
    short, seqs = window()  # 10 tokens each, no block free: the members leave, one preempted
    assert short.decodes is None and [r.request_id for r in short.preempted] == [2]
    assert [(r.num_computed_tokens, r.num_output_tokens, r.token_times) for r in reqs[:2]] \
        == [(14, 9, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])] * 2
    assert reqs[2].num_output_tokens == 5 and reqs[2].token_times == [1.0, 2.0, 3.0, 4.0, 5.0]
    sched.block_manager.check(sched.running)
    assert [r.group_offset for r in reqs] == [4, 4, None]  # they joined again at its update()
    assert sched.abort(0) and reqs[0].num_computed_tokens == 14 and reqs[0].group_offset is None
    assert sched.block_manager.num_free_blocks == 9 - 4 and sched.block_manager.unassigned == 0


def test_a_request_owing_no_token_cannot_join():
    """A member's end is a position a later window covers: one that owes nothing would never
    finish, so it is refused."""
    from policies.decode_group import DecodeGroup

    done = Request(0, 0.0, 16, 4)
    done.num_computed_tokens, done.num_output_tokens = 19, 4
    with pytest.raises(RuntimeError, match="request 0 joins the decode group owing no token"):
        DecodeGroup(lambda n: -(-n // 16), 16).join([done])
