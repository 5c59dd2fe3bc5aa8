"""Where a served run's window time goes, against the same windows in isolation (GPU).

    python benchmarks/window_probe.py OUT_DIR [--smoke]

1. Sustained load for ~20 s so the GPU runs at its steady clocks.
2. Served runs (ShareGPT, Poisson): multi_step k=1 at 40 req/s, with and without gc.freeze.
3. The same window shapes measured in isolation (the calibration's Profiler), and a prefill
   of one ~200-token prompt right after decode graph replays.
4. Kernel time of decode steps (batch 1 and 256) and a small prefill under torch.profiler.
A short table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from experiments.validate import run_one  # noqa: E402

TABLE: list[str] = []


def clocks(tag: str) -> None:
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
        TABLE.append(f"clocks {tag}: {q.stdout.strip()}")
    except Exception as err:  # noqa: BLE001
        TABLE.append(f"clocks {tag}: {err}")


def warm(seconds: float) -> None:
    from h200_suite import sustained_load  # this script's directory is on sys.path

    sustained_load(seconds)
    clocks("after warm-up")


def summarize(tag: str, steps: pd.DataFrame) -> None:
    pre = steps[(steps.num_prefill_seqs > 0) & (steps.num_seqs == steps.num_prefill_seqs)]
    dec = steps[steps.num_prefill_seqs == 0]
    for lo, hi in ((1, 256), (257, 1024), (1025, 1 << 20)):
        p = pre[(pre.num_tokens >= lo) & (pre.num_tokens <= hi)]
        if len(p):
            TABLE.append(f"{tag} prefill {lo}-{hi} tok: n={len(p)} gpu mean {p.gpu_s.mean()*1e3:.2f} "
                         f"med {p.gpu_s.median()*1e3:.2f} launch med {p.launch_s.median()*1e3:.2f} "
                         f"prep med {p.prepare_s.median()*1e3:.2f} ms; max gpu {p.gpu_s.max()*1e3:.1f}")
    for lo, hi in ((1, 16), (17, 48), (49, 128), (129, 256)):
        d = dec[(dec.num_seqs >= lo) & (dec.num_seqs <= hi)]
        if len(d):
            per = d.gpu_s / d.k
            TABLE.append(f"{tag} decode b{lo}-{hi}: n={len(d)} gpu/step med {per.median()*1e3:.2f} "
                         f"mean {per.mean()*1e3:.2f} launch med {d.launch_s.median()*1e3:.3f} ms")
    t_end = steps.t_start + steps.schedule_s + steps.prepare_s + steps.gpu_s
    gaps = steps.t_start.shift(-1) - t_end
    TABLE.append(f"{tag} windows {len(steps)} gpu sum {steps.gpu_s.sum():.2f} s, "
                 f"other (sched+prep+gaps) {gaps.clip(lower=0).sum() + steps.schedule_s.sum() + steps.prepare_s.sum():.2f} s, "
                 f"last t {t_end.iloc[-1]:.2f}")


def served(out: Path, prompts: int, model: list[str]) -> None:
    for tag, freeze in (("nofreeze", False), ("freeze", True)):
        orig = gc.freeze
        if not freeze:
            gc.freeze = lambda: None
        try:
            ov = ["backend=real", "policy=multi_step", "policy.num_steps=1", *model,
                  "workload=sharegpt", f"workload.num_prompts={prompts}", "workload.seed=1",
                  "workload.request_rate=40", "progress=false"]
            res = run_one(ov, out / f"served_{tag}")
            TABLE.append(f"{tag}: req/s {res['request_throughput']:.2f} medTTFT "
                         f"{res['median_ttft_ms']:.2f} medTPOT {res['median_tpot_ms']:.2f}")
            summarize(tag, pd.read_csv(out / f"served_{tag}" / "steps.csv"))
        except Exception:
            traceback.print_exc()
            TABLE.append(f"{tag} FAILED")
        finally:
            gc.freeze = orig


def isolated(model: str, device: str) -> None:
    import yaml

    from experiments.calibrate import Profiler
    from experiments.run import CONF_DIR
    from policies import ModelSpec

    spec = ModelSpec.from_dict(yaml.safe_load(open(Path(CONF_DIR) / "model" / f"{model}.yaml")))
    p = Profiler(spec, {"device": device}, reps=10)
    cuda = device == "cuda"
    rid = 0
    for n, q in ((1, 200), (2, 200), (1, 600), (4, 256)):
        p.measure("prefill", [p.prefill_seq(rid + i, q, 0) for i in range(n)], 1)
        rid += n
    for b in (1, 32, 64, 128):
        p.measure("decode", [p.decode_seq(rid + i, 400, 1) for i in range(b)], 1)
        rid += b
    for r in p.rows:
        TABLE.append(f"isolated {r['kind']} seqs {r['num_seqs']} tok {r['num_tokens']}: "
                     f"gpu {r['gpu_s']*1e3:.2f} ms")
    # A prefill right after decode graph replays (as in a served run), fresh shapes each time.
    runner = p.runner
    from policies import Batch
    dec = [p.decode_seq(rid + i, 400, 1) for i in range(32)]
    rid += 32
    gpu, launch = [], []
    for rep in range(12):
        for _ in range(3):
            runner.run_window(Batch(dec, 1))
        pre = [p.prefill_seq(rid, 190 + 7 * rep, 0)]
        rid += 1
        out = runner.run_window(Batch(pre, 1))
        p.blocks.free(pre[0].request)
        gpu.append(out.gpu_step_s[0])
        launch.append(out.launch_s)
    s = pd.Series(gpu) * 1e3
    TABLE.append(f"after-decode prefill ~200 tok fresh shapes: gpu med {s.median():.2f} mean "
                 f"{s.mean():.2f} max {s.max():.2f} ms; launch med {pd.Series(launch).median()*1e3:.2f} ms")
    if not cuda:
        return
    from torch.profiler import ProfilerActivity, profile
    for tag, seqs in (("decode b1", [p.decode_seq(rid, 500, 4)]),
                      ("decode b256", [p.decode_seq(rid + 1 + i, 500, 4) for i in range(256)]),
                      ("prefill 1x200", [p.prefill_seq(rid + 300, 200, 0)])):
        batch = Batch(seqs, seqs[0].num_steps)
        runner.run_window(batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            runner.run_window(batch)
            torch.cuda.synchronize()
        print(f"==== {tag}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
        rid += 400


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--prompts", type=int, default=300)
    args = ap.parse_args()
    out = Path(args.out)
    if args.smoke:
        model, device = ["model=tiny", "backend.device=cpu", "backend.num_blocks=2048"], "cpu"
    else:
        model, device = ["model=llama3_8b"], "cuda"
        clocks("start")
        warm(20)
    served(out, args.prompts, model)
    if not args.smoke:
        clocks("after served")
    try:
        isolated("tiny" if args.smoke else "llama3_8b", device)
    except Exception:
        traceback.print_exc()
        TABLE.append("isolated FAILED")
    print("\n".join(TABLE))


if __name__ == "__main__":
    main()
