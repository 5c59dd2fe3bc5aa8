"""Benchmark: writing a long run's requests.csv, by the result writer and by pandas' and pyarrow's
CSV writers, on one simulation's requests (the synthetic-1M case of benchmarks/sim_speed.py:
N synthetic requests at t=0 on one replica, llama3_8b, h100_sxm, vllm_v0_5, multi_step k=8).

Usage: python benchmarks/results_write.py [--n N] [--repeats R]
The simulation runs once (its files are not streamed); then each writer renders requests.csv
R times and the best is kept: CPU seconds of this process for the one-process writers, wall
seconds for the writer with its worker processes (experiments/parallel_text.py). Each library's
text is compared with the writer's, byte for byte; figures go in BENCHMARKS.md."""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402

from experiments import parallel_text  # noqa: E402
from experiments.request_rows import (  # noqa: E402
    REQUEST_CSV_COLUMNS,
    REQUEST_CSV_HEADER,
    RequestRows,
)

OVERRIDES = ["workload=synthetic", "metrics.save_per_request=false", "progress=false",
             "model=llama3_8b", "hardware=h100_sxm", "overhead=vllm_v0_5",
             "policy=multi_step", "policy.num_steps=8"]


def simulated(n: int) -> tuple[list, object]:
    """The requests of one simulated run and their TimesTable."""
    from experiments.run import CONF_DIR, RunPlan, RunRequests

    parallel_text.PARALLEL_MIN_ROWS = 10 ** 12  # nothing streamed: the files are timed here
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=[*OVERRIDES, f"workload.num_prompts={n}"])
    plan = RunPlan.of(cfg)
    work = RunRequests.of(plan)
    backend = plan.new_backend()
    with tempfile.TemporaryDirectory() as d:
        backend.run(work.requests, Path(d), max_concurrency=None, progress=False)
    return work.requests, backend.times(work.requests)


def writer_text(requests, times, workers: int) -> str:
    from experiments.request_times import chunk_bounds

    rows = RequestRows(requests, None, times)
    texts = parallel_text.Texts(workers)
    try:
        return REQUEST_CSV_HEADER + "".join(texts.rest(rows.job(a, b)
                                                       for a, b in chunk_bounds(len(rows))))
    finally:
        texts.close()


def columns(requests, times) -> dict:
    """requests.csv's columns as the library writers take them (None where a cell is empty)."""
    import numpy as np

    def attr(name):
        return [getattr(r, name) for r in requests]

    done = times.completed

    def finished(values):
        return [v if d else None for v, d in zip(values.tolist(), done.tolist())]

    return {"request_id": attr("request_id"), "arrival_time": attr("arrival_time"),
            "prompt_len": attr("prompt_len"), "output_len": attr("num_output_tokens"),
            "first_scheduled_time": attr("first_scheduled_time"),
            "ttft": finished(times.ttft), "e2el": finished(times.e2el),
            "tpot": [None if v != v else v for v in times.tpot.tolist()],
            "num_chunks": times.num_chunks.tolist(), "num_preemptions": attr("num_preemptions"),
            "finish_time": attr("finish_time"), "replica": np.zeros(len(requests), np.int64),
            "num_cached_tokens": attr("num_cached_prompt_tokens")}


def pandas_text(cols: dict) -> str:
    import pandas as pd

    return pd.DataFrame(cols, columns=list(REQUEST_CSV_COLUMNS)).to_csv(
        index=False, lineterminator="\n")


def pyarrow_text(cols: dict) -> str:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    buf = io.BytesIO()
    pacsv.write_csv(pa.table(cols), buf,
                    pacsv.WriteOptions(include_header=False, quoting_style="none"))
    return REQUEST_CSV_HEADER + buf.getvalue().decode()


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
    s, ref = best(lambda: writer_text(requests, times, 0), args.repeats, cpu)
    print(f"writer, one process: {s:.2f} s CPU, {len(ref) / 1e6:.1f} MB", flush=True)
    workers = parallel_text.num_workers()
    if workers:
        s, text = best(lambda: writer_text(requests, times, workers), args.repeats,
                       time.perf_counter)
        print(f"writer, {workers} worker(s) beside it: {s:.2f} s wall"
              f"{'' if text == ref else ' (DIFFERS)'}", flush=True)
    s, cols = best(lambda: columns(requests, times), 1, cpu)
    print(f"columns for the libraries: {s:.2f} s CPU", flush=True)
    for name, fn in (("pandas to_csv", pandas_text), ("pyarrow write_csv", pyarrow_text)):
        s, text = best(lambda fn=fn: fn(cols), args.repeats, cpu)
        same = "byte-identical" if text == ref else \
            f"DIFFERS (first at line {_first_diff(text, ref)})"
        print(f"{name}: {s:.2f} s CPU (+ the columns), {same}", flush=True)
    print(f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.1f}")


def _first_diff(a: str, b: str) -> str:
    for i, (x, y) in enumerate(zip(a.splitlines(), b.splitlines())):
        if x != y:
            return f"{i}: {x!r} vs {y!r}"
    return "end"


if __name__ == "__main__":
    main()
