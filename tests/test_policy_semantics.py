"""What each policy of the literature is for, checked in the simulator on small overloaded runs
(Llama-3-8B on the calibrated H200 profile, lognormal lengths, Poisson arrivals above capacity):
the decision a policy changes shows in the metric it exists to move."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest
import yaml

from common.model_spec import ModelSpec
from experiments.run import CONF_DIR
from experiments.workload import build_workload, to_request
from policies import Request, SchedulerConfig, make_policy
from policies.scheduler import Scheduler
from simulator.cost_model import step_time, step_time_fn, window_shapes
from simulator.engine import simulate
from simulator.hardware import HardwareSpec
from simulator.overhead import OverheadSpec


def _conf(group: str, name: str) -> dict:
    return yaml.safe_load((Path(CONF_DIR) / group / f"{name}.yaml").read_text())


MODEL = ModelSpec.from_dict(_conf("model", "llama3_8b"))
HW = HardwareSpec.from_dict(_conf("hardware", "h200_calibrated"))
OVERHEAD = OverheadSpec.from_dict(_conf("overhead", "schedlab_h200"))


def requests(n: int = 400, rate: float = 60.0, seed: int = 3):
    lengths = {**_conf("workload", "synthetic")["lengths"], "dist": "lognormal",
               "prompt_mean": 500, "output_mean": 250, "prompt_max": 4000, "output_max": 2000,
               "output_sigma": 1.0}
    specs = build_workload({"kind": "synthetic", "num_prompts": n, "seed": seed,
                            "request_rate": rate, "burstiness": 1.0, "lengths": lengths},
                           max_model_len=MODEL.max_model_len)
    reqs = [to_request(s, i, with_token_ids=False) for i, s in enumerate(specs)]
    rng = random.Random(seed)
    for r in reqs:
        r.priority = rng.choice((0, 1, 1, 2))  # a quarter in the high class
    return reqs


def serve(policy: str, reqs=None, *, max_num_seqs: int = 64, num_blocks: int | None = 2000,
          windows: list | None = None, **params):
    reqs = reqs if reqs is not None else requests()
    fn = step_time_fn(MODEL, HW)

    def new(blocks: int) -> Scheduler:
        sched = Scheduler(make_policy(policy, **params), SchedulerConfig(max_num_seqs=max_num_seqs),
                          blocks, MODEL.max_model_len, fn)
        if windows is not None:
            schedule = sched.schedule

            def recorded(now):
                batch = schedule(now)
                if batch is not None:
                    windows.append((batch, [(s.num_query_tokens, s.num_cached_tokens)
                                            for s in batch.seqs]))
                return batch

            sched.schedule = recorded
        return sched

    simulate(reqs, new, MODEL, HW, OVERHEAD, num_blocks=num_blocks, progress=False)
    return reqs


def ttft(r) -> float:
    return r.token_times[0] - r.arrival_time


def e2el(r) -> float:
    return r.token_times[-1] - r.arrival_time


def test_sjf_with_the_oracle_cuts_mean_e2el_under_overload():
    fcfs = statistics.mean(map(e2el, serve("single_step")))
    sjf = statistics.mean(map(e2el, serve("sjf", predictor="oracle")))
    assert sjf < 0.8 * fcfs, (sjf, fcfs)
    noisy = statistics.mean(map(e2el, serve("sjf", predictor="noisy", sigma=0.5)))
    assert sjf <= noisy < fcfs


def test_priority_serves_the_high_class_first():
    reqs = serve("priority")
    high = statistics.median(ttft(r) for r in reqs if r.priority == 0)
    low = statistics.median(ttft(r) for r in reqs if r.priority == 2)
    fcfs = serve("single_step")
    high_fcfs = statistics.median(ttft(r) for r in fcfs if r.priority == 0)
    assert high < 0.5 * low and high < 0.5 * high_fcfs, (high, low, high_fcfs)
    assert sum(r.num_preemptions for r in reqs) > 0  # low-priority requests were preempted


def test_edf_with_admission_control_has_at_least_fcfs_goodput():
    slo = 2.0
    fcfs = sum(ttft(r) <= slo for r in serve("single_step"))
    edf = sum(ttft(r) <= slo for r in serve("edf", ttft_slo_ms=slo * 1e3))
    assert edf >= fcfs and edf > 1.2 * fcfs, (edf, fcfs)


def test_sarathi_keeps_every_step_within_the_tbt_target():
    target = 0.030
    windows: list = []
    serve("sarathi", windows=windows, tpot_slo_ms=target * 1e3, num_blocks=None)
    chunked = 0
    for batch, _ in windows:
        shape = window_shapes(batch)[0]
        t = step_time(shape, MODEL, HW)
        if batch.has_prefill:
            assert t <= target + 1e-12, (t, shape)
            chunked += any(s.is_prefill and not s.samples for s in batch.seqs)
    assert chunked > 0  # prompts were cut to fit the target, not only admitted whole


def test_sarathi_without_a_cost_model_is_refused():
    with pytest.raises(ValueError, match="policy sarathi sizes windows by time and needs a "
                                         "hardware profile's cost model"):
        Scheduler(make_policy("sarathi"), SchedulerConfig(), 100, 4096)


def test_mlfq_never_starves_past_its_bound():
    """Long requests at t=0 and a stream of short ones: without a bound the demoted long ones
    are preempted by newcomers and wait for the stream to pause; with it, a request that has
    waited ``starvation_s`` goes first and waits at most until the next windows free room.
    (The bound holds while the requests that reached it fit in the cache together: they are
    never preempted for one another.)"""

    def load():
        rng, t = random.Random(1), 0.0
        reqs = [Request(i, 0.0, 1500, 1500) for i in range(16)]
        for i in range(600):
            t += rng.expovariate(25.0)
            reqs.append(Request(16 + i, t, rng.randint(50, 300), rng.randint(20, 120)))
        return reqs

    bound = 2.0
    bounded = max(r.max_wait for r in serve("mlfq", load(), starvation_s=bound,
                                            quantum_tokens=64, num_blocks=2500))
    assert bounded <= bound + 0.5, bounded
    unbounded = max(r.max_wait for r in serve("mlfq", load(), starvation_s=1e9,
                                              quantum_tokens=64, num_blocks=2500))
    assert unbounded > bound + 3.0, unbounded
