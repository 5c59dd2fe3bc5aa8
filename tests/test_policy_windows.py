"""The built-in policies make exactly the decisions they made before the policy interface was
opened: every window's composition (who, how many tokens from where, how many steps, who was
preempted) on ShareGPT-like loads, at t=0 and under Poisson arrivals, with a KV cache small
enough to preempt, with and without overlap. The digests were taken from the scheduler before
the change; a new policy hook that moves one decision changes them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from common.model_spec import ModelSpec
from experiments.run import CONF_DIR
from experiments.workload import build_workload, to_request
from policies import SchedulerConfig, make_policy
from policies.scheduler import Scheduler
from simulator.engine import simulate
from simulator.hardware import HardwareSpec
from simulator.overhead import OverheadSpec

GOLDEN = Path(__file__).parent / "data" / "policy_windows.yaml"
POLICIES = [("single_step", {}), ("multi_step", {"num_steps": 8}), ("chunked_prefill", {}),
            ("cp1", {"num_steps": 8}), ("cp2", {"num_steps": 4}), ("cp_promote", {"num_steps": 8}),
            ("adaptive", {})]
LOADS = {"t0": "inf", "poisson": 30.0}


def _conf(group: str, name: str) -> dict:
    return yaml.safe_load((Path(CONF_DIR) / group / f"{name}.yaml").read_text())


def window_digest(policy: str, params: dict, rate, overlap: bool, num_blocks: int) -> str:
    model = ModelSpec.from_dict(_conf("model", "llama3_8b"))
    lengths = {**_conf("workload", "synthetic")["lengths"], "dist": "lognormal",
               "prompt_mean": 600, "output_mean": 200, "prompt_max": 1700, "output_max": 300}
    specs = build_workload({"kind": "synthetic", "num_prompts": 300, "seed": 7,
                            "request_rate": float(rate), "burstiness": 1.0, "lengths": lengths},
                           max_model_len=model.max_model_len)
    requests = [to_request(s, i, with_token_ids=False) for i, s in enumerate(specs)]
    digest = hashlib.sha256()

    def new_scheduler(blocks: int) -> Scheduler:
        sched = Scheduler(make_policy(policy, **params),
                          SchedulerConfig(max_num_seqs=64, overlap=overlap), blocks,
                          model.max_model_len)
        schedule = sched.schedule

        def recorded(now: float):
            batch = schedule(now)
            if batch is not None:
                digest.update(repr((batch.num_steps, [
                    (req.request_id, *rest) for req, *rest in sched.window_seqs(batch)],
                    [r.request_id for r in batch.preempted])).encode())
            return batch

        sched.schedule = recorded
        return sched

    simulate(requests, new_scheduler, model,
             HardwareSpec.from_dict(_conf("hardware", "h200_calibrated")),
             OverheadSpec.from_dict(_conf("overhead", "schedlab_h200")), num_blocks=num_blocks,
             progress=False)
    return digest.hexdigest()[:16]


def cases():
    for name, params in POLICIES:
        for load in LOADS:
            for overlap in (False, True):
                yield f"{name}-{load}-{'overlap' if overlap else 'plain'}", name, params, load, overlap


@pytest.mark.parametrize("case,name,params,load,overlap", list(cases()))
def test_builtin_policies_form_the_same_windows(case, name, params, load, overlap):
    golden = yaml.safe_load(GOLDEN.read_text())
    assert window_digest(name, params, LOADS[load], overlap, num_blocks=900) == golden[case]


if __name__ == "__main__":  # rewrites the golden file (only from the scheduler it must match)
    GOLDEN.write_text(yaml.safe_dump({c: window_digest(n, p, LOADS[ld], o, num_blocks=900)
                                      for c, n, p, ld, o in cases()}))
