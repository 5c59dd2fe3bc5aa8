"""The window runner on hand-built windows, the sampler, and KV-cache sizing arithmetic."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from rb_util import greedy_dense, load_spec

from policies import Batch, Request, ScheduledSeq
from real_backend import kv_cache
from real_backend.config import BackendConfig
from real_backend.runner import ModelRunner
from real_backend.sampling import SamplingParams, sample
from real_backend.weights import random_model

SPEC = load_spec("tiny")


def _random_requests(seed: int, num_blocks: int, lengths: tuple[int, ...], blocks_each: int,
                     max_tokens: int) -> list[Request]:
    """Seeded random prompts of the given lengths, each owning its own run of a shuffled cache."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(num_blocks, generator=g).tolist()
    prompts = [[int(t) for t in torch.randint(0, SPEC.vocab_size, (n,), generator=g)]
               for n in lengths]
    return [Request(i, 0.0, 0, max_tokens, prompt_token_ids=p,
                    block_table=blocks[i * blocks_each:(i + 1) * blocks_each])
            for i, p in enumerate(prompts)]


def _in_prefill(r: Request) -> bool:
    """As the scheduler marks a row: a prefill while part of the prompt is uncomputed."""
    return r.num_computed_tokens < len(r.prompt_token_ids)


def _one_step(runner: ModelRunner, entries) -> None:
    """A one-step window of (request, query tokens) rows; updates requests like update()."""
    seqs = [ScheduledSeq(r, q, r.num_computed_tokens, 1, _in_prefill(r)) for r, q in entries]
    res = runner.run_window(Batch(seqs, 1))
    for s, ids in zip(seqs, res.sampled, strict=True):
        s.request.num_computed_tokens += s.num_query_tokens
        s.request.output_token_ids += ids


def test_windows_with_ragged_step_counts() -> None:
    """Rows leave a window at different steps (4/2/1 steps, then 3/1/2), and a 1-token prefill
    chunk that samples nothing rides in pure-decode windows: ids still equal the oracle's."""
    model = random_model(SPEC, "cpu", torch.float32, seed=5)
    runner = ModelRunner(model, BackendConfig(device="cpu", num_blocks=64), block_size=4,
                         max_num_seqs=8, max_lookahead=8)
    runner.allocate_kv_cache(64)
    reqs = _random_requests(0, 64, (9, 3, 14, 5), 16, 12)
    oracle = [greedy_dense(model, r.prompt_token_ids, 12) for r in reqs]

    def run(entries):
        """entries: (request, query tokens, steps); updates requests like Scheduler.update."""
        seqs = [ScheduledSeq(r, q, r.num_computed_tokens, n, _in_prefill(r))
                for r, q, n in entries]
        res = runner.run_window(Batch(seqs, max(n for _, _, n in entries)))
        assert len(res.step_times) == max(n for _, _, n in entries)
        for s, ids in zip(seqs, res.sampled, strict=True):
            r = s.request
            r.num_computed_tokens = s.num_cached_tokens + s.num_query_tokens + s.num_steps - 1
            assert len(ids) == (s.num_steps if s.samples else 0)
            r.output_token_ids += ids
            r.num_output_tokens += len(ids)

    a, b, c, d = reqs
    run([(a, 9, 4), (b, 3, 2), (c, 14, 1), (d, 1, 1)])  # d: first token of its prompt only
    run([(a, 1, 3), (b, 1, 1), (c, 1, 2), (d, 1, 1)])
    run([(d, 3, 3), (a, 1, 2), (b, 1, 4)])  # mixed: d's last chunk, then it decodes
    for r, want in zip(reqs, oracle, strict=True):
        assert r.output_token_ids == want[:len(r.output_token_ids)]
        assert len(r.output_token_ids) > 0
    assert [len(r.output_token_ids) for r in reqs] == [9, 7, 3, 3]


def test_greedy_and_seeded_sampling() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, SamplingParams(), None), logits.argmax(-1))
    hot = SamplingParams(temperature=1.5)

    def draw(seed):
        return sample(logits, hot, torch.Generator().manual_seed(seed))

    assert torch.equal(draw(1), draw(1)) and not torch.equal(draw(1), draw(2))
    one = SamplingParams(temperature=5.0, top_k=1)
    assert torch.equal(sample(logits, one, torch.Generator().manual_seed(3)), logits.argmax(-1))
    top3 = logits.topk(3, dim=-1).indices
    got = sample(logits, SamplingParams(temperature=5.0, top_k=3), torch.Generator())
    assert (top3 == got[:, None]).any(-1).all()


def test_top_p_and_temperature_distribution() -> None:
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = probs.log().repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    # top_p 0.5: the first token alone reaches it; 0.8: the first two do.
    assert (sample(logits, SamplingParams(1.0, -1, 0.5), gen) == 0).all()
    assert set(sample(logits, SamplingParams(1.0, -1, 0.8), gen).tolist()) == {0, 1}
    counts = torch.bincount(sample(logits, SamplingParams(1.0), gen), minlength=4) / 4000
    torch.testing.assert_close(counts, probs, atol=0.03, rtol=0)


def _fake_gpu(monkeypatch, *, total: float, free: float, activations: float) -> None:
    cuda = torch.cuda
    state = {"allocated": 20e9}
    monkeypatch.setattr(cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(cuda, "memory_allocated", lambda *a: state["allocated"])
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda *a: state["allocated"] + activations)
    monkeypatch.setattr(cuda, "mem_get_info", lambda *a: (free, total))


def test_kv_blocks_from_profiled_memory(monkeypatch) -> None:
    spec = load_spec("llama3_8b")
    _fake_gpu(monkeypatch, total=100e9, free=60e9, activations=5e9)
    ran = []
    n = kv_cache.profile_num_blocks(spec, torch.device("cuda", 0), torch.bfloat16, 0.9, 16,
                                    lambda: ran.append(1))
    assert ran == [1]
    assert n == int((90e9 - 40e9 - 5e9) // (2 * 1024 * 1024))
    _fake_gpu(monkeypatch, total=100e9, free=12e9, activations=5e9)
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.9 leaves no room for model "
                                         "llama3_8b's KV cache"):
        kv_cache.profile_num_blocks(spec, torch.device("cuda", 0), torch.bfloat16, 0.9, 16,
                                    lambda: None)


def test_kv_blocks_leave_room_for_drafting_and_graphs(monkeypatch) -> None:
    """Speculating: each block also holds the draft model's KV, and the budget leaves the
    profile's peak (its drafting window included) plus the graphed steps' peak (the CUDA
    graphs' pool) outside the cache."""
    spec = load_spec("llama3_8b")
    cuda, peaks, state = torch.cuda, iter([5e9, 1e9]), {"peak": 0.0}
    monkeypatch.setattr(cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda *a: state.update(peak=0.0))
    monkeypatch.setattr(cuda, "memory_allocated", lambda *a: 20e9)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda *a: 20e9 + state["peak"])
    monkeypatch.setattr(cuda, "mem_get_info", lambda *a: (60e9, 100e9))
    ran = []

    def phase(name):
        return lambda: (ran.append(name), state.update(peak=next(peaks)))

    draft = 512 * 1024  # llama3_2_1b's block of 16
    n = kv_cache.profile_num_blocks(spec, torch.device("cuda", 0), torch.bfloat16, 0.9, 16,
                                    phase("profile"), draft, phase("graphs"))
    assert ran == ["profile", "graphs"]
    assert n == int((90e9 - 40e9 - 5e9 - 1e9) // (2 * 1024 * 1024 + draft))
    assert kv_cache.kv_blocks_that_fit(spec, torch.bfloat16, 16, 100e9, 40e9, 6e9, 0.9,
                                       draft) == n


def test_decode_graphs_share_one_output(monkeypatch) -> None:
    """Every decode graph's logits are a view of the runner's one graph output (allocated
    before the memory profile), not an output of its own kept alive in the graph pool."""
    from real_backend import runner as runner_module
    from real_backend.config import BackendConfig
    from real_backend.cuda_graphs import DecodeGraphs
    from real_backend.runner import ModelRunner
    from real_backend.weights import random_model

    spec = load_spec("tiny")
    monkeypatch.setattr(BackendConfig, "use_cuda_graphs", property(lambda self: True))

    def capture(step, sizes):
        return DecodeGraphs({b: None for b in sizes}, {b: step(b) for b in sizes})

    monkeypatch.setattr(runner_module, "capture_decode_graphs", capture)
    model = random_model(spec, "cpu", torch.float32, seed=5)
    cfg = BackendConfig(device="cpu", num_blocks=16, prefill_graph_max_tokens=0,
                        piecewise_graph_max_tokens=0)
    runner = ModelRunner(model, cfg, block_size=4, max_num_seqs=8, max_lookahead=16)
    assert runner.graph_logits is None  # on the CPU: no graphs, no output for them
    runner.cuda = True  # what a GPU runner allocates and captures
    runner.graph_logits = torch.empty((8, spec.vocab_size))
    runner.allocate_kv_cache(16)
    runner.capture_graphs()
    logits = runner.graphs.logits
    assert sorted(logits) == [1, 2, 4, 8]
    assert {t.data_ptr() for t in logits.values()} == {runner.graph_logits.data_ptr()}
    assert all(t.shape == (b, spec.vocab_size) for b, t in logits.items())


def test_weights_that_do_not_fit_are_refused(monkeypatch) -> None:
    _fake_gpu(monkeypatch, total=143e9, free=139e9, activations=0)
    with pytest.raises(ValueError, match=r"model llama3_70b needs 141 GB of weights but "
                                         r"backend.device cuda:0 has 139 GB free x "
                                         r"gpu_memory_utilization 0.9"):
        kv_cache.check_weights_fit(load_spec("llama3_70b"), torch.device("cuda", 0),
                                   torch.bfloat16, 0.9)
    kv_cache.check_weights_fit(load_spec("llama3_8b"), torch.device("cuda", 0), torch.bfloat16,
                               0.9)


class _EagerPrefillGraphs:
    """Stands in for captured prefill graphs on the CPU: 'replaying' (tokens, seqs) runs the
    very function a graph captures, over the same static buffers, so padding is exercised."""

    def __init__(self, runner: ModelRunner) -> None:
        from common.step_sizes import PREFILL_GRAPH_SEQS, PREFILL_GRAPH_TOKENS

        self.runner = runner
        self.graphs = {(t, p): None for t in PREFILL_GRAPH_TOKENS for p in PREFILL_GRAPH_SEQS}
        self.replayed: list[tuple[int, int]] = []

    def replay(self, key: tuple[int, int]) -> torch.Tensor:
        self.replayed.append(key)
        return self.runner._prefill_static(*key)


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU tensors: Triton runs them only in its interpreter, "
    "which is on where there is no GPU (CI); on a GPU the engine tests cover prefill graphs"))])
def test_padded_prefill_graph_inputs_equal_oracle(kernels: str) -> None:
    """Prefill-only windows padded to a graph's (tokens, sequences) size, with cached prefixes
    and a chunk that samples nothing, give the oracle's ids; larger windows stay eager."""
    from common.step_sizes import prefill_graph_key

    assert prefill_graph_key(10, 1, 512) == (16, 1)
    assert prefill_graph_key(200, 3, 512) == (256, 4)
    assert prefill_graph_key(300, 2, 256) is None and prefill_graph_key(20, 9, 512) is None
    # the interpreter is slow: Triton on one layer (every layer runs the same kernels)
    spec = load_spec("tiny", num_layers=1) if kernels == "triton" else SPEC
    model = random_model(spec, "cpu", torch.float32, seed=7)
    cfg = BackendConfig(device="cpu", num_blocks=96, kernels=kernels, prefill_graph_max_tokens=64)
    runner = ModelRunner(model, cfg, block_size=4, max_num_seqs=8, max_lookahead=4)
    runner.allocate_kv_cache(96)
    runner.warm_up(16, 4)  # scribbles on block 0, which a request below then owns
    fake = _EagerPrefillGraphs(runner)
    runner.prefill_graphs = fake
    reqs = _random_requests(1, 96, (11, 5, 23, 40, 70), 19, 6)
    oracle = [greedy_dense(model, r.prompt_token_ids, 3) for r in reqs]

    run = partial(_one_step, runner)

    a, b, c, d, e = reqs
    run([(a, 11), (b, 5), (c, 13)])  # 29 tokens -> (32, 4); c's chunk samples nothing
    run([(c, 10)])  # a cached prefix of 13, 10 new tokens -> (16, 1)
    run([(d, 40)])  # -> (64, 1)
    run([(e, 70)])  # 70 > 64: eager
    assert fake.replayed == [(32, 4), (16, 1), (64, 1)] and runner.prefill_graph_replays == 3
    for r, want in zip(reqs, oracle, strict=True):
        assert r.output_token_ids == want[:1]


class _EagerPiecewiseGraphs:
    """Stands in for the captured piecewise graphs on the CPU: replaying piece i at a padded size
    runs the very piece a graph captures, over the runner's static buffers."""

    def __init__(self, runner: ModelRunner, max_tokens: int) -> None:
        from common.step_sizes import piecewise_graph_sizes

        self.runner = runner
        self.sizes = piecewise_graph_sizes(max_tokens)
        self.graphs = {(t, i): None for t in self.sizes for i in range(SPEC.num_layers + 1)}
        self.replayed: list[int] = []

    def replay(self, tokens: int, piece: int) -> None:
        from real_backend.model import decoder_piece

        if piece == 0:
            self.replayed.append(tokens)
        decoder_piece(self.runner.model, self.runner.piece_buffers, piece, tokens,
                      self.runner.kernels)


def test_mixed_steps_through_piecewise_pieces_equal_oracle() -> None:
    """Mixed prefill + decode windows and a prefill too large for the prefill graphs run as
    padded piecewise steps (garbage in the padding rows) and give the oracle's ids; a window
    above piecewise_graph_max_tokens stays eager."""
    from real_backend.model import PieceBuffers

    model = random_model(SPEC, "cpu", torch.float32, seed=11)
    cfg = BackendConfig(device="cpu", num_blocks=96, piecewise_graph_max_tokens=64,
                        prefill_graph_max_tokens=16)
    runner = ModelRunner(model, cfg, block_size=4, max_num_seqs=8, max_lookahead=4)
    runner.allocate_kv_cache(96)
    runner.piece_buffers = PieceBuffers.allocate(SPEC, 64, torch.float32, torch.device("cpu"))
    for b in (runner.piece_buffers.x, runner.piece_buffers.qkv, runner.piece_buffers.attn):
        b.normal_()
    fake = _EagerPiecewiseGraphs(runner, 64)
    runner.piecewise = fake
    reqs = _random_requests(2, 96, (9, 30, 17, 70), 22, 6)
    oracle = [greedy_dense(model, r.prompt_token_ids, 4) for r in reqs]

    run = partial(_one_step, runner)  # a chunk samples when it ends its prompt

    a, b, c, d = reqs
    run([(a, 9), (b, 20)])  # 29 tokens, 2 prompts, over the prefill graphs' 16: pieces of 32
    run([(b, 10), (a, 1)])  # b's last chunk over its cached prefix beside a decode: 32
    run([(c, 17), (a, 1), (b, 1)])  # 19 tokens: 32
    run([(d, 70)])  # 70 > 64: eager
    run([(d, 1), (a, 1), (b, 1), (c, 1)])  # decode only: the decode path
    assert fake.replayed == [32, 32, 32]
    assert runner.piecewise_replays == 3
    for r, want in zip(reqs, oracle, strict=True):
        assert r.output_token_ids == want[:len(r.output_token_ids)]
    assert [len(r.output_token_ids) for r in reqs] == [4, 3, 2, 2]
