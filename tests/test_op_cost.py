"""The operator-table cost model: interpolation, fallbacks, the tables' own points, profiles."""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from common.parallel import ParallelConfig
from common.step_sizes import split_tokens
from policies import ModelSpec
from simulator.cost_model import StepShape, step_cost, step_time
from simulator.hardware import HardwareSpec
from simulator.op_cost import graph_kernels_us, kernel_times, launch_terms
from simulator.op_tables import (
    Curve,
    Grid2,
    decode_attention_us,
    gemm_us,
    load_tables,
    prefill_attention_us,
    sampler_us,
    small_us,
)

CONF = Path(__file__).resolve().parents[1] / "conf"
OPS = CONF / "calibration" / "h200_ops"


def model(name: str) -> ModelSpec:
    return ModelSpec.from_dict(yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text()))


def ops_hw(tp: int = 1, **kw) -> HardwareSpec:
    """h200_ops at unit served-vs-isolated factors (the tables' own times) unless ``kw`` says,
    on ``tp`` tensor-parallel GPUs."""
    return HardwareSpec.from_dict({**yaml.safe_load((CONF / "hardware" / "h200_ops.yaml")
                                                    .read_text()), "op_kernel_factor": 1.0,
                                   "op_compute_factor": 1.0, **kw},
                                  ParallelConfig(tensor_parallel_size=tp))


@pytest.fixture(scope="module")
def tables():
    return load_tables("calibration/h200_ops")


# ---------------------------------------------------------------------------- interpolation
def test_curve_interpolates_in_logs_and_extrapolates_linearly():
    c = Curve(np.array([1.0, 4.0, 16.0]), np.array([2.0, 8.0, 8.0]))
    assert c(4.0) == pytest.approx(8.0)
    assert c(2.0) == pytest.approx(4.0)  # log-log midpoint of (1, 2) and (4, 8)
    assert c(8.0) == pytest.approx(8.0)
    assert c(0.5) == pytest.approx(2.0)  # flat below the smallest point
    assert c(32.0) == pytest.approx(16.0)  # proportional past the largest
    assert c(0) == 0.0


def test_curve_takes_the_median_of_repeated_sizes_and_refuses_bad_points():
    c = Curve(np.array([1.0, 1.0, 1.0, 2.0]), np.array([1.0, 3.0, 100.0, 6.0]))
    assert c(1.0) == pytest.approx(3.0)
    with pytest.raises(ValueError):
        Curve(np.array([0.0, 1.0]), np.array([1.0, 2.0]))


def test_grid_is_exact_on_its_points_and_bilinear_in_logs_between():
    rows = pd.DataFrame([{"batch": b, "context": c, "time_us": b * c / 10.0}
                         for b in (1, 4) for c in (100, 400)])
    g = Grid2(rows)
    for r in rows.itertuples():
        assert g(r.batch, r.context) == pytest.approx(r.time_us)
    assert g(2, 200) == pytest.approx(2 * 200 / 10.0)  # b c is log-linear: exact
    assert g(8, 400) == pytest.approx(2 * g(4, 400))  # linear past the largest batch
    assert g(4, 1600) == pytest.approx(4 * g(4, 400))  # ... and context


# ---------------------------------------------------------------------------- the tables' points
def test_gemm_points_are_reproduced(tables):
    g = pd.read_csv(OPS / "gemm.csv")
    for r in g.sample(60, random_state=0).itertuples():
        assert gemm_us(tables, r.op, r.M, r.N, r.K) == pytest.approx(r.time_us, rel=1e-9)


def test_attention_points_are_reproduced(tables):
    d = pd.read_csv(OPS / "attention_decode.csv")
    for r in d[d["ctx_dist"] == "uniform"].itertuples():
        assert decode_attention_us(tables, (r.num_heads, r.num_kv_heads, r.head_dim), r.batch,
                                   r.kv_tokens, r.max_kv_tokens) == pytest.approx(r.time_us)
    p = pd.read_csv(OPS / "attention_prefill.csv")
    one = p[(p["num_seqs"] == 1) & (p["cached_len"] == 0)]
    for r in one.itertuples():
        assert prefill_attention_us(tables, (r.num_heads, r.num_kv_heads, r.head_dim),
                                    r.num_tokens, r.attn_pairs) == pytest.approx(r.time_us)
    # batched prompts from an empty cache: on the line in pairs at their token count
    fresh = p[(p["num_seqs"] > 1) & (p["cached_len"] == 0)]
    err = [prefill_attention_us(tables, (r.num_heads, r.num_kv_heads, r.head_dim),
                                r.num_tokens, r.attn_pairs) / r.time_us - 1
           for r in fresh.itertuples()]
    assert max(abs(e) for e in err) < 0.1


def test_ragged_decode_lies_between_uniform_and_the_ragged_table(tables):
    d = pd.read_csv(OPS / "attention_decode.csv")
    r = d[(d["ctx_dist"] == "ragged") & (d["used_by"] == "llama3_8b") & (d["batch"] == 16)
          & (d["context"] == 1024)].iloc[0]
    heads = (32, 8, 128)
    mean = r.kv_tokens / r.batch
    uniform = decode_attention_us(tables, heads, 16, r.kv_tokens)  # longest unknown: uniform
    ragged = decode_attention_us(tables, heads, 16, r.kv_tokens, r.max_kv_tokens)
    assert uniform < ragged
    assert ragged == pytest.approx(r.time_us, rel=0.1)  # its mean context is not c: 935
    half = decode_attention_us(tables, heads, 16, r.kv_tokens, (mean + r.max_kv_tokens) / 2)
    assert uniform < half < ragged
    # no further than the table's ragged batch: the tables say nothing past it
    far = decode_attention_us(tables, heads, 16, r.kv_tokens, 2 * r.max_kv_tokens - mean)
    assert far == pytest.approx(ragged)


def test_small_kernel_points_are_reproduced(tables):
    s = pd.read_csv(OPS / "per_layer_small.csv")
    for r in s.sample(40, random_state=1).itertuples():
        sizes = (r.hidden_size, r.intermediate_size, r.num_heads, r.num_kv_heads, r.head_dim,
                 r.vocab_size)
        assert small_us(tables, r.op, r.tokens, sizes) == pytest.approx(r.time_us)


# ---------------------------------------------------------------------------- fallbacks
@pytest.fixture
def one_shape_dir(tmp_path):
    """The committed tables with the GEMM table cut to one (N, K)."""
    for f in OPS.iterdir():
        shutil.copy(f, tmp_path / f.name)
    g = pd.read_csv(OPS / "gemm.csv")
    g[(g["N"] == 6144) & (g["K"] == 4096) | (g["op"] == "lm_head")].to_csv(
        tmp_path / "gemm.csv", index=False)
    return tmp_path


def test_gemm_fallback_scales_the_nearest_shape_by_the_roofline(one_shape_dir):
    t = load_tables(str(one_shape_dir))
    base = gemm_us(t, "layer", 8192, 6144, 4096)
    assert gemm_us(t, "layer", 8192, 12288, 4096) == pytest.approx(2 * base, rel=1e-6)  # FLOPs
    small = gemm_us(t, "layer", 1, 6144, 4096)
    # memory-bound at M = 1: the weight bytes (N K) set the ratio
    assert gemm_us(t, "layer", 1, 6144, 8192) == pytest.approx(2 * small, rel=1e-3)
    # the fallback against the real measurement of that shape: within 35%
    full = load_tables("calibration/h200_ops")
    for m in (1, 64, 1024, 8192):
        ratio = gemm_us(t, "layer", m, 4096, 4096) / gemm_us(full, "layer", m, 4096, 4096)
        assert 0.65 < ratio < 1.35, (m, ratio)


def test_head_shape_fallback_scales_by_flops_and_kv_bytes(tables):
    near = (32, 8, 128)  # llama3_8b's, the nearest to 36 heads over 9 KV heads
    assert prefill_attention_us(tables, (36, 9, 128), 512, 131328) == pytest.approx(
        prefill_attention_us(tables, near, 512, 131328) * 36 / 32)
    assert decode_attention_us(tables, (36, 9, 128), 64, 64 * 1024) == pytest.approx(
        decode_attention_us(tables, near, 64, 64 * 1024) * 9 / 8)


def test_small_kernel_fallback_scales_by_bytes(tables):
    assert small_us(tables, "add_rms_norm", 256, (4300, 0, 0, 0, 0, 0)) == pytest.approx(
        4300 / 4096 * small_us(tables, "add_rms_norm", 256, (4096, 0, 0, 0, 0, 0)))


def test_missing_or_broken_tables_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="hardware.op_tables: .* is not a directory"):
        load_tables(str(tmp_path / "nowhere"))
    (tmp_path / "gemm.csv").write_text("op,M\nlayer,1\n")
    with pytest.raises(ValueError, match=r"gemm.csv lacks column\(s\) N, K, time_us"):
        load_tables(str(tmp_path))
    with pytest.raises(ValueError, match="hardware.op_tables must be a directory name"):
        ops_hw(op_tables=3)
    with pytest.raises(ValueError, match="hardware.op_kernel_factor must be > 0"):
        ops_hw(op_kernel_factor=0)


# ---------------------------------------------------------------------------- whole steps
def test_graph_table_steps_are_reproduced_within_its_fit(tables):
    """The decode graph's launch line is fitted over every model of the graph table: each
    model's whole batch-1 decode step at its full depth comes back within 10%."""
    g = tables.graph
    full = g[g["mode"] == "decode_graph"].groupby("model")["num_layers"].max()
    hw = ops_hw()
    for name, layers in full.items():
        spec = dataclasses.replace(model(name), num_layers=int(layers))
        row = g[(g["model"] == name) & (g["num_layers"] == layers)
                & (g["mode"] == "decode_graph")].iloc[0]
        shape = StepShape(1, 1, 0, 1, 0.0, 128, True, 128)
        pred = step_time(shape, spec, hw) * 1e6 - tables.sampler[("greedy", spec.vocab_size)](1)
        assert pred == pytest.approx(row.time_us, rel=0.1), name
        assert graph_kernels_us(tables, name, int(layers), "decode_graph") < row.time_us


def test_step_prices_every_kernel_and_the_factors_scale_them(tables):
    spec = model("llama3_8b")
    hw = ops_hw()
    decode = StepShape(64, 64, 0, 64, 0.0, 64 * 500, True, 500)
    k = kernel_times(tables, spec, decode, 64, 1, False)
    layer = sum(gemm_us(tables, "layer", 64, n, kk)
                for n, kk in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)))
    assert k.total > spec.num_layers * layer
    t = step_time(decode, spec, hw)
    assert step_time(decode, spec, ops_hw(op_kernel_factor=2.0)) == pytest.approx(
        t + k.total * 1e-6, rel=1e-9)
    later = dataclasses.replace(decode, is_first=False)
    assert step_time(later, spec, hw) > t  # advance_step
    prefill = StepShape(4096, 4, 4096, 4, 4 * 1024 * 1025 / 2, 4096, True, 0, 4, 4096)
    t_p, busy = step_cost(prefill, spec, hw)
    assert 0.5 * t_p < busy <= t_p  # a large prefill is compute-bound
    slow = step_time(prefill, spec, ops_hw(op_compute_factor=1.2))
    assert t_p * 1.1 < slow < t_p * 1.2
    # eager prefills above the piecewise graphs pay at least the host's launches
    launch = launch_terms("calibration/h200_ops").eager_prefill_host
    assert t_p >= (launch[0] + launch[1] * spec.num_layers) * 1e-6


def test_tp_adds_the_all_reduces():
    spec = model("llama3_8b")
    shape = StepShape(256, 256, 0, 256, 0.0, 256 * 500, True, 500)
    one, two = step_time(shape, spec, ops_hw()), step_time(shape, spec, ops_hw(tp=2))
    assert two < one  # half the weights each
    hw2 = ops_hw(tp=2)
    link = hw2.link_bytes_per_s * hw2.allreduce_efficiency
    ar = (2 * spec.num_layers + 1) * (hw2.allreduce_latency_us * 1e-6
                                + 256 * spec.hidden_size * 2 / link)
    assert two > ar


def test_other_profiles_ignore_the_new_fields():
    """A profile without op_tables prices through the roofline model, as before."""
    hw = HardwareSpec.from_dict(yaml.safe_load((CONF / "hardware" / "h200_calibrated.yaml")
                                               .read_text()))
    assert hw.op_tables == ""
    shape = StepShape(256, 256, 0, 256, 0.0, 256 * 500, True, 500)
    with_prefill_fields = dataclasses.replace(shape, num_prefill_seqs=0, prefill_kv_tokens=0)
    assert step_time(shape, model("llama3_8b"), hw) == step_time(with_prefill_fields,
                                                                  model("llama3_8b"), hw)
    assert math.isfinite(step_time(shape, model("llama3_8b"), hw))


def _copy_tables(dst: Path, drop_rows: dict[str, tuple[str, str]] | None = None) -> Path:
    """The committed tables in ``dst``, with each table's rows whose ``column`` equals
    ``value`` dropped (``drop_rows``: table -> (column, value))."""
    for f in OPS.iterdir():
        shutil.copy(f, dst / f.name)
    for table, (column, value) in (drop_rows or {}).items():
        df = pd.read_csv(dst / f"{table}.csv")
        df[df[column] != value].to_csv(dst / f"{table}.csv", index=False)
    return dst


def test_decode_waits_for_the_program_that_reads_its_longest_sequence(tmp_path):
    """With "longest" rows, a batch of unequal contexts costs at least the program that reads
    its longest sequence (its keys over the key splits of the rows the kernel sees); without
    them, or with equal contexts, the grids' price stands."""
    (tmp_path / "base").mkdir()
    base_dir = _copy_tables(tmp_path / "base", {"attention_decode": ("ctx_dist", "longest")})
    base = load_tables(str(base_dir))
    assert base.decode_longest == {}
    d = pd.read_csv(base_dir / "attention_decode.csv")
    x = np.array([512.0, 1024, 2048, 4096, 8192])
    extra = pd.DataFrame({"num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                          "used_by": "llama3_8b", "batch": 64, "context": x,
                          "ctx_dist": "longest", "kv_tokens": x + 63 * 16, "max_kv_tokens": x,
                          "num_splits": 1, "copies": 1, "calls": 1, "time_us": 5 + 0.05 * x,
                          "launch_us": 1.0, "sm_mhz": 1980.0})
    (tmp_path / "long").mkdir()
    long_dir = _copy_tables(tmp_path / "long")
    pd.concat([d, extra]).to_csv(long_dir / "attention_decode.csv", index=False)
    t = load_tables(str(long_dir))
    assert t.num_sms == 132
    heads = (32, 8, 128)
    plain = decode_attention_us(base, heads, 40, 40 * 300, 4096)
    # 40 rows x 8 KV heads: one split on 132 SMs, so the program reads all 4096 keys
    assert 5 + 0.05 * 4096 > plain
    assert decode_attention_us(t, heads, 40, 40 * 300, 4096) == pytest.approx(
        5 + 0.05 * 4096, rel=1e-6)
    # 16 rows: three splits, each rounded up to whole 64-key blocks: 1408 keys a program
    assert split_tokens(4096, 3) == 1408
    assert decode_attention_us(t, heads, 16, 16 * 300, 4096) == pytest.approx(
        max(decode_attention_us(base, heads, 16, 16 * 300, 4096), 5 + 0.05 * 1408), rel=1e-2)
    # the splits follow the rows the kernel sees: 16 real sequences padded to 40 rows
    assert decode_attention_us(t, heads, 16, 16 * 300, 4096, rows=40) > \
        decode_attention_us(t, heads, 16, 16 * 300, 4096)
    # equal contexts: nothing waits for one sequence, even where the curve lies above the grid
    assert 5 + 0.05 * split_tokens(4096, 5) > decode_attention_us(base, heads, 8, 8 * 4096, 4096)
    assert decode_attention_us(t, heads, 8, 8 * 4096, 4096) == pytest.approx(
        decode_attention_us(base, heads, 8, 8 * 4096, 4096), rel=1e-12)
    # below the curve's first point (its launch floor) the grid's price stands
    assert decode_attention_us(t, heads, 256, 256 * 100, 400) == pytest.approx(
        decode_attention_us(base, heads, 256, 256 * 100, 400), rel=1e-12)


def test_later_steps_of_a_window_take_the_queued_graph_gap(tmp_path):
    """Steps 2..k replay their decode graph queued behind the step before: with the graph
    table's decode_graph_queued rows 100 us under its decode_graph rows, a later step costs
    100 us less than step 1 plus advance_step; without those rows, step 1 plus advance_step."""
    (tmp_path / "none").mkdir()
    plain = _copy_tables(tmp_path / "none", {"graph": ("mode", "decode_graph_queued")})
    (tmp_path / "queued").mkdir()
    queued = _copy_tables(tmp_path / "queued", {"graph": ("mode", "decode_graph_queued")})
    g = pd.read_csv(queued / "graph.csv")
    q = g[g["mode"] == "decode_graph"].assign(mode="decode_graph_queued")
    q["time_us"] -= 100.0
    pd.concat([g, q]).to_csv(queued / "graph.csv", index=False)
    spec = model("llama3_8b")
    first = StepShape(64, 64, 0, 64, 0.0, 64 * 500, True, 500)
    later = dataclasses.replace(first, is_first=False)
    advance = sampler_us(load_tables(str(plain)), "advance_step", 64, 0)
    for path, saved in ((plain, 0.0), (queued, 100.0)):
        hw = ops_hw(op_tables=str(path))
        step1, step2 = step_time(first, spec, hw), step_time(later, spec, hw)
        assert (step2 - step1) * 1e6 == pytest.approx(advance - saved, abs=0.01), path.name
