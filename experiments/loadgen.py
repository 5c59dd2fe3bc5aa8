"""The client-side benchmark: guidellm (a standard load generator, installed from the registry)
drives a running `python -m experiments.serve` with the ShareGPT requests that the simulator
samples, and its per-request timings become a benchmark_serving-style result.json that
`python -m experiments.validate --measured-dir` reads.

    python -m experiments.loadgen --url http://127.0.0.1:8000 --num-prompts 1000 \\
        --request-rate inf --out OUT/multi_step_k8_rateinf

guidellm sends each prompt as text to /v1/completions with ``max_tokens`` set to the sampled
output length and ``ignore_eos``, streaming with usage; at rate inf it keeps every request in
flight at once (benchmark_serving's t=0), else it sends them at Poisson arrivals. The server
tokenizes each prompt to the length the simulator gives it (real_backend/serving/tokenizer.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from datetime import datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from omegaconf import OmegaConf

from experiments.files import write_text_atomic
from experiments.measured import arrivals_csv, checked_rate
from experiments.metrics import peak_output_and_concurrency, save_result_metadata
from experiments.request_times import RequestTimes, TimesTable
from experiments.run import CONF_DIR

LATENCIES = ("ttft", "tpot", "itl", "e2el")
ARRIVALS = "arrivals.csv"  # beside result.json: each completed request's send time and lengths


class InputError(Exception):
    """A bad option, an unreachable server or a failed client run: one line, exit 2."""


# the server's counters a run's result keeps (their change over the run): what the front end
# received and streamed, the CPU time of its process (experiments.fit_api prices it) and of
# the engine loop's thread
COUNTERS = {"requests": "schedlab_requests_received_total",
            "sse_chunks": "schedlab_sse_chunks_total",
            "front_end_cpu_s": "schedlab_front_end_cpu_seconds",
            "engine_cpu_s": "schedlab_engine_thread_cpu_seconds"}


def scrape(url: str) -> list[Any]:
    """The server's /metrics, parsed."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).raise_for_status().text
    except httpx.HTTPError as err:
        raise InputError(f"--url {url}: no schedlab server answers there ({err})") from None
    return list(text_string_to_metric_families(text))


def server_info(url: str) -> dict[str, str]:
    """What the server runs (its schedlab_engine_info metric): model, policy, k, KV blocks."""
    for fam in scrape(url):
        if fam.name in ("schedlab_engine", "schedlab_engine_info"):
            return dict(fam.samples[0].labels)
    raise InputError(f"--url {url}: /metrics has no schedlab_engine_info; is it "
                     "python -m experiments.serve?")


def server_counters(url: str) -> dict[str, float]:
    """COUNTERS now; one the server does not report (no per-thread CPU clock) is left out."""
    samples = {s.name: s.value for fam in scrape(url) for s in fam.samples}
    return {key: samples[name] for key, name in COUNTERS.items() if name in samples}


def sharegpt_rows(num_prompts: int, seed: int, fixed_output_len: int | None,
                  dataset_path: str | None) -> list[dict[str, Any]]:
    """The sampled ShareGPT requests as guidellm's data rows: prompt text, its token count
    (with BOS, as the server counts it) and the output length."""
    from experiments.workload.jsonstream import read_record_at
    from experiments.workload.sharegpt import _bos_id, sample_sharegpt_section

    conf = Path(CONF_DIR) / "workload" / "sharegpt.yaml"
    section = OmegaConf.to_container(OmegaConf.load(conf))
    section.update(fixed_output_len=fixed_output_len)
    if dataset_path:
        section["dataset_path"] = dataset_path
    sample = sample_sharegpt_section(section, num_prompts, seed)
    bos = int(_bos_id(sample.enc) is not None)
    rows = []
    for i, prompt_len, output_len in sample.sampled:
        offset = int(sample.counts[i, 2])
        text = read_record_at(sample.path, offset)["conversations"][0]["value"]
        n = len(sample.enc.encode_ordinary(text)) + bos
        if n != prompt_len:
            raise InputError(f"{sample.path}: record {i} tokenizes to {n} tokens, its cached "
                             f"count says {prompt_len}; delete the token-count cache and retry")
        rows.append({"prompt": text, "prompt_tokens_count": prompt_len,
                     "output_tokens_count": output_len})
    return rows


def run_guidellm(url: str, model: str, rows: list[dict[str, Any]], rate: float, seed: int,
                 out: Path, processes: int | None) -> Path:
    """guidellm's run over ``rows``, its JSON report in ``out``/guidellm.json."""
    data = out / "requests.jsonl"
    write_text_atomic(data, "".join(json.dumps(r) + "\n" for r in rows))
    report = out / "guidellm.json"
    n = len(rows)
    profile = (f"kind=throughput,max_concurrency={n}" if math.isinf(rate)
               else f"kind=poisson,rate={rate}")
    cmd = [sys.executable, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={url},model={model},"
                        "request_format=/v1/completions",
           "--profile", profile, "--data", f"kind=json_file,path={data}",
           "--constraint", f"kind=max_requests,count={n}", "--seed", f"kind=static,value={seed}",
           "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1",  # nothing fetched: prompts carry their counts
           "GUIDELLM__LOGGING__LOG_FILE": str(out / "guidellm.log")}
    if processes:
        env["GUIDELLM__MAX_WORKER_PROCESSES"] = str(processes)
    report.unlink(missing_ok=True)
    with open(out / "guidellm.out", "w") as log:
        code = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if code != 0 or not report.exists():
        raise InputError(f"guidellm exited {code}; see {out / 'guidellm.out'}")
    return report


def _stats(xs: list[float], ms: bool = True) -> dict[str, float]:
    # benchmark_serving computes np.mean(xs or 0): an empty list reports 0, not NaN.
    a = np.asarray(xs or [0.0]) * (1000 if ms else 1)
    return {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
            "p99": float(np.percentile(a, 99))}


def summarize_report(report: dict[str, Any], num_prompts: int) -> dict[str, Any]:
    """benchmark_serving's metrics from guidellm's per-request timings.

    TTFT: request sent to first token; E2EL: sent to response end; TPOT:
    (E2EL - TTFT) / (output tokens - 1), output tokens from the server's usage. guidellm keeps
    no per-chunk times, only each request's first and last token chunk and their count, so
    the mean ITL is exact (all gaps pooled) and its median, std and p99 are left null; vLLM's
    peaks (max_output_tokens_per_s, max_concurrent_requests) count each request's chunks as
    if spread evenly between its first and last.
    """
    (bench,) = report["benchmarks"]
    reqs = bench["requests"]
    done = reqs.get("successful") or []
    failed = (reqs.get("errored") or []) + (reqs.get("incomplete") or [])
    ttft, tpot, e2el = [], [], []
    gaps, n_gaps = 0.0, 0
    starts, ends = [], []
    total_in = total_out = 0
    input_lens, output_lens, sent, chunked = [], [], [], []
    for r in done:
        t = r["info"]["timings"]
        start, first, last = t["request_start"], t["first_token_iteration"], t["request_end"]
        out_len = r["output_metrics"]["text_tokens"]
        starts.append(start)
        ends.append(last)
        ttft.append(first - start)
        e2el.append(last - start)
        if out_len > 1:
            tpot.append((last - start - (first - start)) / (out_len - 1))
        spread = []
        if t["token_iterations"] > 1:
            gaps += t["last_token_iteration"] - first
            n_gaps += t["token_iterations"] - 1
            spread = [(t["last_token_iteration"] - first) / (t["token_iterations"] - 1)] * (
                t["token_iterations"] - 1)
        chunked.append(RequestTimes(True, out_len, ttft=first - start, e2el=last - start,
                                    itls=spread))
        total_in += r["input_metrics"]["text_tokens"]
        total_out += out_len
        input_lens.append(r["input_metrics"]["text_tokens"])
        output_lens.append(out_len)
        sent.append(start)
    for r in failed:
        t = r["info"]["timings"]
        if t.get("request_start"):
            starts.append(t["request_start"])
    if not done:
        raise InputError("guidellm completed no request; see guidellm.out")
    duration = max(ends) - min(starts)  # first send to last finish, as benchmark_serving
    out: dict[str, Any] = {
        "duration": duration, "completed": len(done), "failed": len(failed),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(done) / duration, "request_goodput": None,  # no SLO
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("e2el", e2el)):
        for stat, v in _stats(xs).items():
            out[f"{stat}_{name}_ms"] = v
    out.update(mean_itl_ms=gaps / n_gaps * 1000 if n_gaps else 0.0, median_itl_ms=None,
               std_itl_ms=None, p99_itl_ms=None)
    # benchmark_serving's per-request lists (seconds) of the completed requests, in the
    # report's order; no itls: guidellm keeps no per-chunk times
    # when the client sent each completed request, after its first send (seconds)
    first = min(starts)
    out.update(input_lens=input_lens, output_lens=output_lens, ttfts=ttft, latencies=e2el,
               e2els=e2el, start_times=[t - first for t in sent])
    out["max_output_tokens_per_s"], out["max_concurrent_requests"] = \
        peak_output_and_concurrency(sent, TimesTable.of(chunked))
    if len(done) + len(failed) != num_prompts:
        raise InputError(f"guidellm sent {len(done) + len(failed)} requests, not {num_prompts}")
    return out


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    url = args.url.rstrip("/")
    info = server_info(url)
    rate = args.request_rate
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError(f"--out {out}: {err.strerror or err}") from None
    try:
        rows = sharegpt_rows(args.num_prompts, args.seed, args.fixed_output_len,
                             args.dataset_path)
    except ValueError as err:
        raise InputError(str(err)) from None
    for name in ("result.json", ARRIVALS):  # never beside another run's client files
        (out / name).unlink(missing_ok=True)
    t0 = time.time()
    before = server_counters(url)
    report_path = run_guidellm(url, info["model"], rows, rate, args.seed, out, args.processes)
    after = server_counters(url)
    summary = summarize_report(json.loads(report_path.read_text()), args.num_prompts)
    sent = sum(r["prompt_tokens_count"] for r in rows)
    if summary["failed"] == 0 and summary["total_input_tokens"] != sent:
        raise InputError(f"the server counted {summary['total_input_tokens']} prompt tokens, "
                         f"the ShareGPT sample {sent}: its tokenizer is not the sample's")
    if summary["failed"] == 0:  # else a replay of the completed ones would be too light
        write_text_atomic(out / ARRIVALS, arrivals_csv(zip(
            summary["start_times"], summary["input_lens"], summary["output_lens"],
            strict=True)))
    else:
        print(f"note: {summary['failed']} requests failed: no {ARRIVALS}; the simulator "
              "will replay the seed's arrivals", file=sys.stderr)
    workload = {"kind": "sharegpt", "num_prompts": args.num_prompts, "seed": args.seed,
                "request_rate": "inf" if math.isinf(rate) else rate,
                "fixed_output_len": args.fixed_output_len, "dataset_path": args.dataset_path,
                # the requests as the client sent them (guidellm draws its own Poisson
                # times): experiments.validate replays this trace on the simulator
                "arrivals": ARRIVALS if (out / ARRIVALS).exists() else None}
    result = {
        **save_result_metadata(backend="schedlab-serve", model_id=info["model"],
                               tokenizer_id=None, num_prompts=args.num_prompts,
                               request_rate=workload["request_rate"],
                               burstiness=None if math.isinf(rate) else 1.0,
                               max_concurrency=None, date=datetime.fromtimestamp(t0),
                               label=args.label),
        **summary,
        # what experiments.measured reads: the configuration measured, the KV cache it had
        "schedlab": {"backend": "real-http", "policy": info["policy"], "k": int(info["k"]),
                     "overlap": info["overlap"] == "true", "model": info["model"],
                     "enable_prefix_caching": info.get("enable_prefix_caching") == "true",
                     "hardware": info["device_name"], "num_blocks": int(info["num_blocks"]),
                     "load_generator": f"guidellm {version('guidellm')}",
                     "workload": workload,
                     # the server's counters over the run (also any other client's requests)
                     "server": {k: after[k] - before[k] for k in after if k in before}},
    }
    write_text_atomic(out / "result.json", json.dumps(result, indent=2) + "\n")
    return result


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return n


def _rate(text: str) -> float:
    try:
        return checked_rate(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = _Parser(prog="python -m experiments.loadgen", description=__doc__.split("\n\n")[0],
                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000",
                    help="the base URL of a running python -m experiments.serve")
    ap.add_argument("--num-prompts", type=_positive_int, default=1000,
                    help="ShareGPT requests to sample and send (workload.num_prompts)")
    ap.add_argument("--request-rate", type=_rate, default=math.inf,
                    help="requests per second (Poisson), or inf: all at once (t=0)")
    ap.add_argument("--seed", type=int, default=0, help="ShareGPT sampling and arrival seed")
    ap.add_argument("--fixed-output-len", type=_positive_int, default=None,
                    help="every request's output length (workload.fixed_output_len); "
                    "None: each conversation's")
    ap.add_argument("--dataset-path", default=None,
                    help="a ShareGPT JSON file (workload.dataset_path); None: the bundled copy")
    ap.add_argument("--processes", type=_positive_int, default=None,
                    help="guidellm's worker processes; None: guidellm's own choice")
    ap.add_argument("--label", default=None,
                    help="the result's label (vllm bench serve's --label)")
    ap.add_argument("--out", required=True, default=argparse.SUPPRESS,
                    help="directory for result.json, arrivals.csv and guidellm's files")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        r = benchmark(args)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("interrupted: no result written", file=sys.stderr)
        raise SystemExit(130) from None
    print(f"{r['completed']}/{r['num_prompts']} requests, {r['request_throughput']:.2f} req/s, "
          f"median TTFT {r['median_ttft_ms']:.1f} ms, median TPOT {r['median_tpot_ms']:.2f} ms "
          f"-> {Path(args.out) / 'result.json'}")


if __name__ == "__main__":
    main()
