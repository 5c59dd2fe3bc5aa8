"""The overlap path's CPU cost: fitted from paired windows formed without and with overlap."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from experiments.fit_cpu import fit_overlap, overlap_pairs


def _steps(n: int, extra_us: float, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"k": 1, "num_seqs": np.arange(1, n + 1), "num_tokens": np.arange(1, n + 1),
                         "kv_tokens": 100 * np.arange(1, n + 1),
                         "schedule_s": 50e-6 + rng.normal(0, 5e-6, n),
                         "prepare_s": 400e-6 + extra_us * 1e-6 + rng.normal(0, 20e-6, n),
                         "launch_s": 200e-6 + np.zeros(n)})


def test_overlap_cost_is_the_median_extra_cpu_time_of_the_same_windows():
    pairs = overlap_pairs(_steps(501, 0.0, 1), _steps(501, 300.0, 2))
    assert len(pairs) == 501
    assert fit_overlap(pairs) == pytest.approx(300.0, abs=5.0)
    assert fit_overlap(overlap_pairs(_steps(50, 0.0, 1), _steps(50, 0.0, 1))) == 0.0
    assert fit_overlap(pd.DataFrame()) == 0.0


def test_runs_with_other_windows_are_refused():
    other = _steps(501, 300.0, 2)
    other.loc[7, "num_seqs"] += 1
    with pytest.raises(ValueError, match="other windows"):
        overlap_pairs(_steps(501, 0.0, 1), other)


def test_committed_pairs_give_the_committed_cost():
    import yaml

    from common.paths import conf_dir

    pairs = pd.read_csv(conf_dir() / "calibration" / "h200_calibrated.overlap.csv")
    committed = yaml.safe_load((conf_dir() / "overhead" / "schedlab_h200.yaml").read_text())
    assert fit_overlap(pairs) == pytest.approx(committed["schedule_overlap_us"], rel=1e-9)
