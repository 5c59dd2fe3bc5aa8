"""Per-request sampling in the real engine: the per-row sampler against a row-by-row reference
and the whole-batch sampler, greedy rows beside sampled ones, seeded rows that depend on their
seed and position alone; and served runs in which a seeded request's ids are the same alone or
in company, under single-step, multi-step (advance_step) and overlap (the token map), with
preemptions, on the reference ops and the Triton kernels (and CUDA graphs on a GPU)."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
from rb_util import DEVICE, WINDOW_KIND_IDS, WINDOW_KINDS, load_spec

from policies import Batch, Request, ScheduledSeq, SchedulerConfig, make_scheduler
from policies.sampling_params import SamplingParams
from real_backend import run_real
from real_backend.device_inputs import row_sampling
from real_backend.sampling import sample, sample_rows, seed_key, seeded_noise
from real_backend.window_inputs import sampling_rows

SPEC = load_spec("tiny")
VOCAB = 64
GREEDY = SamplingParams()


def rows_of(params: list[SamplingParams], positions: list[int] | None = None,
            default: SamplingParams = GREEDY):
    """The device RowSampling of one step whose row i is a request with ``params[i]`` (None:
    the backend's ``default``) sampling at ``positions[i]``."""
    positions = positions or [10] * len(params)
    seqs = [ScheduledSeq(Request(i, 0.0, p, 100, sampling=s), 1, p - 1, 1, False)
            for i, (s, p) in enumerate(zip(params, positions, strict=True))]
    return row_sampling(sampling_rows(seqs, list(range(len(seqs))), 0, default),
                        torch.from_numpy)


def logits_of(n: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def reference_row(logits: torch.Tensor, p: SamplingParams, noise: torch.Tensor) -> int:
    """One row by the rules of ``sample``: temperature, top-k, then top-p over what top-k kept,
    Gumbel-max with the given Exp(1) noise."""
    if p.greedy:
        return int(logits.argmax())
    x = logits / p.temperature
    if 0 < p.top_k < len(x):
        x = x.masked_fill(x < x.topk(p.top_k).values[-1], float("-inf"))
    if p.top_p < 1:
        order = x.argsort(descending=True)
        probs = x[order].softmax(-1)
        keep = (probs.cumsum(-1) - probs) < p.top_p
        keep[0] = True  # the most likely token always stays
        x = x.clone()
        x[order[~keep]] = float("-inf")
    return int((x.softmax(-1) / noise).argmax())


def test_greedy_rows_stay_greedy_beside_sampled_rows() -> None:
    logits = logits_of(8)
    hot = SamplingParams(temperature=2.0)
    params = [SamplingParams(), hot, SamplingParams(seed=3), SamplingParams(2.0, seed=1)] * 2
    got = sample_rows(logits, rows_of(params), 0, torch.Generator().manual_seed(0))
    greedy = logits.argmax(-1)
    assert torch.equal(got[[0, 2, 4, 6]], greedy[[0, 2, 4, 6]])  # temperature 0, seeded or not
    draws = [sample_rows(logits, rows_of(params), 0, torch.Generator().manual_seed(s))
             for s in range(8)]
    assert any(not torch.equal(d[[1, 5]], greedy[[1, 5]]) for d in draws)  # hot rows sample


def test_top_k_1_and_a_tiny_top_p_equal_greedy() -> None:
    logits = logits_of(6, seed=1)
    params = [SamplingParams(5.0, 1), SamplingParams(5.0, -1, 1e-6),
              SamplingParams(5.0, 1, seed=7), SamplingParams(5.0, -1, 1e-6, seed=8),
              SamplingParams(5.0, 1, 0.5), SamplingParams(5.0, -1, 1e-6, seed=-9)]
    for s in range(4):
        got = sample_rows(logits, rows_of(params), 0, torch.Generator().manual_seed(s))
        assert torch.equal(got, logits.argmax(-1))


def test_a_temperature_or_top_p_below_float32s_range_samples_the_argmax() -> None:
    """temperature=1e-40 (below SAMPLING_EPS: greedy, as in vLLM) and top_p=1e-300 (0 in
    float32; the most likely token still stays) give each row's argmax in both samplers,
    seeded or not, not token 0 (every logit inf, or every token dropped: softmax NaN)."""
    logits = logits_of(6, seed=2)
    greedy = logits.argmax(-1)
    assert (greedy != 0).all()
    tiny = [SamplingParams(1e-40), SamplingParams(1e-6, seed=4), SamplingParams(1.0, -1, 1e-300),
            SamplingParams(5.0, 2**63 - 1, 1e-300, seed=5), SamplingParams(1e-40, -1, 1e-300),
            SamplingParams(1e-300, 50, 0.5, seed=-1)]
    assert SamplingParams(1e-40) == SamplingParams() and SamplingParams(1e-40, 3).greedy
    for s in range(4):
        g = torch.Generator().manual_seed(s)
        assert torch.equal(sample_rows(logits, rows_of(tiny), 0, g), greedy)
        for p in tiny:
            assert torch.equal(sample(logits, p, g), greedy)


def test_a_temperature_beyond_float32s_range_samples_without_a_warning() -> None:
    """temperature=1e300 is inf in float32: every finite logit becomes 0, uniform sampling
    (its limit), with no overflow warning from the cast on the way."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = rows_of([SamplingParams(1e300), SamplingParams(1e300, seed=2)])
    ids = sample_rows(logits_of(2), rows, 0, torch.Generator().manual_seed(0))
    assert ((0 <= ids) & (ids < VOCAB)).all()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
    ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),
    ({"temperature": -1e-40}, "temperature must be >= 0, got -1e-40"),
    ({"top_p": float("nan")}, "top_p must be a finite number, got nan"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_k": 2.5}, "top_k must be an integer >= -1, got 2.5"),
    ({"top_k": True}, "top_k must be an integer >= -1, got True"),
    ({"top_k": 0}, "top_k must be -1 or >= 1, got 0"),
])
def test_settings_that_are_no_number_or_out_of_range_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        SamplingParams(**kwargs)


def test_rows_agree_with_the_row_by_row_reference() -> None:
    """Seeded rows (their noise is known: seeded_noise) with every mix of temperature, top-k
    and top-p give what the reference gives row by row."""
    r = random.Random(0)
    params = [SamplingParams(r.choice([0.0, 0.3, 1.0, 3.0]), r.choice([-1, 1, 3, 20]),
                             r.choice([1.0, 0.9, 0.5, 0.05]), seed=r.randrange(-2**63, 2**63))
              for _ in range(64)]
    positions = [r.randrange(1, 5000) for _ in params]
    logits = logits_of(64, seed=2)
    got = sample_rows(logits, rows_of(params, positions), 0, None)
    noise = seeded_noise(torch.tensor([seed_key(p.seed) for p in params]),
                         torch.tensor(positions), VOCAB)
    want = [reference_row(logits[i], p, noise[i]) for i, p in enumerate(params)]
    assert got.tolist() == want


def test_rows_of_the_backend_setting_sample_as_the_whole_batch_does() -> None:
    """Unseeded rows draw the generator's noise as ``sample`` does: a batch of rows that all
    have the backend's setting gives ``sample``'s ids, draw for draw."""
    logits = logits_of(16, seed=3)
    for default in (SamplingParams(0.8, 5), SamplingParams(1.2, -1, 0.7), SamplingParams(1.0)):
        a = sample(logits, default, torch.Generator().manual_seed(4))
        b = sample_rows(logits, rows_of([None] * 16, default=default), 0,
                        torch.Generator().manual_seed(4))
        c = sample_rows(logits, rows_of([default] * 16), 0, torch.Generator().manual_seed(4))
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_seeded_row_depends_on_its_seed_and_position_alone() -> None:
    row = logits_of(1, seed=5)[0]
    mine = SamplingParams(1.0, seed=42)

    def draw(company: int, where: int, position: int, params: SamplingParams = mine) -> int:
        logits = logits_of(company + 1, seed=company)
        logits[where] = row
        params_ = [SamplingParams(r % 3 * 0.7, seed=r if r % 2 else None)
                   for r in range(company + 1)]
        params_[where] = params
        positions = [position + r for r in range(company + 1)]
        positions[where] = position
        return int(sample_rows(logits, rows_of(params_, positions), 0,
                               torch.Generator().manual_seed(company))[where])

    for position in (1, 17, 4000):
        alone = draw(0, 0, position)
        assert alone == draw(5, 3, position) == draw(9, 9, position)
    seq = [draw(0, 0, p) for p in range(1, 41)]
    assert seq == [draw(4, 2, p) for p in range(1, 41)]
    assert seq != [draw(0, 0, p, SamplingParams(1.0, seed=43)) for p in range(1, 41)]
    assert len(set(seq)) > 10  # positions give fresh noise


def test_seeded_noise_is_exponential_and_follows_the_probabilities() -> None:
    noise = seeded_noise(torch.tensor([seed_key(s) for s in range(4)]),
                         torch.tensor([0, 1, 2, 3]), 50_000)
    assert noise.min() > 0
    torch.testing.assert_close(noise.mean(-1), torch.ones(4), atol=0.03, rtol=0)
    torch.testing.assert_close(noise.var(-1), torch.ones(4), atol=0.06, rtol=0)
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    n = 4000
    rows = rows_of([SamplingParams(1.0, seed=11)] * n, list(range(1, n + 1)))
    got = sample_rows(probs.log().repeat(n, 1), rows, 0, None)
    torch.testing.assert_close(torch.bincount(got, minlength=4) / n, probs, atol=0.03, rtol=0)


# ------------------------------------------------------------------ served runs
BLOCK_SIZE = 4
NUM_BLOCKS = 24  # 96 token slots for 12 requests of up to 64 tokens: the policies preempt


def requests(company: bool, eos: int | None = None) -> list[Request]:
    """Two seeded requests of different temperatures (ids 0 and 1), a greedy one (2), then, in
    company, nine more with settings of their own or the backend's."""
    r = random.Random(1)
    out = [Request(0, 0.0, 0, 20, prompt_token_ids=[r.randrange(SPEC.vocab_size) for _ in range(9)],
                   sampling=SamplingParams(0.7, seed=123), eos_token_id=eos),
           Request(1, 0.0, 0, 16, prompt_token_ids=[r.randrange(SPEC.vocab_size) for _ in range(30)],
                   sampling=SamplingParams(1.5, 40, 0.9, seed=-5)),
           Request(2, 0.0, 0, 12, prompt_token_ids=[r.randrange(SPEC.vocab_size) for _ in range(5)],
                   sampling=SamplingParams(0.0, seed=9))]
    if company:
        choices = [None, SamplingParams(1.0), SamplingParams(0.5, 5), SamplingParams(2.0, seed=77)]
        out += [Request(i, 0.0, 0, r.randint(4, 24),
                        prompt_token_ids=[r.randrange(SPEC.vocab_size)
                                          for _ in range(r.randint(1, 40))],
                        sampling=choices[i % 4])
                for i in range(3, 12)]
    return out


def serve(reqs, policy="single_step", params=None, budget=None, *, overlap=False, spec=SPEC,
          **backend):
    cfg = SchedulerConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=budget, overlap=overlap)
    params = params or {}
    # on a GPU: Triton kernels and CUDA graphs (decode, prefill, piecewise), in fp32 so that
    # logits do not depend on the batch's shape beyond rounding
    backend = {"device": DEVICE, "dtype": "float32", "num_blocks": NUM_BLOCKS,
               "save_token_ids": True, "sampling": {"temperature": 0.9}, **backend}
    return run_real(reqs, lambda n: make_scheduler(policy, params, cfg, n, spec.max_model_len),
                    spec, backend, progress=False)


@pytest.fixture(scope="module")
def alone() -> dict[int, list[int]]:
    """Each of the three requests served on its own, single-step."""
    out = {}
    for req in requests(company=False):
        out.update(serve([req]).token_ids)
    return out


@pytest.mark.parametrize(("policy", "params", "budget", "overlap"), WINDOW_KINDS,
                         ids=WINDOW_KIND_IDS)
def test_a_seeded_request_samples_the_same_alone_or_in_company(alone, policy, params, budget,
                                                               overlap) -> None:
    reqs = requests(company=True)
    res = serve(reqs, policy, params, budget, overlap=overlap)
    assert res.stats["num_preemptions"] > 0
    for i in (0, 1, 2):
        assert res.token_ids[i] == alone[i], i
    assert alone[0] != alone[1][:len(alone[0])]
    assert all(len(ids) == r.max_tokens for r, ids in zip(reqs, res.token_ids.values(),
                                                         strict=True))


def test_a_seeded_request_stops_at_its_eos_alike(alone) -> None:
    """An EOS among a seeded request's samples ends it where the alone run has that token,
    found one window late with overlap."""
    eos = alone[0][7]
    want = alone[0][:alone[0].index(eos) + 1]
    for policy, params, overlap in (("single_step", {}, False),
                                    ("multi_step", {"num_steps": 8}, True)):
        res = serve(requests(company=True, eos=eos), policy, params, overlap=overlap)
        assert res.token_ids[0] == want


def test_an_offline_run_with_a_tiny_temperature_or_top_p_is_greedy() -> None:
    """backend.sampling temperature=1e-40 or top_p=1e-300: an offline run's ids are the greedy
    run's, not token 0 repeated."""
    def ids(**sampling) -> dict[int, list[int]]:
        reqs = requests(company=False)
        for r in reqs:
            r.sampling = None
        return serve(reqs, "multi_step", {"num_steps": 4}, sampling=sampling).token_ids

    greedy = ids(temperature=0.0)
    assert any(t != 0 for seq in greedy.values() for t in seq)
    assert ids(temperature=1e-40) == greedy
    assert ids(temperature=1.0, top_p=1e-300) == greedy


def test_the_triton_kernels_sample_what_the_reference_ops_sample() -> None:
    """advance_step and attention in Triton (interpreted on the CPU): the same seeded ids. One
    layer, as every layer runs the same kernels (the interpreter is slow)."""
    one_layer = load_spec("tiny", num_layers=1)
    res = serve(requests(company=False)[:2], "multi_step", {"num_steps": 4}, kernels="triton",
                spec=one_layer)
    alone = {}  # as the fixture's, on the one-layer model
    for req in requests(company=False)[:2]:
        alone.update(serve([req], spec=one_layer).token_ids)
    assert res.token_ids == alone


def test_windows_without_per_request_settings_carry_none() -> None:
    """An offline run's window has no per-row settings: it samples with ``sample`` as before."""
    from real_backend.window_inputs import PlanSizes, plan_window

    reqs = requests(company=False)
    for r in reqs:
        r.sampling = None
    seqs = [ScheduledSeq(r, r.prompt_len, 0, 1, True) for r in reqs]
    sizes = PlanSizes(BLOCK_SIZE, lambda n: n, None, None)
    for r in reqs:
        r.block_table = list(range(16))
    assert plan_window(Batch(seqs, 1), sizes).sampling == []
    reqs[1].sampling = SamplingParams(1.0, seed=1)
    plan = plan_window(Batch(seqs, 1), sizes, sampling=SamplingParams(0.5))
    assert [float(t) for t in plan.sampling[0].temperature] == [0.5, 1.0, 0.5]
    assert np.array_equal(plan.sampling[0].seeded, [1])


def test_a_window_of_several_tokens_a_decode_step_is_refused_in_one_line() -> None:
    """plan_window's decode rows compute one token a step: a sequence that asks for more (a
    draft to verify, which the runner sends to real_backend/speculative.py) is refused there
    naming the request and the setting, not built wrong."""
    from real_backend.window_inputs import PlanSizes, plan_window

    req = Request(7, 0.0, 6, 4)
    req.block_table = list(range(4))
    seq = ScheduledSeq(req, 3, 6, 1, False, num_decode_tokens=3)
    with pytest.raises(ValueError, match=r"request 7 decodes 3 tokens a step .*num_decode_tokens"):
        plan_window(Batch([seq], 1), PlanSizes(BLOCK_SIZE, lambda n: n, None, None))
