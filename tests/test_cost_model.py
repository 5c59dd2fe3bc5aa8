"""The GPU cost model, the hardware and overhead profiles, and the KV memory model."""

from __future__ import annotations

import dataclasses
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import yaml

from common.parallel import ParallelConfig
from common.step_sizes import (
    decode_graph_size,
    decode_graph_sizes,
    decode_splits,
    piecewise_graph_size,
    prefill_graph_key,
)
from policies import Batch, ModelSpec, Request, ScheduledSeq
from simulator.cost_model import (
    StepShape,
    decode_attention_splits,
    graph_tokens,
    piecewise_eager_kernels,
    piecewise_tokens,
    split_merge_kernels,
    stage_time,
    step_time,
    window_gpu_times,
    window_shapes,
)
from simulator.hardware import HardwareSpec
from simulator.memory import blocks_per_engine, num_gpu_blocks
from simulator.overhead import OverheadSpec, output_time, scale_overhead, schedule_time

CONF = Path(__file__).resolve().parents[1] / "conf"


def load(kind: str, name: str) -> dict:
    return yaml.safe_load((CONF / kind / f"{name}.yaml").read_text())


def model(name: str = "llama3_8b") -> ModelSpec:
    return ModelSpec.from_dict(load("model", name))


def hardware(name: str = "h100_sxm", **changes) -> HardwareSpec:
    return dataclasses.replace(HardwareSpec.from_dict(load("hardware", name)), **changes)


def decode_seq(rid: int, ctx: int, steps: int = 1, max_tokens: int = 1000) -> ScheduledSeq:
    """A request that has generated one token and now decodes at position ``ctx``."""
    req = Request(rid, 0.0, ctx, max_tokens)
    req.num_output_tokens = 1
    req.num_computed_tokens = ctx
    return ScheduledSeq(req, 1, ctx, steps, False)


def decode_batch(n: int, ctx: int, steps: int = 1) -> Batch:
    return Batch([decode_seq(i, ctx, steps) for i in range(n)], steps)


def decode_time(n: int, ctx: int, hw: HardwareSpec | None = None, m: ModelSpec | None = None):
    return window_gpu_times(decode_batch(n, ctx), m or model(), hw or hardware())[0]


# ---------------------------------------------------------------- profiles


@pytest.mark.parametrize("path", sorted((CONF / "hardware").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_hardware_profile_loads(path):
    hw = HardwareSpec.from_dict(yaml.safe_load(path.read_text()))
    assert hw.name == path.stem and hw.tp == 1 and hw.pp == 1


@pytest.mark.parametrize("path", sorted((CONF / "overhead").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_overhead_profile_loads(path):
    assert OverheadSpec.from_dict(yaml.safe_load(path.read_text())).name == path.stem


@pytest.mark.parametrize("change, message", [
    ({"tp": 2}, "hardware.tp is no longer a hardware setting: set "
                "parallel.tensor_parallel_size instead"),
    ({"pp": 1}, "hardware.pp is no longer a hardware setting: set "
                "parallel.pipeline_parallel_size instead"),
    ({"matmul_efficiency": 1.5}, "hardware.matmul_efficiency must be in (0, 1], got 1.5"),
    ({"hbm_tbps": 0}, "hardware.hbm_tbps must be > 0, got 0"),
    ({"kernel_launch_us": -1}, "hardware.kernel_launch_us must be >= 0, got -1"),
    ({"warp_speed": 9}, "hardware has no setting 'warp_speed'"),
])
def test_bad_hardware_settings_are_one_line_errors(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        HardwareSpec.from_dict({**load("hardware", "h100_sxm"), **change})


def test_the_parallel_section_sets_the_gpu_count_and_is_checked():
    hw = HardwareSpec.from_dict(load("hardware", "h100_sxm"), ParallelConfig(2, 3))
    assert (hw.tp, hw.pp, hw.num_gpus) == (2, 3, 6)
    assert "tp" not in hw.profile and hw.profile["name"] == "h100_sxm"
    for bad, message in (({"tensor_parallel_size": 0}, "parallel.tensor_parallel_size must be an "
                          "integer >= 1, got 0"),
                         ({"pipeline_parallel_size": 1.5}, "parallel.pipeline_parallel_size must "
                          "be an integer >= 1, got 1.5"),
                         ({"tp": 2}, "parallel has no setting 'tp'")):
        with pytest.raises(ValueError, match=message):
            ParallelConfig.from_mapping(bad)


def test_bad_overhead_settings_are_one_line_errors():
    with pytest.raises(ValueError, match="overhead.output_per_seq_us must be >= 0, got -2"):
        OverheadSpec(output_per_seq_us=-2)
    with pytest.raises(ValueError, match="overhead has no setting 'gc_pause_us'"):
        OverheadSpec.from_dict({"gc_pause_us": 1})
    with pytest.raises(ValueError, match="async_output_processing must be true or false"):
        OverheadSpec(async_output_processing="yes")


# ---------------------------------------------------------------- step shapes


def naive_shapes(batch: Batch) -> list[tuple]:
    """Per step, per sequence, the obvious way: the reference window_shapes must agree with."""
    out = []
    for j in range(batch.num_steps):
        tokens = seqs = prefill = sampled = kv = longest = 0
        pairs = 0.0
        for s in batch.seqs:
            if s.num_steps <= j:
                continue
            seqs += 1
            if j == 0:
                q, c = s.num_query_tokens, s.num_cached_tokens
                tokens += q
                kv += c + q
                if s.is_prefill:
                    prefill += q
                    pairs += sum(c + i + 1 for i in range(q))  # query i sees c + i + 1 keys
                else:
                    longest = max(longest, c + q)
                sampled += s.samples
            else:
                tokens += 1
                kv += s.num_cached_tokens + s.num_query_tokens + j
                longest = max(longest, s.num_cached_tokens + s.num_query_tokens + j)
                sampled += 1
        out.append((tokens, seqs, prefill, sampled, pairs, kv, j == 0, longest))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_window_shapes_match_a_per_step_per_sequence_count(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 10))
    seqs = []
    for i in range(int(rng.integers(1, 40))):
        if rng.random() < 0.3:  # a prefill chunk, finishing its prompt or not
            prompt = int(rng.integers(2, 300))
            cached = int(rng.integers(0, prompt))
            q = int(rng.integers(1, prompt - cached + 1))
            req = Request(i, 0.0, prompt, 50)
            done = cached + q == prompt
            seqs.append(ScheduledSeq(req, q, cached, int(rng.integers(1, k + 1)) if done else 1,
                                     True))
        else:
            seqs.append(decode_seq(i, int(rng.integers(1, 2000)), int(rng.integers(1, k + 1))))
    batch = Batch(seqs, k)
    got = [(s.num_tokens, s.num_seqs, s.num_prefill_tokens, s.num_sampled, s.attn_pairs,
            s.kv_tokens, s.is_first, s.max_kv_tokens) for s in window_shapes(batch)]
    assert got == naive_shapes(batch)


def test_cuda_graph_padding_and_eligibility():
    assert [decode_graph_size(n) for n in (1, 2, 3, 4, 5, 8, 9, 250, 256, 257)] == \
        [1, 2, 4, 4, 8, 8, 16, 256, 256, None]
    assert decode_graph_sizes(20) == [1, 2, 4, 8, 16, 24] and decode_graph_sizes(999)[-1] == 256
    hw = hardware()
    decode = StepShape(250, 250, 0, 250, 0.0, 250 * 500, True)
    assert graph_tokens(decode, hw) == 256
    assert graph_tokens(dataclasses.replace(decode, num_seqs=257, num_tokens=257), hw) is None
    assert graph_tokens(dataclasses.replace(decode, num_prefill_tokens=10), hw) == 256
    # ... as the engine runs 1-token prefill chunks on the decode path; longer chunks: eager
    assert graph_tokens(StepShape(260, 250, 20, 250, 0.0, 250 * 500, True), hw) is None
    assert graph_tokens(decode, dataclasses.replace(hw, cuda_graph_max_batch=0)) is None


def test_prefill_graphs_pad_like_the_engine():
    """Prefill-only steps replay a graph padded as the engine pads them; mixed steps, more
    than 8 prompts, more tokens than prefill_graph_max_tokens, or no graphs at all: eager."""
    hw = hardware(prefill_graph_max_tokens=256, kernel_launch_us=30.0)  # launches as in schedlab
    for tokens in range(1, 600, 7):
        for seqs in (1, 3, 8, 9):
            if seqs > tokens:
                continue
            shape = StepShape(tokens, seqs, tokens, seqs, 0.0, tokens, True)
            if tokens == seqs:  # 1-token chunks run on the decode path, as decode graphs
                assert graph_tokens(shape, hw) == decode_graph_size(seqs)
                continue
            want = next((b for b in (16, 32, 64, 128, 192, 256) if b >= tokens), None)
            assert graph_tokens(shape, hw) == (want if seqs <= 8 else None)
            key = prefill_graph_key(tokens, seqs, 256)
            assert graph_tokens(shape, hw) == (key[0] if key else None)
    prefill = StepShape(200, 2, 200, 2, 20000.0, 200, True)
    assert graph_tokens(prefill, hw) == 256
    assert graph_tokens(dataclasses.replace(prefill, num_tokens=232, num_seqs=34), hw) is None
    assert graph_tokens(prefill, hardware()) is None  # vLLM profiles: every prefill eager
    assert graph_tokens(prefill, dataclasses.replace(hw, cuda_graph_max_batch=0)) is None
    eager = step_time(prefill, model(), dataclasses.replace(hw, prefill_graph_max_tokens=0))
    assert step_time(prefill, model(), hw) < eager  # launch-bound eagerly, not in a graph


def test_piecewise_graphs_cover_what_no_whole_step_graph_does():
    """Mixed steps and prefills beyond the prefill graphs replay piecewise graphs padded as the
    engine pads them, up to piecewise_graph_max_tokens; decode steps never do; vLLM profiles
    (0) are unchanged; a launch-bound mixed step is faster piecewise than eager."""
    hw = hardware(prefill_graph_max_tokens=512, piecewise_graph_max_tokens=2048,
                  kernel_launch_us=40.0, mixed_kernels_per_layer=5.0)
    assert piecewise_graph_size(1, 2048) == 32 and piecewise_graph_size(513, 2048) == 576
    assert piecewise_graph_size(2048, 2048) == 2048 and piecewise_graph_size(2049, 2048) is None
    assert piecewise_graph_size(600, 512) is None
    mixed = StepShape(356, 256, 100, 256, 5050.0, 256 * 500 + 100, True)
    assert piecewise_tokens(mixed, hw) == 384 and graph_tokens(mixed, hw) is None
    small_prefill = StepShape(200, 2, 200, 2, 20000.0, 200, True)
    assert graph_tokens(small_prefill, hw) == 256 and piecewise_tokens(small_prefill, hw) is None
    many = StepShape(700, 12, 700, 12, 20000.0, 700, True)
    assert piecewise_tokens(many, hw) == 704
    assert piecewise_tokens(StepShape(4000, 2, 4000, 2, 1e6, 4000, True), hw) is None
    decode = StepShape(256, 256, 0, 256, 0.0, 256 * 500, True)
    assert piecewise_tokens(decode, dataclasses.replace(hw, cuda_graph_max_batch=128)) is None
    assert piecewise_tokens(mixed, hardware()) is None  # vLLM profiles: eager
    assert piecewise_tokens(mixed, dataclasses.replace(hw, cuda_graph_max_batch=0)) is None
    eager = dataclasses.replace(hw, piecewise_graph_max_tokens=0)
    assert step_time(mixed, model(), hw) < step_time(mixed, model(), eager)
    # the linear layers run on the padded rows: 1025 tokens cost what 1152 do
    big = StepShape(1025, 2, 1025, 2, 1e5, 1025, True)
    assert step_time(big, model(), hw) == step_time(dataclasses.replace(
        big, num_tokens=1152, num_prefill_tokens=1152), model(), hw)
    assert step_time(big, model(), hw) > step_time(big, model(), eager)  # GPU-bound: padding costs


def test_a_piecewise_step_launches_per_layer_what_the_engine_does():
    """Between its graph pieces a step launches, per layer, the KV write, its attention and the
    copy into the pieces' buffer (3); with prefill and decode rows both, the other attention and
    the concatenation (5); when few decoding sequences split their keys (decode_splits > 1),
    the merge of the splits besides (6). Eager steps add the merge to their floor too.
    (llama3_8b: 8 KV heads, 132 SMs: 33 decoding sequences or more keep one split.)"""
    hw = hardware("h200", prefill_graph_max_tokens=512, piecewise_graph_max_tokens=2048,
                  kernel_launch_us=400.0, decode_split_kernels_per_layer=1.0)
    m = model()
    L = m.num_layers

    def mixed(decoding: int) -> StepShape:
        return StepShape(170 + decoding, 1 + decoding, 170, 1 + decoding, 170 * 171 / 2,
                         170 + decoding * 300, True, 300)

    prefill = StepShape(600, 1, 600, 1, 600 * 601 / 2, 600, True)
    assert split_merge_kernels(mixed(25), m, hw) == 1.0  # 25 x 8 < 264 programs: 2 splits
    assert split_merge_kernels(mixed(33), m, hw) == 0.0  # 33 x 8 >= 264: one split
    assert split_merge_kernels(prefill, m, hw) == 0.0
    assert split_merge_kernels(mixed(25), m, hardware()) == 0.0  # vLLM profiles: none
    # tensor parallelism: the rank's KV heads decide (40 x 4 < 264 split, 40 x 8 does not)
    assert split_merge_kernels(mixed(40), m, dataclasses.replace(hw, tp=2)) == 1.0
    assert split_merge_kernels(mixed(40), m, hw) == 0.0
    # the rows decode attention sees: a mixed step's decoding sequences (its prompt goes to the
    # prefill kernel), one home for the launch count and the longest-sequence bound
    assert decode_splits(33, 8, 132) == 1 and decode_attention_splits(mixed(32), m, hw) == 2
    assert split_merge_kernels(mixed(32), m, hw) == 1.0
    decode = StepShape(20, 20, 0, 20, 0.0, 20 * 300, True, 300)
    assert decode_attention_splits(decode, m, hw, padded=24) == decode_splits(24, 8, 132)
    assert decode_attention_splits(decode, m, hw) == decode_splits(20, 8, 132)
    assert [piecewise_eager_kernels(s, m, hw) for s in (prefill, mixed(40), mixed(25))] == [
        3.0, 5.0, 6.0]
    # launch-bound (a slow launch): the floor is (L + 1) replays and L n_e eager kernels
    for shape, n_e in ((prefill, 3), (mixed(40), 5), (mixed(25), 6)):
        assert step_time(shape, m, hw) == pytest.approx((L + 1 + n_e * L) * 400e-6)
    # eager (no piecewise graphs): the merge adds L kernels to the eager floor
    eager = dataclasses.replace(hw, piecewise_graph_max_tokens=0)
    n = hw.kernels_per_layer * L
    assert step_time(mixed(25), m, eager) == pytest.approx((n + L) * 400e-6)
    assert step_time(mixed(40), m, eager) == pytest.approx(n * 400e-6)
    with pytest.raises(ValueError, match="decode_split_kernels_per_layer"):
        HardwareSpec.from_dict({**load("hardware", "h200"), "decode_split_kernels_per_layer": -1})


# ---------------------------------------------------------------- step times


def test_decode_step_llama3_8b_h100_is_in_a_sane_range():
    t = decode_time(256, 500)
    assert 0.010 < t < 0.020, t
    # batch 1: bound by reading 16 GB of weights at ~2.7 TB/s
    assert 0.004 < decode_time(1, 100) < 0.009


def test_step_time_grows_with_batch_and_context():
    sizes = [1, 2, 8, 32, 64, 128, 256, 384, 512]
    times = [decode_time(n, 500) for n in sizes]
    assert all(a <= b for a, b in pairwise(times)), times
    ctxs = [10, 100, 500, 1000, 4000]
    times = [decode_time(64, c) for c in ctxs]
    assert all(a < b for a, b in pairwise(times)), times


def test_prefill_attention_grows_quadratically():
    m, hw = model(), hardware()

    def prefill(q, cached=0):
        return step_time(StepShape(q, 1, q, 1, q * (q + 1) / 2 + q * cached, cached + q, True),
                         m, hw)

    assert prefill(1024) < prefill(2048) < prefill(4096) < prefill(8192)
    # the same chunk over a longer cached prefix costs more
    assert prefill(512, cached=4000) > prefill(512, cached=0)


def test_tensor_parallel_halves_compute_and_memory_terms():
    """With communication made free, tp=2 does exactly half the per-GPU work."""
    free = dict(allreduce_latency_us=0.0, nvlink_gbps=1e12, kernel_launch_us=0.0,
                graph_kernel_us=0.0, cuda_graph_replay_us=0.0, sampler_us=0.0,
                sampler_bytes_per_logit=0.0, advance_step_us=0.0)
    m = model()
    for shape in (StepShape(4096, 4, 4096, 4, 4 * 1024 * 1025 / 2, 4096, True),  # prefill
                  StepShape(256, 256, 0, 256, 0.0, 256 * 500, False)):  # decode
        one = step_time(shape, m, hardware(**free))
        two = step_time(shape, m, hardware(tp=2, **free))
        assert two == pytest.approx(one / 2, rel=1e-9)
    # real all-reduces cost something: more than half, still much less than one GPU
    shape = StepShape(4096, 4, 4096, 4, 4 * 1024 * 1025 / 2, 4096, True)
    one, two = step_time(shape, m, hardware()), step_time(shape, m, hardware(tp=2))
    assert one / 2 < two < 0.7 * one


def test_pipeline_stage_costs_a_share_of_the_step_plus_a_send():
    m = model()
    shape = StepShape(256, 256, 0, 256, 0.0, 256 * 500, True)
    full = step_time(shape, m, hardware())
    stage = stage_time(shape, m, hardware(pp=4))
    assert full / 4 < stage < full / 4 + 50e-6


def test_advance_step_is_paid_by_later_steps_only():
    hw = hardware()
    times = window_gpu_times(decode_batch(64, 500, steps=4), model(), hw)
    first = step_time(StepShape(64, 64, 0, 64, 0.0, 64 * 501, True), model(), hw)
    second = step_time(StepShape(64, 64, 0, 64, 0.0, 64 * 502, False), model(), hw)
    assert times[0] == first and times[1] == second
    no_kv = dataclasses.replace(hw, attn_decode_efficiency=1.0)
    a = step_time(StepShape(64, 64, 0, 64, 0.0, 0, True), model(), no_kv)
    b = step_time(StepShape(64, 64, 0, 64, 0.0, 0, False), model(), no_kv)
    assert b - a == pytest.approx(hw.advance_step_us * 1e-6)


def test_a_step_nobody_takes_part_in_costs_nothing():
    req = Request(0, 0.0, 100, 10)
    batch = Batch([ScheduledSeq(req, 100, 0, 1, True)], 4)  # CP_2: a prefill in a 4-step window
    times = window_gpu_times(batch, model(), hardware())
    assert times[0] > 0 and times[1:] == [0.0, 0.0, 0.0]


def test_costing_a_window_is_linear_in_its_sequences_not_steps_times_sequences():
    """The per-sequence pass runs once per window: k only adds O(k) arithmetic."""
    calls = []

    class CountingSeq(ScheduledSeq):
        __slots__ = ()

        @property
        def num_steps(self):  # read once per sequence by the single pass
            calls.append(1)
            return 8

        @num_steps.setter
        def num_steps(self, value):
            pass

    seqs = [CountingSeq(decode_seq(i, 300).request, 1, 300, 8, False) for i in range(256)]
    window_gpu_times(Batch(seqs, 8), model(), hardware())
    assert len(calls) <= 2 * 256


# ---------------------------------------------------------------- CPU overhead


def test_vllm_v0_5_profile_reproduces_the_published_breakdown():
    """The derivation in conf/overhead/vllm_v0_5.yaml: 38% GPU, 29% schedule, 33% output + API."""
    o = OverheadSpec.from_dict(load("overhead", "vllm_v0_5"))
    gpu = decode_time(256, 350)
    sched = schedule_time(o, 256, 256)
    out = output_time(o, 256, 256)
    total = gpu + sched + out
    assert gpu / total == pytest.approx(0.38, abs=0.015)
    assert sched / total == pytest.approx(0.29, abs=0.015)
    assert out / total == pytest.approx(0.33, abs=0.015)


def test_api_server_off_the_critical_path_leaves_the_engine_thread():
    o5 = OverheadSpec.from_dict(load("overhead", "vllm_v0_5"))
    o6 = OverheadSpec.from_dict(load("overhead", "vllm_v0_6"))
    assert output_time(o6, 256, 256) < output_time(o5, 256, 256)
    assert output_time(o5, 0, 0) == 0.0
    double = scale_overhead(o5, 2.0)
    assert schedule_time(double, 10, 100) == pytest.approx(2 * schedule_time(o5, 10, 100))
    assert double.async_output_processing == o5.async_output_processing


# ---------------------------------------------------------------- memory


def test_kv_blocks_follow_the_memory_formula():
    m, hw = model(), hardware()
    weights = m.num_params * 2  # bf16, embedding and LM head untied
    free = 79.65 * 2**30 * 0.9 - weights - 2.0 * 2**30
    per_block = 16 * 2 * 32 * 8 * 128 * 2  # block_size * K and V * layers * kv heads * head_dim
    assert num_gpu_blocks(m, hw) == pytest.approx(free // per_block, abs=1)
    assert 400_000 < num_gpu_blocks(m, hw) * 16 < 500_000  # tokens of KV cache


def test_more_memory_more_blocks_and_tp_more_than_doubles_them():
    m = model()
    b = [num_gpu_blocks(m, hardware(), gpu_memory_utilization=u) for u in (0.5, 0.7, 0.9)]
    assert b[0] < b[1] < b[2]
    assert num_gpu_blocks(m, hardware(tp=2)) > 2 * num_gpu_blocks(m, hardware())
    # pp: each stage holds half the layers; each of the 2 virtual engines gets half the blocks
    per_engine = blocks_per_engine(m, hardware(pp=2))
    assert per_engine == num_gpu_blocks(m, hardware(pp=2)) // 2


def test_a_model_that_does_not_fit_is_a_clear_error():
    with pytest.raises(ValueError, match=r"model llama3_70b does not fit on hardware h100_sxm "
                                         r"\(parallel.tensor_parallel_size=1, "
                                         r"pipeline_parallel_size=1\) at "
                                         r"gpu_memory_utilization=0.9"):
        num_gpu_blocks(model("llama3_70b"), hardware())
    assert num_gpu_blocks(model("llama3_70b"), hardware(tp=4)) > 0


def test_a_cache_smaller_than_one_max_length_request_is_a_clear_error():
    m = model()
    with pytest.raises(ValueError, match=r"model llama3_8b on hardware a10g .* "
                                         r"gpu_memory_utilization=0.75 .* max_model_len=8192"):
        blocks_per_engine(m, hardware("a10g"), gpu_memory_utilization=0.75)
    assert blocks_per_engine(m, hardware("a10g"), gpu_memory_utilization=0.75,
                             max_model_len=2048) > 0


@pytest.mark.parametrize("tp, message", [
    (3, "parallel.tensor_parallel_size=3 must divide model.num_heads=32"),
    (6, "parallel.tensor_parallel_size=6 must divide model.num_heads=32")])
def test_impossible_parallelism_is_a_clear_error(tp, message):
    with pytest.raises(ValueError, match=message):
        num_gpu_blocks(model(), hardware(tp=tp))


def test_bad_memory_settings():
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        num_gpu_blocks(model(), hardware(), gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="scheduler.block_size must be >= 1"):
        num_gpu_blocks(model(), hardware(), block_size=0)


def test_matmul_knee_and_longest_sequence_terms():
    """roofline_exponent p prices a matmul at the p-norm of its two bounds; attn_seq_gbps makes
    a ragged batch wait for its longest sequence (fewer key splits: longer wait)."""
    m = model()
    base = hardware(kernel_launch_us=0.0, sampler_us=0.0)
    shape = StepShape(128, 128, 0, 128, 0.0, 128 * 300, True, 300)
    t0 = step_time(shape, m, base)
    t1 = step_time(shape, m, dataclasses.replace(base, roofline_exponent=2.0))
    mm = base.peak_flops * base.matmul_efficiency
    mem = base.hbm_bytes_per_s * base.mem_bw_efficiency
    c_lin = 2.0 * 128 * m.num_layers * (m.params_per_layer - 2 * m.hidden_size) / mm
    m_lin = m.num_layers * m.params_per_layer * m.dtype_bytes / mem
    c_lm = 2.0 * 128 * m.hidden_size * m.vocab_size / mm
    m_lm = m.hidden_size * m.vocab_size * m.dtype_bytes / mem
    # weight-bound: the p-norm adds sqrt(c^2 + m^2) - m to each matmul's time
    extra = sum((c * c + w * w) ** 0.5 - max(c, w) for c, w in ((c_lin, m_lin), (c_lm, m_lm)))
    assert t1 - t0 == pytest.approx(extra, rel=1e-6)
    # far from the knee the larger bound alone sets the time
    huge = dataclasses.replace(base, roofline_exponent=64.0)
    assert step_time(shape, m, huge) == pytest.approx(t0, rel=1e-3)
    seq = dataclasses.replace(base, attn_seq_gbps=50.0)
    assert step_time(shape, m, seq) == pytest.approx(t0)  # balanced: the longest is no bound
    ragged = dataclasses.replace(shape, max_kv_tokens=4000)
    assert step_time(ragged, m, seq) > t0 + 1e-3
    # 4 sequences replay the batch-4 graph: 9 key splits on 132 SMs, 1 on 8 SMs
    few = dataclasses.replace(ragged, num_seqs=4, num_tokens=4, num_sampled=4, kv_tokens=4300)
    assert decode_splits(4, 8, 132) == 9 and decode_splits(4, 8, 8) == 1
    assert decode_splits(128, 8, 132) == 1
    assert step_time(few, m, seq) < step_time(few, m, dataclasses.replace(seq, num_sms=8))
    for bad, message in (({"roofline_exponent": 0.5}, "roofline_exponent must be 0"),
                         ({"attn_seq_gbps": -1}, "attn_seq_gbps must be >= 0"),
                         ({"num_sms": 0}, "num_sms must be an integer >= 1")):
        with pytest.raises(ValueError, match=message):
            HardwareSpec.from_dict({**load("hardware", "h100_sxm"), **bad})


@pytest.mark.parametrize("kind,bad", [("hardware", {"clock_heat_slowdown": float("nan")}),
                                      ("hardware", {"mixed_kernels_per_layer": "three"}),
                                      ("overhead", {"schedule_per_kv_token_us": float("nan")}),
                                      ("overhead", {"schedule_base_us": "fast"})])
def test_non_numbers_are_one_line_errors_naming_the_setting(kind, bad):
    spec = HardwareSpec if kind == "hardware" else OverheadSpec
    name = "h100_sxm" if kind == "hardware" else "vllm_v0_5"
    with pytest.raises(ValueError, match=f"{kind}.{next(iter(bad))} must be a number"):
        spec.from_dict({**load(kind, name), **bad})
