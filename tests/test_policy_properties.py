"""Property tests: random workloads on small KV caches, every policy, invariants after each window."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import POLICIES, Request, RequestState, SchedulerConfig, make_scheduler

PARAMS = {
    "single_step": {}, "chunked_prefill": {},
    "multi_step": {"num_steps": 4}, "cp1": {"num_steps": 4}, "cp2": {"num_steps": 3},
    "cp_promote": {"num_steps": 4}, "adaptive": {"num_steps": 6},
    "priority": {}, "sjf": {"predictor": "noisy", "sigma": 1.0, "starvation_s": 40.0},
    "edf": {"ttft_slo_ms": 8000.0}, "sarathi": {"tpot_slo_ms": 30.0},
    "mlfq": {"quantum_tokens": 4, "num_levels": 3, "starvation_s": 40.0},
    "slo_adaptive": {"num_steps": 6, "ttft_slo_ms": 8000.0},
    "lpm": {"num_steps": 4, "fcfs_above": 6},
}


def stand_in_step_time(decodes, decode_kv, longest, chunks):
    """A stand-in cost model for the policies that price windows (sarathi): 1 ms a token."""
    return 1e-3 * (decodes + sum(q for q, _, _ in chunks))

workloads = st.fixed_dictionaries({
    "requests": st.lists(st.tuples(st.integers(0, 30),    # arrival window
                                   st.integers(1, 40),    # prompt_len
                                   st.integers(1, 24)),   # max_tokens
                         min_size=1, max_size=16),
    "block_size": st.sampled_from([1, 2, 4, 8]),
    "spare_blocks": st.integers(0, 12),  # beyond what the largest request needs alone
    "max_num_seqs": st.integers(1, 6),
    "budget": st.integers(64, 96),
    "watermark": st.sampled_from([0.0, 0.05]),
    # prefix caching: every prompt starts with `shared` tokens of one system prompt, and the
    # rest is one of `families` contents (equal families: equal prompts)
    "shared": st.integers(0, 12),
    "families": st.integers(1, 20),
})


def run_workload(name: str, w: dict) -> tuple[list[Request], object]:
    bs = w["block_size"]
    reqs = [Request(i, float(a), p, m) for i, (a, p, m) in enumerate(w["requests"])]
    for r in reqs:
        shared = min(w.get("shared", 0), r.prompt_len)
        own = ((1000 + r.request_id % w.get("families", 1) * 100 + r.prompt_len,
                r.prompt_len - shared),)
        r.prefix_segments = ((7, shared),) * (shared > 0) + own * (r.prompt_len > shared)
    policy_steps = PARAMS[name].get("num_steps", 1)
    need = max(-(-(r.prompt_len + r.max_tokens + policy_steps) // bs) for r in reqs)
    num_blocks = need + w["spare_blocks"]
    num_blocks = int((num_blocks + 1) / (1 - w["watermark"])) + 1  # room for the watermark
    cfg = SchedulerConfig(max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=w["budget"],
                          block_size=bs, watermark=w["watermark"])
    s = make_scheduler(name, PARAMS[name], cfg, num_blocks, max_model_len=4096,
                       step_time_fn=stand_in_step_time)
    pending = sorted(reqs, key=lambda r: r.arrival_time)
    now, windows = 0.0, 0
    while pending or s.has_unfinished:
        while pending and pending[0].arrival_time <= now:
            s.add_request(pending.pop(0))
        batch = s.schedule(now)
        if batch is None:
            assert not s.running, "running requests but no window formed"
            now = pending[0].arrival_time
            continue
        windows += 1
        assert windows < 5000, "no progress"
        ids = [x.request.request_id for x in batch.seqs]
        assert len(ids) == len(set(ids))
        # a victim is never re-admitted (and recomputed) in the window that preempted it
        assert not {r.request_id for r in batch.preempted} & set(ids)
        assert len(s.running) <= cfg.max_num_seqs
        assert sum(x.num_query_tokens for x in batch.seqs) <= s.max_num_batched_tokens
        for x in batch.seqs:
            assert x.request.state is RequestState.RUNNING
            assert 1 <= x.num_steps <= batch.num_steps
            assert len(x.request.block_table) * bs >= x.num_cached_tokens + x.num_slots
        s.block_manager.check(s.running + s.finishing)
        step_times = [now + j + 1.0 for j in range(batch.num_steps)]
        s.update(batch, step_times)
        s.block_manager.check(s.running + s.finishing)
        now = step_times[-1]
    return reqs, s


def check(name: str, w: dict) -> None:
    reqs, s = run_workload(name, w)
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
    assert not s.block_manager._refs  # no block left referenced
    for r in reqs:
        assert r.is_finished and r.num_output_tokens == r.max_tokens
        assert len(r.token_times) == r.max_tokens
        assert all(a <= b for a, b in zip(r.token_times, r.token_times[1:], strict=False))
        assert r.token_times[0] >= r.arrival_time and r.finish_time == r.token_times[-1]
        assert r.first_scheduled_time is not None and r.first_scheduled_time >= r.arrival_time
        assert r.block_table == []


def make_test(name: str):
    @settings(max_examples=200, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(workloads)
    def test(w):
        check(name, w)
    test.__name__ = f"test_invariants_{name}"
    return test


for _name in PARAMS:
    globals()[f"test_invariants_{_name}"] = make_test(_name)


def test_every_policy_is_covered():
    # the built-in ones: a test may have registered a policy of its own
    built_in = {n for n, c in POLICIES.items() if c.__module__.startswith("policies.")}
    assert set(PARAMS) == built_in


def test_small_caches_do_force_preemption_and_restart():
    """The property workloads must actually exercise preemption, for every policy."""
    w = {"requests": [(0, 30, 20)] * 6 + [(3, 10, 24)] * 4, "block_size": 4, "spare_blocks": 2,
         "max_num_seqs": 6, "budget": 64, "watermark": 0.0}
    for name in PARAMS:
        reqs, s = run_workload(name, w)
        assert s.stats.num_preemptions > 0, name
        assert any(r.num_preemptions for r in reqs)
        check(name, w)
