"""Benchmark: CPU cost of Scheduler.schedule() + update(), and a host's profile from it.

Usage: python benchmarks/scheduler_speed.py
Prints microseconds per window (one schedule() and one update()) for each policy, median
over many windows in steady state (every request decoding, none finishing).

       python benchmarks/scheduler_speed.py --host NAME [--reference conf/host/REF.yaml]
Measures this host once and writes conf/host/NAME.yaml: the scheduler's CPU time per window
for a fixed set of windows (the calibration's Scheduler bench: multi_step k = 1 and 8 with
1-256 decoding requests, as ``experiments.measure`` times it) and ``cpu_factor``, the median
ratio of those times to the reference host's. The default reference is the host that
conf/overhead/schedlab_h200.yaml was fitted on (the Scheduler bench rows of
conf/calibration/h200_calibrated.csv). A simulation with ``host=NAME`` scales its overhead
profile's CPU costs by ``cpu_factor`` (docs/validation/README.md, "Host profiles").
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.model_spec import ModelSpec  # noqa: E402
from policies import Request, SchedulerConfig, make_scheduler  # noqa: E402
from simulator.cost_model import step_time_fn  # noqa: E402
from simulator.hardware import HardwareSpec  # noqa: E402

CASES = [("single_step", {}), ("multi_step", {"num_steps": 8}), ("chunked_prefill", {}),
         ("cp1", {"num_steps": 8}), ("cp2", {"num_steps": 8}), ("cp_promote", {"num_steps": 8}),
         ("adaptive", {"num_steps": 8}), ("priority", {}), ("sjf", {}), ("edf", {}),
         ("sarathi", {}), ("mlfq", {}), ("slo_adaptive", {"num_steps": 8})]
NUM_SEQS = 256
# sarathi and slo_adaptive price windows: Llama-3-8B on the calibrated H200 profile
_CONF = ROOT / "conf"
STEP_TIME = step_time_fn(
    ModelSpec.from_dict(yaml.safe_load((_CONF / "model" / "llama3_8b.yaml").read_text())),
    HardwareSpec.from_dict(
        yaml.safe_load((_CONF / "hardware" / "h200_calibrated.yaml").read_text())))
WINDOWS = 400

# The host probe: the calibration's Scheduler bench (experiments.measure.Profiler.cpu_scheduler)
PROBE_SEQS = (1, 8, 32, 64, 128, 256)
PROBE_STEPS = (1, 8)
PROBE_WINDOWS = 50  # per case, as the calibration times it
PROBE_REPEATS = 5  # the whole probe, each case's median over the repeats
REFERENCE_CSV = _CONF / "calibration" / "h200_calibrated.csv"
REFERENCE_NOTE = (
    "the Scheduler bench of the calibration host (the first H200 host, 2026-12-03), on which "
    "conf/overhead/schedlab_h200.yaml was fitted: conf/calibration/h200_calibrated.csv, "
    "kind=scheduler. It ran the scheduler code of that day, which has changed since, so "
    "cpu_factor also carries the code's own change; timing the reference host again with "
    "today's code needs that GPU host. The leave-one-model-out folds (h200_ops) pool runs of "
    "several hosts and have no reference host.")
NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")


class HostProfileError(ValueError):
    """A host profile that cannot be made or read; its message is one line naming the file."""


def measure(name: str, params: dict) -> float:
    s = make_scheduler(name, params, SchedulerConfig(max_num_batched_tokens=1 << 20),
                       num_blocks=200_000, max_model_len=1 << 20, step_time_fn=STEP_TIME)
    for i in range(NUM_SEQS):
        s.add_request(Request(i, 0.0, 500, 100_000))
    now = 0.0
    while s.num_waiting:  # admit and prefill everybody
        b = s.schedule(now)
        s.update(b, [now] * b.num_steps)
    costs = []
    for _ in range(WINDOWS):
        t0 = time.perf_counter()
        b = s.schedule(now)
        s.update(b, [now + j for j in range(b.num_steps)])
        costs.append(time.perf_counter() - t0)
        assert len(b.seqs) == NUM_SEQS
        now += b.num_steps
    return statistics.median(costs) * 1e6


def probe_window_us(num_seqs: int, k: int, windows: int = PROBE_WINDOWS) -> float:
    """schedule() + update() of a multi_step k Scheduler with ``num_seqs`` decoding requests,
    median over ``windows`` windows, in microseconds (Profiler.cpu_scheduler's measurement)."""
    from experiments.measure import scheduler_window_s

    return scheduler_window_s(num_seqs, k, windows) * 1e6


def probe(repeats: int = PROBE_REPEATS, windows: int = PROBE_WINDOWS) -> dict[str, dict[int, float]]:
    """Every probe case's time per window (us), the median over ``repeats`` rounds, with the
    collector frozen as the serving loop runs: {"k1": {num_seqs: us}, "k8": {...}}."""
    rounds: dict[tuple[int, int], list[float]] = {}
    gc.collect()
    gc.freeze()
    try:
        for _ in range(repeats):
            for k in PROBE_STEPS:
                for n in PROBE_SEQS:
                    rounds.setdefault((k, n), []).append(probe_window_us(n, k, windows))
    finally:
        gc.unfreeze()
    return {f"k{k}": {n: round(statistics.median(rounds[(k, n)]), 3) for n in PROBE_SEQS}
            for k in PROBE_STEPS}


def reference_window_us(path: Path | None = None) -> dict[str, dict[int, float]]:
    """The reference host's probe times: a host profile's ``window_us``, or (None) the
    calibration host's Scheduler bench rows."""
    if path is not None:
        return read_host_profile(path)["window_us"]
    import pandas as pd

    data = pd.read_csv(REFERENCE_CSV)
    rows = data[data["kind"] == "scheduler"]
    return {f"k{k}": {int(r.num_seqs): round(float(r.sched_s) * 1e6, 3)
                      for r in rows[rows["k"] == k].itertuples()} for k in PROBE_STEPS}


def cpu_factor(window_us: dict[str, dict[int, float]],
               reference: dict[str, dict[int, float]]) -> float:
    """The median over the cases both have of this host's time over the reference's."""
    ratios = [us / reference[k][n] for k, by_n in window_us.items() for n, us in by_n.items()
              if reference.get(k, {}).get(n, 0) > 0]
    if not ratios:
        raise HostProfileError("the reference has none of the probe's windows")
    return round(statistics.median(ratios), 4)


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(),
            # other work on the host moves the probe: its 1-minute load when measured
            "load_average": round(os.getloadavg()[0], 2)}


def host_profile(name: str, window_us: dict[str, dict[int, float]],
                 reference: Path | None = None) -> dict[str, Any]:
    """A host profile's content (conf/host/NAME.yaml) from its probe times."""
    ref = reference_window_us(reference)
    return {"name": name, "cpu_factor": cpu_factor(window_us, ref),
            "measured": datetime.date.today().isoformat(), "machine": machine(),
            "reference": str(reference) if reference is not None else REFERENCE_NOTE,
            "window_us": window_us}


def write_host_profile(profile: dict[str, Any], conf_dir: Path = _CONF) -> Path:
    """conf_dir/host/NAME.yaml, whose content Hydra places under ``overhead.host``."""
    from experiments.files import write_text_atomic

    path = conf_dir / "host" / f"{profile['name']}.yaml"
    head = ("# @package overhead.host\n"
            f"# A host profile: `python benchmarks/scheduler_speed.py --host {profile['name']}`. "
            "A run with\n# host=NAME scales its overhead profile's CPU costs by cpu_factor "
            "(this host's scheduler time\n# per window over the reference host's, median over "
            "window_us's windows).\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, head + yaml.safe_dump(profile, sort_keys=False, width=96))
    return path


def read_host_profile(path: Path) -> dict[str, Any]:
    """A host profile, checked: its name, a cpu_factor > 0 and window_us per k and num_seqs."""
    try:
        prof = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise HostProfileError(f"{path}: not a readable host profile "
                               f"({str(err).splitlines()[0]})") from None
    if not isinstance(prof, dict) or not isinstance(prof.get("name"), str):
        raise HostProfileError(f"{path}: not a host profile (no name)")
    f = prof.get("cpu_factor")
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < float("inf"):
        raise HostProfileError(f"{path}: cpu_factor must be a number > 0, got {f!r}")
    w = prof.get("window_us")
    if not isinstance(w, dict) or not all(
            isinstance(by_n, dict) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                           and v > 0 for v in by_n.values())
            for by_n in w.values()):
        raise HostProfileError(f"{path}: window_us must map k1/k8 to {{num_seqs: us > 0}}")
    return prof


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", metavar="NAME",
                    help="measure this host and write conf/host/NAME.yaml (its host profile)")
    ap.add_argument("--reference", type=Path, default=None,
                    help="a host profile of the host the overhead profile was fitted on "
                    "(default: the calibration host of schedlab_h200)")
    ap.add_argument("--conf-dir", type=Path, default=_CONF, help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=PROBE_REPEATS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.host is None:
        print(f"{'policy':<16}{'us/window':>10}")
        for name, params in CASES:
            print(f"{name:<16}{measure(name, params):>10.0f}")
        return
    try:
        if not NAME_RE.fullmatch(args.host):
            raise HostProfileError(f"--host {args.host!r}: not a plain profile name "
                                   "(letters, digits, _ . -)")
        if args.reference is not None:
            read_host_profile(args.reference)  # a bad reference fails before the probe
        prof = host_profile(args.host, probe(args.repeats), args.reference)
        path = write_host_profile(prof, args.conf_dir)
    except HostProfileError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"{path}: cpu_factor {prof['cpu_factor']:g} against the reference host")


if __name__ == "__main__":
    main()
