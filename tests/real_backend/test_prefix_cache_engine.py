"""Prefix caching on the real engine: a prefill that starts after a cached prefix attends over
the cached KV through the block table and samples the same greedy ids as with caching off, for
every policy; the simulator finds the same hits, request for request, and forms the same
windows. A later turn of a conversation is sent after the previous turn's answer."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import yaml
from rb_util import load_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_policy_properties import PARAMS, stand_in_step_time  # noqa: E402  (every policy's settings)
from test_prefix_cache import colliding  # noqa: E402  (blocks with equal tuple hashes)

from policies import Request, Scheduler, SchedulerConfig, make_policy
from real_backend import run_real
from real_backend.serving.inbox import Inbox
from simulator import OverheadSpec, simulate
from simulator.hardware import HardwareSpec

CONF = Path(__file__).resolve().parents[2] / "conf"

SPEC = load_spec("tiny")
BLOCK_SIZE = 4
HW = HardwareSpec.from_dict(yaml.safe_load((CONF / "hardware" / "h100_sxm.yaml").read_text()))
WINDOW_COLUMNS = ("window", "k", "num_seqs", "num_prefill_seqs", "num_tokens", "kv_tokens",
                  "num_preempted", "num_wasted_steps")
# content keys and their lengths: 1 a system prompt, 2..4 a conversation's earlier turns
LENGTHS = {1: 13, 2: 7, 3: 9, 4: 5}


def _ids(key: int, n: int) -> list[int]:
    rng = random.Random(key)
    return [rng.randrange(SPEC.vocab_size) for _ in range(n)]


def make_requests(with_ids: bool) -> list[Request]:
    """Prompts that share a system prompt, and turns that extend earlier ones."""
    r = random.Random(4)
    out = []
    for i in range(14):
        keys = [1] * (i % 4 != 3) + [2, 3, 4][:r.randint(0, 3)]
        segments = [(k, LENGTHS[k]) for k in keys] + [(100 + i, r.randint(1, 6))]
        ids = [t for k, n in segments for t in _ids(k, n)]
        req = Request(i, 0.0, len(ids), r.randint(3, 12),
                      prompt_token_ids=ids if with_ids else None)
        req.prefix_segments = tuple(segments)
        out.append(req)
    return out


def _scheduler(policy: str, caching: bool, num_blocks: int, overlap: bool = False) -> Scheduler:
    cfg = SchedulerConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching, overlap=overlap,
                          max_num_batched_tokens=48 if policy in ("sarathi",) else None)
    return Scheduler(make_policy(policy, **PARAMS[policy]), cfg, num_blocks, SPEC.max_model_len,
                     stand_in_step_time)


def run(policy: str, *, caching: bool, real: bool, num_blocks: int = 64, overlap: bool = False):
    reqs = make_requests(real)
    make = lambda n: _scheduler(policy, caching, n, overlap)  # noqa: E731
    if real:
        out = run_real(reqs, make, SPEC, {"device": "cpu", "num_blocks": num_blocks,
                                          "save_token_ids": True, "async_output": overlap},
                       progress=False)
    else:
        out = simulate(reqs, make, SPEC, HW, OverheadSpec(), block_size=BLOCK_SIZE,
                       num_blocks=num_blocks, progress=False)
    windows = [tuple(row[c] for c in WINDOW_COLUMNS) for row in out.steps]
    return reqs, out, windows


@pytest.fixture(scope="module")
def ids_without_caching() -> dict[int, list[int]]:
    """The greedy ids of a run with caching off: every policy's, as greedy ids do not depend
    on the policy (test_real_engine.py checks each policy's against the no-cache oracle)."""
    return run("single_step", caching=False, real=True)[1].token_ids


@pytest.mark.parametrize("policy", sorted(PARAMS))
def test_cached_prefixes_give_the_same_greedy_ids_and_the_simulator_the_same_hits(
        policy, ids_without_caching):
    reqs, on, windows = run(policy, caching=True, real=True)
    assert on.token_ids == ids_without_caching
    hits = [r.num_cached_prompt_tokens for r in reqs]
    assert sum(hits) > 0  # the shared prefixes were found
    sim_reqs, _, sim_windows = run(policy, caching=True, real=False)
    assert [r.num_cached_prompt_tokens for r in sim_reqs] == hits
    assert sim_windows == windows


@pytest.mark.parametrize("policy", ["multi_step", "chunked_prefill"])
def test_cached_prefixes_under_overlap_scheduling(policy):
    """With overlap the next window is formed while this one runs: a request admitted then
    may share blocks the window in flight computes; ids and hits as without overlap."""
    reqs, on, windows = run(policy, caching=True, real=True, overlap=True, num_blocks=30)
    _, off, _ = run(policy, caching=False, real=True, overlap=False, num_blocks=30)
    assert on.token_ids == off.token_ids
    assert sum(r.num_cached_prompt_tokens for r in reqs) > 0
    sim_reqs, _, sim_windows = run(policy, caching=True, real=False, overlap=True, num_blocks=30)
    assert [r.num_cached_prompt_tokens for r in sim_reqs] == \
        [r.num_cached_prompt_tokens for r in reqs]
    assert sim_windows == windows


def test_shared_blocks_survive_preemption_on_the_engine():
    """A cache too small for every request: preemptions free shared blocks that another
    request still reads; its ids are those of a run with caching off."""
    reqs, on, windows = run("multi_step", caching=True, real=True, num_blocks=22)
    _, off, _ = run("multi_step", caching=False, real=True, num_blocks=22)
    assert any(w[6] for w in windows)  # preemptions
    assert on.token_ids == off.token_ids
    assert [w for w in run("multi_step", caching=True, real=False, num_blocks=22)[2]] == windows


def test_a_later_turn_is_sent_after_the_previous_answer_plus_think_time():
    def turns(with_ids: bool) -> list[Request]:
        first = Request(0, 0.0, 9, 6, prompt_token_ids=_ids(1, 9) if with_ids else None)
        second = Request(1, 0.0, 20, 4, prompt_token_ids=(_ids(1, 9) + _ids(5, 11))
                         if with_ids else None)
        first.prefix_segments, second.prefix_segments = ((1, 9),), ((1, 9), (5, 11))
        second.previous_turn, second.think_time = 0, 0.25
        return [first, second]

    make = lambda n: _scheduler("single_step", True, n)  # noqa: E731
    for real in (False, True):
        reqs = turns(real)
        if real:
            run_real(reqs, make, SPEC, {"device": "cpu", "num_blocks": 32}, progress=False)
        else:
            simulate(reqs, make, SPEC, HW, OverheadSpec(), block_size=BLOCK_SIZE, num_blocks=32,
                     progress=False)
        first, second = reqs
        assert second.arrival_time == pytest.approx(first.finish_time + 0.25)
        assert second.first_scheduled_time >= second.arrival_time
        assert second.num_cached_prompt_tokens == 8  # the first turn's 2 full blocks


def test_a_served_prompt_is_cached_by_its_token_ids():
    sched = _scheduler("single_step", True, 32)
    inbox = Inbox.__new__(Inbox)  # only _add's bookkeeping is used
    inbox._closed, inbox._sent, inbox._requests = False, {}, {}
    ids = _ids(9, 18)
    for i in range(2):
        inbox._add(sched, Request(i, 0.0, 0, 2, prompt_token_ids=list(ids)))
    batch = sched.schedule(0.0)
    assert [s.num_cached_tokens for s in batch.seqs] == [0, 16]


def test_a_served_prompt_is_not_served_from_another_s_blocks():
    """Two prompts whose first blocks differ but have equal tuple hashes (the collision content digests fixed): the
    second computes its own block rather than reading the first's KV."""
    sched = _scheduler("single_step", True, 32)
    inbox = Inbox.__new__(Inbox)
    inbox._closed, inbox._sent, inbox._requests = False, {}, {}
    a = _ids(9, BLOCK_SIZE)
    b = colliding(_ids(10, BLOCK_SIZE - 1), hash(tuple(a)))
    assert a != b and hash(tuple(a)) == hash(tuple(b))
    for i, ids in enumerate((a, b)):
        inbox._add(sched, Request(i, 0.0, 0, 2, prompt_token_ids=ids + [5, 6]))
    batch = sched.schedule(0.0)
    assert [s.num_cached_tokens for s in batch.seqs] == [0, 0]


def test_validate_scores_the_hit_rate_of_a_measured_multiturn_run(tmp_path):
    """benchmarks/prefix_suite.py's layout scored by validate_policies --table prefix_cache: the
    simulator, from the run's config alone, finds the engine's hit rate to the token."""
    from experiments.validate import run_one
    from experiments.validate_policies import main

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from prefix_suite import overrides, workloads

    run_one(overrides("single_step", workloads(0, 0, smoke=True)["multiturn"], True, "inf",
                      smoke=True), tmp_path / "runs" / "multiturn_on")
    df = main([str(tmp_path / "runs"), "--table", "prefix_cache", "--hardware", "cpu",
               "--overhead", "none", "--sim-repeats", "1", "--out", str(tmp_path / "out")])
    hit = df[df["metric"] == "prefix_cache_hit_rate"].iloc[0]
    assert hit["measured"] > 10 and hit["error"] == 0
    assert "Prefix caching" in (tmp_path / "out" / "prefix_cache.md").read_text()
