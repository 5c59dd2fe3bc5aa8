"""Speculative decoding: the acceptance process (common/spec_acceptance.py), the speculation
policies and their windows (policies/speculation.py, the scheduler), the simulator's accounting
(tokens, blocks freed on rejection, token times, draft pricing), a user's own policy, bad
settings in one line, determinism, and the spec_decode_* metrics of a run."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from common.spec_acceptance import acceptance_process
from policies import Policy, Request, SchedulerConfig, make_scheduler, make_speculation
from policies.scheduler import Scheduler
from policies.user_code import HookError
from simulator.cost_model import step_time_fn
from simulator.engine import simulate
from tests.test_policy_semantics import HW, MODEL, OVERHEAD

RATE = {"rate": 0.8}


def speculation(policy="spec_fixed", k=3, acceptance=RATE, method="ngram", seed=0, **settings):
    return make_speculation({"method": method, "num_tokens": k, "draft_model": None,
                             "policy": policy, **settings},
                            acceptance_process(acceptance, seed) if acceptance else None,
                            step_time_fn(MODEL, HW))


def scheduler(spec, policy="multi_step", params=None, blocks=400, bs=4):
    cfg = SchedulerConfig(max_num_seqs=16, block_size=bs, watermark=0.0)
    return make_scheduler(policy, params if params is not None else {"num_steps": 2}, cfg,
                          blocks, 4096, step_time_fn(MODEL, HW), spec)


def run_by_hand(s, reqs):
    """Every window of ``s`` serving ``reqs`` (all at t=0), run to the end, the block manager's
    books checked after each: the windows' decodes as (request, k + 1, accepted)."""
    for r in reqs:
        s.add_request(r)
    t, windows = 0.0, []
    while s.has_unfinished:
        b = s.schedule(t)
        windows.append([(x.request.request_id, x.num_decode_tokens, x.num_accepted)
                        for x in b.seqs if not x.is_prefill])
        t += 1.0
        s.update(b, [t + 0.1 * j for j in range(b.num_steps)])
        s.block_manager.check(s.running)
    return windows


# ------------------------------------------------------------------ the acceptance process
def test_acceptance_is_a_function_of_seed_request_outputs_and_k():
    p = acceptance_process(RATE, 7)
    draws = [p.num_accepted(r, n, 4) for r in range(50) for n in range(50)]
    assert draws == [acceptance_process(RATE, 7).num_accepted(r, n, 4)
                     for r in range(50) for n in range(50)]
    assert draws != [acceptance_process(RATE, 8).num_accepted(r, n, 4)
                     for r in range(50) for n in range(50)]
    assert all(0 <= a <= 4 for a in draws)
    # the mean of many draws is the process's: 0.8 + 0.8^2 + 0.8^3 + 0.8^4
    assert statistics.mean(draws) == pytest.approx(p.expected_accepted(4), abs=0.08)
    assert p.num_accepted(3, 5, 0) == 0


def test_per_position_rates_and_a_trace(tmp_path):
    p = acceptance_process({"rates": [1.0, 0.0]}, 0)  # the first token always, never a second
    assert {p.num_accepted(r, 0, 3) for r in range(100)} == {1}
    trace = tmp_path / "drafts.csv"
    trace.write_text("num_draft_tokens,num_accepted\n5,5\n5,2\n5,0\n")
    t = acceptance_process({"trace": str(trace)}, 0)
    assert {t.num_accepted(r, 0, 3) for r in range(200)} == {0, 2, 3}  # 5 capped at k
    t.check_num_tokens(5)
    with pytest.raises(ValueError, match=r"^spec.num_tokens = 6 exceeds what workload\."
                                         r"acceptance's trace .* drafted \(5 tokens"):
        t.check_num_tokens(6)


@pytest.mark.parametrize("setting, message", [
    ({"rate": 1.5}, "workload.acceptance.rate must be a number in [0, 1], got 1.5"),
    ({"rates": [0.9, "x"]}, "workload.acceptance.rates[1] must be a number in [0, 1], got 'x'"),
    ({"rates": []}, "workload.acceptance.rates must be a non-empty list"),
    ({"rate": 0.5, "rates": [0.5]}, "workload.acceptance must be null or one of"),
    ({"trace": "no/such.csv"}, "workload.acceptance.trace: no such file no/such.csv"),
    ("0.8", "workload.acceptance must be null or one of"),
])
def test_a_bad_acceptance_is_one_line(setting, message):
    with pytest.raises(ValueError) as err:
        acceptance_process(setting, 0)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_bad_trace_is_one_line_naming_its_line(tmp_path):
    trace = tmp_path / "drafts.csv"
    trace.write_text("num_draft_tokens,num_accepted\n4,2\n4,5\n")
    with pytest.raises(ValueError, match=r"^workload\.acceptance\.trace .*drafts\.csv:3: needs "
                                         r"0 <= num_accepted <= num_draft_tokens"):
        acceptance_process({"trace": str(trace)}, 0)
    trace.write_text("k,a\n4,2\n")
    with pytest.raises(ValueError, match="no column 'num_accepted'"):
        acceptance_process({"trace": str(trace)}, 0)


# ------------------------------------------------------------------ windows and accounting
def test_a_speculative_window_reserves_k_plus_one_slots_a_step_and_keeps_the_accepted():
    """A 2-step window of a decode drafting 3: 4 slots a step reserved (8), the accepted
    tokens drawn as it is formed; update() grows the request by accepted + 1 a step, emits as
    many tokens at each step's time, and gives back the blocks past its new length."""
    s = scheduler(speculation(k=3))
    req = Request(0, 0.0, 10, 40)
    s.add_request(req)
    s.update(s.schedule(0.0), [1.0])  # prefill: 10 computed, 1 token out
    b = s.schedule(1.0)
    (seq,) = b.seqs
    assert (seq.num_query_tokens, seq.num_decode_tokens, seq.num_slots) == (4, 4, 8)
    acc = seq.num_accepted
    p = acceptance_process(RATE, 0)
    assert acc == [p.num_accepted(0, 1, 3), p.num_accepted(0, 2 + acc[0], 3)]
    assert len(req.block_table) == -(-(10 + 8) // 4)  # every slot the window computes
    s.update(b, [2.0, 3.0])
    grown = sum(acc) + 2
    assert req.num_computed_tokens == 10 + grown and req.num_output_tokens == 1 + grown
    assert req.token_times == [1.0] + [2.0] * (acc[0] + 1) + [3.0] * (acc[1] + 1)
    assert len(req.block_table) == -(-(10 + grown) // 4)  # rejected slots' blocks freed
    s.block_manager.check(s.running)


def test_nothing_accepted_is_one_token_a_step_and_everything_accepted_k_plus_one():
    for rate, per_step in ((0.0, 1), (1.0, 4)):
        s = scheduler(speculation(k=3, acceptance={"rate": rate}), "single_step", {})
        req = Request(0, 0.0, 8, 25)
        windows = run_by_hand(s, [req])
        decode_windows = [w for w in windows if w]
        assert req.num_output_tokens == 25
        assert len(decode_windows) == -(-24 // per_step)
        assert all(acc == [per_step - 1] for w in decode_windows for _, _, acc in w)


def test_multi_step_windows_with_speculation_deliver_every_token_once():
    reqs = [Request(i, 0.0, 20 + i, 30 + 7 * i) for i in range(6)]
    windows = run_by_hand(scheduler(speculation(k=4), "multi_step", {"num_steps": 4}), reqs)
    assert any(len(acc) == 4 for w in windows for _, _, acc in w if acc)
    for r in reqs:
        assert r.num_output_tokens == r.max_tokens == len(r.token_times)
        assert r.token_times == sorted(r.token_times) and r.finish_time == r.token_times[-1]


def test_the_windows_and_draws_are_the_same_run_to_run():
    def windows():
        return run_by_hand(scheduler(speculation(k=3)),
                           [Request(i, 0.0, 16, 20 + i) for i in range(5)])

    assert windows() == windows()


def simulated(spec, n=32, rate=None, policy="multi_step", params=None, model=MODEL):
    reqs = [Request(i, 0.0 if rate is None else i / rate, 256, 64) for i in range(n)]
    cfg = SchedulerConfig(max_num_seqs=256)

    def new(blocks):
        return make_scheduler(policy, params or {"num_steps": 4}, cfg, blocks,
                              model.max_model_len, step_time_fn(model, HW), spec)

    return reqs, simulate(reqs, new, model, HW, OVERHEAD, num_blocks=4000, progress=False)


def tpot(reqs):
    return statistics.mean((r.token_times[-1] - r.token_times[0]) / (r.num_output_tokens - 1)
                           for r in reqs)


def test_the_simulator_counts_every_token_and_speculation_cuts_tpot_when_accepted():
    off, _ = simulated(None)
    hi, res = simulated(speculation(k=4, acceptance={"rate": 0.9}))
    lo, _ = simulated(speculation(k=4, acceptance={"rate": 0.0}))
    for reqs in (off, hi, lo):
        assert all(r.num_output_tokens == 64 == len(r.token_times) for r in reqs)
    assert tpot(hi) < 0.6 * tpot(off)  # ~4 tokens a step for a little more than a step's time
    assert tpot(lo) > tpot(off)  # nothing accepted: verify steps of 5 tokens for one
    m = res.spec_decode.metrics()
    assert m["spec_decode_draft_tokens"] == 4 * m["spec_decode_num_drafts"]
    # every decode token came from a draft's accepted tokens or its step's own token
    assert m["spec_decode_num_drafts"] + m["spec_decode_accepted_tokens"] >= 32 * 63
    assert m["spec_decode_acceptance_rate"] == pytest.approx(
        m["spec_decode_accepted_tokens"] / m["spec_decode_draft_tokens"])
    rates = m["spec_decode_per_position_acceptance_rate"]
    assert len(rates) == 4 and rates == sorted(rates, reverse=True)
    assert rates[0] == pytest.approx(0.9, abs=0.05)


def test_a_draft_model_is_priced_by_its_own_shape():
    """The same windows (ngram: no draft on the GPU) take longer with a 1B draft model's k
    draft steps, and longer still with the target drafting for itself."""
    from experiments.choices import draft_model_spec

    def run(method, draft):
        d = draft_model_spec({"method": "draft", "draft_model": draft}, MODEL) if draft else None
        spec = make_speculation({"method": method, "num_tokens": 3, "draft_model": draft,
                                 "policy": "spec_fixed"}, acceptance_process(RATE, 0),
                                step_time_fn(d, HW) if d else None, d)
        return simulated(spec)[1].duration

    ngram, small, same = run("ngram", None), run("draft", "llama3_2_1b"), run("draft", "same")
    assert ngram < small < same


def test_a_draft_model_takes_its_weights_and_kv_from_the_cache():
    from experiments.choices import draft_model_spec
    from simulator.memory import num_gpu_blocks

    draft = draft_model_spec({"method": "draft", "draft_model": "llama3_2_1b"}, MODEL)
    assert num_gpu_blocks(MODEL, HW, draft=draft) < num_gpu_blocks(MODEL, HW)
    assert num_gpu_blocks(MODEL, HW, draft=MODEL) == num_gpu_blocks(MODEL, HW)  # `same`


def test_overlap_and_mixed_batches_speculate_too():
    for policy, params, overlap in (("chunked_prefill", {}, False), ("multi_step",
                                                                     {"num_steps": 2}, True)):
        cfg = SchedulerConfig(max_num_seqs=64, overlap=overlap)
        reqs = [Request(i, i / 50, 200, 40) for i in range(20)]
        spec = speculation(k=3)
        simulate(reqs, lambda b, p=policy, q=params, c=cfg, sp=spec: make_scheduler(
            p, q, c, b, MODEL.max_model_len, None, sp), MODEL, HW, OVERHEAD, num_blocks=2000,
            progress=False)
        assert all(r.num_output_tokens == 40 == len(r.token_times) for r in reqs)


# ------------------------------------------------------------------ the policies
def test_spec_off_under_load_stops_above_its_batch_size():
    spec = speculation("spec_off_under_load", k=3, max_batch_size=2)
    s = scheduler(spec, "single_step", {})
    windows = run_by_hand(s, [Request(i, 0.0, 8, 3 + 20 * i) for i in range(3)])
    ks = [{w for _, w, _ in win} for win in windows if win]
    assert ks[0] == {1}  # three running: no draft
    assert {4} in ks  # two or fewer left: k = 3


def test_smartspec_speculates_when_it_pays_and_stops_when_it_does_not():
    """Few requests at a high acceptance rate: long drafts pay; at a low rate, or a large
    batch (compute-bound verify steps), the cost model says speculation costs more than it
    gives."""

    def chosen(n, rate):
        spec = speculation("smartspec", k=6, acceptance={"rate": rate}, prior_rate=rate,
                           min_drafts=10**9)
        s = scheduler(spec, "single_step", {}, blocks=100000, bs=16)
        for i in range(n):
            s.add_request(Request(i, 0.0, 512, 100))
        s.update(s.schedule(0.0), [1.0])
        return max(q.num_decode_tokens - 1 for q in s.schedule(1.0).seqs)  # the window's k

    assert chosen(2, 0.9) >= 4
    assert chosen(2, 0.05) == 0
    assert chosen(256, 0.6) < chosen(2, 0.6)


def test_smartspec_needs_a_cost_model():
    spec = speculation("smartspec", k=4)
    with pytest.raises(ValueError, match="^speculation policy smartspec prices steps and needs "
                                         "a hardware profile's cost model$"):
        Scheduler(Policy(), SchedulerConfig(), 100, 1024, None, spec)


def test_a_users_speculation_policy_from_a_file(tmp_path):
    mine = tmp_path / "every_other.py"
    mine.write_text(
        "from dataclasses import dataclass\n"
        "from policies.speculation import SpeculationPolicy\n\n\n"
        "@dataclass(frozen=True)\n"
        "class EveryOther(SpeculationPolicy):\n"
        "    name = 'every_other'\n"
        "    parity: int = 0\n\n"
        "    def request_tokens(self, req, k, sched):\n"
        "        return k if req.request_id % 2 == self.parity else 0\n")
    spec = speculation(str(mine), k=2, parity=1)
    assert type(spec.policy).__name__ == "EveryOther"
    windows = run_by_hand(scheduler(spec, "single_step", {}),
                          [Request(i, 0.0, 8, 6) for i in range(4)])
    assert {(rid % 2, w) for win in windows for rid, w, _ in win} == {(0, 1), (1, 3)}
    with pytest.raises(ValueError, match=r"^spec \(policy .*every_other\.py\) has no setting "
                                         r"'colour'; its settings: parity$"):
        speculation(str(mine), k=2, colour=1)


def test_a_users_bad_window_tokens_is_one_line(tmp_path):
    mine = tmp_path / "too_long.py"
    mine.write_text("from policies.speculation import SpeculationPolicy\n\n\n"
                    "class TooLong(SpeculationPolicy):\n"
                    "    def window_tokens(self, sched):\n"
                    "        return self.num_tokens + 1\n")
    s = scheduler(speculation(str(mine), k=2), "single_step", {})
    s.add_request(Request(0, 0.0, 8, 6))
    s.update(s.schedule(0.0), [1.0])
    with pytest.raises(HookError, match=r"^speculation policy TooLong\.window_tokens returned 3; "
                                        r"it must return an int from 0 \(no speculation\) to "
                                        r"spec\.num_tokens = 2$"):
        s.schedule(1.0)


@pytest.mark.parametrize("spec, message", [
    ({"method": "medusa"}, "spec.method must be one of off, draft, ngram, got 'medusa'"),
    ({"method": "ngram", "num_tokens": 0, "policy": "spec_fixed"},
     "spec.num_tokens must be an integer >= 1, got 0"),
    ({"method": "draft", "num_tokens": 2, "policy": "spec_fixed"},
     "spec.draft_model must name a conf/model config"),
    ({"method": "ngram", "num_tokens": 2, "policy": "nope"},
     "unknown speculation policy 'nope' (spec.policy); choose one of: smartspec, spec_fixed, "
     "spec_off_under_load, or a .py file"),
    ({"method": "ngram", "num_tokens": 2, "policy": "spec_fixed", "max_batch_size": 3},
     "spec (policy spec_fixed) has no setting 'max_batch_size'; its settings: none"),
    ({"method": "ngram", "num_tokens": 2, "policy": "spec_off_under_load",
      "max_batch_size": 0}, "spec.max_batch_size must be an integer >= 1, got 0"),
    ({"method": "ngram", "num_tokens": 2, "policy": "missing.py"},
     "spec.policy missing.py: no such file"),
])
def test_bad_spec_settings_are_one_line(spec, message):
    with pytest.raises(ValueError) as err:
        make_speculation(spec)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_speculation_off_is_none():
    assert make_speculation({"method": "off", "num_tokens": 4}) is None
    assert make_speculation({"method": False}) is None  # YAML's reading of a bare off
    assert make_speculation(None) is None


# ------------------------------------------------------------------ a run's results
CONF = str(Path(__file__).resolve().parents[1] / "conf")
BASE = ["backend=sim", "model=llama3_8b", "hardware=h200_calibrated", "overhead=none",
        "progress=false", "workload=synthetic", "workload.num_prompts=40",
        "workload.request_rate=20", "workload.lengths.dist=fixed", "workload.lengths.prompt_len=128",
        "workload.lengths.output_len=32"]


def run_config(tmp_path, *overrides):
    from experiments.run import run

    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("config", overrides=[*BASE, *overrides])
    out = tmp_path / "run"
    run(cfg, out, sweep_label="spec")
    return json.loads((out / "result.json").read_text()), out


@pytest.mark.parametrize("spec", ["spec_fixed", "spec_off_under_load", "smartspec"])
def test_each_speculation_policy_runs_and_reports_vllms_metrics(tmp_path, spec):
    from experiments.aggregate import read_row

    result, out = run_config(tmp_path, f"spec={spec}", "workload.acceptance={rate: 0.7}")
    ext = result["schedlab"]
    assert ext["spec"]["policy"]["name"] == spec and ext["spec"]["acceptance"] == "rate=0.7"
    for key in ("spec_decode_num_drafts", "spec_decode_draft_tokens",
                "spec_decode_accepted_tokens", "spec_decode_acceptance_rate",
                "spec_decode_acceptance_length", "spec_decode_per_position_acceptance_rate"):
        assert key in ext
    assert ext["spec_decode_num_drafts"] > 0 and 0 < ext["spec_decode_acceptance_rate"] < 1
    assert "spec_decode_acceptance_rate:" in (out / "summary.txt").read_text()
    row = read_row(out / "result.json")
    assert row["spec_policy"] == spec and row["spec_decode_acceptance_rate"] == \
        ext["spec_decode_acceptance_rate"]
    assert "spec_decode_per_position_acceptance_rate.0" in row


def test_the_simulator_refuses_speculation_without_an_acceptance(tmp_path):
    with pytest.raises(ValueError, match=r"^spec\.method=draft needs workload\.acceptance in the "
                                         r"simulator"):
        run_config(tmp_path, "spec=spec_fixed")


def test_the_sweeps_figure_draws_a_line_per_policy_and_length(tmp_path):
    """plot_spec over a small sweep's table: no speculation and spec_fixed at two rates, each
    run's acceptance rate read from its spec section (off: from its directory's name)."""
    import pandas as pd

    from experiments.aggregate import read_row
    from experiments.plot_spec import plot_spec, spec_figure, spec_table

    rows = []
    for spec in ("off", "spec_fixed"):
        for rate in (4, 8):
            result, out = run_config(tmp_path / f"{spec}" / f"workload.acceptance.rate=0.7,r={rate}",
                                     f"spec={spec}", "workload.acceptance={rate: 0.7}",
                                     f"workload.request_rate={rate}", "goodput.tpot_ms=20")
            rows.append(read_row(out / "result.json"))
    df = pd.DataFrame(rows)
    table = spec_table(df)
    assert sorted(set(zip(table["spec_policy"], table["spec_k"], strict=True))) == \
        [("off", 0), ("spec_fixed", 4)]
    assert set(table["acceptance_rate"]) == {0.7}
    fig = spec_figure(df)
    assert [len(ax.get_lines()) for ax in fig.axes] == [2, 3]  # TPOT; goodput and offered load
    df.to_csv(tmp_path / "aggregate.csv", index=False)
    made = plot_spec(tmp_path / "aggregate.csv")
    assert [p.name for p in made] == ["spec_sweep_tpot_goodput.png", "spec_sweep_tpot_goodput.svg"]
    with pytest.raises(ValueError, match="nothing to plot"):
        df[df["spec_policy"].isna()].to_csv(tmp_path / "off.csv", index=False)
        plot_spec(tmp_path / "off.csv")


def test_without_an_acceptance_the_engine_writes_the_accepted_counts_before_update():
    """Where the engine verifies for real (no workload.acceptance), the window carries no draws;
    the counts the engine writes into num_accepted are what update() applies."""
    s = scheduler(speculation(k=2, acceptance=None))
    req = Request(0, 0.0, 10, 40)
    s.add_request(req)
    s.update(s.schedule(0.0), [1.0])
    b = s.schedule(1.0)
    (seq,) = b.seqs
    assert seq.num_accepted is None and seq.num_decode_tokens == 3
    seq.num_accepted = [2, 0]  # the engine's verification
    s.update(b, [2.0, 3.0])
    assert req.num_output_tokens == 1 + 3 + 1 and req.num_computed_tokens == 10 + 4
    assert req.token_times == [1.0, 2.0, 2.0, 2.0, 3.0]
    assert s.spec_stats.metrics()["spec_decode_accepted_tokens"] == 2


def test_vllms_backend_refuses_speculation_rather_than_running_without_it(tmp_path):
    with pytest.raises(ValueError, match=r"^spec: backend=vllm does not pass speculative "
                                         r"decoding to vLLM's engine"):
        run_config(tmp_path, "backend=vllm", "model=tiny", "spec=spec_fixed",
                   "workload.acceptance={rate: 0.8}")


# ------------------------------------------------------------------ the draft model's price
class Recorder:
    """A draft step time that records each call's arguments and costs 1 s."""

    def __init__(self):
        self.calls = []

    def __call__(self, decodes, kv, longest, chunks, decode_tokens=None):
        self.calls.append((decodes, kv, longest, list(chunks)))
        return 1.0


def drafting(rid, cached, k, accepted, prompt=8, preemptions=0):
    from policies.batch import ScheduledSeq

    req = Request(rid, 0.0, prompt, 100)
    req.num_preemptions = preemptions
    s = ScheduledSeq(req, k + 1, cached, len(accepted), False, 0, k + 1)
    s.num_accepted = accepted
    return s


def test_the_draft_runs_num_tokens_plus_one_steps_over_every_drafting_decode():
    """As the engine does: spec.num_tokens + 1 one-token draft steps before each verify step,
    every drafting decode in each (one drafting fewer than num_tokens attends over its own
    drafts only), contexts growing by the accepted tokens; draft KV already whole: no
    catch-up."""
    from policies.batch import Batch
    from simulator.cost_model import DraftKV, window_draft_times

    a, b = drafting(0, 20, 3, [2, 0]), drafting(1, 30, 1, [1, 1])
    kv = DraftKV()
    kv.lengths = {0: (0, 20), 1: (0, 30)}
    rec = Recorder()
    assert window_draft_times(Batch([a, b], 2), rec, 3, kv) == [4.0, 4.0]
    # step 1: contexts 21 and 31; step 2: 21 + 3 and 31 + 2
    assert rec.calls == [(2, 21 + 31 + min(3, i) + min(1, i), max(21 + i, 31 + min(1, i)), [])
                         for i in range(4)] + [
                        (2, 24 + 33 + min(3, i) + min(1, i), max(24 + i, 33 + min(1, i)), [])
                        for i in range(4)]
    assert kv.lengths == {0: (0, 20 + 4), 1: (0, 30 + 4)}  # whole through the accepted tokens


def test_a_fresh_request_catches_its_draft_kv_up_once():
    """A decode drafting for the first time (its prompt and first token never seen by the
    draft) costs one prefill-like draft forward over them in step 1, no logits; the next
    window drafts from where it left off; a request that decoded without drafting in between
    catches up just those tokens, and a preempted one all of its context again."""
    from policies.batch import Batch
    from simulator.cost_model import DraftKV, window_draft_times

    kv, rec = DraftKV(), Recorder()
    assert window_draft_times(Batch([drafting(0, 9, 2, [1])], 1), rec, 2, kv) == [4.0]
    assert rec.calls[0] == (0, 0, 0, [(9, 0, False)])  # positions 0..8 before its newest
    assert len(rec.calls) == 4
    rec.calls.clear()
    assert window_draft_times(Batch([drafting(0, 11, 2, [2])], 1), rec, 2, kv) == [3.0]
    assert all(not c[3] for c in rec.calls)  # nothing to catch up
    rec.calls.clear()  # three tokens decoded without drafting, at 14..16
    window_draft_times(Batch([drafting(0, 17, 2, [0])], 1), rec, 2, kv)
    assert rec.calls[0] == (0, 0, 0, [(3, 14, False)])
    rec.calls.clear()
    window_draft_times(Batch([drafting(0, 18, 2, [0], preemptions=1)], 1), rec, 2, kv)
    assert rec.calls[0] == (0, 0, 0, [(18, 0, False)])


def test_a_window_that_does_not_draft_runs_no_draft():
    from policies.batch import Batch, ScheduledSeq
    from simulator.cost_model import DraftKV, window_draft_times

    req = Request(0, 0.0, 8, 100)
    kv, rec = DraftKV(), Recorder()
    batch = Batch([ScheduledSeq(req, 8, 0, 3, True), ScheduledSeq(Request(1, 0.0, 8, 9), 1, 8,
                                                                   3, False)], 3)
    assert window_draft_times(batch, rec, 4, kv) == [0.0, 0.0, 0.0]
    assert not rec.calls and not kv.lengths


def test_a_step_budget_counts_the_draft_steps():
    """sarathi's and slo_adaptive's chunk: the window's first step is the draft model's steps
    plus the verify step, so a draft model leaves less of the budget to the chunk."""
    from types import SimpleNamespace

    from policies.speculation import draft_steps_time
    from policies.step_budget import largest_chunk, step_seconds

    target = step_time_fn(MODEL, HW)
    forming = [drafting(i, 500, 3, [0]) for i in range(8)]

    def sched(draft):
        spec = SimpleNamespace(draft_step_time=draft, num_tokens=3)
        return SimpleNamespace(forming=forming, step_time_fn=target, speculation=spec)

    plain = step_seconds(sched(None), (64, 0, True))
    draft = step_seconds(sched(target), (64, 0, True))
    assert draft == pytest.approx(plain + draft_steps_time(target, 3, {3: (8, 8 * 501, 501)}))
    req = Request(9, 0.0, 4096, 10)
    budget = plain + 0.5 * (draft - plain)
    assert largest_chunk(sched(target), req, 4096, 4096, budget) \
        < largest_chunk(sched(None), req, 4096, 4096, budget)
