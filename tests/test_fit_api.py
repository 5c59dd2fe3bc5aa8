"""experiments.fit_api: the front end's per-chunk and per-request CPU terms, recovered from
client-measured results made from known coefficients, written as a profile the simulator takes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
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
    """conf/overhead/schedlab_h200_server.yaml is what fit_api makes of the client-measured
    runs in docs/validation/measured/server/client."""
    conf = tmp_path / "conf"
    (conf / "overhead").mkdir(parents=True)
    for name in ("schedlab_h200",):
        (conf / "overhead" / f"{name}.yaml").write_text(
            (CONF / "overhead" / f"{name}.yaml").read_text())
    runs = CONF.parent / "docs" / "validation" / "measured" / "server" / "client"
    fit_api.main(["--measured-dir", str(runs), "--conf-dir", str(conf)])
    refit = yaml.safe_load((conf / "overhead" / "schedlab_h200_server.yaml").read_text())
    committed = yaml.safe_load((CONF / "overhead" / "schedlab_h200_server.yaml").read_text())
    assert refit == committed


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
