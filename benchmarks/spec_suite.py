"""Speculative decoding on the real engine, for a GPU validation against the simulator.

    python benchmarks/spec_suite.py OUT_DIR [--rates inf,28] [--acceptance 0.6,0.8]
    python benchmarks/spec_suite.py OUT_DIR --backend sim     # the same runs, simulated

Llama-3-8B (random bf16 weights) with Llama-3.2-1B as the draft model on the same GPU, ShareGPT
(seed 1), all requests at t = 0 (rate inf) and Poisson arrivals near capacity; speculation off,
a fixed speculation length of 2 and of 4 (spec_fixed) and SmartSpec (up to 4), each under two
acceptance rates of the workload's acceptance process (workload.acceptance={rate: r}), so that
both backends apply the same accepted counts. smartspec prices its choices with
hardware=h200_calibrated (--hardware: another profile taken before the runs). Each run's directory goes under OUT_DIR/<spec>_acc<r>_rate<q>; a
short table last (the speculation-off run once per rate).
--smoke: the tiny model on the CPU drafting for itself, 16 short synthetic prompts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import real_backend  # noqa: E402,F401  (sets CUDA_MODULE_LOADING before CUDA starts)
from experiments.validate import run_one  # noqa: E402

# (name, the spec overrides): speculation off, fixed lengths, SmartSpec
SPECS = {
    "off": ["spec=off"],
    "k2": ["spec=spec_fixed", "spec.num_tokens=2"],
    "k4": ["spec=spec_fixed", "spec.num_tokens=4"],
    "smartspec": ["spec=smartspec", "spec.num_tokens=4"],
}


def overrides(spec: str, acceptance: str, rate: str, prompts: int, smoke: bool,
              backend: str = "real", hardware: str = "h200_calibrated") -> list[str]:
    model = ["model=tiny", "hardware=cpu", "workload=synthetic",
             "workload.lengths.dist=fixed", "workload.lengths.prompt_len=32",
             "workload.lengths.output_len=16"] if smoke else \
        ["model=llama3_8b", f"hardware={hardware}", "workload=sharegpt"]
    draft = [] if spec == "off" else \
        [f"spec.draft_model={'same' if smoke else 'llama3_2_1b'}",
         f"workload.acceptance={{rate: {acceptance}}}"]
    keep = ["backend.keep_runner=true"] if backend == "real" else []
    if backend == "real" and smoke:
        keep.append("backend.device=cpu")
    return [f"backend={backend}", "policy=single_step", *model, *SPECS[spec], *draft,
            f"workload.num_prompts={prompts}", f"workload.request_rate={rate}",
            "workload.seed=1", "progress=false", *keep]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--rates", default="inf,28", help="req/s, comma-separated (inf: t = 0)")
    ap.add_argument("--acceptance", default="0.6,0.8", help="acceptance rates, comma-separated")
    ap.add_argument("--specs", default=",".join(SPECS))
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--backend", default="real", choices=["real", "sim"])
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, 16 prompts")
    ap.add_argument("--hardware", default="h200_calibrated",
                    help="the profile smartspec prices its choices with (and, with --backend sim, "
                         "the simulated GPU): one taken before the runs")
    args = ap.parse_args(argv)
    out = Path(args.out)
    prompts = 16 if args.smoke else args.prompts
    table = [f"{'run':<30} {'req/s':>7} {'tok/s':>8} {'med TTFT':>9} {'med TPOT':>9} "
             f"{'acc len':>7} {'wall s':>6}"]
    for rate in args.rates.split(","):
        for spec in args.specs.split(","):
            for acc in (["-"] if spec == "off" else args.acceptance.split(",")):
                tag = f"{spec}_rate{rate}" if spec == "off" else f"{spec}_acc{acc}_rate{rate}"
                t0 = time.perf_counter()
                try:
                    res = run_one(overrides(spec, acc, rate, prompts, args.smoke, args.backend,
                                         args.hardware),
                                  out / tag)
                except SystemExit as err:  # run_one's InputError: one line, the rest go on
                    print(f"{tag}: failed: {getattr(err, 'message', err)}", flush=True)
                    continue
                s = res.get("schedlab", {})
                length = s.get("spec_decode_acceptance_length") or 1.0
                table.append(f"{tag:<30} {res['request_throughput']:7.2f} "
                             f"{res['output_throughput']:8.0f} {res['median_ttft_ms']:9.1f} "
                             f"{res['median_tpot_ms']:9.2f} {length:7.2f} "
                             f"{time.perf_counter() - t0:6.0f}")
                print(table[-1], flush=True)
    print("\n".join(table))


if __name__ == "__main__":
    main()
