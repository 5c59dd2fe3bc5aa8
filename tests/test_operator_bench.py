"""The GPU measurement scripts' CPU paths: benchmarks/operators.py's tables (tiny shapes),
h200_suite's models part, and the model shapes they measure."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from common.model_spec import ModelSpec
from simulator.hardware import HardwareSpec
from simulator.memory import blocks_per_engine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import operators  # noqa: E402

COLUMNS = {
    "gemm": {"op", "used_by", "M", "N", "K", "copies", "calls", "time_us", "launch_us",
             "tflops", "gbps", "sm_mhz"},
    "attention_prefill": {"num_heads", "num_kv_heads", "head_dim", "num_seqs", "query_len",
                          "cached_len", "num_tokens", "kv_tokens", "attn_pairs", "time_us",
                          "launch_us", "sm_mhz"},
    "attention_decode": {"num_heads", "num_kv_heads", "head_dim", "batch", "context",
                         "ctx_dist", "kv_tokens", "max_kv_tokens", "num_splits", "time_us",
                         "launch_us", "sm_mhz"},
    "per_layer_small": {"op", "tokens", "hidden_size", "intermediate_size", "num_heads",
                        "num_kv_heads", "head_dim", "vocab_size", "bytes", "time_us",
                        "launch_us", "sm_mhz"},
    "sampler": {"op", "num_sampled", "vocab_size", "time_us", "launch_us", "sm_mhz"},
    "graph": {"model", "num_layers", "mode", "tokens", "time_us", "host_us", "device_ops",
              "sm_mhz"},
}


def load(name: str) -> ModelSpec:
    return ModelSpec.from_dict(yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml")
                                              .read_text()))


def test_operators_smoke_writes_every_table(tmp_path, capsys):
    out = tmp_path / "ops"
    code = operators.main([str(out), "--smoke", "--reps", "2"])  # in this process: no imports
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "estimated time on an H200" in printed.out
    for table, cols in COLUMNS.items():
        df = pd.read_csv(out / f"{table}.csv")
        assert cols <= set(df.columns), (table, cols - set(df.columns))
        assert len(df) > 0 and (df["time_us"] > 0).all(), table
        meta = json.loads((out / f"{table}.meta.json").read_text())
        assert meta["table"] == table and meta["models"] == ["tiny"]
        assert {"gpu_name", "torch", "triton", "date_utc"} <= set(meta)
    gemm = pd.read_csv(out / "gemm.csv")
    tiny = load("tiny")
    assert set(zip(gemm["N"], gemm["K"])) == {
        (tiny.q_size + 2 * tiny.kv_size, tiny.hidden_size), (tiny.hidden_size, tiny.q_size),
        (2 * tiny.intermediate_size, tiny.hidden_size),
        (tiny.hidden_size, tiny.intermediate_size), (tiny.vocab_size, tiny.hidden_size)}
    sampler = pd.read_csv(out / "sampler.csv")
    assert {"greedy", "random", "advance_step", "logits_fp32"} <= set(sampler["op"])
    decode = pd.read_csv(out / "attention_decode.csv")
    assert set(decode["ctx_dist"]) == {"uniform", "ragged", "longest"}
    longest = decode[decode["ctx_dist"] == "longest"]  # one long sequence among short ones
    assert (longest["max_kv_tokens"] == longest["context"]).all()
    assert (longest["kv_tokens"] == longest["context"] + 16 * (longest["batch"] - 1)).all()
    graph = pd.read_csv(out / "graph.csv")  # the CPU has no graphs: the eager steps
    assert set(graph["mode"]) == {"decode_eager", "piecewise_eager"}
    assert sorted(set(graph["num_layers"])) == [1, 2]


@pytest.mark.parametrize("argv, message", [
    (["--models", "no_such_model"], "--models: no model 'no_such_model'"),
    (["--tables", "gemm,nope"], "--tables: unknown table 'nope'"),
    (["--reps", "0"], "--reps must be >= 1"),
    (["--budget-s", "-1"], "--budget-s must be > 0"),
])
def test_operators_bad_settings_are_one_line_errors(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        operators.main([str(tmp_path / "ops"), "--smoke", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_operators_refuses_a_table_of_an_earlier_run(tmp_path, capsys):
    (tmp_path / "gemm.csv").write_text("old\n")
    with pytest.raises(SystemExit) as exc:
        operators.main([str(tmp_path), "--smoke", "--tables", "gemm"])
    assert exc.value.code == 2
    assert "gemm.csv exists" in capsys.readouterr().err
    assert (tmp_path / "gemm.csv").read_text() == "old\n"


def test_operator_grid_covers_every_model_shape_and_fits_the_budget():
    specs = operators.load_models("all", smoke=False)
    names = {s.name for s in specs}
    assert {"llama3_2_1b", "llama3_2_3b", "llama3_8b", "llama2_13b"} <= names
    assert "tiny" not in names
    assert not names & {"opt_13b", "opt_66b", "opt_175b"}  # model.mlp: plain, simulated only
    shapes = operators.gemm_shapes(specs)
    for s in specs:  # every projection and LM head of every model has its row
        h = s.hidden_size
        for n, k in ((s.q_size + 2 * s.kv_size, h), (h, s.q_size),
                     (2 * s.intermediate_size, h), (h, s.intermediate_size)):
            assert s.name in shapes[("layer", n, k)]
        assert s.name in shapes[("lm_head", s.vocab_size, h)]
    heads = operators.head_shapes(specs)
    assert (40, 40, 128) in heads and (32, 8, 64) in heads  # MHA (13B) and 1B's head_dim 64
    grid = operators.full_grid()
    assert grid.gemm_m[0] == 1 and grid.gemm_m[-1] == 8192
    total = sum(operators.estimate(t, specs, grid, 5) for t in operators.TABLES)
    assert 60 < total < 330  # the whole run within ~6 minutes on an H200, as estimated
    thin = operators.thinned(grid)
    assert thin.gemm_m[0] == 1 and thin.gemm_m[-1] == 8192
    assert len(thin.gemm_m) < len(grid.gemm_m)


@pytest.mark.parametrize("name, params_b, layers, kv_heads, vocab, tied", [
    ("llama3_2_3b", 3.21, 28, 8, 128256, True),
    ("llama2_13b", 13.02, 40, 40, 32000, False),
])
def test_new_model_shapes_load_and_fit_one_h200(name, params_b, layers, kv_heads, vocab, tied):
    spec = load(name)
    assert spec.name == name and spec.num_layers == layers and spec.head_dim == 128
    assert spec.num_kv_heads == kv_heads and spec.vocab_size == vocab
    assert spec.tie_word_embeddings is tied
    assert spec.num_params / 1e9 == pytest.approx(params_b, abs=0.01)  # the releases' counts
    hw = HardwareSpec.from_dict(yaml.safe_load((ROOT / "conf/hardware/h200.yaml").read_text()))
    blocks = blocks_per_engine(spec, hw)  # raises where one max_model_len request does not fit
    assert blocks * 16 >= 100_000  # room for a served batch of ShareGPT requests


def test_llama2_13b_sharegpt_ids_fit_its_vocabulary():
    """No Llama-2 tokenizer offline: the Llama-3 one gives lengths, and the ids the real
    backend gets are folded below the 32k vocabulary."""
    from experiments.workload import build_workload

    spec = load("llama2_13b")
    cfg = yaml.safe_load((ROOT / "conf/workload/sharegpt.yaml").read_text())
    cfg.update(num_prompts=20, seed=0)
    reqs = build_workload(cfg, vocab_size=spec.vocab_size, max_model_len=spec.max_model_len)
    ids = [t for r in reqs for t in r.prompt_token_ids]
    assert max(ids) < spec.vocab_size and min(ids) >= 0
    assert max(ids) > 20000  # folded, not clipped: the ids still spread over the vocabulary


@pytest.mark.slow
def test_suite_models_part_writes_runs_validate_reads(tmp_path, capsys):
    import h200_suite  # benchmarks/h200_suite.py, run in this process: no second import of torch

    from experiments.measured import measured_from_dir

    out = tmp_path / "suite"
    # --rates poisson alone needs an earlier t=0 run in OUT_DIR
    with pytest.raises(SystemExit) as exc:
        h200_suite.main([str(out), "--smoke", "--model", "tiny", "--parts", "models",
                         "--rates", "poisson"])
    assert exc.value.code == 2 and "--rates poisson needs" in capsys.readouterr().err
    h200_suite.main([str(out), "--smoke", "--model", "tiny", "--parts", "models,synthetic",
                     "--prompts", "3", "--extra", "workload.fixed_output_len=3"])
    printed = capsys.readouterr()
    assert "estimated on an H200" in printed.out and "FAILED" not in printed.out, \
        printed.err[-3000:]
    base = out / "models" / "tiny"
    thr = json.loads((base / "t0/single_step_k1/result.json").read_text())["request_throughput"]
    rate = max(1, round(0.6 * thr))
    measured = measured_from_dir(base)
    assert set(measured) == {(p, k, r) for p, k in (("single_step", None), ("multi_step", 8),
                                                    ("cp1", 8))
                             for r in (math.inf, float(rate))}
    assert all(m["num_prompts"] == 3 for m in measured.values())
    served = pd.read_csv(base / "served_synthetic.csv")
    assert {"served", "served_step"} <= set(served["kind"])
    assert (base / "served_synthetic.timeline.csv").exists()
