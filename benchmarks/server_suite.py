"""The engine measured in-process and behind its HTTP server, under the same policies and requests.

    python benchmarks/server_suite.py OUT_DIR [--parts inprocess,server] [--prompts N]
                                              [--poisson-prompts N] [--rates 20,40]
                                              [--fixed-output-len N] [--seed N] [--smoke]

For single_step, multi_step k=8 and single_step + overlap on llama3_8b (random bf16):
inprocess: python -m experiments.run's real backend, ShareGPT at t=0 (``--seed``, 0 by default)
           and at each Poisson rate (seed 1), each in OUT_DIR/inprocess/<config>_rate<r>;
server:    python -m experiments.serve under the same policy, a fresh server for each run, driven
           by python -m experiments.loadgen (guidellm) with the same ShareGPT requests
           (guidellm draws its own Poisson arrival times), each result in
           OUT_DIR/client/<config>_rate<r>, with the server's per-window CPU phases
           (steps.csv, written at its shutdown) beside it.
The in-process part runs in a child process, so that its kept runner has freed the GPU before
the first server starts. A finished run is not repeated. A table is printed last: request
throughput and median TTFT and TPOT in-process and client-measured, the client's over the
in-process figure, and the front end's CPU time per SSE chunk. ``--fixed-output-len N`` gives
every request N output tokens (directories end in ``_out<N>``): runs with many requests per
token, which let experiments.fit_api tell the front end's per-request cost from its per-token
and per-chunk ones. ``--seed N`` draws the t=0 prompts with another seed (directories end in
``_seed<N>``): calibration runs on other requests than the validation runs'. ``--rates none``:
t=0 only. ``--smoke`` runs the tiny model on the CPU with
a few prompts: a check of the script.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (tag, policy, k, overlap)
CONFIGS = [("single_step", "single_step", None, False),
           ("multi_step_k8", "multi_step", 8, False),
           ("single_step_overlap", "single_step", None, True)]
MODEL = ["model=llama3_8b"]
SMOKE_MODEL = ["model=tiny", "backend.device=cpu", "backend.num_blocks=2048"]
SMOKE_OUTPUT_LEN = 6


def policy_overrides(policy: str, k: int | None, overlap: bool) -> list[str]:
    return ([f"policy={policy}", f"scheduler.overlap={str(overlap).lower()}"]
            + ([f"policy.num_steps={k}"] if k else []))


def workloads(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(rate, prompts, seed): t=0, then each Poisson rate."""
    return [("inf", args.prompts, args.seed)] + [(r, args.poisson_prompts, 1) for r in args.rates]


def output_len(args: argparse.Namespace) -> int | None:
    return SMOKE_OUTPUT_LEN if args.smoke and not args.fixed_output_len \
        else args.fixed_output_len


def run_name(args: argparse.Namespace, tag: str, rate: str) -> str:
    return (f"{tag}_rate{rate}" + (f"_out{args.fixed_output_len}" if args.fixed_output_len
                                   else "")
            + (f"_seed{args.seed}" if args.seed and rate == "inf" else ""))


def inprocess(args: argparse.Namespace, out: Path) -> None:
    from overlap_suite import overrides  # (it imports real_backend before CUDA starts)

    from experiments.validate import run_one

    for tag, policy, k, overlap in CONFIGS:
        for rate, prompts, seed in workloads(args):
            ov = overrides(policy, k, overlap, rate, seed, prompts, model=MODEL)
            if output_len(args):
                ov.append(f"workload.fixed_output_len={output_len(args)}")
            t0 = time.perf_counter()
            try:
                res = run_one(ov, out / "inprocess" / run_name(args, tag, rate))
                print(f"in-process {tag} rate {rate}: {res['request_throughput']:.2f} req/s "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
            except Exception:  # keep the other measurements
                traceback.print_exc()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(proc: subprocess.Popen, url: str, timeout: float) -> bool:
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def served(args: argparse.Namespace, out: Path) -> None:
    """A fresh server for each client run, so that its per-window phases (steps.csv, written
    at a clean shutdown) are that run's alone; they are copied into the run's directory."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    for tag, policy, k, overlap in CONFIGS:
        for rate, prompts, seed in workloads(args):
            name = run_name(args, tag, rate)
            run_dir = out / "client" / name
            if (run_dir / "result.json").exists():
                continue
            server_dir = out / "server" / name
            (server_dir / "steps.csv").unlink(missing_ok=True)  # never an older server's
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log = open(out / f"serve_{name}.log", "w")
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                [sys.executable, "-m", "experiments.serve", *MODEL,
                 *policy_overrides(policy, k, overlap), f"server.port={port}",
                 f"hydra.run.dir={server_dir}"],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                if not wait_serving(proc, url, 300):
                    print(f"server {name}: not serving (see {log.name})", flush=True)
                    continue
                print(f"server {name}: up in {time.perf_counter() - t0:.0f} s", flush=True)
                cmd = [sys.executable, "-m", "experiments.loadgen", "--url", url,
                       "--num-prompts", str(prompts), "--request-rate", rate,
                       "--seed", str(seed), "--out", str(run_dir)]
                if output_len(args):
                    cmd += ["--fixed-output-len", str(output_len(args))]
                if args.smoke:
                    cmd += ["--processes", "1"]
                t1 = time.perf_counter()
                p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
                print(f"client {name}: {(p.stdout or p.stderr).strip()} "
                      f"({time.perf_counter() - t1:.0f} s)", flush=True)
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                log.close()
            steps = server_dir / "steps.csv"
            if proc.returncode == 0 and steps.exists() and (run_dir / "result.json").exists():
                shutil.copyfile(steps, run_dir / "steps.csv")


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def table(args: argparse.Namespace, out: Path) -> list[str]:
    lines = [f"{'config':<22}{'rate':>5} | {'req/s in':>8} {'client':>7} {'ratio':>6} | "
             f"{'TTFT in':>8} {'client':>8} | {'TPOT in':>7} {'client':>7} | {'us/chunk':>8}"]
    for tag, *_ in CONFIGS:
        for rate, _, _ in workloads(args):
            a = load(out / "inprocess" / run_name(args, tag, rate) / "result.json")
            b = load(out / "client" / run_name(args, tag, rate) / "result.json")
            if a is None or b is None:
                lines.append(f"{tag:<22}{rate:>5} | missing: {'in-process' if a is None else ''}"
                             f" {'client' if b is None else ''}")
                continue
            srv = b["schedlab"].get("server", {})
            per_chunk = (srv.get("front_end_cpu_s", math.nan) / srv["sse_chunks"] * 1e6
                         if srv.get("sse_chunks") else math.nan)
            x, y = (a["request_throughput"], b["request_throughput"])
            lines.append(
                f"{tag:<22}{rate:>5} | {x:8.2f} {y:7.2f} {y / x:6.3f} | "
                f"{a['median_ttft_ms']:8.1f} {b['median_ttft_ms']:8.1f} | "
                f"{a['median_tpot_ms']:7.2f} {b['median_tpot_ms']:7.2f} | {per_chunk:8.1f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--parts", default="inprocess,server")
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--poisson-prompts", type=int, default=500)
    ap.add_argument("--rates", type=lambda s: [] if s == "none" else s.split(","),
                    default=["20", "40"])
    ap.add_argument("--fixed-output-len", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0, help="the t=0 workload's seed")
    ap.add_argument("--smoke", action="store_true", help="tiny model on cpu: check the script")
    args = ap.parse_args()
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - {"inprocess", "server", "_inprocess"})
    if unknown:
        raise SystemExit(f"error: --parts has no part {unknown[0]!r}; its parts: inprocess, "
                         "server")
    if min(args.prompts, args.poisson_prompts) < 1:
        raise SystemExit("error: --prompts and --poisson-prompts must be >= 1")
    if args.seed < 0:
        raise SystemExit(f"error: --seed must be >= 0, got {args.seed}")
    if args.fixed_output_len is not None and args.fixed_output_len < 1:
        raise SystemExit(f"error: --fixed-output-len must be >= 1, got {args.fixed_output_len}")
    if args.smoke:
        MODEL[:] = SMOKE_MODEL
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if "_inprocess" in parts:  # the child process of the in-process part
        inprocess(args, out)
        return
    if "inprocess" in parts:
        child = ([sys.executable, __file__, str(out), "--parts", "_inprocess",
                 "--prompts", str(args.prompts), "--poisson-prompts", str(args.poisson_prompts),
                 "--rates", ",".join(args.rates) or "none", "--seed", str(args.seed)]
                 + (["--smoke"] if args.smoke else []))
        if args.fixed_output_len:
            child += ["--fixed-output-len", str(args.fixed_output_len)]
        subprocess.run(child, cwd=ROOT)
    if "server" in parts:
        served(args, out)
    print("\n".join(["", *table(args, out)]))


if __name__ == "__main__":
    main()
