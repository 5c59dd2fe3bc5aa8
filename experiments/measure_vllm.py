"""Calibration measurements on vLLM's engine: ``experiments.measure``'s rows, from vLLM.

vLLM's model runner cannot be handed a window, so each microbenchmark is a small run that
makes the step shapes of the grid: n prompts of q tokens at t=0 (prefill steps), b prompts
decoding side by side (decode steps of all b sequences), decodes joined by late prompts (mixed
steps). Served synthetic runs (lognormal lengths, never the validation's ShareGPT) add the
steps a policy forms and the CPU costs only serving shows. Every engine step is timed in
parts, in the engine core (which runs in this process): the scheduler's ``schedule()`` and
``update_from_output()``, the model executor's ``execute_model()`` and ``sample_tokens()``
(the device's part, ``gpu_s``: on the CPU it holds vLLM's input preparation too), and the
rest of the engine's step (output processing). Each step's shape comes from the requests vLLM
scheduled (``simulator.step_shape.window_shapes``), so ``experiments.fit`` fits these rows as
it fits the real backend's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from experiments.measure import SHAPE_COLS, Profile
from policies import Batch, ModelSpec, Request, ScheduledSeq
from simulator.step_shape import window_shapes

# (num_seqs, prompt tokens): prefill steps; (batch, prompt tokens): decode steps; (decodes,
# their prompt, a late prompt's tokens): mixed steps; the served runs' (request rate (inf: t=0),
# requests)
GRID = {"prefill": [(1, 16), (1, 64), (1, 128), (1, 256), (1, 512), (1, 1024), (1, 2000),
                    (2, 100), (4, 60), (4, 256), (8, 128), (16, 64), (3, 600), (8, 400)],
        "decode": [(b, c) for b in (1, 8, 32, 64, 128, 256) for c in (64, 300, 1000)],
        "mixed": [(8, 200, 300), (32, 300, 600), (64, 150, 1000), (128, 100, 200),
                  (200, 60, 800)],
        "served": [(float("inf"), 100), (12.0, 60)]}
QUICK = {"prefill": [(1, 64), (2, 100), (1, 500)], "decode": [(1, 64), (16, 200)],
         "mixed": [(8, 100, 200)], "served": [(float("inf"), 16)]}
DECODE_STEPS = 8  # the steps of each decode microbenchmark at its whole batch
# a mixed microbenchmark's late prompts arrive at these times, while the first ones decode
MIXED_DELAYS_S = (0.1, 0.3, 0.6)


class StepTimer:
    """Each engine step's parts, timed by wrapping the engine core's scheduler and model
    executor (instance attributes: vLLM's classes are untouched), with the step's shape."""

    def __init__(self, llm: Any) -> None:
        from vllm_backend.engine import scheduler_of

        core = llm.llm_engine.engine_core.engine_core
        self.sched = scheduler_of(llm)
        self.steps: list[dict[str, Any]] = []
        self._cur: dict[str, Any] = {}
        self.sched.schedule = self._timed(self.sched.schedule, "schedule_s", self._shape)
        self.sched.update_from_output = self._timed(self.sched.update_from_output, "update_s")
        ex = core.model_executor
        ex.execute_model = self._timed(ex.execute_model, "gpu_s")
        ex.sample_tokens = self._timed(ex.sample_tokens, "gpu_s")

    def _timed(self, fn: Callable[..., Any], part: str,
               then: Callable[[Any], None] | None = None) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if part == "schedule_s":
                self._cur = {"schedule_s": 0.0, "gpu_s": 0.0, "update_s": 0.0}
                self.steps.append(self._cur)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self._cur[part] += time.perf_counter() - t0
            if then is not None:
                then(out)
            return out
        return call

    def _shape(self, out: Any) -> None:
        """The step's shape from what vLLM scheduled (its requests' computed tokens are
        already advanced past this step's when schedule() returns)."""
        seqs = []
        for rid, q in out.num_scheduled_tokens.items():
            r = self.sched.requests[rid]
            c = r.num_computed_tokens - q
            req = Request(0, 0.0, r.num_prompt_tokens, r.max_tokens or 1)
            req.num_output_tokens = r.num_output_tokens
            seqs.append(ScheduledSeq(req, q, c, 1, not (q == 1 and c + 1 == r.num_tokens)))
        if not seqs:
            self._cur["empty"] = True
            return
        shape = window_shapes(Batch(seqs, 1))[0]
        self._cur.update({c: getattr(shape, c) for c in SHAPE_COLS},
                         num_prefill_seqs=shape.num_prefill_seqs)


def kind_of(row: dict[str, Any]) -> str:
    """A microbenchmark step's kind by what it computes."""
    if row["num_prefill_tokens"] == 0:
        return "decode"
    return "prefill" if row["num_prefill_tokens"] == row["num_tokens"] else "mixed"


class VllmProfiler:
    """Runs the grid's small workloads and the served runs on one vLLM engine (built as
    ``backend=vllm`` builds it, from ``cfg``) and records each step as a calibration row."""

    def __init__(self, cfg: dict[str, Any], reps: int, seed: int = 0) -> None:
        from common.parallel import ParallelConfig
        from experiments.backends import VllmBackend
        from experiments.choices import ClusterChoice, PolicyChoice, plain
        from vllm_backend.engine import build_engine

        self.spec = ModelSpec.from_dict(plain(cfg["model"]))
        parallel = ParallelConfig.from_mapping(plain(cfg.get("parallel") or {}))
        backend = VllmBackend(cfg, PolicyChoice(cfg, self.spec), self.spec, parallel,
                              ClusterChoice(cfg, plain(cfg["backend"]), parallel))
        self.schedlab = backend.schedlab_section()
        self.llm = build_engine(self.spec, backend.settings, self.schedlab)
        # the token budget of a step (chunked_prefill's, the grid's policy: the scheduler's)
        self.budget = int(self.schedlab["scheduler"].get("max_num_batched_tokens") or 2048)
        self.timer = StepTimer(self.llm)
        self.reps = reps
        self.rng = np.random.default_rng(seed)
        self.next_id = 0
        self.rows: list[dict[str, Any]] = []
        self.window = 0

    def requests(self, lengths: list[tuple[int, int]], arrivals: list[float]) -> list[Request]:
        out = []
        for (prompt, max_tokens), t in zip(lengths, arrivals, strict=True):
            self.next_id += 1
            ids = self.rng.integers(0, self.spec.vocab_size, prompt).tolist()
            out.append(Request(self.next_id, t, prompt, max_tokens, prompt_token_ids=ids))
        return out

    def serve(self, reqs: list[Request]) -> list[dict[str, Any]]:
        """The requests served (vllm_backend.engine.serve); each step's timed parts and shape
        beside its whole time (``step_s``), less the steps that scheduled nothing."""
        from vllm_backend.engine import serve

        self.timer.steps.clear()
        result = serve(self.llm, reqs, progress=False)
        steps = [s for s in self.timer.steps if not s.get("empty")]
        if len(steps) != len(result.steps):
            raise RuntimeError(f"calibration: {len(steps)} timed steps, but the run logged "
                               f"{len(result.steps)}")
        for s, logged in zip(steps, result.steps, strict=True):
            # the engine's step beyond the core's parts: output processing
            s["pythonize_s"] = max(logged["step_s"] - s["schedule_s"] - s["gpu_s"]
                                   - s["update_s"], 0.0)
        return steps

    def micro(self, kind: str, lengths: list[tuple[int, int]], arrivals: list[float],
              batch: int | None = None) -> None:
        """One microbenchmark, ``reps`` times: its steps of ``kind`` (the steps that lead up to
        them, e.g. a decode benchmark's prefills, are not its measurement), of ``batch``
        sequences where it is given."""
        for _ in range(self.reps):
            for s in self.serve(self.requests(lengths, arrivals)):
                self.window += 1
                if kind_of(s) == kind and batch in (None, s["num_seqs"]):
                    self.rows.append(self._row(kind, s))

    def decode(self, batch: int, prompt: int) -> None:
        """``batch`` prompts at t=0 decoding together for DECODE_STEPS steps: each generates
        as many tokens as the steps that prefill them all (chunks of the token budget, the
        first prompts decoding meanwhile) and DECODE_STEPS more, so that the whole batch
        decodes side by side; the steps of fewer sequences (before the last prompt's first
        token, after the first request's last) are not recorded."""
        prefill_steps = -(-batch * prompt // self.budget)
        self.micro("decode", [(prompt, prefill_steps + DECODE_STEPS)] * batch,
                   [0.0] * batch, batch=batch)

    def served(self, rate: float, num_prompts: int, quick: bool) -> None:
        """A synthetic workload (lognormal lengths, as experiments.measure's served runs) at
        ``rate`` (inf: all at t=0): a ``served_step`` row per step (its device time, for the
        step-time fit) and a ``served`` row of its CPU costs (fit_cpu.fit_overhead)."""
        cap_p, cap_o = (200, 16) if quick else (2000, 1000)
        prompts = np.clip(np.round(self.rng.lognormal(np.log(180), 0.9, num_prompts)), 2, cap_p)
        outputs = np.clip(np.round(self.rng.lognormal(np.log(120), 0.9, num_prompts)), 2, cap_o)
        gaps = (np.zeros(num_prompts) if np.isinf(rate)
                else self.rng.exponential(1.0 / rate, num_prompts))
        arrivals = np.cumsum(gaps).tolist()
        lengths = [(int(p), int(o)) for p, o in zip(prompts, outputs, strict=True)]
        policy = self.schedlab["policy"]["name"]
        for s in self.serve(self.requests(lengths, arrivals)):
            self.window += 1
            self.rows.append({**self._row("served_step", s), "policy": policy,
                              "served_window": self.window})
            self.rows.append({"kind": "served", "k": 1, "step": 0, "policy": policy,
                              "served_window": self.window, "window": self.window,
                              "num_seqs": s["num_seqs"], "num_tokens": s["num_tokens"],
                              "kv_tokens": s["kv_tokens"],
                              "num_prefill_seqs": s["num_prefill_seqs"],
                              "gpu_s": s["gpu_s"], "cpu_s": s["schedule_s"] + s["update_s"],
                              "gap_s": float("nan"), "pythonize_s": s["pythonize_s"]})

    def _row(self, kind: str, s: dict[str, Any]) -> dict[str, Any]:
        return {"kind": kind, "k": 1, "step": 0, "window": self.window,
                **{c: s[c] for c in SHAPE_COLS}, "num_prefill_seqs": s["num_prefill_seqs"],
                "prefill_graph_max_tokens": 0, "piecewise_graph_max_tokens": 0,
                "gpu_s": s["gpu_s"], "prepare_s": float("nan"),
                "pythonize_s": s["pythonize_s"], "sched_s": s["schedule_s"] + s["update_s"]}


def profile(cfg: dict[str, Any], quick: bool, reps: int, progress: bool = True) -> Profile:
    """The grid's microbenchmarks and the served runs on vLLM's engine (``cfg``: a
    ``backend=vllm`` run's composed config), as ``experiments.measure.profile``'s Profile
    (no window timeline or clock samples: vLLM's steps are timed whole on the host)."""
    from tqdm import tqdm

    g = QUICK if quick else GRID
    p = VllmProfiler(cfg, reps)
    total = sum(len(v) for v in g.values())
    with tqdm(total=total, desc="calibrating vLLM", disable=not progress) as bar:
        for n, q in g["prefill"]:
            p.micro("prefill", [(q, 1)] * n, [0.0] * n)
            bar.update()
        for b, c in g["decode"]:
            p.decode(b, c)
            bar.update()
        for b, c, q in g["mixed"]:
            late = len(MIXED_DELAYS_S)
            p.micro("mixed", [(c, 8 * DECODE_STEPS)] * b + [(q, 1)] * late,
                    [0.0] * b + list(MIXED_DELAYS_S))
            bar.update()
        for rate, num_prompts in g["served"]:
            p.served(rate, num_prompts, quick)
            bar.update()
    del p.llm
    return Profile(pd.DataFrame(p.rows), pd.DataFrame(columns=["window", "start_s", "end_s",
                                                               "gpu_s"]),
                   pd.DataFrame(columns=["t", "sm_mhz", "power_w", "temp_c"]))
