"""Benchmark: writing a long run's requests.csv, by the result writer (pyarrow from columns,
experiments/result_text.py), by the csv module and by pandas' CSV writer, on one simulation's
requests (the synthetic-1M case of benchmarks/sim_speed.py: N synthetic requests at t=0 on one
replica, llama3_8b, h100_sxm, vllm_v0_5, multi_step k=8).

Usage: python benchmarks/results_write.py [--n N] [--repeats R]
The simulation runs once; then each writer makes requests.csv's text R times from the same
columns and the best CPU seconds of this process are kept (the writer's thread included). Each
text is compared with the csv module's, byte for byte; figures go in BENCHMARKS.md."""

from __future__ import annotations

import argparse
import csv
import io
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402

from experiments.request_rows import REQUEST_CSV_COLUMNS, RequestRows  # noqa: E402
from experiments.request_times import chunk_bounds  # noqa: E402
from experiments.result_text import csv_text  # noqa: E402

OVERRIDES = ["workload=synthetic", "metrics.save_per_request=false", "progress=false",
             "model=llama3_8b", "hardware=h100_sxm", "overhead=vllm_v0_5",
             "policy=multi_step", "policy.num_steps=8"]


def simulated(n: int) -> tuple[list, object]:
    """The requests of one simulated run and their TimesTable."""
    from experiments.run import CONF_DIR, RunPlan, RunRequests

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=[*OVERRIDES, f"workload.num_prompts={n}"])
    plan = RunPlan.of(cfg)
    work = RunRequests.of(plan)
    backend = plan.new_backend()
    with tempfile.TemporaryDirectory() as d:
        backend.run(work.requests, Path(d), max_concurrency=None, progress=False)
    return work.requests, backend.times(work.requests)


def writer_text(requests, times) -> str:
    """The result writer's text: pyarrow's, a chunk of requests at a time."""
    rows = RequestRows(requests, None, times)
    names = rows.names
    return ",".join(names) + "\n" + "".join(
        csv_text(names, rows.columns(a, b)).split("\n", 1)[1] for a, b in chunk_bounds(len(rows)))


def columns(requests, times) -> dict:
    """requests.csv's columns as Python lists (None where a cell is empty)."""
    done = times.completed.tolist()

    def attr(name):
        return [getattr(r, name) for r in requests]

    def finished(values):
        return [v if d else None for v, d in zip(values.tolist(), done)]

    return {"request_id": attr("request_id"), "arrival_time": attr("arrival_time"),
            "prompt_len": attr("prompt_len"), "output_len": attr("num_output_tokens"),
            "first_scheduled_time": attr("first_scheduled_time"),
            "ttft": finished(times.ttft), "e2el": finished(times.e2el),
            "tpot": [None if v != v else v for v in times.tpot.tolist()],
            "num_chunks": times.num_chunks.tolist(), "num_preemptions": attr("num_preemptions"),
            "finish_time": attr("finish_time"), "replica": [0] * len(requests),
            "num_cached_tokens": attr("num_cached_prompt_tokens")}


def csv_module_text(cols: dict) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(REQUEST_CSV_COLUMNS)
    writer.writerows(zip(*(cols[c] for c in REQUEST_CSV_COLUMNS)))
    return buf.getvalue()


def pandas_text(cols: dict) -> str:
    import pandas as pd

    return pd.DataFrame(cols, columns=list(REQUEST_CSV_COLUMNS)).to_csv(
        index=False, lineterminator="\n")


def best(fn, repeats: int, clock) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = clock()
        out = fn()
        times.append(clock() - t0)
    return min(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    t0 = time.perf_counter()
    requests, times = simulated(args.n)
    print(f"simulated {args.n} requests in {time.perf_counter() - t0:.1f} s", flush=True)
    cpu = time.process_time
    s, cols = best(lambda: columns(requests, times), 1, cpu)
    print(f"columns as Python lists (for the csv module and pandas): {s:.2f} s CPU", flush=True)
    s, ref = best(lambda: csv_module_text(cols), args.repeats, cpu)
    print(f"csv module: {s:.2f} s CPU (+ the lists), {len(ref) / 1e6:.1f} MB", flush=True)
    s, text = best(lambda: writer_text(requests, times), args.repeats, cpu)
    print(f"result writer (pyarrow from columns): {s:.2f} s CPU, "
          f"{'byte-identical' if text == ref else 'DIFFERS: ' + _first_diff(text, ref)}",
          flush=True)
    s, text = best(lambda: pandas_text(cols), args.repeats, cpu)
    print(f"pandas to_csv: {s:.2f} s CPU (+ the lists), "
          f"{'byte-identical' if text == ref else 'DIFFERS: ' + _first_diff(text, ref)}",
          flush=True)
    print(f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.1f}")


def _first_diff(a: str, b: str) -> str:
    for i, (x, y) in enumerate(zip(a.splitlines(), b.splitlines())):
        if x != y:
            return f"{i}: {x!r} vs {y!r}"
    return "end"


if __name__ == "__main__":
    main()
