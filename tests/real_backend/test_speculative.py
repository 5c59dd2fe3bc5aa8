"""Speculative decoding in the real engine on hand-built windows (tiny model, CPU): self-draft
greedy verification is lossless, given acceptance counts emit accepted + 1 tokens a step with the
KV rolled back, n-gram lookup drafts from the prompt, and bad settings fail in one line."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from rb_util import greedy_dense, load_spec

from policies import Batch, ModelSpec, Request, ScheduledSeq
from real_backend.config import BackendConfig
from real_backend.model import forward_dense
from real_backend.runner import ModelRunner
from real_backend.speculative import (
    SpecSettings,
    Speculator,
    catch_up_chunks,
    check_draft,
    draft_spec,
    ngram_propose,
)
from real_backend.weights import random_model

SPEC = load_spec("tiny")
BLOCK = 4
BLOCKS_EACH = 24


def _runner(settings: SpecSettings, draft_shape=None, kernels: str = "torch",
            num_blocks: int = 128, max_tokens: int = 256, graphs: bool = False,
            spec: ModelSpec = SPEC) -> ModelRunner:
    model = random_model(spec, "cpu", torch.float32, seed=5)
    cfg = BackendConfig(device="cpu", num_blocks=num_blocks, kernels=kernels)
    runner = ModelRunner(model, cfg, block_size=BLOCK, max_num_seqs=8, max_lookahead=16)
    draft = None
    if settings.method == "draft":
        draft = model if draft_shape is None else random_model(draft_shape, "cpu",
                                                               torch.float32, seed=11)
    runner.spec = Speculator(settings, model, draft, runner.kernels, BLOCK, 8, max_tokens,
                             BLOCKS_EACH, graphs)
    runner.allocate_kv_cache(num_blocks)
    return runner


def _requests(lengths: tuple[int, ...], max_tokens: int, seed: int = 0,
              prompts: list[list[int]] | None = None) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(len(lengths) * BLOCKS_EACH, generator=g).tolist()
    if prompts is None:
        prompts = [torch.randint(0, SPEC.vocab_size, (n,), generator=g).tolist() for n in lengths]
    return [Request(i, 0.0, len(p), max_tokens, prompt_token_ids=list(p),
                    block_table=blocks[i * BLOCKS_EACH:(i + 1) * BLOCKS_EACH])
            for i, p in enumerate(prompts)]


def _run(runner: ModelRunner, entries, num_steps: int, k: int, accepted=None) -> list[list[int]]:
    """One window of (request, steps) rows: a request with uncomputed prompt prefills it whole
    in step 1, the others decode drafting k tokens a step; ``accepted`` (request id -> counts)
    fills ScheduledSeq.num_accepted. Moves the requests on as Scheduler.update does."""
    seqs = []
    for r, n in entries:
        prefill = r.num_computed_tokens < r.prompt_len
        q = r.prompt_len - r.num_computed_tokens if prefill else k + 1
        s = ScheduledSeq(r, q, r.num_computed_tokens, n, prefill, num_decode_tokens=k + 1)
        if accepted is not None:
            s.num_accepted = accepted[r.request_id]
        seqs.append(s)
    res = runner.run_window(Batch(seqs, num_steps))
    for s, ids in zip(seqs, res.sampled, strict=True):
        r = s.request
        r.output_token_ids += ids
        r.num_output_tokens += len(ids)
        r.num_computed_tokens = r.prompt_len + r.num_output_tokens - 1  # the newest is not
    return res.sampled


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("steps", [1, 3])
def test_self_draft_greedy_is_lossless(k: int, steps: int) -> None:
    """The draft is the target (shared weights, its own cache): every draft is accepted and the
    ids are exactly greedy decoding's without speculation, in single- and multi-step windows
    (the prefills ride in the first window and draft from its second step on)."""
    runner = _runner(SpecSettings("draft", k, "same"))
    reqs = _requests((9, 3, 14), 40)
    want = [greedy_dense(runner.model, r.prompt_token_ids, 40) for r in reqs]
    first = _run(runner, [(r, steps) for r in reqs], steps, k)
    assert [len(ids) for ids in first] == [1 + (steps - 1) * (k + 1)] * 3
    while min(len(r.output_token_ids) for r in reqs) < 24:
        got = _run(runner, [(r, steps) for r in reqs], steps, k)
        assert [len(ids) for ids in got] == [steps * (k + 1)] * 3  # everything accepted
    for r, w in zip(reqs, want, strict=True):
        assert r.output_token_ids == w[:len(r.output_token_ids)]
    c = runner.spec.counters
    assert c.num_draft_tokens == c.num_accepted_tokens > 0
    assert c.metrics()["spec_decode_acceptance_length"] == k + 1


def test_self_draft_triton_kernels() -> None:
    """The same on the Triton kernels (interpreted on the CPU): the verify's multi-token rows
    through the prefill attention kernel, the draft steps through the decode one. One layer:
    every layer runs the same kernels, and the interpreter is slow."""
    runner = _runner(SpecSettings("draft", 2, "same"), kernels="triton",
                     spec=load_spec("tiny", num_layers=1))
    reqs = _requests((6, 5), 16)
    want = [greedy_dense(runner.model, r.prompt_token_ids, 16) for r in reqs]
    for _ in range(3):
        _run(runner, [(r, 2) for r in reqs], 2, 2)
    for r, w in zip(reqs, want, strict=True):
        assert r.output_token_ids == w  # 1 + 3, then 6 a window


class _Replay:
    """A CUDA graph's stand-in on the CPU: capture runs the step once into its output buffer,
    replay runs it again into the same buffer (what the graph's static output is)."""

    def __init__(self, run) -> None:
        self.run, self.out = run, run()
        self.replays = 0

    def replay(self) -> None:
        self.out.copy_(self.run())
        self.replays += 1


def test_graph_shaped_steps_pad_rows_without_changing_ids(monkeypatch) -> None:
    """The graphed path on the CPU: the verify and the draft step over padded row counts (3
    rows padded to 4, the static buffers' padding tokens writing no KV), replayed through
    stand-ins of the captured graphs: the ids are still greedy decoding's."""
    from real_backend import speculative

    graphs = []

    def capture(run, pool):
        graphs.append(_Replay(run))
        return graphs[-1], graphs[-1].out

    monkeypatch.setattr(speculative, "capture_graph", capture)
    runner = _runner(SpecSettings("draft", 2, "same"))
    with pytest.raises(ValueError, match="the verify graphs write verify_out"):
        runner.spec.capture_graphs(runner.kv_cache, 8, None)
    runner = _runner(SpecSettings("draft", 2, "same"), graphs=True)
    runner.spec.capture_graphs(runner.kv_cache, 8, None)
    assert sorted(runner.spec.verify_graphs) == sorted(runner.spec.draft_graphs) == [1, 2, 4, 8]
    # one output for every padded row count: 8 x (k + 1) rows of logits, not 15 x (k + 1)
    out = runner.spec.verify_out
    assert out.shape == (8 * 3, SPEC.vocab_size)
    assert {g.out.data_ptr() for g in graphs[::2]} == {out.data_ptr()}
    reqs = _requests((9, 3, 14), 26)
    want = [greedy_dense(runner.model, r.prompt_token_ids, 26) for r in reqs]
    for _ in range(3):
        _run(runner, [(r, 3) for r in reqs], 3, 2)
    for r, w in zip(reqs, want, strict=True):
        assert r.output_token_ids == w[:len(r.output_token_ids)] and len(r.output_token_ids) > 20
    assert runner.spec.verify_graphs[4].replays == 8  # every step but the prefills'
    assert runner.spec.draft_graphs[4].replays == 8 * 3  # k + 1 draft steps each


def _greedy_at(model, ids: list[int]) -> list[int]:
    """Greedy next token after every prefix of ``ids`` (no KV cache)."""
    return forward_dense(model, torch.tensor(ids)).argmax(-1).tolist()


@pytest.mark.parametrize("steps", [1, 3])
def test_given_acceptance_rolls_back(steps: int) -> None:
    """A draft model of another shape and given accepted counts: each step emits accepted + 1
    tokens, the accepted ones the draft's greedy tokens and the last the target's, each checked
    against a no-cache recomputation of the sequence as committed, so a rejected draft's KV
    (left in both caches) never reaches a later step."""
    k = 3
    draft_shape = load_spec("tiny", name="tiny_draft", num_layers=1, hidden_size=64,
                            num_heads=2, num_kv_heads=1, intermediate_size=128)
    runner = _runner(SpecSettings("draft", k, "tiny_draft"), draft_shape)
    draft = runner.spec.draft
    reqs = _requests((7, 12), 64, seed=3)
    rng = np.random.default_rng(0)
    _run(runner, [(r, 1) for r in reqs], 1, k)  # the prefills
    record = {r.request_id: [] for r in reqs}  # (position of the first emitted token, accepted)
    for _ in range(5):
        acc = {r.request_id: rng.integers(0, k + 1, steps).tolist() for r in reqs}
        acc[reqs[0].request_id][0] = 0  # everything rejected at least once
        before = {r.request_id: r.prompt_len + len(r.output_token_ids) for r in reqs}
        got = _run(runner, [(r, steps) for r in reqs], steps, k, acc)
        for r, ids in zip(reqs, got, strict=True):
            assert len(ids) == sum(a + 1 for a in acc[r.request_id])
            p = before[r.request_id]
            for a in acc[r.request_id]:
                record[r.request_id].append((p, a))
                p += a + 1
    for r in reqs:
        seq = r.prompt_token_ids + r.output_token_ids
        target, drafted = _greedy_at(runner.model, seq), _greedy_at(draft, seq)
        for p, a in record[r.request_id]:
            for i in range(a):  # accepted: the draft's tokens
                assert seq[p + i] == drafted[p + i - 1]
            assert seq[p + a] == target[p + a - 1]  # the target's own token after them
    c = runner.spec.counters
    assert c.num_drafts == 2 * 5 * steps and c.num_draft_tokens == k * c.num_drafts


def test_ngram_proposes_from_the_prompt() -> None:
    """Prompt lookup: the continuation of the latest earlier match of the longest suffix."""
    hist = torch.tensor([[1, 2, 3, 4, 9, 1, 2, 0, 0], [5, 6, 7, 8, 9, 10, 11, 0, 0]])
    lens = torch.tensor([7, 7])
    got = ngram_propose(hist, lens, 2, 1, 3)
    assert got[0].tolist() == [3, 4]  # "1 2" seen at 0: then 3 4
    assert got[1].tolist() == [11, 11]  # no match: the newest token repeated
    hist = torch.tensor([[7, 1, 2, 8, 3, 1, 2, 8, 4, 2, 8]])
    assert ngram_propose(hist, torch.tensor([11]), 1, 1, 3).tolist() == [[4]]  # latest "2 8"


def test_ngram_window_drafts_the_prompt_and_greedy_stays_lossless() -> None:
    """In the engine: with every draft accepted the emitted tokens continue the prompt's
    pattern; verified greedily instead, the ids are greedy decoding's."""
    k = 3
    pattern = [11, 22, 33, 44, 55, 66]
    runner = _runner(SpecSettings("ngram", k))
    reqs = _requests((0,), 30, prompts=[pattern * 3 + [11, 22]])
    _run(runner, [(reqs[0], 1)], 1, k)  # the prefill samples the first token, t
    t = reqs[0].output_token_ids[0]
    got = _run(runner, [(reqs[0], 1)], 1, k, {0: [k]})[0]
    i = pattern.index(t) if t in pattern else None
    expect = [pattern[(i + 1 + j) % 6] for j in range(k)] if i is not None else [t] * k
    assert got[:k] == expect
    reqs = _requests((0,), 30, prompts=[pattern * 3 + [11, 22]])
    want = greedy_dense(runner.model, reqs[0].prompt_token_ids, 30)
    runner = _runner(SpecSettings("ngram", k))
    while len(reqs[0].output_token_ids) < 20:
        _run(runner, [(reqs[0], 2)], 2, k)
    assert reqs[0].output_token_ids == want[:len(reqs[0].output_token_ids)]


def test_bad_settings_fail_in_one_line() -> None:
    def one_line(fn, match):
        with pytest.raises(ValueError, match=match) as err:
            fn()
        assert "\n" not in str(err.value)

    one_line(lambda: SpecSettings("draft", 0), "spec.num_tokens")
    one_line(lambda: SpecSettings("medusa", 2), "spec.method")
    one_line(lambda: check_draft(load_spec("tiny", vocab_size=1000), SPEC),
             "vocab_size 1000 but model tiny has 512")
    one_line(lambda: draft_spec(SpecSettings("draft", 2, "no_such_model"), SPEC),
             "not a conf/model name")
    one_line(lambda: BackendConfig.from_mapping({"device": "cpu", "spec": {"method": "draft",
                                                                          "k": 2}}), "spec")
    one_line(lambda: BackendConfig.from_mapping(
        {"device": "cpu", "weights": "/ckpt/8b", "spec": {"method": "draft",
                                                          "draft_model": "llama3_2_1b"}}),
        "draft_weights")
    plain = ModelRunner(random_model(SPEC, "cpu", torch.float32), BackendConfig(device="cpu"),
                        block_size=BLOCK, max_num_seqs=8, max_lookahead=16)
    plain.allocate_kv_cache(64)
    r = _requests((5,), 10)[0]
    _run(plain, [(r, 1)], 1, 0)
    one_line(lambda: _run(plain, [(r, 1)], 1, 2), "no drafter: set spec.method")
    runner = _runner(SpecSettings("draft", 2, "same"))
    r = _requests((5,), 10)[0]
    _run(runner, [(r, 1)], 1, 2)
    one_line(lambda: _run(runner, [(r, 2)], 2, 2, {0: [1]}), "num_accepted")
    one_line(lambda: _run(runner, [(r, 1)], 1, 3), "spec.num_tokens is 2")



def _both_backends(policy: str, params: dict, acceptance: dict | None, method: str = "draft",
                   spec_policy: dict | None = None):
    """A run of 12 requests at t = 0 on each backend with speculation (k = 3, the target as its
    own draft, or n-gram lookup) under ``policy`` (and the speculation policy ``spec_policy``,
    its settings beside its name; spec_fixed by default): (window rows, spec_decode metrics,
    outputs)."""
    import random

    import yaml

    from common.spec_acceptance import acceptance_process
    from policies import Scheduler, SchedulerConfig, make_policy
    from policies.speculation import make_speculation
    from real_backend import run_real
    from simulator import OverheadSpec, simulate
    from simulator.cost_model import step_time_fn
    from simulator.hardware import HardwareSpec

    conf = rb_conf()
    hw = HardwareSpec.from_dict(yaml.safe_load((conf / "hardware" / "h100_sxm.yaml").read_text()))
    fn = step_time_fn(SPEC, hw)
    section = {"method": method, "num_tokens": 3, "draft_model": "same",
               **(spec_policy or {"policy": "spec_fixed"})}
    cfg = SchedulerConfig(block_size=BLOCK, max_num_batched_tokens=64)

    def new(n: int) -> Scheduler:
        spec = make_speculation(section, acceptance_process(acceptance, 7), fn,
                                SPEC if method == "draft" else None)
        return Scheduler(make_policy(policy, **params), cfg, n, SPEC.max_model_len, fn, spec)

    def requests(ids: bool) -> list[Request]:
        r = random.Random(2)
        out = []
        for i in range(12):
            n, prompt = r.randint(4, 30), [r.randrange(SPEC.vocab_size)
                                           for _ in range(r.randint(2, 30))]
            out.append(Request(i, 0.0, 0, n, prompt_token_ids=prompt) if ids
                       else Request(i, 0.0, len(prompt), n))
        return out

    engine = {"method": method, "num_tokens": 3, "draft_model": "same"}
    reqs = requests(True)
    real = run_real(reqs, new, SPEC, {"device": "cpu", "num_blocks": 160, "spec": engine},
                    progress=False)
    sim = simulate(requests(False), new, SPEC, hw, OverheadSpec(), block_size=BLOCK,
                   num_blocks=160, progress=False)
    cols = ("window", "k", "num_seqs", "num_prefill_seqs", "num_tokens", "kv_tokens",
            "num_preempted", "num_wasted_steps")
    rows = [[tuple(row[c] for c in cols) for row in out.steps] for out in (real, sim)]
    return rows, real, sim, reqs


@pytest.mark.parametrize(("policy", "params"), [("single_step", {}),
                                                ("multi_step", {"num_steps": 4}),
                                                ("cp2", {"num_steps": 4})])
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_spec_decode_runs_in_both_backends_identically(policy, params, method) -> None:
    """The workload's acceptance applied by the scheduler: the real engine (the tiny model on the
    CPU) and the simulator form the same windows and count the same drafts and acceptances."""
    (real_rows, sim_rows), real, sim, reqs = _both_backends(policy, params, {"rate": 0.6},
                                                            method)
    assert real_rows == sim_rows
    assert real.spec_decode.metrics() == sim.spec_decode.metrics()
    m = real.spec_decode.metrics()
    assert m["spec_decode_num_drafts"] > 0 and 0 < m["spec_decode_acceptance_rate"] < 1
    assert all(len(r.output_token_ids) == r.max_tokens for r in reqs)


def rb_conf():
    from rb_util import CONF

    return CONF.parent


@pytest.mark.parametrize(("method", "draft"), [("ngram", None), ("draft", "tiny")])
def test_greedy_verification_end_to_end(method, draft) -> None:
    """No acceptance process (workload.acceptance null): the real engine verifies greedily with
    its weights (a draft model of other random weights, or prompt lookup, so drafts are
    rejected too) and tells the scheduler what it accepted; the ids are greedy decoding's."""
    import random

    from policies import Scheduler, SchedulerConfig, make_policy
    from policies.speculation import make_speculation
    from real_backend import run_real

    section = {"method": method, "num_tokens": 3, "draft_model": draft, "policy": "spec_fixed"}
    cfg = SchedulerConfig(block_size=BLOCK, max_num_batched_tokens=64)

    def new(n: int) -> Scheduler:
        return Scheduler(make_policy("multi_step", num_steps=4), cfg, n, SPEC.max_model_len,
                         None, make_speculation(section, None, None, SPEC))

    r = random.Random(4)
    reqs = [Request(i, 0.0, 0, r.randint(4, 30),
                    prompt_token_ids=[r.randrange(SPEC.vocab_size) for _ in range(r.randint(2, 30))])
            for i in range(6)]
    engine = {"method": method, "num_tokens": 3} | ({"draft_model": draft} if draft else {})
    out = run_real(reqs, new, SPEC, {"device": "cpu", "num_blocks": 160, "spec": engine},
                   progress=False)
    model = random_model(SPEC, "cpu", torch.float32, seed=0)
    for q in reqs:
        assert q.output_token_ids == greedy_dense(model, q.prompt_token_ids, q.max_tokens)
    m = out.spec_decode.metrics()
    assert m["spec_decode_num_drafts"] > 0 and m["spec_decode_acceptance_rate"] < 1


def test_server_metrics_show_the_spec_counters() -> None:
    """/metrics carries vLLM's spec_decode counters from the scheduler's counts, each window's
    increments once."""
    from policies import Scheduler, SchedulerConfig, make_policy
    from real_backend.serving.metrics import EngineMetrics

    sched = Scheduler(make_policy("single_step"), SchedulerConfig(block_size=BLOCK), 64,
                      SPEC.max_model_len)
    metrics = EngineMetrics({})
    sched.spec_stats.record([3, 1], 3, 2)
    metrics.sample(sched)
    sched.spec_stats.record([0], 3, 1)
    metrics.sample(sched)
    text = metrics.text().decode()
    for line in ("schedlab_spec_decode_num_drafts_total 3.0",
                 "schedlab_spec_decode_draft_tokens_total 9.0",
                 "schedlab_spec_decode_accepted_tokens_total 4.0",
                 'schedlab_spec_decode_per_position_acceptance_rate{position="0"} 0.666',
                 "schedlab_spec_decode_acceptance_length 2.333"):
        assert line in text


def _tiny_draft_schedulers():
    """A scheduler factory for the engine: multi_step windows of 2 steps, a draft of the tiny
    shape drafting 2 tokens under spec_fixed, acceptance rate 0.7 (seed 3)."""
    from common.spec_acceptance import acceptance_process
    from policies import Scheduler, SchedulerConfig, make_policy
    from policies.speculation import make_speculation

    section = {"method": "draft", "num_tokens": 2, "draft_model": "tiny", "policy": "spec_fixed"}
    cfg = SchedulerConfig(block_size=BLOCK, max_num_batched_tokens=64)

    def new(n: int) -> Scheduler:
        return Scheduler(make_policy("multi_step", num_steps=2), cfg, n, SPEC.max_model_len,
                         None, make_speculation(section, acceptance_process({"rate": 0.7}, 3),
                                                None, SPEC))

    return new


def test_a_kept_runner_starts_each_run_afresh() -> None:
    """backend.keep_runner: a second run on the same runner (its draft cache holding the first
    run's KV under the same request ids) gives the first run's ids and counts."""
    import random

    from real_backend import run_real
    from real_backend.engine import release_kept_runner

    new = _tiny_draft_schedulers()

    def run():
        r = random.Random(5)
        reqs = [Request(i, 0.0, 0, 12, prompt_token_ids=[r.randrange(SPEC.vocab_size)
                                                          for _ in range(10 + i)])
                for i in range(4)]
        out = run_real(reqs, new, SPEC, {"device": "cpu", "num_blocks": 64, "keep_runner": True,
                                         "spec": {"method": "draft", "num_tokens": 2,
                                                  "draft_model": "tiny"}}, progress=False)
        return [q.output_token_ids for q in reqs], out

    try:
        first, a = run()
        second, b = run()
    finally:
        release_kept_runner()
    assert b.stats["runner_kept"] and first == second
    assert a.spec_decode.metrics() == b.spec_decode.metrics()


def test_warm_up_runs_a_drafting_window_and_starts_afresh() -> None:
    """The warm-up drafts on block 0 (the kernels of the draft and the verify compile there)
    and leaves nothing counted and no draft KV marked valid."""
    runner = _runner(SpecSettings("draft", 2, "tiny"), load_spec("tiny"))
    assert not runner.spec.draft_cache.k[0][0].any()
    runner.warm_up(64, 4)
    assert runner.spec.draft_cache.k[0][0].any()
    assert runner.spec.counters.num_drafts == 0 and not runner.spec.draft_lens


def test_memory_profile_runs_the_largest_drafting_window(monkeypatch) -> None:
    """The profiled peak (what the KV cache is sized around) includes a drafting window of
    max_num_seqs rows: the draft's catch-up over max_num_batched_tokens, its k + 1 steps and the
    verify's max_num_seqs x (k + 1) positions with their logits, on scratch caches; the real
    caches come back and nothing is counted or marked valid afterwards."""
    runner = _runner(SpecSettings("draft", 3, "tiny"), load_spec("tiny"), max_tokens=64)
    spec, real, real_draft = runner.spec, runner.kv_cache, runner.spec.draft_cache
    seen = {"verify": [], "logits": [], "catch_up": [], "draft_rows": [], "draft_cache": set()}
    verify, catch_up, draft = spec.verify_forward, spec._catch_up_forward, spec.draft_forward

    def verify_forward(kv, tokens, rows, max_query_len, num_logits, out=None):
        seen["verify"].append(tokens)
        logits = verify(kv, tokens, rows, max_query_len, num_logits, out)
        seen["logits"].append(tuple(logits.shape))
        return logits

    def catch_up_forward(spans, tables, to):
        seen["catch_up"].append(sum(len(ids) for _, _, ids in spans))
        seen["draft_cache"].add(spec.draft_cache.num_blocks)
        return catch_up(spans, tables, to)

    def draft_forward(rows):
        seen["draft_rows"].append(rows)
        return draft(rows)

    monkeypatch.setattr(spec, "verify_forward", verify_forward)
    monkeypatch.setattr(spec, "_catch_up_forward", catch_up_forward)
    monkeypatch.setattr(spec, "draft_forward", draft_forward)
    runner.profile_run(64, 8)
    assert seen["verify"] == [8 * 4] and seen["logits"] == [(8 * 4, SPEC.vocab_size)]
    assert seen["catch_up"] == [64] and seen["draft_cache"] == {1}  # a one-block scratch
    assert seen["draft_rows"] == [8] * 4  # k + 1 draft steps over every row
    assert runner.kv_cache is real and spec.draft_cache is real_draft
    assert spec.counters.num_drafts == 0 and not spec.draft_lens
    seen["verify"].clear()
    windows, run_window = [], runner.run_window
    monkeypatch.setattr(runner, "run_window", lambda b: (
        windows.append([(s.num_query_tokens, s.is_prefill) for s in b.seqs]), run_window(b))[1])
    runner.profile_graph_steps(8)  # the graphed steps: the same verify, a token of catch-up
    assert seen["verify"] == [8 * 4] and seen["catch_up"][-1] == 8
    biggest = min(runner.cfg.piecewise_graph_max_tokens, SPEC.max_model_len - 2)
    assert windows[:2] == [[(biggest, True)], [(1, False)] * 8]  # the largest prefill graph's


def test_catch_up_runs_in_forwards_of_at_most_max_tokens(monkeypatch) -> None:
    """A catch-up owed over whole prompts runs in forwards of at most max_num_batched_tokens
    (the profiled bound), a long span split across them in order: the self-draft's KV is still
    exact (every draft accepted, greedy ids)."""
    spans = [(0, 0, list(range(5))), (1, 3, [7, 8]), (2, 0, list(range(12)))]
    chunks = catch_up_chunks(spans, 4)
    assert all(sum(len(ids) for _, _, ids in c) <= 4 for c in chunks)
    for i, first, ids in spans:  # each span's pieces, in order, make the span again
        pieces = [(a, p) for c in chunks for j, a, p in c if j == i]
        assert [t for _, p in pieces for t in p] == ids
        assert [a for a, _ in pieces] == [first + sum(len(p) for _, p in pieces[:m])
                                          for m in range(len(pieces))]
        assert all(sum(j == i for j, _, _ in c) <= 1 for c in chunks)  # one piece a forward
    assert catch_up_chunks([], 4) == []
    runner = _runner(SpecSettings("draft", 2, "same"), max_tokens=5)  # 22 prompt tokens owed
    forwards, catch_up = [], runner.spec._catch_up_forward
    monkeypatch.setattr(runner.spec, "_catch_up_forward", lambda spans, *a: (
        forwards.append(sum(len(ids) for _, _, ids in spans)), catch_up(spans, *a)))
    reqs = _requests((9, 3, 10), 20)
    want = [greedy_dense(runner.model, r.prompt_token_ids, 20) for r in reqs]
    while min(len(r.output_token_ids) for r in reqs) < 12:
        _run(runner, [(r, 2) for r in reqs], 2, 2)
    for r, w in zip(reqs, want, strict=True):
        assert r.output_token_ids == w[:len(r.output_token_ids)]
    c = runner.spec.counters
    assert c.num_draft_tokens == c.num_accepted_tokens > 0
    assert forwards[:5] == [5, 5, 5, 5, 2]  # the prompts' 22 tokens, 5 at most a forward


def test_a_run_releases_its_runner(monkeypatch) -> None:
    """A run that does not keep its runner leaves none of it alive (weights, both KV caches,
    graphs): a next run in the process builds its own in the memory this one held."""
    import gc
    import weakref

    from real_backend import engine, run_real

    built = []

    def build_runner(*args, **kwargs):
        runner = build(*args, **kwargs)
        built.append((weakref.ref(runner), weakref.ref(runner.spec.draft_cache.k[0])))
        return runner

    build = engine.build_runner
    monkeypatch.setattr(engine, "build_runner", build_runner)
    new = _tiny_draft_schedulers()

    reqs = [Request(i, 0.0, 0, 6, prompt_token_ids=[1 + i] * 8) for i in range(3)]
    gc.disable()  # freed by the run's own release, not whenever the collector next runs
    try:
        run_real(reqs, new, SPEC, {"device": "cpu", "num_blocks": 32,
                                   "spec": {"method": "draft", "num_tokens": 2,
                                            "draft_model": "tiny"}}, progress=False)
        assert len(built) == 1 and all(ref() is None for ref in built[0])
    finally:
        gc.enable()

ALTERNATE = """
from policies.speculation import SpeculationPolicy


class Alternate(SpeculationPolicy):
    name = "alternate"

    def window_tokens(self, sched):
        return self.num_tokens if len(sched.running) % 2 == 0 else 0
"""


def test_the_simulator_prices_the_draft_forwards_the_engine_runs(monkeypatch, tmp_path) -> None:
    """Over a run whose requests decode both with and without drafting (a policy drafting
    while an even number of requests run), the simulator's draft forwards are the engine's:
    per drafting window the same catch-up spans (tokens, first position), and before each
    verify step spec.num_tokens + 1 one-token draft steps over the same number of rows."""
    from real_backend.speculative import Speculator
    from simulator import cost_model

    real: dict[str, list] = {"catch_up": [], "draft": []}
    sim: dict[str, list] = {"catch_up": [], "draft": []}
    plan, draft = Speculator.plan, Speculator._draft
    catch_up, steps = cost_model.DraftKV.catch_up, cost_model.draft_steps_time

    def real_plan(self, batch, sampling):
        p = plan(self, batch, sampling)
        real["catch_up"].append([(len(ids), a) for _, a, ids in p.catch_up])
        return p

    def real_draft(self, last, start, tables, k, max_k):
        real["draft"].append((last.shape[0], max_k + 1))
        return draft(self, last, start, tables, k, max_k)

    def sim_catch_up(self, batch):
        chunks = catch_up(self, batch)
        sim["catch_up"].append([(q, c) for q, c, _ in chunks])
        return chunks

    def sim_steps(draft_step, num_tokens, groups):
        sim["draft"].append((sum(g[0] for g in groups.values()), num_tokens + 1))
        return steps(draft_step, num_tokens, groups)

    monkeypatch.setattr(Speculator, "plan", real_plan)
    monkeypatch.setattr(Speculator, "_draft", real_draft)
    monkeypatch.setattr(cost_model.DraftKV, "catch_up", sim_catch_up)
    monkeypatch.setattr(cost_model, "draft_steps_time", sim_steps)
    policy = tmp_path / "alternate.py"
    policy.write_text(ALTERNATE)
    (real_rows, sim_rows), *_ = _both_backends("multi_step", {"num_steps": 4}, {"rate": 0.6},
                                               "draft", {"policy": str(policy)})
    assert real_rows == sim_rows
    assert real == sim
    spans = [span for window in real["catch_up"] for span in window]
    assert any(a == 0 for _, a in spans)  # a prompt seen by the draft for the first time
    assert any(a > 0 for _, a in spans)  # tokens decoded while not drafting
    assert {n for _, n in real["draft"]} == {4}


@functools.cache
def _fixed_length_metrics(method: str) -> dict:
    """The spec_decode metrics of the same runs under spec_fixed (k = 3 for every decode)."""
    return _both_backends("multi_step", {"num_steps": 4}, {"rate": 0.6}, method)[1] \
        .spec_decode.metrics()


EVERY_OTHER = ("from dataclasses import dataclass\n"
               "from policies.speculation import SpeculationPolicy\n\n\n"
               "@dataclass(frozen=True)\n"
               "class EveryOther(SpeculationPolicy):\n"
               "    name = 'every_other'\n\n"
               "    def request_tokens(self, req, k, sched):\n"
               "        return k if req.request_id % 2 else 0\n")


@pytest.mark.parametrize("spec_policy", ["smartspec", "spec_off_under_load", "user"])
def test_every_speculation_policy_runs_alike_in_both_backends(spec_policy, tmp_path) -> None:
    """smartspec, spec_off_under_load (its batch limit crossed as the 12 requests finish) and a
    user's own policy from a file decide the same draft lengths in the real engine and the
    simulator: the same windows, drafts and acceptances (smartspec's choices themselves:
    tests/test_speculation.py)."""
    if spec_policy == "user":
        mine = tmp_path / "every_other.py"
        mine.write_text(EVERY_OTHER)
        section = {"policy": str(mine)}
    else:
        section = {"smartspec": {"policy": "smartspec", "min_drafts": 4},
                   "spec_off_under_load": {"policy": "spec_off_under_load",
                                           "max_batch_size": 6}}[spec_policy]
    # smartspec with n-gram lookup: a draft as large as the target (the self-draft) never pays
    method = "ngram" if spec_policy == "smartspec" else "draft"
    (real_rows, sim_rows), real, sim, reqs = _both_backends("multi_step", {"num_steps": 4},
                                                            {"rate": 0.6}, method, section)
    assert real_rows == sim_rows
    assert real.spec_decode.metrics() == sim.spec_decode.metrics()
    assert real.spec_decode.metrics()["spec_decode_num_drafts"] > 0
    if spec_policy != "smartspec":  # (a free draft: smartspec's best k is the longest here)
        fixed = _fixed_length_metrics(method)  # the policy decided: not what a fixed k drafts
        assert real.spec_decode.metrics() != fixed
    assert all(len(r.output_token_ids) == r.max_tokens for r in reqs)
