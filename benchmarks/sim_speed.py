"""Benchmark: simulator wall time for 1000 ShareGPT prompts and for 100,000 synthetic requests.

Usage: python benchmarks/sim_speed.py [--big N]
Runs the main configuration (llama3_8b, h100_sxm, vllm_v0_5, all requests at t=0) through
experiments.run.run; the ShareGPT token-count cache is built first so it is not timed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.run import CONF_DIR, run


def timed(overrides: list[str]) -> tuple[float, dict]:
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = OmegaConf.to_container(compose("config", overrides=overrides + ["progress=false"]),
                                     resolve=True)
    with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(io.StringIO()):
        t0 = time.perf_counter()
        res = run(cfg, d)
        return time.perf_counter() - t0, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--big", type=int, default=100_000)
    args = ap.parse_args()
    timed(["workload.num_prompts=10"])  # builds the token-count cache
    cases = [("sharegpt 1000, multi_step k=8", ["policy=multi_step", "policy.num_steps=8"]),
             ("sharegpt 1000, single_step", ["policy=single_step"]),
             (f"synthetic {args.big}, multi_step k=8",
              ["workload=synthetic", f"workload.num_prompts={args.big}", "policy.num_steps=8"]),
             (f"synthetic {args.big}, single_step",
              ["workload=synthetic", f"workload.num_prompts={args.big}", "policy=single_step"])]
    print(f"{'case':<36}{'wall s':>8}{'sim s':>9}{'sim s / wall s':>16}")
    for name, ov in cases:
        wall, res = timed(ov)
        print(f"{name:<36}{wall:>8.2f}{res['duration']:>9.1f}"
              f"{res['schedlab']['simulated_seconds_per_wall_second']:>16.1f}")


if __name__ == "__main__":
    main()
