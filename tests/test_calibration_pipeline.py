"""CPU end to end: calibrate -> validate -> plot on the tiny model, files and finite errors."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import yaml

pytest.importorskip("torch")


def test_calibrate_validate_plot_on_cpu(tmp_path):
    from experiments import calibrate, plot, validate

    conf = tmp_path / "conf"
    out = calibrate.main(["--model", "tiny", "--device", "cpu", "--num-blocks", "256", "--quick",
                          "--reps", "2", "--conf-dir", str(conf), "--name", "cpu_calibrated",
                          "--overhead-name", "schedlab_cpu"])
    hw_file = conf / "hardware" / "cpu_calibrated.yaml"
    oh_file = conf / "overhead" / "schedlab_cpu.yaml"
    hw = yaml.safe_load(hw_file.read_text())
    oh = yaml.safe_load(oh_file.read_text())
    assert hw["name"] == "cpu_calibrated" and oh["name"] == "schedlab_cpu"
    for key, lo, hi in calibrate.FIT_KEYS:
        assert lo <= hw[key] <= hi and math.isfinite(hw[key])
    assert all(math.isfinite(v) for v in out["terms"]["median_abs_rel_error"])
    assert (conf / "calibration" / "cpu_calibrated.csv").exists()

    df = validate.main(["--model", "tiny", "--device", "cpu", "--hardware", str(hw_file),
                        "--overhead", str(oh_file), "--workload", "synthetic",
                        "--num-prompts", "6", "--rates", "inf,50",
                        "--policies", "single_step,multi_step:4", "--runs", str(tmp_path / "runs"),
                        "--out", str(tmp_path / "val"),
                        "--real-override", "backend.num_blocks=256"])
    assert len(df) > 0 and df["rel_error"].map(math.isfinite).all()
    assert set(df["policy"]) == {"single_step", "multi_step"}
    table = pd.read_csv(tmp_path / "val" / "validation.csv")
    assert len(table) == len(df)
    for name in ("validation.md", "validation_scatter.png", "validation_scatter.svg"):
        assert (tmp_path / "val" / name).stat().st_size > 0
    # the sim side ran on the measured engine's KV cache
    sim = pd.read_json(next((tmp_path / "runs" / "sim").rglob("result.json")), typ="series")
    assert sim["schedlab"]["num_blocks"] == 256
    made = plot.plot_table(tmp_path / "val" / "validation.csv", tmp_path / "figs")
    assert any(p.suffix == ".png" for p in made)
