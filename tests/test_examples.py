"""examples/small_study.py runs its study end to end (three policies at two loads: the runs,
the aggregate table, the comparison and the figures), small, in a temporary directory."""

from __future__ import annotations

import runpy
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # six simulated runs, the tables and nine figures
def test_the_small_study_runs_compares_and_draws(tmp_path, capsys):
    example = runpy.run_path(str(ROOT / "examples" / "small_study.py"))
    made = example["main"]([str(tmp_path / "study"), "--num-prompts", "40"])
    policies, rates = example["POLICIES"], example["RATES"]
    assert len(made["runs"]) == len(policies) * len(rates)
    assert all((run / "result.json").is_file() for run in made["runs"])
    table = pd.read_csv(tmp_path / "study" / "runs" / "aggregate.csv")
    assert sorted(table["policy"]) == sorted(p for p in policies for _ in rates)
    assert (table["completed"] == 40).all()
    text = (tmp_path / "study" / "compare" / "compare.md").read_text()
    assert all(f"{p}_rate{max(rates)}" in text for p in policies)
    figures = {p.name for p in made["figures"]}
    assert {"goodput_vs_rate.png", "p99_ttft_vs_rate.png"} <= figures
    assert (tmp_path / "study" / "figures" / "goodput_vs_rate.png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "# Runs compared" in out and "figures: " in out
