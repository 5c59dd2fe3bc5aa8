"""The layout search (DistServe's placement question, Vidur-Search's idea): for one model,
hardware, workload and SLO, which cluster layout (colocated replicas, or prefill and decode
replicas, and the policy each runs) gives the most goodput per GPU.

    python -m experiments.search                       # the documented scenario (docs/cluster.md)
    python -m experiments.search --max-gpus 8 --gpus-per-replica 4 \\
        --policies multi_step:8 chunked_prefill --rates-per-gpu 2 4 6 8 \\
        -- model=llama3_70b parallel.tensor_parallel_size=4
    python -m experiments.search --prefill-tp 1 2      # prefill replicas of 1 or 2 GPUs
    python -m experiments.search -- hydra/launcher=slurm hydra.launcher.partition=<p>

Every layout of up to ``--max-gpus`` GPUs (n colocated replicas; p prefill + d decode
replicas, each role at each tensor-parallel size of ``--prefill-tp`` and ``--decode-tp``, its
replicas taking that many GPUs each) under each policy is run at each rate of ``--rates-per-gpu`` times its GPU count,
on ``--prompts-per-gpu`` times its GPU count requests, the layouts of one GPU count as one
Hydra sweep of experiments.run (so on joblib, SLURM or Ray as every sweep, through the
arguments after ``--``). A layout's goodput per GPU is DistServe's:
the highest rate at which at least ``--attainment`` of the requests meet every goodput target,
over its GPUs. The search prints each layout's, the best, and the Pareto front of GPUs against
the goodput they sustain, and draws it (search_pareto.png in the search's directory).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from experiments.figure_style import save  # noqa: E402

# The documented scenario's run settings (docs/cluster.md, "The layout search")
SCENARIO = ("model=llama3_8b", "hardware=h100_sxm", "workload=sharegpt",
            "goodput.ttft_ms=250", "goodput.tpot_ms=25",
            "router=least_outstanding", "cluster.decode_router=kv_balance",
            "cluster.link=nvlink")


@dataclass(frozen=True)
class Layout:
    """A candidate: ``colocated`` replicas serving whole requests, or ``prefill`` and
    ``decode`` replicas (of ``prefill_tp`` and ``decode_tp`` GPUs each where not 1: the
    group's own parallel); every replica runs ``policy`` (a name, with ``k`` steps where it
    takes them)."""

    colocated: int = 0
    prefill: int = 0
    decode: int = 0
    policy: str = "multi_step"
    k: int | None = 8
    prefill_tp: int = 1
    decode_tp: int = 1

    @property
    def replicas(self) -> int:
        return self.colocated + self.prefill + self.decode

    def gpus(self, gpus_per_replica: int = 1) -> int:
        """Its GPUs: each group's replicas x their GPUs (``gpus_per_replica``, the run's
        parallel, times a role's own tensor-parallel size)."""
        return gpus_per_replica * (self.colocated + self.prefill * self.prefill_tp
                                   + self.decode * self.decode_tp)

    def policy_setting(self) -> str:
        if self.k is None:
            return f"policy:{self.policy}"
        return f"policy:{{name:{self.policy},num_steps:{self.k}}}"

    def groups(self) -> str:
        """cluster.groups as an override's value."""
        pol = self.policy_setting()
        if self.colocated:
            return f"[{{replicas:{self.colocated},{pol}}}]"
        own = [f",parallel:{{tensor_parallel_size:{tp}}}" if tp != 1 else ""
               for tp in (self.prefill_tp, self.decode_tp)]
        return (f"[{{replicas:{self.prefill},role:prefill,{pol}{own[0]}}},"
                f"{{replicas:{self.decode},role:decode,{pol}{own[1]}}}]")

    def name(self) -> str:
        tp = [f"(tp{t})" if t != 1 else "" for t in (self.prefill_tp, self.decode_tp)]
        shape = (f"{self.colocated} colocated" if self.colocated
                 else f"{self.prefill}P{tp[0]}+{self.decode}D{tp[1]}")
        return f"{shape} {self.policy}" + (f" k={self.k}" if self.k is not None else "")


def layouts(max_gpus: int, gpus_per_replica: int, policies: list[tuple[str, int | None]],
            prefill_tp: Sequence[int] = (1,), decode_tp: Sequence[int] = (1,)
            ) -> dict[int, list[Layout]]:
    """Every candidate of at most ``max_gpus`` GPUs, by GPU count (each group's replicas x
    their GPUs)."""
    out: dict[int, list[Layout]] = {}
    for n in range(1, max_gpus // gpus_per_replica + 1):
        for policy, k in policies:
            out.setdefault(n * gpus_per_replica, []).append(
                Layout(colocated=n, policy=policy, k=k))
            for p in range(1, n):
                for ptp in prefill_tp:
                    for dtp in decode_tp:
                        cand = Layout(prefill=p, decode=n - p, policy=policy, k=k,
                                      prefill_tp=ptp, decode_tp=dtp)
                        if cand.gpus(gpus_per_replica) <= max_gpus:
                            out.setdefault(cand.gpus(gpus_per_replica), []).append(cand)
    return dict(sorted(out.items()))


def goodput_per_gpu(rows: pd.DataFrame, gpus: int, attainment: float) -> float:
    """The highest rate at which at least ``attainment`` of the requests met every target (the
    run's goodput over its offered rate, its unfinished requests counting as misses), per GPU;
    0 if none did."""
    met = rows["request_goodput"] * rows["duration"] / rows["num_prompts"]
    ok = rows[met >= attainment]
    return float(ok["request_rate"].max()) / gpus if len(ok) else 0.0


def pareto(table: pd.DataFrame) -> pd.DataFrame:
    """The layouts no other beats on both fewer GPUs and more goodput (GPUs x goodput per GPU),
    best per GPU count, by GPUs."""
    best = table.sort_values("goodput_per_gpu", ascending=False).groupby("gpus").head(1)
    best = best.sort_values("gpus")
    front, top = [], -1.0
    for _, row in best.iterrows():
        total = row["goodput_per_gpu"] * row["gpus"]
        if total > top:
            front.append(row)
            top = total
    return pd.DataFrame(front)


def run_sweep(out: Path, gpus: int, cands: list[Layout], rates: list[float],
              extra: list[str], prompts: int = 1000) -> Path:
    """One Hydra sweep of experiments.run over these layouts and rates, ``prompts`` requests
    each (a larger cluster gets more, so that its highest rate lasts as long); its
    aggregate.csv."""
    sweep = out / f"{gpus}gpu"
    groups = ",".join(c.groups() for c in cands)
    cmd = [sys.executable, "-m", "experiments.run", "-m", "progress=false", "++skip_existing=true",
           *SCENARIO, f"workload.num_prompts={prompts}", f"cluster.groups={groups}",
           "workload.request_rate=" + ",".join(f"{r:g}" for r in rates),
           f"hydra.sweep.dir={sweep}", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        lines = [line for line in (proc.stderr + proc.stdout).splitlines()
                 if line.strip() and "HYDRA_FULL_ERROR" not in line]
        raise ValueError(f"the {gpus}-GPU sweep failed: {lines[0] if lines else proc.returncode}")
    return sweep / "aggregate.csv"


def search(out: Path, max_gpus: int, policies: list[tuple[str, int | None]],
           rates_per_gpu: list[float], attainment: float, gpus_per_replica: int = 1,
           extra: list[str] | None = None, prompts_per_gpu: int = 1000,
           prefill_tp: Sequence[int] = (1,), decode_tp: Sequence[int] = (1,)) -> pd.DataFrame:
    """Run every candidate and return one row per layout: its GPUs and goodput per GPU."""
    rows = []
    for gpus, cands in layouts(max_gpus, gpus_per_replica, policies, prefill_tp,
                               decode_tp).items():
        table = pd.read_csv(run_sweep(out, gpus, cands, [r * gpus for r in rates_per_gpu],
                                      list(extra or []), prompts_per_gpu * gpus))
        # (a colocated run records no layout)
        layout = table["layout"].astype(object) if "layout" in table else \
            pd.Series([None] * len(table), dtype=object)
        for cand in cands:
            mine = table[(layout.fillna(f"{cand.replicas} colocated")
                          == _layout_label(cand)) & (table["policy"] == cand.policy)
                         & ((table["k"] == cand.k) if cand.k is not None else True)]
            rows.append({"layout": cand.name(), "gpus": gpus, "runs": len(mine),
                         "goodput_per_gpu": goodput_per_gpu(mine, gpus, attainment)})
    return pd.DataFrame(rows)


def _layout_label(cand: Layout) -> str:
    """result.json's schedlab.layout of the candidate (a colocated one's as plot_cluster
    names it)."""
    if cand.colocated:
        return f"{cand.colocated} colocated"
    tp = [f" (tp={t})" if t != 1 else "" for t in (cand.prefill_tp, cand.decode_tp)]
    return f"{cand.prefill} prefill{tp[0]} + {cand.decode} decode{tp[1]}"


def pareto_figure(table: pd.DataFrame, front: pd.DataFrame) -> plt.Figure:
    """Each layout's goodput sustained (per GPU times GPUs) against its GPUs, the Pareto front
    drawn and named."""
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    ax.scatter(table["gpus"], table["goodput_per_gpu"] * table["gpus"], color="0.6", s=18,
               label="layouts")
    ax.plot(front["gpus"], front["goodput_per_gpu"] * front["gpus"], marker="o", color="C3",
            label="Pareto front")
    for _, row in front.iterrows():
        ax.annotate(row["layout"], (row["gpus"], row["goodput_per_gpu"] * row["gpus"]),
                    fontsize=7, xytext=(4, 6), textcoords="offset points")
    ax.set_xticks(sorted(table["gpus"].unique()))
    ax.margins(x=0.2, y=0.12)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("goodput sustained (req/s at the attainment)")
    ax.set_title("Layout search")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _policy(text: str) -> tuple[str, int | None]:
    name, _, k = text.partition(":")
    if k and not k.isdigit():
        raise argparse.ArgumentTypeError(f"--policies: {text!r}: NAME or NAME:K (K an integer)")
    return name, int(k) if k else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("multirun/search"))
    ap.add_argument("--max-gpus", type=int, default=3)
    ap.add_argument("--gpus-per-replica", type=int, default=1,
                    help="tensor x pipeline parallel size of each replica (set the same "
                         "parallel.* after --)")
    ap.add_argument("--policies", nargs="+", type=_policy, default=[("multi_step", 8)],
                    help="NAME or NAME:K (num_steps) each")
    ap.add_argument("--rates-per-gpu", nargs="+", type=float,
                    default=[10, 20, 30, 40, 50, 60, 70, 80, 90, 100])
    ap.add_argument("--prefill-tp", nargs="+", type=int, default=[1],
                    help="tensor-parallel sizes of a prefill replica (its GPUs), each tried")
    ap.add_argument("--decode-tp", nargs="+", type=int, default=[1],
                    help="tensor-parallel sizes of a decode replica (its GPUs), each tried")
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--prompts-per-gpu", type=int, default=1000,
                    help="requests a run, per GPU of its layout")
    ap.add_argument("extra", nargs="*", help="after --: experiments.run overrides (model, "
                                             "hardware, workload, goodput, hydra/launcher)")
    args = ap.parse_args(argv)
    for name, value, low in (("--max-gpus", args.max_gpus, 1),
                             ("--gpus-per-replica", args.gpus_per_replica, 1),
                             ("--prompts-per-gpu", args.prompts_per_gpu, 1)):
        if value < low:
            ap.error(f"{name} must be >= {low}, got {value}")
    for name, sizes in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)):
        if any(t < 1 for t in sizes):
            ap.error(f"{name} must be >= 1 each, got {sizes}")
    if args.gpus_per_replica != 1 and (args.prefill_tp != [1] or args.decode_tp != [1]):
        ap.error("--prefill-tp and --decode-tp set a replica's GPUs themselves: leave "
                 f"--gpus-per-replica at 1, got {args.gpus_per_replica}")
    if not 0 < args.attainment <= 1:
        ap.error(f"--attainment must be in (0, 1], got {args.attainment}")
    if any(r <= 0 for r in args.rates_per_gpu):
        ap.error("--rates-per-gpu must be > 0")
    try:
        table = search(args.out, args.max_gpus, args.policies, args.rates_per_gpu,
                       args.attainment, args.gpus_per_replica, args.extra, args.prompts_per_gpu,
                       args.prefill_tp, args.decode_tp)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    front = pareto(table)
    best = table.sort_values(["goodput_per_gpu", "gpus"], ascending=[False, True]).iloc[0]
    print(table.sort_values(["gpus", "goodput_per_gpu"], ascending=[True, False])
          .to_string(index=False))
    print(f"\nbest: {best['layout']} on {best['gpus']} GPUs, "
          f"{best['goodput_per_gpu']:.1f} req/s per GPU")
    print("Pareto front (GPUs, goodput sustained): " + "; ".join(
        f"{int(r['gpus'])}: {r['layout']} {r['goodput_per_gpu'] * r['gpus']:.0f} req/s"
        for _, r in front.iterrows()))
    table.to_csv(args.out / "search.csv", index=False)
    for p in save(pareto_figure(table, front), args.out, "search_pareto"):
        print(p)


if __name__ == "__main__":
    main()
