"""The policies of the literature, and a policy written outside schedlab, form the same windows
on the real engine as in the simulator (offline, every decision depends on the scheduler's state
alone), preemptions included."""

from __future__ import annotations

import random
import textwrap
from pathlib import Path

import pytest
import yaml
from rb_util import load_spec

from policies import Request, Scheduler, SchedulerConfig, make_policy
from real_backend import run_real
from simulator import OverheadSpec, simulate
from simulator.cost_model import step_time_fn
from simulator.hardware import HardwareSpec

SPEC = load_spec("tiny")
BLOCK_SIZE = 4
NUM_BLOCKS = 24  # 96 token slots for 16 requests of up to 64 tokens: preemptions
CONF = Path(__file__).resolve().parents[2] / "conf"
HW = HardwareSpec.from_dict(yaml.safe_load((CONF / "hardware" / "h100_sxm.yaml").read_text()))
WINDOW_COLUMNS = ("window", "k", "num_seqs", "num_prefill_seqs", "num_tokens", "kv_tokens",
                  "num_preempted", "num_wasted_steps")
USER_POLICY = '''
    """short_prompt_first: shortest prompt first; at most max_long long prompts run at once."""

    from dataclasses import dataclass

    from policies import Policy, register


    @register
    @dataclass(frozen=True)
    class ShortPromptFirst(Policy):
        name = "short_prompt_first"
        orders_queue = True
        long_tokens: int = 20
        max_long: int = 2

        def queue_key(self, req, sched):
            return (req.prompt_len, req.arrival_time)

        def admit(self, req, sched):
            if req.prompt_len < self.long_tokens:
                return True
            return sum(r.prompt_len >= self.long_tokens for r in sched.running) < self.max_long
'''


def make_requests(with_ids: bool) -> list[Request]:
    r = random.Random(1)
    out = []
    for i in range(16):
        out_len, prompt = r.randint(4, 24), [r.randrange(SPEC.vocab_size)
                                             for _ in range(r.randint(1, 40))]
        req = (Request(i, 0.0, 0, out_len, prompt_token_ids=prompt) if with_ids
               else Request(i, 0.0, len(prompt), out_len))
        req.priority = r.choice((0, 1, 2))
        out.append(req)
    return out


def windows(policy: str, params: dict, budget: int | None, *, real: bool) -> list[tuple]:
    cfg = SchedulerConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=budget)
    fn = step_time_fn(SPEC, HW)

    def new(n: int) -> Scheduler:
        return Scheduler(make_policy(policy, **params), cfg, n, SPEC.max_model_len, fn)

    if real:
        out = run_real(make_requests(True), new, SPEC,
                       {"device": "cpu", "num_blocks": NUM_BLOCKS}, progress=False)
    else:
        out = simulate(make_requests(False), new, SPEC, HW, OverheadSpec(), block_size=BLOCK_SIZE,
                       num_blocks=NUM_BLOCKS, progress=False)
    return [tuple(row[c] for c in WINDOW_COLUMNS) for row in out.steps]


@pytest.mark.parametrize(("policy", "params", "budget"), [
    ("priority", {}, None),
    ("sjf", {"predictor": "noisy", "sigma": 1.0}, None),
    ("edf", {"ttft_slo_ms": 1e6}, None),
    ("sarathi", {"tpot_slo_ms": 0.095}, 32),  # under the tiny model's 4-token step (0.1 ms)
    ("mlfq", {"quantum_tokens": 4, "num_levels": 3}, None),
])
def test_policies_of_the_literature_make_the_same_windows_on_both_backends(policy, params, budget):
    real = windows(policy, params, budget, real=True)
    assert real == windows(policy, params, budget, real=False)
    if policy in ("priority", "mlfq"):
        assert any(w[6] for w in real)  # preemptions
    if policy == "sarathi":  # the target, not the token budget, sized the chunks
        assert real != windows("chunked_prefill", {}, budget, real=False)


def test_a_policy_from_outside_schedlab_runs_on_both_backends(tmp_path):
    path = tmp_path / "my_policy.py"
    path.write_text(textwrap.dedent(USER_POLICY))
    params = {"module": str(path), "max_long": 1}
    real = windows("short_prompt_first", params, None, real=True)
    assert real == windows("short_prompt_first", params, None, real=False)
    first = [w for w in real if w[3]][0]  # the first prefill window: short prompts, one long
    assert first[3] > 1


def test_validate_policies_predicts_a_measured_run_from_its_config(tmp_path):
    """benchmarks/policy_suite.py's run layout (config.json beside result.json) scored by
    experiments.validate_policies: every metric of the table, predicted from the config."""
    import sys

    from experiments.validate import run_one
    from experiments.validate_policies import main

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from policy_suite import overrides

    run_one(overrides("priority", "inf", 6, smoke=True), tmp_path / "runs" / "priority_rateinf")
    df = main([str(tmp_path / "runs"), "--hardware", "cpu", "--overhead", "none",
               "--sim-repeats", "1", "--out", str(tmp_path / "out")])
    assert set(df["metric"]) == {"request_throughput", "median_ttft_ms", "median_tpot_ms",
                                 "p90_ttft_ms", "p90_tpot_ms", "slo_attainment"}
    assert (df["run"] == "priority_rateinf").all() and (df["policy"] == "priority").all()
    assert "cells within target" in (tmp_path / "out" / "policies.md").read_text()
