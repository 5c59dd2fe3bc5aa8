"""The policies of the literature, and a policy written outside schedlab, form the same windows
on the real engine as in the simulator (offline, every decision depends on the scheduler's state
alone), preemptions included."""

from __future__ import annotations

import random
import textwrap
from pathlib import Path

import pytest
import yaml
from rb_util import load_spec

from policies import Request, Scheduler, SchedulerConfig, make_policy
from real_backend import run_real
from simulator import OverheadSpec, simulate
from simulator.cost_model import step_time_fn
from simulator.hardware import HardwareSpec

SPEC = load_spec("tiny")
BLOCK_SIZE = 4
NUM_BLOCKS = 24  # 96 token slots for 16 requests of up to 64 tokens: preemptions
CONF = Path(__file__).resolve().parents[2] / "conf"
HW = HardwareSpec.from_dict(yaml.safe_load((CONF / "hardware" / "h100_sxm.yaml").read_text()))
WINDOW_COLUMNS = ("window", "k", "num_seqs", "num_prefill_seqs", "num_tokens", "kv_tokens",
                  "num_preempted", "num_wasted_steps")
USER_POLICY = Path(__file__).resolve().parents[1] / "data" / "short_prompt_first.py"


# A policy written outside schedlab whose hook ``hook`` answers ``value`` (a function of the
# hook's arguments where the answer depends on them): cp1's windows otherwise, preemptive
# (preempt_for_waiting is asked) and with max_steps a hook of its own.
BAD_HOOKS = '''
    from dataclasses import dataclass
    from typing import Any

    from policies import KStepPolicy, register


    @register
    @dataclass(frozen=True)
    class BadHooks(KStepPolicy):
        name = "bad_hooks"
        mixed_batches = True
        chunk_prefills = True
        orders_queue = True
        preemptive = True
        num_steps: int = 4
        hook: str = ""
        value: Any = None

        def answer(self, hook, default, *args):
            if hook != self.hook:
                return default
            if self.value == "divide by zero":
                return len(args) // 0
            return self.value(*args) if callable(self.value) else self.value

        @property
        def max_steps(self):
            return self.answer("max_steps", self.num_steps)

        def window_steps(self, sched, has_prefill):
            return self.answer("window_steps", 1 if has_prefill else self.num_steps, sched)

        def prefill_steps(self, k):
            return self.answer("prefill_steps", 1, k)

        def queue_key(self, req, sched):
            return self.answer("queue_key", 0, req, sched)

        def window_budget(self, sched):
            return self.answer("window_budget", super().window_budget(sched), sched)

        def admit(self, req, sched):
            return self.answer("admit", True, req, sched)

        def chunk_size(self, req, num_new, budget, sched):
            return self.answer("chunk_size", min(num_new, budget), req, num_new, budget, sched)

        def preemption_victim(self, sched, req):
            return self.answer("preemption_victim", sched.running[-1], sched, req)

        def preempt_for_waiting(self, sched):
            return self.answer("preempt_for_waiting", [], sched)
'''


def make_requests(with_ids: bool) -> list[Request]:
    r = random.Random(1)
    out = []
    for i in range(16):
        out_len, prompt = r.randint(4, 24), [r.randrange(SPEC.vocab_size)
                                             for _ in range(r.randint(1, 40))]
        req = (Request(i, 0.0, 0, out_len, prompt_token_ids=prompt) if with_ids
               else Request(i, 0.0, len(prompt), out_len))
        req.priority = r.choice((0, 1, 2))
        out.append(req)
    return out


def windows(policy: str, params: dict, budget: int | None, *, real: bool) -> list[tuple]:
    cfg = SchedulerConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=budget)
    fn = step_time_fn(SPEC, HW)

    def new(n: int) -> Scheduler:
        return Scheduler(make_policy(policy, **params), cfg, n, SPEC.max_model_len, fn)

    if real:
        out = run_real(make_requests(True), new, SPEC,
                       {"device": "cpu", "num_blocks": NUM_BLOCKS}, progress=False)
    else:
        out = simulate(make_requests(False), new, SPEC, HW, OverheadSpec(), block_size=BLOCK_SIZE,
                       num_blocks=NUM_BLOCKS, progress=False)
    return [tuple(row[c] for c in WINDOW_COLUMNS) for row in out.steps]


@pytest.mark.parametrize(("policy", "params", "budget"), [
    ("priority", {}, None),
    ("sjf", {"predictor": "noisy", "sigma": 1.0}, None),
    ("edf", {"ttft_slo_ms": 1e6}, None),
    ("sarathi", {"tpot_slo_ms": 0.095}, 32),  # under the tiny model's 4-token step (0.1 ms)
    ("mlfq", {"quantum_tokens": 4, "num_levels": 3}, None),
])
def test_policies_of_the_literature_make_the_same_windows_on_both_backends(policy, params, budget):
    real = windows(policy, params, budget, real=True)
    assert real == windows(policy, params, budget, real=False)
    if policy in ("priority", "mlfq"):
        assert any(w[6] for w in real)  # preemptions
    if policy == "sarathi":  # the target, not the token budget, sized the chunks
        assert real != windows("chunked_prefill", {}, budget, real=False)


def test_a_policy_from_outside_schedlab_runs_on_both_backends(tmp_path):
    params = {"module": str(USER_POLICY), "long_tokens": 20, "max_long": 1}
    real = windows("short_prompt_first", params, None, real=True)
    assert real == windows("short_prompt_first", params, None, real=False)
    first = [w for w in real if w[3]][0]  # the first prefill window: short prompts, one long
    assert first[3] > 1


def test_validate_policies_predicts_a_measured_run_from_its_config(tmp_path):
    """benchmarks/policy_suite.py's run layout (config.json beside result.json) scored by
    experiments.validate_policies: every metric of the table, predicted from the config."""
    import sys

    from experiments.validate import run_one
    from experiments.validate_policies import main

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from policy_suite import overrides

    run_one(overrides("priority", "inf", 6, smoke=True), tmp_path / "runs" / "priority_rateinf")
    df = main([str(tmp_path / "runs"), "--hardware", "cpu", "--overhead", "none",
               "--sim-repeats", "1", "--out", str(tmp_path / "out")])
    assert set(df["metric"]) == {"request_throughput", "median_ttft_ms", "median_tpot_ms",
                                 "p90_ttft_ms", "p90_tpot_ms", "slo_attainment"}
    assert (df["run"] == "priority_rateinf").all() and (df["policy"] == "priority").all()
    assert "cells within target" in (tmp_path / "out" / "policies.md").read_text()


@pytest.fixture(scope="module")
def bad_hooks(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user") / "bad_hooks.py"
    path.write_text(textwrap.dedent(BAD_HOOKS))
    return path


def _tail_twice(sched):
    return [sched.running[-1]] * 2 if sched.running else []


def _a_waiting_one(sched, *_):
    return sched.waiting[0] if sched.waiting else sched.running[-1]


@pytest.mark.parametrize("real", [False, True], ids=["sim", "real"])
@pytest.mark.parametrize(("hook", "value", "message"), [
    ("window_steps", 0, "window_steps returned 0; it must return an int from 1 to max_steps = 4"),
    ("window_steps", -3, "window_steps returned -3; it must return an int from 1 to max_steps"),
    ("window_steps", 2.5, "window_steps returned 2.5; it must return an int from 1 to max_steps"),
    ("window_steps", True, "window_steps returned True; it must return an int from 1"),
    ("window_steps", 10**9, "window_steps returned 1000000000; it must return an int from 1 to "
                            "max_steps = 4"),
    ("max_steps", 0, "max_steps returned 0; it must return an int >= 1"),
    ("max_steps", 2.5, "max_steps returned 2.5; it must return an int >= 1"),
    ("prefill_steps", 0, "prefill_steps returned 0; it must return an int from 1 to the "
                         "window's k"),
    ("prefill_steps", lambda k: k + 1, "prefill_steps returned 5; it must return an int from 1 to "
                                       "the window's k = 4"),
    # item 3: more tokens than the request has left (the simulator priced phantom tokens, the
    # real engine raised IndexError), or than the window's budget
    ("chunk_size", lambda req, num_new, budget, sched: num_new + 16,
     "chunk_size returned {} for request 0 (num_new={}, budget="),
    ("chunk_size", lambda req, num_new, budget, sched: budget + 1,
     "it must return an int from 0 (it does not fit) to min(num_new, budget)"),
    ("chunk_size", -16, "chunk_size returned -16 for request 0"),
    ("chunk_size", 2.5, "chunk_size returned 2.5 for request 0"),
    ("chunk_size", None, "chunk_size returned None for request 0"),
    ("window_budget", (0, 0), "window_budget returned (0, 0); it must return (tokens, seqs): ints, "
                              "tokens >= 1 (a window of no tokens forms nothing) and seqs from 0 "
                              "to scheduler.max_num_seqs (256)"),
    ("window_budget", (-2048, 8), "window_budget returned (-2048, 8)"),
    ("window_budget", (2048, -1), "window_budget returned (2048, -1)"),
    ("window_budget", (2048, 10**6), "window_budget returned (2048, 1000000)"),
    ("window_budget", (2048.0, 8), "window_budget returned (2048.0, 8)"),
    ("window_budget", 2048, "window_budget returned 2048; it must return (tokens, seqs)"),
    ("admit", None, "admit returned None for request 0; it must return True or False"),
    ("admit", "yes", "admit returned 'yes' for request 0; it must return True or False"),
    ("preemption_victim", None, "preemption_victim returned None for request"),
    ("preemption_victim", _a_waiting_one, "preemption_victim returned request "),
    ("preempt_for_waiting", _tail_twice, "preempt_for_waiting returned request "),
    ("preempt_for_waiting", lambda sched: [sched.waiting[0]],
     "preempt_for_waiting returned request 0 (waiting), which is not running; it must return a "
     "list of distinct running requests (sched.running)"),
    ("preempt_for_waiting", None, "preempt_for_waiting returned None; it must return a list of "
                                  "distinct running requests"),
    ("queue_key", lambda req, sched: req.request_id if req.request_id % 2 else "even",
     "queue_key returned keys that do not compare ("),
])
def test_a_user_policys_hook_answer_outside_its_contract_is_one_line(
        bad_hooks, hook, value, message, real):
    """Every hook's answer is checked against its contract, on both backends: one line naming
    the class, the hook, the value and the contract (not an IndexError, a TypeError from deep
    inside, or a silently wrong run)."""
    params = {"module": str(bad_hooks), "hook": hook, "value": value}
    with pytest.raises(ValueError) as err:
        windows("bad_hooks", params, 32 if hook == "chunk_size" else None, real=real)
    text = str(err.value)
    assert text.startswith(f"policy BadHooks.{hook} ") and "\n" not in text, text
    if "{}" in message:  # the value: the tokens the request had left, plus 16
        left = int(text.split("num_new=")[1].split(",")[0])
        message = message.format(left + 16, left)
    assert message in text, text
    if hook == "preempt_for_waiting" and value is _tail_twice:
        assert text.endswith("(running) twice; it must return a list of distinct running "
                             "requests (sched.running)")


@pytest.mark.parametrize("real", [False, True], ids=["sim", "real"])
@pytest.mark.parametrize("hook", ["window_steps", "chunk_size", "preemption_victim"])
def test_an_exception_in_a_user_policys_hook_names_the_hook_and_the_users_line(
        bad_hooks, hook, real):
    params = {"module": str(bad_hooks), "hook": hook, "value": "divide by zero"}
    with pytest.raises(ValueError) as err:
        windows("bad_hooks", params, None, real=real)
    line = textwrap.dedent(BAD_HOOKS).splitlines().index("            return len(args) // 0") + 1
    assert str(err.value) == (f"policy BadHooks.{hook} raised ZeroDivisionError: integer division "
                              f"or modulo by zero ({bad_hooks}:{line})")


@pytest.mark.parametrize("backend", [["backend=sim", "hardware=cpu", "overhead=none"],
                                     # a 20 MiB cache: zeroing the CPU's default 1 GiB
                                     # would be most of the run's setup
                                     ["backend=real", "backend.device=cpu",
                                      "backend.cpu_kv_cache_gib=0.02"]], ids=["sim", "real"])
def test_a_run_whose_policy_answers_outside_the_contract_ends_in_one_line(
        tmp_path, bad_hooks, backend):
    """Through the command line on the simulator: exit code 2, the one line on stderr, no
    result written; on the real engine through run() in this process (the command's line is
    the message of the error run() raises, as the simulator's case shows)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "run"
    settings = [*backend, "model=tiny", "workload=synthetic", "workload.num_prompts=8",
                "progress=false", "policy.name=bad_hooks", f"+policy.module={bad_hooks}",
                "+policy.hook=window_steps", "+policy.value=0"]
    line = ("error: policy BadHooks.window_steps returned 0; it must return an int from 1 to "
            "max_steps = 8 (the longest window the policy runs: decodes reserve its slots)")
    if "backend=sim" in backend:
        proc = subprocess.run(
            [sys.executable, "-m", "experiments.run", *settings, f"hydra.run.dir={out}"],
            cwd=root, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [line]
    else:
        from hydra import compose, initialize_config_dir

        from experiments.run import CONF_DIR, run

        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = compose("config", overrides=settings)
        with pytest.raises(ValueError) as err:
            run(cfg, out)
        assert f"error: {err.value}".splitlines() == [line]
    assert not (out / "result.json").exists()


def test_a_user_policys_answers_within_their_contract_make_the_same_windows(bad_hooks):
    """The checked hooks change no decision: the wrapped user policy forms cp1's windows."""
    params = {"module": str(bad_hooks), "num_steps": 4}
    mine = windows("bad_hooks", params, None, real=False)
    assert mine == windows("cp1", {"num_steps": 4}, None, real=False)
    assert mine == windows("bad_hooks", params, None, real=True)
