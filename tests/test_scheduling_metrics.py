"""SLO classes (drawn by share or named by a trace) and the metrics a scheduling policy is judged
by: per-class goodput and tails, slowdown, Jain's fairness, the longest queueing delay; in
result.json and the aggregate table."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from experiments.aggregate import aggregate
from experiments.run import CONF_DIR, run
from experiments.scheduling_metrics import jain_index, scheduling_metrics
from experiments.workload import build_workload
from policies.request import Request

CLASSES = {"hi": {"share": 0.25, "priority": 0, "ttft_ms": 300.0, "tpot_ms": 60.0},
           "lo": {"share": 0.75, "priority": 2}}
SYNTH = {"kind": "synthetic", "num_prompts": 400, "seed": 5, "request_rate": 20.0,
         "lengths": {"dist": "fixed", "prompt_len": 64, "output_len": 16}}


def test_classes_are_drawn_by_share_without_moving_the_workload():
    plain = build_workload(SYNTH)
    drawn = build_workload({**SYNTH, "classes": CLASSES})
    assert [(s.arrival_time, s.prompt_len) for s in plain] == \
        [(s.arrival_time, s.prompt_len) for s in drawn]
    names = [s.slo_class.name for s in drawn]
    assert names == [s.slo_class.name for s in build_workload({**SYNTH, "classes": CLASSES})]
    assert 0.18 < names.count("hi") / len(names) < 0.32
    hi = next(s.slo_class for s in drawn if s.slo_class.name == "hi")
    assert (hi.priority, hi.ttft_ms, hi.tpot_ms) == (0, 300.0, 60.0)


def test_a_trace_names_each_request_class(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_time,prompt_len,output_len,slo_class\n0,10,5,lo\n1,10,5,hi\n2,10,5,\n")
    specs = build_workload({"kind": "trace", "trace_path": str(path), "classes": CLASSES})
    assert [s.slo_class.name for s in specs][:2] == ["lo", "hi"]  # the third is drawn
    path.write_text("arrival_time,prompt_len,output_len,slo_class\n0,10,5,lo\n1,10,5,gold\n")
    with pytest.raises(ValueError) as err:
        build_workload({"kind": "trace", "trace_path": str(path), "classes": CLASSES})
    assert str(err.value) == f"{path}:3: slo_class 'gold' is not one of workload.classes (hi, lo)"
    with pytest.raises(ValueError, match=r"t.csv:2: the trace names SLO classes \(slo_class\) "
                                         "but workload.classes defines none"):
        build_workload({"kind": "trace", "trace_path": str(path)})


@pytest.mark.parametrize(("classes", "message"), [
    ({"hi": {"share": 0.25, "priority": 0}, "lo": {"priority": 2}},
     "workload.classes.lo has no share: requests are drawn by share, so give every class one "
     "(0 for a class drawn for none)"),
    ({"hi": {"share": 0.3}, "lo": {"share": 0.3}},
     "workload.classes: the shares sum to 0.6 (hi 0.3, lo 0.3), not 1; give shares that sum to 1"),
    ({"hi": {"share": 2}, "lo": {"share": 2}},
     "workload.classes: the shares sum to 4 (hi 2, lo 2), not 1; give shares that sum to 1"),
])
def test_drawn_classes_need_every_share_and_shares_summing_to_one(classes, message):
    """A class without a share used to get no request, and shares were renormalised."""
    with pytest.raises(ValueError) as err:
        build_workload({**SYNTH, "classes": classes})
    assert str(err.value) == message


def test_classes_a_trace_names_need_no_share(tmp_path):
    """Where the trace names every request's class nothing is drawn, so shares may be left out;
    a request it leaves unnamed is drawn, and then every class needs its share."""
    path = tmp_path / "t.csv"
    path.write_text("arrival_time,prompt_len,output_len,slo_class\n0,10,5,lo\n1,10,5,hi\n")
    named = {"hi": {"priority": 0, "ttft_ms": 300.0}, "lo": {"priority": 2}}
    specs = build_workload({"kind": "trace", "trace_path": str(path), "classes": named})
    assert [(s.slo_class.name, s.slo_class.priority) for s in specs] == [("lo", 2), ("hi", 0)]
    path.write_text("arrival_time,prompt_len,output_len,slo_class\n0,10,5,lo\n1,10,5,\n")
    with pytest.raises(ValueError) as err:
        build_workload({"kind": "trace", "trace_path": str(path), "classes": named})
    assert str(err.value) == (
        f"workload.classes.hi has no share: {path}:3 names no slo_class, and such requests are "
        "drawn by share, so give every class one (0 for a class drawn for none)")
    with pytest.raises(ValueError, match=r"^workload\.classes: the shares sum to 0\.5 "):
        build_workload({"kind": "trace", "trace_path": str(path),
                        "classes": {"hi": {"share": 0.25}, "lo": {"share": 0.25}}})


@pytest.mark.parametrize(("classes", "message"), [
    ({"hi": {"share": 1, "prio": 0}}, "workload.classes.hi has no setting 'prio'"),
    ({"hi": {"share": -1}}, "workload.classes.hi.share must be >= 0"),
    ({"hi": {"share": 1, "ttft_ms": 0}}, "workload.classes.hi.ttft_ms must be > 0"),
    ({"hi": {"share": 0}}, "workload.classes: the shares sum to 0"),
    ([1, 2], "workload.classes must map class names"),
])
def test_bad_classes_are_one_line_errors(classes, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        build_workload({**SYNTH, "classes": classes})


def test_jain_index():
    assert jain_index([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)


def _run(tmp_path, *overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=["workload=synthetic", "progress=false", *overrides])
    return run(cfg, tmp_path)


def test_a_request_alone_has_slowdown_one(tmp_path):
    result = _run(tmp_path, "workload.num_prompts=1", "overhead=none", "hardware=h200")
    assert result["mean_slowdown"] == pytest.approx(1.0, abs=0.02)
    assert result["jain_fairness_slowdown"] == pytest.approx(1.0)
    assert result["max_queueing_delay_ms"] == 0.0


def test_classes_reach_result_json_and_the_aggregate(tmp_path):
    classes = ("workload.classes={hi: {share: 0.3, priority: 0, ttft_ms: 200}, "
               "lo: {share: 0.7, priority: 1, ttft_ms: 200}}")
    result = _run(tmp_path / "run", "policy=priority", "workload.num_prompts=200", classes,
                  "workload.request_rate=inf")
    per = result["schedlab"]["classes"]
    assert set(per) == {"hi", "lo"} and per["hi"]["num_requests"] + per["lo"]["num_requests"] == 200
    # priority serves the high class first: more of it meets the same TTFT target
    assert per["hi"]["slo_attainment"] > per["lo"]["slo_attainment"]
    assert per["hi"]["median_ttft_ms"] < per["lo"]["median_ttft_ms"]
    for m in ("ttft", "tpot", "e2el"):
        assert per["hi"][f"median_{m}_ms"] <= per["hi"][f"p90_{m}_ms"] <= per["hi"][f"p99_{m}_ms"]
    saved = json.loads((tmp_path / "run" / "result.json").read_text())
    assert saved["max_queueing_delay_ms"] > 0 and saved["p90_ttft_ms"] > 0
    table = aggregate(tmp_path)
    assert isinstance(table, pd.DataFrame)
    assert table.loc[0, "hi.request_goodput"] == pytest.approx(per["hi"]["request_goodput"])
    assert table.loc[0, "mean_slowdown"] == pytest.approx(result["mean_slowdown"])


def test_the_policy_sweep_figures(tmp_path):
    """Goodput and p99 TTFT versus rate, a line per policy, and the TTFT CDF at the second
    highest rate from each run's requests.csv."""
    from experiments.plot_policies import plot_policies, policy_figures

    rows = []
    for policy in ("single_step", "sjf"):
        for rate in (10.0, 20.0, 30.0):
            run_dir = tmp_path / f"{policy}_{rate:g}"
            run_dir.mkdir()
            pd.DataFrame({"ttft": [0.01 * rate, 0.02 * rate]}).to_csv(run_dir / "requests.csv")
            rows.append({"policy": policy, "request_rate": rate, "class_goodput": rate * 0.9,
                         "p99_ttft_ms": rate * 10, "run_dir": str(run_dir), "model": "llama3_8b"})
    df = pd.DataFrame(rows)
    import matplotlib.pyplot as plt

    drawn = list(policy_figures(df))
    stems = [stem for stem, _ in drawn]
    for _, fig in drawn:
        plt.close(fig)
    assert stems == ["goodput_vs_rate", "p99_ttft_vs_rate", "ttft_cdf_rate20", "policies_overview"]
    made = plot_policies(df, tmp_path / "figures")
    assert len(made) == 8 and all(p.stat().st_size > 0 for p in made)
    assert list(policy_figures(df[df["policy"] == "sjf"])) == []  # one policy: nothing to compare


def test_the_policy_sweep_composes_every_policy_and_rate():
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=["+experiment=policy_sweep"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert set(params["policy"].split(",")) == {
        "single_step", "chunked_prefill", "priority", "sjf", "edf", "sarathi", "mlfq",
        "slo_adaptive"}
    assert [float(r) for r in params["workload.request_rate"].split(",")] == [28, 42, 56, 70, 84]
    assert set(cfg.workload.classes) == {"interactive", "standard", "batch"}
    assert cfg.hardware.name == "h200_calibrated"


def _finished(rid: int, arrival: float, times: list[float], cls: str | None,
              ttft_ms: float | None = None, tpot_ms: float | None = None) -> Request:
    r = Request(rid, arrival, 10, len(times))
    r.token_times, r.num_output_tokens, r.finish_time = list(times), len(times), times[-1]
    r.slo_class, r.ttft_slo_ms, r.tpot_slo_ms = cls, ttft_ms, tpot_ms
    return r


def test_each_request_is_judged_against_its_own_targets():
    """A class's goodput and attainment count each completed request against the targets it
    carries (a class need not give all its requests the same ones); requests of no class are
    in none, and a class's first request need not be the run's first."""
    reqs = [_finished(0, 0.0, [0.5, 0.6], None),
            _finished(1, 0.0, [0.2, 0.3], "a", ttft_ms=300),  # TTFT 200 ms: met
            _finished(2, 0.0, [0.2, 0.3], "a", ttft_ms=100),  # the same times: missed
            _finished(3, 0.0, [0.1, 0.2, 0.3], "a", tpot_ms=50),  # TPOT 100 ms: missed
            _finished(4, 0.0, [0.1], "a", tpot_ms=50),  # one token: TPOT 0, met
            _finished(5, 0.0, [0.4, 0.5], "b")]  # no targets: met
    classes = scheduling_metrics(reqs, duration=2.0)["classes"]
    assert set(classes) == {"a", "b"}
    assert classes["a"]["num_requests"] == 4 and classes["a"]["slo_attainment"] == 0.5
    assert classes["a"]["request_goodput"] == 1.0 and classes["a"]["ttft_slo_ms"] == 300
    assert classes["b"]["num_requests"] == 1 and classes["b"]["slo_attainment"] == 1.0


def test_service_time_alone_prices_each_request_by_its_own_steps():
    """Slowdown's denominator, taken for many requests at once (each distinct prompt and
    context priced once), is each request's own prefill step plus max_tokens - 1 decode steps
    at its middle context, to the last bit; a run's mean slowdown divides E2EL by it."""
    import numpy as np

    from common.model_spec import ModelSpec
    from simulator.cost_model import service_time_fn, step_time_fn
    from simulator.hardware import HardwareSpec

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config")
    model = ModelSpec.from_dict(dict(cfg["model"]))
    hw = HardwareSpec.from_dict(dict(cfg["hardware"]))
    step = step_time_fn(model, hw)
    prompts = np.array([7, 300, 7, 1024, 300, 5])
    outputs = np.array([1, 20, 9, 256, 20, 2])
    got = service_time_fn(model, hw)(prompts, outputs)
    for p, o, t in zip(prompts.tolist(), outputs.tolist(), got.tolist(), strict=True):
        mid = p + o // 2
        assert t == step(0, 0, 0, [(p, 0, True)]) + (o - 1) * step(1, mid, mid, ())
    reqs = [Request(i, 0.0, p, o) for i, (p, o) in enumerate(zip(prompts.tolist(),
                                                                  outputs.tolist()))]
    for r, e2el in zip(reqs, [0.5, 1.0, 2.0, 4.0, 1.0, 0.25]):
        r.first_scheduled_time, r.finish_time = 0.0, e2el
        r.num_output_tokens = r.max_tokens
        r.token_times = [e2el] * r.max_tokens
    reqs[2].finish_time = None  # unfinished: no slowdown
    reqs[2].num_output_tokens, reqs[2].token_times = 3, [2.0] * 3
    out = scheduling_metrics(reqs, 4.0, service_time_fn(model, hw))
    e2el = np.array([0.5, 1.0, 2.0, 4.0, 1.0, 0.25])
    done = np.array([True, True, False, True, True, True])
    assert out["mean_slowdown"] == pytest.approx(np.mean(e2el[done] / got[done]))
    assert len(service_time_fn(model, hw)(prompts[:0], outputs[:0])) == 0
