"""Scenario: speculative decoding in the real engine on a GPU, where the CPU tests cannot reach:
the CUDA graphs of the verify and of the draft step, and the Triton kernels at scale.

1. ids: the tiny model (fp32) serving 24 requests under multi_step (4 steps a window) gives
   the same ids with speculation verified greedily (self-draft, n-gram lookup) as without it,
   and, under a given acceptance rate, the same ids and drafts with CUDA graphs as eagerly;
2. speed (``--speed``): output tokens a second of a target with a draft model of another
   shape (random weights, the workload's acceptance rate), without speculation and drafting
   k tokens, offline; each run's runner is released before the next, and the device memory
   still in use after it is printed (it should fall back to what the process held before).

    python benchmarks/spec_engine_check.py [--speed --model llama3_8b --draft llama3_2_1b]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.model_spec import ModelSpec  # noqa: E402
from common.spec_acceptance import acceptance_process  # noqa: E402
from policies import Request, Scheduler, SchedulerConfig, make_policy  # noqa: E402
from policies.speculation import make_speculation  # noqa: E402
from real_backend import run_real  # noqa: E402
from real_backend.engine import release_kept_runner  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"
DEVICE = {"device": "cuda"}  # --device cpu: a smoke run of the same code without a GPU


def model_spec(name: str) -> ModelSpec:
    return ModelSpec.from_dict(yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text()))


def serve(model: ModelSpec, requests: list[Request], spec: dict | None, acceptance: dict | None,
          backend: dict, num_steps: int = 4, max_num_seqs: int = 256):
    """One offline run: its result (token ids kept)."""
    draft = None
    if spec and spec["method"] == "draft":
        draft = model if spec["draft_model"] == "same" else model_spec(spec["draft_model"])
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs)

    def new(n: int) -> Scheduler:
        speculation = (make_speculation({**spec, "policy": "spec_fixed"},
                                        acceptance_process(acceptance, 7), None, draft)
                       if spec else None)
        return Scheduler(make_policy("multi_step", num_steps=num_steps), cfg, n,
                         model.max_model_len, None, speculation)

    engine = {k: v for k, v in (spec or {}).items() if k != "policy"}
    settings = {**DEVICE, "save_token_ids": True, **backend}
    if spec:
        settings["spec"] = engine
    return run_real(requests, new, model, settings, progress=False)


def requests(model: ModelSpec, n: int, prompt: tuple[int, int], output: tuple[int, int],
             seed: int = 1, repeat: bool = False) -> list[Request]:
    """Seeded random prompts; ``repeat``: each a short random phrase repeated (n-gram lookup
    finds its continuations)."""
    r = random.Random(seed)
    out = []
    for i in range(n):
        length = r.randint(*prompt)
        if repeat:
            phrase = [r.randrange(model.vocab_size) for _ in range(r.randint(3, 8))]
            ids = (phrase * (length // len(phrase) + 1))[:length]
        else:
            ids = [r.randrange(model.vocab_size) for _ in range(length)]
        out.append(Request(i, 0.0, 0, r.randint(*output), prompt_token_ids=ids))
    return out


def check_ids() -> None:
    tiny = model_spec("tiny")
    fp32 = {"dtype": "float32"}

    def run(spec, acceptance=None, graphs=True, repeat=False):
        reqs = requests(tiny, 24, (4, 60), (8, 80), repeat=repeat)
        out = serve(tiny, reqs, spec, acceptance, {**fp32, "cuda_graphs": graphs})
        return out.token_ids, out.stats, out.spec_decode

    base, stats, _ = run(None)
    print("no speculation: cuda graph sizes", stats["cuda_graph_sizes"][:4], "...")
    for spec in ({"method": "draft", "num_tokens": 3, "draft_model": "same"},
                 {"method": "ngram", "num_tokens": 4}):
        ids, _, counts = run(spec)
        assert ids == base, f"{spec}: greedy verification changed the ids"
        print(f"{spec['method']} greedy: ids as without speculation;", counts.metrics())
    ids, _, counts = run({"method": "ngram", "num_tokens": 4}, repeat=True)
    print("ngram on repeated phrases:", counts.metrics())
    spec = {"method": "draft", "num_tokens": 3, "draft_model": "tiny"}
    graphed = run(spec, {"rate": 0.7})
    eager = run(spec, {"rate": 0.7}, graphs=False)
    assert graphed[0] == eager[0], "CUDA graphs and the eager path disagree"
    assert graphed[2].metrics() == eager[2].metrics()
    print("given acceptance 0.7: CUDA graphs == eager;", graphed[2].metrics())


def device_memory() -> str:
    """The device memory in use now: torch's tensors, its cache, and the device as a whole."""
    if not torch.cuda.is_available():
        return "no GPU"
    free, total = torch.cuda.mem_get_info()
    return (f"allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB, reserved "
            f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB, device in use "
            f"{(total - free) / 2**30:.2f} of {total / 2**30:.2f} GiB")


def speed(args: argparse.Namespace) -> None:
    model = model_spec(args.model)
    print(f"{args.model} target, {args.draft} draft, {args.requests} requests "
          f"prompt {args.prompt} output {args.output}, acceptance rate {args.rate}")
    release_kept_runner()
    print("before the runs:", device_memory())
    for k in [0] + args.k:
        spec = None if k == 0 else {"method": "draft", "num_tokens": k,
                                    "draft_model": args.draft}
        reqs = requests(model, args.requests, (args.prompt, args.prompt),
                        (args.output, args.output))
        t = time.perf_counter()
        out = serve(model, reqs, spec, {"rate": args.rate} if spec else None, {},
                    num_steps=args.steps)
        tokens = sum(len(v) for v in out.token_ids.values())
        m = out.spec_decode.metrics() if out.spec_decode else {}
        print(f"k={k}: {tokens / out.duration:8.0f} output tok/s, duration {out.duration:.2f} s"
              f" (setup {out.stats['setup_s']:.0f} s, wall {time.perf_counter() - t:.0f} s), "
              f"blocks {out.stats['num_blocks']}, acceptance length "
              f"{m.get('spec_decode_acceptance_length')}")
        del out
        release_kept_runner()  # the next run builds its runner in what this one leaves
        print(f"after k={k}, runner released:", device_memory())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speed", action="store_true", help="also measure output throughput")
    ap.add_argument("--model", default="llama3_8b")
    ap.add_argument("--draft", default="llama3_2_1b")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rate", type=float, default=0.8)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--skip-ids", action="store_true")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    DEVICE["device"] = args.device
    if not args.skip_ids:
        check_ids()
    if args.speed:
        speed(args)


if __name__ == "__main__":
    main()
