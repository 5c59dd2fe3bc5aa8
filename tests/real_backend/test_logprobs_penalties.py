"""vLLM's penalties and logprobs in the real engine: the penalty function against a plain
PyTorch reference; penalized greedy requests served under single-step, multi-step and overlap
(with preemptions: the counts kept on the device across windows) against a no-cache greedy
decode penalized by that reference; sampled and prompt logprobs against the log_softmax of the
no-cache logits, in chunked prefills and beside a request that shares the prompt's blocks."""

from __future__ import annotations

import random

import pytest
import torch
from rb_util import DEVICE, WINDOW_KIND_IDS, WINDOW_KINDS, load_spec
from reference_sampling import dense_logits, penalized_greedy, reference_penalties

from policies import Request, SchedulerConfig, make_scheduler
from policies.prefix_cache import token_segments
from policies.sampling_params import SamplingParams
from real_backend.config import BackendConfig
from real_backend.engine import build_runner, serve_on
from real_backend.sampling import apply_penalties

SPEC = load_spec("tiny")
BLOCK_SIZE = 4
NUM_BLOCKS = 24  # 96 token slots for the requests below: the policies preempt


def test_the_penalties_agree_with_a_plain_reference() -> None:
    g = torch.Generator().manual_seed(0)
    vocab, rows = 50, 6
    logits = torch.randn(rows, vocab, generator=g) * 3
    r = random.Random(0)
    params = [SamplingParams(presence_penalty=r.uniform(-2, 2), frequency_penalty=r.uniform(-2, 2),
                             repetition_penalty=r.uniform(0.5, 2)) for _ in range(rows)]
    prompts = [[r.randrange(vocab) for _ in range(r.randint(1, 30))] for _ in range(rows)]
    outputs = [[r.randrange(vocab) for _ in range(r.randint(0, 30))] for _ in range(rows)]
    counts = torch.zeros(rows, vocab)
    mask = torch.zeros(rows, vocab, dtype=torch.bool)
    for i in range(rows):
        mask[i, prompts[i]] = True
        for t in outputs[i]:
            counts[i, t] += 1

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params])

    got = apply_penalties(logits, counts, mask, column("presence_penalty"),
                          column("frequency_penalty"), column("repetition_penalty"))
    want = torch.stack([reference_penalties(logits[i], prompts[i], outputs[i], params[i])
                        for i in range(rows)])
    torch.testing.assert_close(got, want)
    assert not torch.equal(got, logits)


def runner_and_scheduler(policy: str, params: dict, budget: int | None = None,
                         overlap: bool = False, caching: bool = True):
    cfg = SchedulerConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=budget, overlap=overlap,
                          enable_prefix_caching=caching)
    sched = make_scheduler(policy, params, cfg, NUM_BLOCKS, SPEC.max_model_len)
    runner = build_runner(SPEC, BackendConfig(device=DEVICE, dtype="float32",
                                              num_blocks=NUM_BLOCKS), sched)
    return runner, sched


PENALTIES = [SamplingParams(repetition_penalty=1.8),
             SamplingParams(frequency_penalty=1.5, presence_penalty=0.5),
             SamplingParams(presence_penalty=2.0, repetition_penalty=0.7),
             None, SamplingParams(temperature=0.0, seed=3)]  # company without penalties


def penalized_requests() -> list[Request]:
    r = random.Random(2)
    return [Request(i, 0.0, 0, r.randint(12, 24),
                    prompt_token_ids=[r.randrange(SPEC.vocab_size) for _ in range(r.randint(3, 30))],
                    sampling=PENALTIES[i % len(PENALTIES)])
            for i in range(10)]


@pytest.mark.parametrize(("policy", "params", "budget", "overlap"), WINDOW_KINDS,
                         ids=WINDOW_KIND_IDS)
def test_penalized_greedy_requests_generate_what_the_reference_does(policy, params, budget,
                                                                    overlap) -> None:
    runner, sched = runner_and_scheduler(policy, params, budget, overlap)
    reqs = penalized_requests()
    serve_on(runner, sched, reqs)
    assert sched.stats.num_preemptions > 0
    changed = 0
    for req in reqs:
        p = req.sampling or SamplingParams()
        want = penalized_greedy(runner.model, req.prompt_token_ids, req.max_tokens, p)
        assert req.output_token_ids == want, req.request_id
        if p.penalized:
            changed += want != penalized_greedy(runner.model, req.prompt_token_ids,
                                                req.max_tokens, SamplingParams())
    assert changed >= 2  # the penalties change greedy output


def logprob_requests(shared: bool) -> list[Request]:
    """Requests asking for 5 logprobs per sampled token (two of them sampled at a
    temperature), one also for its prompt's; with ``shared``, one before it with the same
    prompt, whose blocks the prefix cache would give it."""
    r = random.Random(3)
    prompt = [r.randrange(SPEC.vocab_size) for _ in range(37)]
    out = [Request(0, 0.0, 0, 6, prompt_token_ids=list(prompt),
                   sampling=SamplingParams(logprobs=5) if shared else None),
           Request(1, 0.0, 0, 9, prompt_token_ids=list(prompt),
                   sampling=SamplingParams(logprobs=3, prompt_logprobs=4)),
           Request(2, 0.0, 0, 8, prompt_token_ids=[r.randrange(SPEC.vocab_size)
                                                   for _ in range(20)],
                   sampling=SamplingParams(temperature=1.0, seed=5, logprobs=0)),
           Request(3, 0.0, 0, 7, prompt_token_ids=[r.randrange(SPEC.vocab_size)
                                                   for _ in range(11)],
                   sampling=SamplingParams(temperature=0.8, repetition_penalty=1.3,
                                           logprobs=2))]
    for req in out:  # as the server gives them: equal prompt blocks may be shared
        req.prefix_segments = token_segments(req.prompt_token_ids)
    return out


def check_entry(entry, lp: torch.Tensor, token: int, n: int) -> None:
    """A token's logprobs entry against the reference row of logprobs ``lp``."""
    own, ids, values = entry
    assert own == pytest.approx(float(lp[token]), abs=1e-4)
    top = lp.topk(n)
    assert len(ids) == len(values) == n
    assert values == pytest.approx(top.values.tolist(), abs=1e-4)
    assert [float(lp[t]) for t in ids] == pytest.approx(values, abs=1e-4)  # ties may reorder


@pytest.mark.parametrize(("policy", "params", "budget", "overlap"), [
    ("multi_step", {"num_steps": 4}, None, False),
    ("chunked_prefill", {}, 16, False),  # the 37-token prompt in chunks of 16
    ("multi_step", {"num_steps": 4}, None, True),
], ids=["multi_step4", "chunked", "overlap"])
def test_logprobs_are_the_log_softmax_of_the_model_s_logits(policy, params, budget,
                                                            overlap) -> None:
    runner, sched = runner_and_scheduler(policy, params, budget, overlap)
    reqs = logprob_requests(shared=True)
    sampled: dict[int, list] = {r.request_id: [] for r in reqs}
    prompt: dict[int, dict[int, tuple]] = {r.request_id: {} for r in reqs}

    def collect(batch, out, wall_s) -> None:
        for i, seq in enumerate(batch.seqs):
            rid = seq.request.request_id
            if out.logprobs is not None:
                sampled[rid] += out.logprobs[i]
            if out.prompt_logprobs and i in out.prompt_logprobs:
                first, entries = out.prompt_logprobs[i]
                for pos, e in enumerate(entries, first):
                    prompt[rid].setdefault(pos, e)

    serve_on(runner, sched, reqs, on_window=collect)
    assert reqs[1].num_cached_prompt_tokens == 0  # its prompt computed whole, not shared
    for req in reqs:
        ids = req.prompt_token_ids + list(req.output_token_ids)
        lp = dense_logits(runner.model, ids).log_softmax(-1)
        p = req.sampling
        # a request's entries follow its tokens; wasted multi-step slots may add more
        assert len(sampled[req.request_id]) >= req.max_tokens
        for t, entry in enumerate(sampled[req.request_id][:req.max_tokens]):
            pos = req.prompt_len + t
            check_entry(entry, lp[pos - 1], ids[pos], p.logprobs)
        if p.prompt_logprobs is not None:
            assert sorted(prompt[req.request_id]) == list(range(1, req.prompt_len))
            for pos, entry in prompt[req.request_id].items():
                check_entry(entry, lp[pos - 1], ids[pos], p.prompt_logprobs)
        else:
            assert not prompt[req.request_id]
    # a greedy request's token is the most likely one
    greedy = sampled[1][:reqs[1].max_tokens]
    assert all(ids[0] == tok for (_, ids, _), tok in zip(greedy, reqs[1].output_token_ids,
                                                         strict=True))


def test_a_request_beside_a_prompt_logprobs_one_still_shares_its_blocks() -> None:
    """The request asking for prompt logprobs computes its whole prompt (no prefix hit), yet
    its blocks are indexed: a request after it with the same prompt starts from them."""
    runner, sched = runner_and_scheduler("single_step", {})
    reqs = logprob_requests(shared=False)
    first = reqs[1]
    later = Request(9, 0.0, 0, 3, prompt_token_ids=list(first.prompt_token_ids))
    later.prefix_segments = first.prefix_segments
    serve_on(runner, sched, [first, later])
    assert first.num_cached_prompt_tokens == 0
    assert later.num_cached_prompt_tokens == (first.prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE
