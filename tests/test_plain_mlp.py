"""model.mlp: plain (OPT's fc1 -> ReLU -> fc2): priced as two GEMMs by both cost models, its
weights two matrices; the engines refuse it in one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from common.model_spec import ModelSpec
from simulator import op_cost
from simulator.cost_model import StepShape, step_cost
from simulator.hardware import HardwareSpec
from simulator.memory import weight_bytes_per_gpu

CONF = Path(__file__).resolve().parents[1] / "conf"


def spec(name: str) -> ModelSpec:
    return ModelSpec.from_dict(yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text()))


def profile(name: str) -> HardwareSpec:
    return HardwareSpec.from_dict(yaml.safe_load((CONF / "hardware" / f"{name}.yaml").read_text()))


def prefill(tokens: int) -> StepShape:
    """One prompt of ``tokens`` tokens, sampled once."""
    return StepShape(tokens, 1, tokens, 1, tokens * (tokens + 1) / 2, tokens, True, 0, 1, tokens)


OPT = spec("opt_13b")
GATED = dataclasses.replace(OPT, mlp="gated")  # the same shape with Llama's 3-matrix MLP
H, INTER, L = OPT.hidden_size, OPT.intermediate_size, OPT.num_layers


def test_a_plain_mlp_has_two_thirds_of_the_gated_mlp_s_weights():
    assert GATED.params_per_layer - OPT.params_per_layer == H * INTER  # 3 h i against 2 h i
    mlp_bytes = 2 * L * H * INTER * OPT.dtype_bytes
    assert GATED.weight_bytes - OPT.weight_bytes == mlp_bytes // 2
    hw = profile("h200_calibrated")
    assert weight_bytes_per_gpu(GATED, hw) - weight_bytes_per_gpu(OPT, hw) == mlp_bytes // 2
    assert OPT.kv_bytes_per_token == GATED.kv_bytes_per_token  # the MLP holds no KV
    assert 12.8e9 < OPT.num_params < 12.9e9  # OPT-13B's published 12.85B, less 0.1% left out


def test_the_roofline_cost_model_prices_two_thirds_of_the_mlp_flops():
    hw = profile("h200_calibrated")
    tokens = 2048  # compute-bound: the tensor-core seconds are FLOPs over the matmul rate
    busy_gated = step_cost(prefill(tokens), GATED, hw)[1]
    busy_plain = step_cost(prefill(tokens), OPT, hw)[1]
    one_matrix = 2.0 * tokens * L * H * INTER / (hw.peak_flops * hw.matmul_efficiency)
    assert busy_gated - busy_plain == pytest.approx(one_matrix, rel=1e-9)


def test_the_operator_tables_price_a_plain_mlp_as_fc1_and_fc2(monkeypatch):
    calls: list[tuple[int, int]] = []
    real = op_cost.gemm_us

    def recording(t, op, m, n, k):
        if op == "layer":
            calls.append((n, k))
        return real(t, op, m, n, k)

    monkeypatch.setattr(op_cost, "gemm_us", recording)
    tables = op_cost.load_tables("calibration/h200_ops")
    tokens = 512
    mlp_flops = {}
    for m in (GATED, OPT):
        calls.clear()
        tables.memo.clear()
        op_cost.kernel_times(tables, m, prefill(tokens), tokens, 1, False)
        q = m.num_heads * m.head_dim
        attn = {(q + 2 * m.num_kv_heads * m.head_dim, H), (H, q)}
        mlp_flops[m.mlp] = sum(2 * tokens * n * k for n, k in calls if (n, k) not in attn)
    assert mlp_flops["plain"] == pytest.approx(mlp_flops["gated"] * 2 / 3)
    assert calls == [(3 * H, H), (H, H), (INTER, H), (H, INTER)]  # qkv, o, fc1, fc2
    hw = HardwareSpec.from_dict(yaml.safe_load((CONF / "hardware" / "h200_ops.yaml").read_text()))
    assert op_cost.op_step_cost(prefill(tokens), OPT, hw)[0] < \
        op_cost.op_step_cost(prefill(tokens), GATED, hw)[0]


def test_mlp_is_checked_and_the_engines_refuse_a_plain_one():
    with pytest.raises(ValueError, match=r"model\.mlp must be one of gated, plain, got 'swiglu'"):
        dataclasses.replace(OPT, mlp="swiglu")
    msg = (r"model opt_13b: model\.mlp=plain \(a 2-matrix ReLU MLP, as OPT's\) is simulated "
           r"only: the real engine builds Llama's gated MLP only \(model\.mlp=gated\)")
    with pytest.raises(ValueError, match=msg):
        OPT.require_gated_mlp("the real engine")
    with pytest.raises(ValueError, match=r"model opt_13b: model\.mlp=plain .* a Hugging Face"):
        OPT.hf_config("bfloat16")
    GATED.require_gated_mlp("the real engine")  # a Llama shape passes


def test_a_real_run_of_a_plain_mlp_model_is_one_line(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "experiments.run", "backend=real",
                           "model=opt_13b", "workload=synthetic", "workload.num_prompts=2",
                           f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert err[-1].startswith("error: model opt_13b: model.mlp=plain"), proc.stderr[-2000:]
    assert "the real engine builds Llama's gated MLP only" in err[-1]
    assert "Traceback" not in proc.stderr
