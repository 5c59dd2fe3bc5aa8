"""How the GPU's clock and step times move with load: bursts of one window, recovery, served runs.

    python benchmarks/clock_probe.py OUT_DIR [--parts bursts,served] [--seconds S]

A thread samples the SM clock, power and temperature (NVML) every 10 ms while the script runs
hand-built windows (experiments.calibrate's Profiler) back to back: a large eager prefill, a
full decode window, a graph-replayed prefill, an offline-like mix; each burst is followed by
isolated probes of the same window at growing idle gaps. Then (``served``) the engine serves
ShareGPT offline and at 20 req/s with the sampler on. Writes clock.csv (the samples),
windows.csv (one row per timed window: phase, wall time, GPU time) and the served runs'
directories, and prints per-phase medians.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd  # noqa: E402

from real_backend.gpu_clock import ClockSampler  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--parts", default="bursts,served")
    ap.add_argument("--seconds", type=float, default=15.0, help="length of the long bursts")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sampler = ClockSampler()
    sampler.start()
    rows: list[dict] = []
    parts = args.parts.split(",")
    t_start = time.perf_counter()
    print(f"max SM clock {sampler.max_sm_mhz} MHz")
    if "bursts" in parts:
        import torch

        from experiments.calibrate import Profiler, load_conf
        from policies import Batch, ModelSpec

        spec = ModelSpec.from_dict(load_conf("model", "llama3_8b"))
        p = Profiler(spec, {"device": "cuda"}, 1)
        run = p.runner.run_window
        rid = iter(range(10**6))

        def window(kind: str) -> Batch:
            if kind == "prefill4k":
                return Batch([p.prefill_seq(next(rid), 1024, 0) for _ in range(4)], 1)
            if kind == "prefill400g":
                return Batch([p.prefill_seq(next(rid), 200, 0) for _ in range(2)], 1)
            if kind == "decode256":
                return Batch([p.decode_seq(next(rid), 500, 8) for _ in range(256)], 8)
            if kind == "decode8":
                return Batch([p.decode_seq(next(rid), 500, 8) for _ in range(8)], 8)
            raise ValueError(kind)

        def timed(phase: str, kind: str, batch: Batch) -> None:
            torch.cuda.synchronize()
            t = time.perf_counter()
            r = run(batch)
            rows.append({"phase": phase, "kind": kind, "t": t, "gpu_s": r.gpu_step_s[0],
                         "gpu_total_s": sum(r.gpu_step_s)})

        def burst(phase: str, kinds: list[str], seconds: float) -> None:
            batches = [(k, window(k)) for k in kinds]
            t_end = time.perf_counter() + seconds
            while time.perf_counter() < t_end:
                for k, b in batches:
                    timed(phase, k, b)
            recover(phase + "_recover", batches[0], [0.05, 0.1, 0.2, 0.5, 1, 2, 4])
            for _, b in batches:
                for s in b.seqs:
                    p.blocks.free(s.request)

        def recover(phase: str, kb, gaps: list[float]) -> None:
            for g in gaps:
                time.sleep(g)
                timed(f"{phase}_{g}", *kb)

        time.sleep(3)  # idle clocks
        s = args.seconds
        burst("prefill4k", ["prefill4k"], s)
        burst("decode256", ["decode256"], s / 2)
        burst("prefill400g", ["prefill400g"], s / 2)
        burst("decode8", ["decode8"], s / 4)
        burst("mix", ["prefill4k"] + ["decode256"] * 6, s)
        # prefills one at a time between decode windows, as at moderate load
        burst("interleaved400g", ["prefill400g", "decode256", "decode256"], s / 2)
        del p
        torch.cuda.empty_cache()
    if "served" in parts:
        from experiments.validate import run_one

        for tag, rate, n in (("offline_k8", "inf", 1000), ("poisson20_k8", "20", 300)):
            t0 = time.perf_counter()
            run_one(["backend=real", "policy=multi_step", "policy.num_steps=8",
                     "model=llama3_8b", "workload=sharegpt", f"workload.num_prompts={n}",
                     "workload.seed=1", f"workload.request_rate={rate}", "progress=false"],
                    out / tag)
            rows.append({"phase": f"served_{tag}", "kind": "run", "t": t0,
                         "gpu_s": time.perf_counter() - t0, "gpu_total_s": 0.0})
    sampler.stop()
    clock = sampler.frame()
    clock["t"] -= t_start
    w = pd.DataFrame(rows)
    w["t"] -= t_start
    clock.to_csv(out / "clock.csv", index=False)
    w.to_csv(out / "windows.csv", index=False)
    # summary: per phase, the window time at the start / middle / end and the clock there
    print(f"{'phase':<28} {'n':>5} {'first ms':>9} {'1s ms':>8} {'last ms':>8} {'MHz0':>6} {'MHzend':>6} {'W':>5}")
    for phase, g in w.groupby("phase", sort=False):
        t0, t1 = g.t.iloc[0], g.t.iloc[-1]
        c = clock[(clock.t >= t0) & (clock.t <= t1 + 0.02)]
        at1 = g[g.t >= t0 + 1.0]
        print(f"{phase:<28} {len(g):5d} {g.gpu_s.iloc[:3].median()*1e3:9.2f} "
              f"{(at1.gpu_s.iloc[:3].median() if len(at1) else float('nan'))*1e3:8.2f} "
              f"{g.gpu_s.iloc[-3:].median()*1e3:8.2f} "
              f"{(c.sm_mhz.iloc[:5].median() if len(c) else 0):6.0f} "
              f"{(c.sm_mhz.iloc[-5:].median() if len(c) else 0):6.0f} "
              f"{(c.power_w.median() if len(c) else 0):5.0f}")


if __name__ == "__main__":
    main()
