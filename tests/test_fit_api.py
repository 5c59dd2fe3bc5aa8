"""experiments.fit_api: the front end's per-chunk and per-request CPU terms, recovered from
client-measured results made from known coefficients, written as a profile the simulator takes."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from experiments import fit_api
from simulator.overhead import OverheadSpec

CONF = Path(__file__).resolve().parents[1] / "conf"
CHUNK_US, TOKEN_US, REQUEST_US = 23.5, 6.0, 410.0


def write_run(root: Path, name: str, chunks: int, requests: int, cpu_s: float,
              backend: str = "real-http", counters: bool = True, tokens: int = 0) -> None:
    d = root / name
    d.mkdir(parents=True)
    server = {"sse_chunks": chunks, "requests": requests, "front_end_cpu_s": cpu_s,
              "engine_cpu_s": 9.0}
    meta = {"backend": backend, "policy": "single_step", "k": 1, "overlap": False,
            **({"server": server} if counters else {})}
    (d / "result.json").write_text(json.dumps({"request_rate": "inf", "total_output_tokens": tokens,
                                               "schedlab": meta}))


def synthetic_runs(root: Path, noise: float = 0.0) -> None:
    rng = np.random.default_rng(0)
    # single-step runs stream a chunk per token; multi-step ones one per window
    for i, (chunks, tokens, requests) in enumerate([
            (189_000, 189_000, 1000), (24_000, 189_000, 1000), (95_000, 95_000, 500),
            (12_000, 95_000, 500), (90_000, 180_000, 1000), (40_000, 40_000, 800)]):
        cpu = ((CHUNK_US * chunks + TOKEN_US * tokens + REQUEST_US * requests) * 1e-6
               * (1 + noise * rng.normal()))
        write_run(root, f"run{i}", chunks, requests, cpu, tokens=tokens)


def test_recovers_known_terms(tmp_path):
    synthetic_runs(tmp_path)
    write_run(tmp_path, "in_process", 1, 1, 99.0, backend="real")  # not a client run: skipped
    rows = fit_api.client_runs(tmp_path)
    assert len(rows) == 6
    terms = fit_api.fit_api(rows)
    assert terms["api_per_chunk_us"] == pytest.approx(CHUNK_US, rel=1e-6)
    assert terms["api_per_token_us"] == pytest.approx(TOKEN_US, rel=1e-6)
    assert terms["api_per_request_us"] == pytest.approx(REQUEST_US, rel=1e-6)


def test_recovers_terms_within_noise(tmp_path):
    synthetic_runs(tmp_path, noise=0.01)
    terms = fit_api.fit_api(fit_api.client_runs(tmp_path))
    assert terms["api_per_chunk_us"] == pytest.approx(CHUNK_US, rel=0.1)
    assert terms["api_per_token_us"] == pytest.approx(TOKEN_US, rel=0.3)


def test_writes_a_profile_the_simulator_takes(tmp_path):
    runs, conf = tmp_path / "runs", tmp_path / "conf"
    synthetic_runs(runs)
    (conf / "overhead").mkdir(parents=True)
    base = yaml.safe_load((CONF / "overhead" / "schedlab_h200.yaml").read_text())
    (conf / "overhead" / "schedlab_h200.yaml").write_text(yaml.safe_dump(base))
    terms = fit_api.main(["--measured-dir", str(runs), "--conf-dir", str(conf)])
    written = yaml.safe_load((conf / "overhead" / "schedlab_h200_server.yaml").read_text())
    spec = OverheadSpec.from_dict(written)
    assert spec.name == "schedlab_h200_server"
    assert spec.api_per_chunk_us == pytest.approx(terms["api_per_chunk_us"], abs=1e-3)
    assert not spec.api_server_on_critical_path and spec.api_chunk_per_window
    # the engine's own costs are the base profile's
    assert spec.schedule_base_us == base["schedule_base_us"]
    assert spec.schedule_overlap_us == base["schedule_overlap_us"]


def test_bad_input_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        fit_api.main(["--measured-dir", str(tmp_path / "nowhere")])
    assert exc.value.code == 2 and "not a directory" in capsys.readouterr().err
    write_run(tmp_path, "old", 10, 1, 0.1, counters=False)
    with pytest.raises(ValueError, match="without the server's counters"):
        fit_api.client_runs(tmp_path)
    other = tmp_path / "few"
    write_run(other, "one", 10, 1, 0.1)
    with pytest.raises(ValueError, match="needs at least 3"):
        fit_api.client_runs(other)


def test_refitting_the_committed_runs_gives_the_committed_profile(tmp_path):
    """conf/overhead/schedlab_h200_server.yaml is what fit_api makes of the calibration runs
    in docs/validation/measured/server/calibration; the validation runs (client/) play no
    part in it."""
    conf = tmp_path / "conf"
    (conf / "overhead").mkdir(parents=True)
    for name in ("schedlab_h200",):
        (conf / "overhead" / f"{name}.yaml").write_text(
            (CONF / "overhead" / f"{name}.yaml").read_text())
    calibration = CONF.parent / "docs" / "validation" / "measured" / "server" / "calibration"
    fit_api.main(["--measured-dir", str(calibration / "client"),
                  "--inprocess-dir", str(calibration / "inprocess"), "--conf-dir", str(conf)])
    refit = yaml.safe_load((conf / "overhead" / "schedlab_h200_server.yaml").read_text())
    committed = yaml.safe_load((CONF / "overhead" / "schedlab_h200_server.yaml").read_text())
    assert refit == committed
    assert committed["handoff_per_window_us"] > 0 and committed["handoff_per_chunk_us"] > 0
    # no calibration run shares its requests with a validation run: another seed at t=0
    def workloads(root: Path) -> set[tuple]:
        out = set()
        for path in root.rglob("result.json"):
            w = json.loads(path.read_text())["schedlab"]["workload"]
            out.add((w["seed"], w["num_prompts"], str(w["request_rate"])))
        return out

    validation, fitted = workloads(calibration.parent / "client"), workloads(calibration)
    assert validation and fitted and not {s for s, *_ in validation} & {s for s, *_ in fitted}


WINDOW_US, CHUNK_HANDOFF_US = 80.0, 1.5


def write_steps(d: Path, base_us: float, per_seq_us: float, gz: bool = False,
                windows: int = 400) -> None:
    """A run's steps.csv whose decode windows' update() time is base_us + per_seq_us *
    num_seqs (+ noise); every tenth window a prefill one, dearer (not on the line); and, for an
    in-process run, the result.json of the same configuration as write_run's."""
    rng = np.random.default_rng(len(str(d)))
    n = rng.integers(1, 257, size=windows)
    prefill = (np.arange(windows) % 10 == 0).astype(int)
    update = ((base_us + per_seq_us * n) * (1 + 0.02 * rng.normal(size=n.size))
              + 500 * prefill) * 1e-6
    d.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame({"window": np.arange(1, n.size + 1), "k": 1, "num_seqs": n,
                          "num_prefill_seqs": prefill, "update_s": update})
    frame.to_csv(d / ("steps.csv.gz" if gz else "steps.csv"), index=False)
    if not (d / "result.json").exists():
        meta = {"backend": "real", "policy": "single_step", "k": 1, "overlap": False}
        (d / "result.json").write_text(json.dumps({"schedlab": meta}))


def test_recovers_the_handoff_from_paired_runs(tmp_path):
    """The server's update() excess over the in-process run of the same name, per window and
    per chunk, whatever each run's own line is."""
    client, alone = tmp_path / "client", tmp_path / "inprocess"
    synthetic_runs(client)
    for i, (base, slope) in enumerate([(10.0, 1.2), (30.0, 2.0)]):
        write_steps(client / f"run{i}", base + WINDOW_US, slope + CHUNK_HANDOFF_US, gz=True)
        write_steps(alone / f"run{i}", base, slope)
    pairs = fit_api.handoff_pairs(fit_api.client_runs(client), client, alone)
    assert [p["run"] for p in pairs] == ["run0", "run1"]  # runs without steps: no pair
    handoff = fit_api.fit_handoff(pairs)
    assert handoff["handoff_per_window_us"] == pytest.approx(WINDOW_US, rel=0.1)
    assert handoff["handoff_per_chunk_us"] == pytest.approx(CHUNK_HANDOFF_US, rel=0.05)
    conf = tmp_path / "conf"
    (conf / "overhead").mkdir(parents=True)
    (conf / "overhead" / "schedlab_h200.yaml").write_text(
        (CONF / "overhead" / "schedlab_h200.yaml").read_text())
    fit_api.main(["--measured-dir", str(client), "--inprocess-dir", str(alone),
                  "--conf-dir", str(conf)])
    spec = OverheadSpec.from_dict(yaml.safe_load(
        (conf / "overhead" / "schedlab_h200_server.yaml").read_text()))
    assert spec.handoff_per_chunk_us == pytest.approx(handoff["handoff_per_chunk_us"], abs=1e-3)


def test_a_client_run_without_its_in_process_pair_is_one_line(tmp_path, capsys):
    client, alone = tmp_path / "client", tmp_path / "inprocess"
    synthetic_runs(client)
    write_steps(client / "run0", 90.0, 2.0)
    alone.mkdir()
    with pytest.raises(SystemExit) as exc:
        fit_api.main(["--measured-dir", str(client), "--inprocess-dir", str(alone),
                      "--conf-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "no in-process run run0" in err and len(err.splitlines()) == 1
    rows = fit_api.client_runs(client)
    write_steps(alone / "run0", 10.0, 1.0)
    assert len(fit_api.handoff_pairs(rows, client, alone)) == 1
    (client / "run0" / "steps.csv").write_text("window,k\n1,1\n")
    with pytest.raises(ValueError, match="run0/steps.csv: no column num_seqs"):
        fit_api.handoff_pairs(rows, client, alone)
    (client / "run0" / "steps.csv").write_text(
        "num_seqs,num_prefill_seqs,update_s\n4,0,0.001\n5,0,abc\n")
    with pytest.raises(ValueError, match="run0/steps.csv: column update_s must hold numbers"):
        fit_api.handoff_pairs(rows, client, alone)
    steps = client / "run0" / "steps.csv"
    data = gzip.compress(b"num_seqs,num_prefill_seqs,update_s\n" + b"4,0,0.001\n" * 2000)
    steps.unlink()
    (client / "run0" / "steps.csv.gz").write_bytes(data[:20] + bytes(50) + data[70:])
    with pytest.raises(ValueError, match=r"run0/steps.csv.gz: unreadable steps"):
        fit_api.handoff_pairs(rows, client, alone)
    (client / "run0" / "steps.csv.gz").unlink()
    # too few decode windows: the pair is left out, and with no pair left the fit stops
    write_steps(client / "run0", 90.0, 2.0, windows=50)
    with pytest.raises(ValueError, match="no client run keeps the server's steps.csv with 100"):
        fit_api.handoff_pairs(rows, client, alone)
    write_steps(client / "run1", 90.0, 2.0)
    write_steps(alone / "run1", 10.0, 1.0)
    pairs = fit_api.handoff_pairs(rows, client, alone)
    assert [fit_api.usable(p) for p in pairs] == [False, True]
    assert fit_api.fit_handoff(pairs)["handoff_per_chunk_us"] == pytest.approx(1.0, rel=0.1)
    # a twin of another configuration or workload is not a pair
    twin = json.loads((alone / "run1" / "result.json").read_text())
    twin["schedlab"]["k"] = 8
    (alone / "run1" / "result.json").write_text(json.dumps(twin))
    with pytest.raises(ValueError, match=r"run1/result.json: not the run of .* \(k differs\)"):
        fit_api.handoff_pairs(rows, client, alone)


def test_a_term_the_runs_cannot_set_is_named(tmp_path):
    """At one prompt mix, requests move with tokens: the per-request term (or the per-token
    one: either can stand in for the other) is not set by the runs, and the profile's header
    says so instead of passing its value off as measured."""
    for i, (chunks, tokens, requests) in enumerate([(189_000, 189_000, 1000),
                                                    (24_000, 189_000, 1000),
                                                    (76_000, 75_600, 400),
                                                    (10_000, 75_600, 400)]):
        cpu = (CHUNK_US * chunks + TOKEN_US * tokens + REQUEST_US * requests) * 1e-6
        write_run(tmp_path, f"run{i}", chunks, requests, cpu, tokens=tokens)
    rows = fit_api.client_runs(tmp_path)
    terms = fit_api.fit_api(rows)
    unset = fit_api.unset_terms(fit_api.fit_errors(rows), terms)
    assert "api_per_request_us" in unset and "api_per_chunk_us" not in unset
    base = yaml.safe_load((CONF / "overhead" / "schedlab_h200.yaml").read_text())
    text = fit_api.profile_text(base, terms, rows, fit_api.fit_errors(rows), "x", "cmd")
    assert "# api_per_request_us is not set by these runs" in text
    # runs with another mix set it
    synthetic_runs(tmp_path / "mixed")
    rows = fit_api.client_runs(tmp_path / "mixed")
    assert fit_api.unset_terms(fit_api.fit_errors(rows), fit_api.fit_api(rows)) == []


def test_server_suite_names_calibration_runs_by_their_seed():
    """benchmarks/server_suite.py --seed: the t=0 prompts come from that seed and the run's
    directory says so (Poisson runs keep seed 1), so calibration and validation runs never
    share a directory; fit_api pairs a client run with the in-process run of its name."""
    import argparse
    import sys

    sys.path.insert(0, str(CONF.parent / "benchmarks"))
    import server_suite

    args = argparse.Namespace(prompts=1000, poisson_prompts=400, rates=["20"], seed=2,
                              fixed_output_len=8, smoke=False)
    assert server_suite.workloads(args) == [("inf", 1000, 2), ("20", 400, 1)]
    assert server_suite.run_name(args, "single_step", "inf") == "single_step_rateinf_out8_seed2"
    assert server_suite.run_name(args, "single_step", "20") == "single_step_rate20_out8"
    plain = argparse.Namespace(**{**vars(args), "seed": 0, "fixed_output_len": None})
    assert server_suite.run_name(plain, "multi_step_k8", "inf") == "multi_step_k8_rateinf"
