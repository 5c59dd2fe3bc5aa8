"""A small study, end to end: three policies at two loads, compared side by side and drawn.

Scenario: Llama-3-8B on one H100 (the simulator), NUM_PROMPTS synthetic requests sent as a
Poisson stream at each of RATES req/s, under each of POLICIES; a request meets its target when
its TTFT is within TTFT_TARGET_MS. Each run is what ``python -m experiments.run`` does with the
same overrides (here from Python, as a notebook would), the table is experiments.aggregate's,
the comparison experiments.compare's (at the higher load, the first policy the baseline) and
the figures experiments.plot's (goodput and p99 TTFT against the load, a line per policy).

    python examples/small_study.py study     # writes study/: runs, tables, figures
"""

from __future__ import annotations

import argparse
from pathlib import Path

POLICIES = ("single_step", "multi_step", "cp1")
RATES = (10, 40)  # requests per second
NUM_PROMPTS = 200
TTFT_TARGET_MS = 500
SETTINGS = ["workload=synthetic", "model=llama3_8b", "hardware=h100_sxm", "progress=false",
            f"goodput.ttft_ms={TTFT_TARGET_MS}"]


def run_policy(out: Path, policy: str, rate: float, num_prompts: int) -> Path:
    """One run, as ``python -m experiments.run policy=... workload.request_rate=...``."""
    from hydra import compose, initialize_config_dir

    from common.paths import conf_dir
    from experiments.run import run

    overrides = [*SETTINGS, f"policy={policy}", f"workload.request_rate={rate}",
                 f"workload.num_prompts={num_prompts}"]
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose("config", overrides=overrides)
    run_dir = out / "runs" / f"{policy}_rate{rate}"
    run(cfg, run_dir, sweep_label=f"{policy} at {rate} req/s")  # one line per run
    return run_dir


def study(out: Path, num_prompts: int = NUM_PROMPTS) -> dict[str, list[Path]]:
    """Every run, then the table (out/runs/aggregate.csv), the comparison (out/compare/) and
    the figures (out/figures/); the files each step wrote."""
    from experiments.aggregate import aggregate
    from experiments.compare import compare
    from experiments.plot import plot_table

    runs = {(p, r): run_policy(out, p, r, num_prompts) for p in POLICIES for r in RATES}
    aggregate(out / "runs")  # runs/aggregate.csv and .parquet: one row per run
    _, text, compared = compare([runs[p, max(RATES)] for p in POLICIES], out / "compare")
    print(text, end="")
    figures = plot_table(out / "runs" / "aggregate.csv", out / "figures")
    return {"runs": list(runs.values()), "compare": compared, "figures": figures}


def main(argv: list[str] | None = None) -> dict[str, list[Path]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="study", help="directory of the study (default "
                    "study/)")
    ap.add_argument("--num-prompts", type=int, default=NUM_PROMPTS,
                    help=f"requests per run (default {NUM_PROMPTS})")
    args = ap.parse_args(argv)
    made = study(Path(args.out), args.num_prompts)
    print("figures:", ", ".join(str(p) for p in made["figures"]))
    return made


if __name__ == "__main__":
    main()
