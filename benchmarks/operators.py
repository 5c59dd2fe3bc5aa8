"""GPU operator microbenchmarks over the shapes of every conf/model: the engine's GEMMs, paged
attention, small per-layer kernels, sampler and CUDA-graph replays, as CSV tables from which a
GPU profile that does not depend on the model is fitted.

    python benchmarks/operators.py OUT_DIR [--models all|NAME,...] [--tables NAME,...]
                                   [--reps 5] [--budget-s 330] [--smoke]

Tables (OUT_DIR/<table>.csv, each beside <table>.meta.json: GPU, versions, date, SM clock):
  gemm               F.linear over M = tokens in a step (1..8192) x every (N, K) of the models'
                     fused qkv, o_proj, fused gate_up and down; the LM head over M <= 512
  attention_prefill  the engine's paged prefill attention: each model's (heads, KV heads,
                     head_dim) x sequences x query length x cached prefix
  attention_decode   paged decode attention: head shapes x batch x context (uniform, ragged),
                     and one long sequence among short ones (the program that reads it)
  per_layer_small    RMSNorm with its residual add, RoPE, SiLU-and-mul, KV slot write, the
                     piecewise steps' attention copy and the embedding, over tokens x sizes
  sampler            logits to fp32, greedy and random sampling over num_sampled x vocab;
                     advance_step over batch sizes
  graph              a decode step (batch 1) and a 32-token piecewise step of truncated copies
                     of each model (1..40 layers): graph replay against eager launches

Every op is the engine's own code path (real_backend.kernels' Triton set on cuda in bf16; with
--smoke the torch reference ops in fp32 on the CPU over tiny shapes). KV caches use the
engine's block size 16 and scattered block tables, as a served cache has. op_timing.py says how
a point is timed. The run's estimated time is printed first; --budget-s thins the grids until
the estimate fits. A table that already exists in OUT_DIR is refused (results never mix runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn

import pandas as pd
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from op_graph import graph_layers, graph_model_spec, graph_table  # noqa: E402
from op_grid import Grid  # noqa: E402
from op_kernels import (  # noqa: E402
    decode_table,
    gemm_shapes,
    gemm_table,
    head_shapes,
    prefill_table,
    release,
    roofline_us,
    sampler_table,
    small_shapes,
    small_table,
)
from op_timing import Bench, clock_of_spans, environment  # noqa: E402

from common.model_spec import ModelSpec  # noqa: E402
from experiments.files import write_text_atomic  # noqa: E402
from real_backend.kernels import Kernels, select_kernels  # noqa: E402

MODEL_DIR = Path(__file__).resolve().parents[1] / "conf" / "model"
TABLES = ("gemm", "attention_prefill", "attention_decode", "per_layer_small", "sampler", "graph")
# seconds per point beyond its GPU time (capture, events, Python), and per Triton compilation
# (fitted to a first H200 run: Triton's launcher, not the GPU, sets the small tables' pace)
EST_POINT_S = {"gemm": 0.015, "attention_prefill": 0.02, "attention_decode": 0.012,
               "per_layer_small": 0.08, "sampler": 0.015}
EST_COMPILE_S = 0.8


class InputError(Exception):
    """A bad setting: printed as one line, exit code 2."""


def full_grid() -> Grid:
    return Grid(
        gemm_m=[1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768,
                1024, 1280, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192],
        lm_head_m=[1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 384, 512],
        decode_batches=[1, 2, 4, 8, 16, 32, 64, 128, 192, 256],
        decode_contexts=[128, 512, 1024, 2048, 4096],
        longest_batches=[4, 8, 16, 32, 64, 256], longest_contexts=[512, 1024, 2048, 4096, 8192],
        prefill=[(1, q, 0) for q in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)]
        + [(1, 512, 512), (1, 512, 2048), (1, 2048, 2048), (1, 128, 1024), (4, 512, 1024)]
        + [(2, 256, 0), (4, 128, 0), (4, 512, 0), (8, 64, 0), (8, 256, 0), (8, 512, 0),
           (16, 128, 0), (16, 256, 0), (32, 64, 0), (4, 1024, 0), (2, 2048, 0)],
        small_tokens=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192],
        sampled=[1, 2, 4, 8, 16, 32, 64, 128, 256],
        graph_layers=[1, 2, 4, 8, 16, 32, 40], graph_context=128, piece_tokens=32)


def smoke_grid() -> Grid:
    return Grid(gemm_m=[1, 4, 16], lm_head_m=[1, 4], decode_batches=[1, 4],
                decode_contexts=[16, 40], longest_batches=[4], longest_contexts=[40],
                prefill=[(1, 8, 0), (2, 5, 16)], small_tokens=[1, 8],
                sampled=[1, 4], graph_layers=[1, 2], graph_context=20, piece_tokens=32)


def thin(values: list) -> list:
    """Every other value, the first and last kept."""
    if len(values) <= 3:
        return values
    kept = values[::2]
    return kept if kept[-1] == values[-1] else kept + [values[-1]]


def thinned(grid: Grid) -> Grid:
    return dataclasses.replace(
        grid, gemm_m=thin(grid.gemm_m), lm_head_m=thin(grid.lm_head_m),
        decode_batches=thin(grid.decode_batches), longest_batches=thin(grid.longest_batches),
        prefill=thin(grid.prefill),
        small_tokens=thin(grid.small_tokens), sampled=thin(grid.sampled),
        graph_layers=thin(grid.graph_layers))

# ---------------------------------------------------------------------------- model shapes
def load_models(names: str, smoke: bool) -> list[ModelSpec]:
    """``all``: every conf/model entry the engine runs (Llama's gated MLP: OPT's plain one is
    simulated only) but the CPU test model (``tiny``, which --smoke uses)."""
    every = sorted(p.stem for p in MODEL_DIR.glob("*.yaml"))
    if names == "all":
        chosen = ["tiny"] if smoke else [n for n in every if n != "tiny"]
    else:
        chosen = [n for n in names.split(",") if n]
    if not chosen:
        raise InputError("--models: no model named")
    specs = []
    for name in chosen:
        path = MODEL_DIR / f"{name}.yaml"
        if not path.is_file():
            raise InputError(f"--models: no model {name!r} in {MODEL_DIR} "
                             f"(there: {', '.join(every)})")
        try:
            specs.append(ModelSpec.from_dict(yaml.safe_load(path.read_text())))
        except (ValueError, TypeError, yaml.YAMLError) as err:
            raise InputError(f"--models: {path}: {err}") from None
    if names == "all":
        specs = [s for s in specs if s.mlp == "gated"]
    return specs


# ---------------------------------------------------------------------------- estimates
def _point_s(table: str, est_us: float, reps: int) -> float:
    calls = min(256, max(1, math.ceil(200.0 / est_us)))
    return EST_POINT_S[table] + (2 + calls * (reps + 1) + min(calls, 10)) * est_us * 1e-6


def estimate(table: str, specs: list[ModelSpec], grid: Grid, reps: int) -> float:
    """Seconds the table takes on an H200 (a rough model of the run: GPU time, per-point
    overhead, Triton compilations)."""
    total = 0.0
    if table == "gemm":
        for (kind, n, k) in gemm_shapes(specs):
            for m in grid.lm_head_m if kind == "lm_head" else grid.gemm_m:
                total += _point_s(table, roofline_us(2 * m * n * k, 2 * (n * k + m * k + m * n)),
                                  reps)
    elif table == "attention_decode":
        for (h, kvh, d) in head_shapes(specs):
            total += 6 * EST_COMPILE_S  # one kernel per count of key splits
            for b, c in itertools.product(grid.decode_batches, grid.decode_contexts):
                est = roofline_us(4 * b * c * h * d, 4 * b * c * kvh * d)
                total += _point_s(table, est, reps) * (2 if b >= 4 else 1)
            for c in grid.longest_contexts * len(grid.longest_batches):
                total += _point_s(table, roofline_us(4 * c * h * d, 4 * c * kvh * d), reps)
    elif table == "attention_prefill":
        for (h, kvh, d) in head_shapes(specs):
            total += EST_COMPILE_S
            for n, q, cached in grid.prefill:
                pairs = n * (q * cached + q * (q + 1) / 2)
                est = roofline_us(4 * pairs * h * d / 0.5, 4 * n * (q + cached) * kvh * d)
                total += _point_s(table, est, reps)
    elif table == "per_layer_small":
        dims = len(small_shapes(specs))
        total += dims * EST_COMPILE_S
        for _ in range(dims):
            for t in grid.small_tokens:
                total += _point_s(table, roofline_us(0, 6 * t * 8192), reps)
    elif table == "sampler":
        vocabs = {s.vocab_size for s in specs}
        total += 2 * EST_COMPILE_S
        for v in vocabs:
            for m in grid.sampled:
                total += sum(_point_s(table, roofline_us(0, f * m * v * 4), reps)
                             for f in (1.5, 1, 6))
        total += len(grid.sampled) * _point_s(table, 3.0, reps)
    elif table == "graph":
        for s in specs:
            layers = graph_layers(s, grid)
            weights = graph_model_spec(s, max(layers)).weight_bytes
            total += 2.0 + weights / 20e9  # random init, profiles of kernel counts
            total += sum(0.25 + 0.02 * n for n in layers)  # (and the queued decode graph)
    return total

# ---------------------------------------------------------------------------- the run
@torch.inference_mode()  # as the engine runs (its buffers are inference tensors)
def run_table(name: str, bench: Bench, specs: list[ModelSpec], grid: Grid,
              kernels: Kernels) -> pd.DataFrame:
    bench.start_clock()
    try:
        if name == "gemm":
            rows, spans = gemm_table(bench, specs, grid)
        elif name == "attention_decode":
            rows, spans = decode_table(bench, specs, grid, kernels)
        elif name == "attention_prefill":
            rows, spans = prefill_table(bench, specs, grid, kernels)
        elif name == "per_layer_small":
            rows, spans = small_table(bench, specs, grid, kernels)
        elif name == "sampler":
            rows, spans = sampler_table(bench, specs, grid, kernels)
        else:
            rows, spans = graph_table(bench, specs, grid)
    finally:
        clock = bench.stop_clock()
    df = pd.DataFrame(rows)
    df["sm_mhz"] = clock_of_spans(clock, spans)
    return df


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="directory of the tables")
    ap.add_argument("--models", default="all", help="'all' or comma-separated conf/model names")
    ap.add_argument("--tables", default=",".join(TABLES), help="comma-separated tables")
    ap.add_argument("--reps", type=int, default=5, help="timed replays per point (median)")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="thin the grids until the estimated run time fits (seconds)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        specs = load_models(args.models, args.smoke)
        tables = [t for t in args.tables.split(",") if t]
        unknown = [t for t in tables if t not in TABLES]
        if unknown or not tables:
            raise InputError(f"--tables: unknown table {unknown[0] if unknown else '(none)'!r} "
                             f"(tables: {', '.join(TABLES)})")
        if args.reps < 1:
            raise InputError(f"--reps must be >= 1, got {args.reps}")
        if not args.budget_s > 0:
            raise InputError(f"--budget-s must be > 0, got {args.budget_s}")
        if not args.smoke and not torch.cuda.is_available():
            raise InputError("no CUDA device here; --smoke runs the CPU path")
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise InputError(f"OUT_DIR {out} is a file")
        taken = [t for t in tables if (out / f"{t}.csv").exists()]
        if taken:
            raise InputError(f"{out / (taken[0] + '.csv')} exists (from an earlier run); "
                             "choose another OUT_DIR or leave that table out (--tables)")
        out.mkdir(parents=True, exist_ok=True)
    except (InputError, OSError) as err:
        fail(str(err))
    if args.smoke:  # tiny shapes: one thread, not a pool contending for a shared CPU
        torch.set_num_threads(1)
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    bench = Bench(device, args.reps)
    kernels = select_kernels("triton" if bench.cuda else "torch")
    grid = smoke_grid() if args.smoke else full_grid()
    est = {t: estimate(t, specs, grid, args.reps) for t in tables}
    for _ in range(3):
        if sum(est.values()) <= args.budget_s:
            break
        grid = thinned(grid)
        est = {t: estimate(t, specs, grid, args.reps) for t in tables}
        print(f"estimate over --budget-s {args.budget_s:g}: grids thinned", flush=True)
    print(f"models: {', '.join(s.name for s in specs)}; estimated time on an H200: "
          + ", ".join(f"{t} {s:.0f} s" for t, s in est.items())
          + f"; total {sum(est.values()):.0f} s", flush=True)
    failed = []
    command = "python benchmarks/operators.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    for name in tables:
        t0 = time.perf_counter()
        try:
            df = run_table(name, bench, specs, grid, kernels)
        except Exception:  # the other tables still get measured
            traceback.print_exc()
            failed.append(name)
            print(f"{name}: FAILED after {time.perf_counter() - t0:.0f} s", flush=True)
            release(bench)
            continue
        elapsed = time.perf_counter() - t0
        meta = {**environment(bench), "table": name, "command": command,
                "models": [s.name for s in specs], "rows": len(df),
                "elapsed_s": round(elapsed, 2), "estimate_s": round(est[name], 1),
                "sm_mhz_median": float(df["sm_mhz"].median()) if df["sm_mhz"].notna().any()
                else None, "grid": dataclasses.asdict(grid)}
        # the table last: its presence says the run of it finished
        write_text_atomic(out / f"{name}.meta.json", json.dumps(meta, indent=1, default=str))
        write_text_atomic(out / f"{name}.csv", df.to_csv(index=False))
        print(f"{name}: {len(df)} rows in {elapsed:.0f} s (estimated {est[name]:.0f} s)",
              flush=True)
        release(bench)
    if failed:
        print(f"failed tables: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
