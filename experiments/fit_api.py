"""The API-server terms of the simulator's overhead model, fitted on schedlab's HTTP server.

    python -m experiments.fit_api \\
        --measured-dir docs/validation/measured/server/calibration/client \\
        --inprocess-dir docs/validation/measured/server/calibration/inprocess \\
        --base schedlab_h200 --name schedlab_h200_server

Reads every client-measured result (``python -m experiments.loadgen``'s result.json) under
``--measured-dir``. Each records what the server's front end did over the run (its /metrics
counters): requests received, SSE chunks streamed with output tokens, and the CPU seconds of
the front-end process (uvicorn's event loop: HTTP parsing, tokenization, detokenization,
JSON, socket writes; and the pipe to the engine), and the output tokens the client received.
A non-negative least-squares fit over the runs,

    front_end_cpu_s = api_per_chunk_us * sse_chunks + api_per_token_us * tokens
                    + api_per_request_us * requests,

prices that work (single-step runs stream a chunk per token, multi-step ones a chunk per
window, which tells the per-chunk and per-token terms apart; runs with a few output tokens a
request, ``benchmarks/server_suite.py --fixed-output-len``, tell the per-request term from the
per-token one), and the profile written is
``--base`` (the engine's own CPU costs) with those terms, ``api_server_on_critical_path:
false`` (the front end runs in a process of its own: its work delays each token's delivery
and each request's admission, not the engine) and ``api_chunk_per_window: true`` (a
multi-step window streams one chunk per request).

``--inprocess-dir`` holds in-process runs of the same configurations and workloads, under the
client runs' names (``benchmarks/server_suite.py`` writes both). For each client run whose
directory keeps the server's per-window CPU phases (``steps.csv``), the engine thread's
``update_s`` per decode window (its bookkeeping, and behind the server the one pipe message
that hands the window's tokens to the front end) is fitted as a + b * num_seqs in both runs;
the server's excess is ``handoff_per_window_us`` (a) and ``handoff_per_chunk_us`` (b: every
sequence of a decode window gets a token), averaged over the pairs weighted by their decode
windows. A pair with fewer than MIN_WINDOWS decode windows in a run is left out (the header
says so).

Fit on calibration runs (other prompts than the validation runs': ``--seed``): only CPU
counters and CPU phases enter it, never a latency or throughput, and the runs that
``experiments.validate`` scores play no part in it.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from experiments.files import write_text_atomic
from experiments.profiles import load_conf
from experiments.run import CONF_DIR
from simulator.overhead import OverheadSpec

TERMS = ("api_per_chunk_us", "api_per_token_us", "api_per_request_us")
HANDOFF = ("handoff_per_window_us", "handoff_per_chunk_us")
COUNTS = ("sse_chunks", "tokens", "requests")
SERVER_COUNTERS = ("sse_chunks", "requests", "front_end_cpu_s")  # /metrics (tokens: the client's)


def client_runs(measured_dir: str | Path) -> list[dict[str, Any]]:
    """One row per client-measured run under ``measured_dir``: its directory, configuration and
    the server's counters over it."""
    root = Path(measured_dir)
    if not root.is_dir():
        raise ValueError(f"--measured-dir {root}: not a directory")
    rows = []
    for path in sorted(root.rglob("result.json")):
        result = read_result(path)
        meta = result.get("schedlab") or {}
        server = meta.get("server") or {}
        if meta.get("backend") != "real-http":
            continue
        missing = [k for k in SERVER_COUNTERS if k not in server]
        if missing:
            raise ValueError(f"{path}: a client-measured run without the server's counters "
                             f"{', '.join(missing)} (measured before they existed?)")
        rows.append({"run": str(path.parent.relative_to(root)), "meta": meta,
                     "policy": meta.get("policy"), "k": meta.get("k"),
                     "overlap": meta.get("overlap"),
                     "request_rate": result.get("request_rate"),
                     "tokens": float(result.get("total_output_tokens", 0)),
                     **{k: float(server[k]) for k in SERVER_COUNTERS}})
    if len(rows) < len(TERMS):
        raise ValueError(f"--measured-dir {root}: {len(rows)} client-measured runs with server "
                         f"counters; the fit needs at least {len(TERMS)}")
    return rows


def read_result(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: unreadable result ({err})") from None


def fit_api(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The non-negative least-squares terms (us) of the front end's CPU time."""
    from scipy.optimize import nnls

    a = np.array([[r[c] for c in COUNTS] for r in rows], dtype=float)
    b = np.array([r["front_end_cpu_s"] * 1e6 for r in rows])
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0  # a count no run has: its term stays 0
    x, _ = nnls(a / scale, b)
    return {t: float(v) for t, v in zip(TERMS, x / scale, strict=True)}


def fit_error(rows: list[dict[str, Any]], terms: dict[str, float]) -> float:
    """RMS relative error of the fitted front-end CPU seconds over the runs."""
    err = [predicted_cpu_s(terms, r) / r["front_end_cpu_s"] - 1 for r in rows
           if r["front_end_cpu_s"] > 0]
    return float(np.sqrt(np.mean(np.square(err)))) if err else 0.0


def fit_errors(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The fit error with every term (``"all"``), and refitted without each term (by its name).
    A term whose removal leaves the error where it was is not set by these runs (its count
    moves with another's: requests and tokens do at one prompt mix)."""
    errors = {"all": fit_error(rows, fit_api(rows))}
    for term, count in zip(TERMS, COUNTS, strict=True):
        kept = [{**r, count: 0.0} for r in rows]  # the term's count zeroed: it drops out
        errors[term] = fit_error(rows, fit_api(kept))
    return errors


def unset_terms(errors: dict[str, float], terms: dict[str, float]) -> list[str]:
    """Terms the fit left at 0, or whose removal raises the fit error by under 1 point."""
    return [t for t in TERMS if terms[t] == 0.0 or errors[t] - errors["all"] < 0.01]


MIN_WINDOWS = 100  # decode windows a run needs for its update() line (fewer: noise)
# what a client run and its in-process twin must share (result.json's schedlab section)
PAIRED = ("policy", "k", "overlap", "model")
PAIRED_WORKLOAD = ("kind", "num_prompts", "seed", "request_rate", "fixed_output_len")


def read_steps(run_dir: Path) -> tuple[Path, pd.DataFrame] | None:
    """A run's per-window CPU phases (steps.csv, or steps.csv.gz as committed) and their path;
    None: the run has none."""
    for name in ("steps.csv", "steps.csv.gz"):
        path = run_dir / name
        if not path.exists():
            continue
        try:
            steps = pd.read_csv(path)
        except (OSError, ValueError, EOFError, zlib.error) as err:  # zlib: a corrupt .gz
            raise ValueError(f"{path}: unreadable steps ({err})") from None
        for col in ("num_seqs", "num_prefill_seqs", "update_s"):
            if col not in steps.columns:
                raise ValueError(f"{path}: no column {col}")
            steps[col] = pd.to_numeric(steps[col], errors="coerce")
            if steps[col].isna().any() or (steps[col] < 0).any():
                raise ValueError(f"{path}: column {col} must hold numbers >= 0")
        return path, steps
    return None


def update_line(steps: pd.DataFrame) -> np.ndarray | None:
    """update() us per decode window as a + b * num_seqs (least squares); None: fewer than
    MIN_WINDOWS decode windows, or one batch size. Decode windows only: a window with prompts
    does other bookkeeping per sequence, and the two runs of a pair need not mix the kinds
    alike."""
    decode = steps[steps["num_prefill_seqs"] == 0]
    if len(decode) < MIN_WINDOWS or decode["num_seqs"].nunique() < 2:
        return None
    a = np.column_stack([np.ones(len(decode)), decode["num_seqs"].to_numpy(dtype=float)])
    return np.linalg.lstsq(a, decode["update_s"].to_numpy(dtype=float) * 1e6, rcond=None)[0]


def handoff_pairs(rows: list[dict[str, Any]], measured_dir: str | Path,
                  inprocess_dir: str | Path) -> list[dict[str, Any]]:
    """For each client run (``rows``: client_runs) with the server's steps.csv, the in-process
    run of the same name under ``inprocess_dir``, which must be the same configuration and
    workload: both runs' update() lines over their decode windows."""
    root, other = Path(measured_dir), Path(inprocess_dir)
    if not other.is_dir():
        raise ValueError(f"--inprocess-dir {other}: not a directory")
    pairs = []
    for row in rows:
        served = read_steps(root / row["run"])
        if served is None:
            continue
        twin = other / row["run"]
        alone = read_steps(twin)
        if alone is None:
            raise ValueError(f"--inprocess-dir {other}: no in-process run {row['run']} "
                             f"(steps.csv) for the client run {root / row['run']}")
        a, b = row["meta"], read_result(twin / "result.json").get("schedlab") or {}
        wa, wb = a.get("workload") or {}, b.get("workload") or {}
        differ = ([f for f in PAIRED if a.get(f) != b.get(f)]
                  + [f"workload.{f}" for f in PAIRED_WORKLOAD if wa.get(f) != wb.get(f)])
        if differ:
            raise ValueError(f"{twin / 'result.json'}: not the run of {root / row['run']} "
                             f"in-process ({differ[0]} differs)")
        lines = update_line(served[1]), update_line(alone[1])
        pairs.append({"run": row["run"], "windows": int((served[1]["num_prefill_seqs"] == 0)
                                                        .sum()),
                      "server": lines[0], "inprocess": lines[1]})
    if not any(usable(p) for p in pairs):
        raise ValueError(f"--measured-dir {root}: no client run keeps the server's steps.csv "
                         f"with {MIN_WINDOWS} or more decode windows over 2 or more batch "
                         "sizes, in it and in its in-process run")
    return pairs


def usable(pair: dict[str, Any]) -> bool:
    """Both runs of the pair have an update() line (enough decode windows)."""
    return pair["server"] is not None and pair["inprocess"] is not None


def excess(pairs: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """Each usable pair's update() excess behind the server, [per window, per sequence] (us),
    and its decode windows."""
    used = [p for p in pairs if usable(p)]
    return (np.array([p["server"] - p["inprocess"] for p in used]),
            np.array([p["windows"] for p in used], dtype=float))


def fit_handoff(pairs: list[dict[str, Any]]) -> dict[str, float]:
    """The server's update() excess over in-process, per window and per chunk (us, >= 0),
    averaged over the pairs weighted by their decode windows."""
    x, w = excess(pairs)
    mean = (x * w[:, None]).sum(axis=0) / w.sum()
    return {t: max(float(v), 0.0) for t, v in zip(HANDOFF, mean, strict=True)}


def predicted_cpu_s(terms: dict[str, float], row: dict[str, Any]) -> float:
    return sum(terms[t] * row[c] for t, c in zip(TERMS, COUNTS, strict=True)) * 1e-6


def profile_text(base: dict[str, Any], terms: dict[str, float], rows: list[dict[str, Any]],
                 errors: dict[str, float], name: str, command: str,
                 pairs: list[dict[str, Any]] | None = None,
                 handoff: dict[str, float] | None = None) -> str:
    """The overhead profile's YAML: a header saying where each number comes from (``errors``:
    fit_errors; ``pairs``: handoff_pairs), then ``base`` with the API-server terms (and
    ``handoff``, fit_handoff of ``pairs``)."""
    import scipy

    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Fitted by `{command}` on {now}",
             f"# (numpy {np.__version__}, scipy {scipy.__version__}).",
             "# schedlab's engine behind its HTTP server (python -m experiments.serve): the "
             "engine's CPU costs",
             f"# from {base['name']}, plus the front end's (a process of its own), fitted on its "
             f"CPU time over "
             f"{len(rows)} client-measured runs:",
             "#   front_end_cpu_s = api_per_chunk_us * sse_chunks + api_per_token_us * tokens",
             "#                   + api_per_request_us * requests",
             "# run: measured / fitted front-end CPU seconds (chunks, tokens, requests)"]
    for r in rows:
        fit = predicted_cpu_s(terms, r)
        lines.append(f"#   {r['run']}: {r['front_end_cpu_s']:.3f} / {fit:.3f} s "
                     f"({r['sse_chunks']:.0f}, {r['tokens']:.0f}, {r['requests']:.0f})")
    values = {k: v for k, v in base.items() if k != "name"}
    values.update({t: round(v, 3) for t, v in terms.items()},
                  api_server_on_critical_path=False, api_chunk_per_window=True)
    if pairs:
        values.update({t: round(v, 3) for t, v in handoff.items()})
        lines += ["# the engine thread's hand-over of each window's tokens to the front end "
                  "(update() and the pipe",
                  "# message): us per decode window as a + b * num_seqs, behind the server "
                  "against in-process (decode windows):"]
        for p in pairs:
            if usable(p):
                lines.append(f"#   {p['run']}: {p['server'][0]:.1f} + {p['server'][1]:.3f} n "
                             f"against {p['inprocess'][0]:.1f} + {p['inprocess'][1]:.3f} n "
                             f"({p['windows']})")
            else:
                lines.append(f"#   {p['run']}: left out, under {MIN_WINDOWS} decode windows "
                             "or one batch size in a run")
        x, _ = excess(pairs)
        lines.append(f"#   weighted mean excess: handoff_per_window_us "
                     f"{handoff['handoff_per_window_us']:.1f} (pairs "
                     f"{x[:, 0].min():.1f} to {x[:, 0].max():.1f}), "
                     f"handoff_per_chunk_us {handoff['handoff_per_chunk_us']:.3f} "
                     f"({x[:, 1].min():.3f} to {x[:, 1].max():.3f})")
    OverheadSpec.from_dict({"name": name, **values})  # a profile the simulator takes
    lines.append(f"# fit error (RMS relative): {100 * errors['all']:.1f}% with every term, "
                 + ", ".join(f"{100 * errors[t]:.1f}% without {t}" for t in TERMS))
    for t in unset_terms(errors, terms):
        lines.append(f"# {t} is not set by these runs (its count moves with another's); "
                     f"it stays {terms[t]:g}")
    lines.append(f"name: {name}")
    lines += [f"{k}: {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(prog="python -m experiments.fit_api",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured-dir", required=True,
                    help="client-measured runs (experiments.loadgen's result.json files)")
    ap.add_argument("--inprocess-dir", default=None,
                    help="in-process runs of the same workloads, under the client runs' names: "
                         "fits the engine thread's hand-over (handoff_*); without it, 0")
    ap.add_argument("--base", default="schedlab_h200",
                    help="the overhead profile with the engine's own CPU costs")
    ap.add_argument("--name", default="schedlab_h200_server", help="the new profile's name")
    ap.add_argument("--conf-dir", default=CONF_DIR,
                    help="where conf/overhead/ is read and the profile written")
    args = ap.parse_args(argv)
    command = "python -m experiments.fit_api " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]))
    try:
        rows = client_runs(args.measured_dir)
        terms, errors = fit_api(rows), fit_errors(rows)
        pairs = (handoff_pairs(rows, args.measured_dir, args.inprocess_dir)
                 if args.inprocess_dir else None)
        handoff = fit_handoff(pairs) if pairs else {}
        base = load_conf("overhead", args.base, args.conf_dir)
        text = profile_text(base, terms, rows, errors, args.name, command, pairs, handoff)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    out = Path(args.conf_dir) / "overhead" / f"{args.name}.yaml"
    write_text_atomic(out, text)
    print(f"{len(rows)} runs: " + ", ".join(f"{t} {v:.3f}" for t, v in
                                             {**terms, **handoff}.items()) + f" -> {out}")
    for t in unset_terms(errors, terms):
        print(f"note: {t} is not set by these runs (its count moves with another's: add runs "
              "with another output length, e.g. loadgen --fixed-output-len)", file=sys.stderr)
    return terms


if __name__ == "__main__":
    main()
