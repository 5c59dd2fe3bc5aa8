"""A replica that fails and comes back: a SimPy process of your own beside the simulation's.

At ``START`` seconds replica ``REPLICA`` goes down for ``DOWN`` seconds: its engine thread is
held (``ReplicaSim.stall``), so it schedules nothing and processes no output meanwhile; the
windows already on its GPU finish, its KV cache is kept, and the requests routed to it wait.
A router that looks at load (least_outstanding) sends the others more while it is down.

In a run (a cluster of two behind least_outstanding):

    python -m experiments.run cluster.num_replicas=2 router=least_outstanding \\
        workload=synthetic workload.request_rate=40 \\
        'backend.processes=["docs/examples/replica_outage.py:outage"]'

or from Python, ``simulate_cluster(..., processes=[outage])``; ``python
docs/examples/replica_outage.py`` runs a small cluster with and without the outage and prints
what changed.
"""

from __future__ import annotations

REPLICA, START, DOWN = 0, 2.0, 3.0


def outage(env, sim):
    """Replica ``REPLICA`` is down from ``START`` to ``START + DOWN`` (simulated seconds)."""
    yield env.timeout(START)
    sim.replicas[REPLICA].stall(env.now + DOWN)


def waiting_monitor(samples, every=0.5):
    """A process that only reads: every ``every`` seconds, each replica's waiting requests,
    appended to ``samples`` as (time, [waiting per replica]); it changes no result."""

    def monitor(env, sim):
        while True:  # the run ends with the simulation's own processes
            samples.append((env.now, [sum(s.num_waiting for s in r.schedulers)
                                      for r in sim.replicas]))
            yield env.timeout(every)

    return monitor


def main() -> dict:
    """A small cluster (two replicas of Llama-3-8B, multi_step k=8 on an H100 profile, least
    outstanding, 40 req/s) with and without the outage: what each replica served."""
    from pathlib import Path

    import numpy as np
    import yaml

    from common.model_spec import ModelSpec
    from experiments.workload import build_workload, to_request
    from policies import SchedulerConfig, make_scheduler
    from policies.routers import make_router
    from simulator.engine import simulate_cluster
    from simulator.hardware import HardwareSpec
    from simulator.outcome import ReplicaSpec
    from simulator.overhead import OverheadSpec

    conf = Path(__file__).resolve().parents[2] / "conf"

    def load(group, name):
        return yaml.safe_load((conf / group / f"{name}.yaml").read_text())

    model = ModelSpec.from_dict(load("model", "llama3_8b"))
    workload = {**load("workload", "synthetic"), "num_prompts": 400, "request_rate": 40.0}

    def make(num_blocks):
        return make_scheduler("multi_step", {"num_steps": 8}, SchedulerConfig(), num_blocks,
                              model.max_model_len)

    def run(processes):
        requests = [to_request(s, i, with_token_ids=False) for i, s in
                    enumerate(build_workload(workload, max_model_len=model.max_model_len))]
        replicas = [ReplicaSpec(make, model, HardwareSpec.from_dict(load("hardware", "h100_sxm")),
                                OverheadSpec.from_dict(load("overhead", "vllm_v0_6")),
                                num_blocks=4000) for _ in range(2)]
        result = simulate_cluster(requests, replicas, make_router("least_outstanding"),
                                  progress=False, processes=processes)
        return requests, result

    samples = []
    out = {}
    for name, processes in (("without", []), ("with", [outage, waiting_monitor(samples)])):
        requests, result = run(processes)
        where = np.asarray(result.replica_of)
        ttft = np.array([r.token_times[0] - r.arrival_time for r in requests])
        out[name] = {"requests": requests, "result": result,
                     "routed": np.bincount(where, minlength=2).tolist(),
                     "p99_ttft_ms": float(np.percentile(ttft, 99) * 1e3)}
    out["samples"] = samples
    return out


if __name__ == "__main__":
    runs = main()
    for name in ("without", "with"):
        print(f"{name:>7} the outage: requests per replica {runs[name]['routed']}, "
              f"p99 TTFT {runs[name]['p99_ttft_ms']:.0f} ms")
    peak = max(runs["samples"], key=lambda s: s[1][REPLICA])
    print(f"replica {REPLICA}'s longest queue: {peak[1][REPLICA]} waiting at t = {peak[0]:.1f} s")
