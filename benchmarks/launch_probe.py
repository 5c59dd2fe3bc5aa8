"""Eager windows served against microbenchmarked: which calibration protocol reproduces them (GPU).

    python benchmarks/launch_probe.py OUT_DIR [--smoke]

1. A served cp1 k=8 run (ShareGPT, all at t=0): its mixed windows' launch and GPU times.
2. Mixed windows in isolation under three protocols: the same shape repeated (the old
   calibration), a fresh shape every repetition, and fresh shapes after a full decode window and
   a real schedule() + update() over 256 requests (as served).
3. Eager prefills at round and odd token counts (does cuBLAS favour round ones?), up to 8192.
4. Decode windows of 256 alone, and right after a 4096-token prefill.
5. cProfile of one eager mixed step's launch: where its CPU time goes.
A short table is printed last.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

import real_backend  # noqa: E402,F401  (sets CUDA_MODULE_LOADING before CUDA starts)
from experiments.validate import run_one  # noqa: E402
from policies import Batch  # noqa: E402

TABLE: list[str] = []


def _cp1_overrides(model: list[str], prompts: int) -> list[str]:
    return ["backend=real", "policy=cp1", "policy.num_steps=8", *model, "workload=sharegpt",
            f"workload.num_prompts={prompts}", "workload.seed=0", "workload.request_rate=inf",
            "progress=false"]


def _mixed(steps: pd.DataFrame) -> pd.DataFrame:
    """The windows whose step 1 holds both prefill chunks and decodes."""
    return steps[(steps.num_prefill_seqs > 0) & (steps.num_prefill_seqs < steps.num_seqs)]


def served(out: Path, model: list[str], prompts: int) -> None:
    res = run_one(_cp1_overrides(model, prompts), out / "served_cp1")
    TABLE.append(f"served cp1: req/s {res['request_throughput']:.2f}")
    mixed = _mixed(pd.read_csv(out / "served_cp1" / "steps.csv"))
    for lo, hi in ((1, 384), (385, 768), (769, 1536), (1537, 1 << 20)):
        m = mixed[(mixed.num_tokens >= lo) & (mixed.num_tokens <= hi)]
        if len(m):
            TABLE.append(f"served mixed {lo}-{hi} tok: n={len(m)} seqs med "
                         f"{m.num_seqs.median():.0f} gpu med {m.gpu_s.median()*1e3:.2f} "
                         f"launch med {m.launch_s.median()*1e3:.2f} "
                         f"prep med {m.prepare_s.median()*1e3:.2f} ms")


def served_profiled(out: Path, model: list[str], prompts: int) -> None:
    """The whole served cp1 run under cProfile, with the CUDA allocator's counters."""
    import torch

    before = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    prof = cProfile.Profile()
    prof.enable()
    run_one(_cp1_overrides(model, prompts), out / "served_cp1_profiled")
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    print("==== cProfile of a served cp1 run")
    print(buf.getvalue())
    after = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    for key in ("num_alloc_retries", "num_device_alloc", "num_device_free",
                "num_sync_all_streams", "num_ooms"):
        TABLE.append(f"allocator {key}: {after.get(key, 0) - before.get(key, 0)}")
    st = pd.read_csv(out / "served_cp1_profiled" / "steps.csv")
    m = _mixed(st)
    pre = st[(st.num_prefill_seqs > 0) & (st.num_prefill_seqs == st.num_seqs)]
    TABLE.append(f"profiled served cp1: duration {st.t_start.iloc[-1]:.2f} s; mixed n={len(m)} "
                 f"launch med {m.launch_s.median()*1e3:.2f} mean {m.launch_s.mean()*1e3:.2f} "
                 f"ms, blocked (launch > 0.9 gpu) {int((m.launch_s > 0.9 * m.gpu_s).sum())}; "
                 f"prefill-only n={len(pre)} launch med {pre.launch_s.median()*1e3:.2f} ms")


def isolated(model: str, device: str, reps: int) -> None:
    import torch
    import yaml

    from experiments.calibrate import Profiler, decoding_scheduler
    from experiments.run import CONF_DIR
    from policies import ModelSpec

    spec = ModelSpec.from_dict(yaml.safe_load(open(Path(CONF_DIR) / "model" / f"{model}.yaml")))
    p = Profiler(spec, {"device": device}, reps=reps, sustain_s=0.4 if device == "cuda" else 0)
    runner, rng = p.runner, np.random.default_rng(1)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rid = [0]

    def new_id() -> int:
        rid[0] += 1
        return rid[0]

    def mixed(d: int, q: int) -> list:
        return ([p.decode_seq(new_id(), int(c), 1) for c in rng.integers(32, 1200, d)]
                + [p.prefill_seq(new_id(), q, 0)])

    def free(seqs: list) -> None:
        for s in seqs:
            p.blocks.free(s.request)

    sched = decoding_scheduler(256, 8)
    big = [p.decode_seq(new_id(), int(c), 8) for c in rng.integers(32, 1200, 256)]
    big_batch = Batch(big, 8)
    now = [0.0]

    def served_like() -> None:
        runner.run_window(big_batch)
        b = sched.schedule(now[0])
        sched.update(b, [now[0] + j for j in range(b.num_steps)])
        now[0] += 8

    def timed(batch: Batch) -> tuple[float, float]:
        sync()
        out = runner.run_window(batch)
        return out.gpu_step_s[0] if cuda else 0.0, out.launch_s

    for d, q in ((32, 128), (128, 256), (256, 512), (200, 1024)):
        res = {}
        seqs = mixed(d, q)
        batch = Batch(seqs, 1)
        runner.run_window(batch)
        t_end = time.perf_counter() + p.sustain_s
        while time.perf_counter() < t_end:
            runner.run_window(batch)
        res["repeat"] = [timed(batch) for _ in range(reps)]
        free(seqs)
        for tag, before in (("fresh", None), ("fresh+served", served_like)):
            got = []
            for _ in range(reps):
                dd = max(1, int(d * rng.uniform(0.9, 1.1)))
                qq = max(2, int(q * rng.uniform(0.9, 1.1)))
                seqs = mixed(dd, qq)
                if before:
                    before()
                else:
                    runner.run_window(p.between)
                got.append(timed(Batch(seqs, 1)))
                free(seqs)
            res[tag] = got
        for tag, got in res.items():
            g = statistics.median(x[0] for x in got) * 1e3
            lc = statistics.median(x[1] for x in got) * 1e3
            TABLE.append(f"mixed d{d} q{q} {tag:<13}: gpu med {g:.2f} launch med {lc:.2f} ms")

    for q in (2048, 2039, 4096, 4093, 3911, 6000, 8192, 7777):
        got = []
        for _ in range(3):
            seqs = [p.prefill_seq(new_id(), q, 0)]
            runner.run_window(p.between)
            got.append(timed(Batch(seqs, 1))[0])
            free(seqs)
        g = statistics.median(got)
        TABLE.append(f"prefill {q} tok: gpu med {g*1e3:.2f} ms, {g/q*1e6:.2f} us/token")

    pre = [p.prefill_seq(new_id(), 4096, 0)]
    for tag, heat in (("alone", False), ("after 4096 prefill", True)):
        got = []
        for _ in range(reps):
            if heat:
                runner.run_window(Batch(pre, 1))
            sync()
            got.append(statistics.median(runner.run_window(big_batch).gpu_step_s) if cuda else 0.0)
        TABLE.append(f"decode b256 k8 {tag}: gpu/step med {statistics.median(got)*1e3:.3f} ms")
    free(pre)

    seqs = mixed(256, 512)
    batch = Batch(seqs, 1)
    runner.run_window(batch)
    sync()
    prof = cProfile.Profile()
    prof.enable()
    runner.run_window(batch)
    prof.disable()
    sync()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    print("==== cProfile of one eager mixed window (256 decodes + 512 prefill)")
    print(buf.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--profiled", action="store_true", help="only the served run, under cProfile")
    args = ap.parse_args()
    out = Path(args.out)
    if args.smoke:
        model = ["model=tiny", "backend.device=cpu", "backend.num_blocks=2048"]
        device, reps = "cpu", 2
    else:
        import os

        import torch
        from h200_suite import sustained_load  # this script's directory is on sys.path

        t0 = time.perf_counter()
        torch.ones(1, device="cuda") @ torch.ones(1, 1, device="cuda")
        free, total = torch.cuda.mem_get_info()
        TABLE.append(f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING')}: context in "
                     f"{time.perf_counter() - t0:.1f} s, {(total - free) / 2**30:.2f} GiB used")
        model, device, reps = ["model=llama3_8b"], "cuda", 8
        sustained_load(10)
    if args.profiled:
        served_profiled(out, model, args.prompts)
        print("\n".join(TABLE))
        return
    for part in (lambda: served(out, model, args.prompts),
                 lambda: isolated("tiny" if args.smoke else "llama3_8b", device, reps)):
        try:
            part()
        except Exception:
            traceback.print_exc()
            TABLE.append("FAILED")
    print("\n".join(TABLE))


if __name__ == "__main__":
    main()
