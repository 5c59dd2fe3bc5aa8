"""experiments.validate as a user meets it: every mistake is one line naming the setting or file
(exit code 2), unreadable measured files are never skipped in silence, Ctrl-C exits 130."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import validate

ROOT = Path(__file__).resolve().parent.parent
# a fast grid: the tiny model, one configuration, one simulated run
FAST = ["--model", "tiny", "--workload", "synthetic", "--hardware", "cpu", "--overhead", "none",
        "--policies", "single_step", "--rates", "inf", "--sim-repeats", "1"]
# vLLM's --metadata policy=single_step names the policy (a file without it is refused)
RESULT = {"request_throughput": 3.0, "median_ttft_ms": 20.0, "request_rate": "inf",
          "num_prompts": 5, "policy": "single_step"}


def measured(root: Path, name: str = "a.json", **fields) -> Path:
    """A vLLM benchmark_serving result file (single_step, 5 prompts) with ``fields`` changed."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / name
    path.write_text(json.dumps({**RESULT, **fields}))
    return path


def dirs(tmp_path: Path) -> list[str]:
    return ["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]


def fails(capsys, argv: list[str], *needles: str) -> str:
    """main(argv) exits 2 with one line on stderr that holds every needle."""
    with pytest.raises(SystemExit) as exc:
        validate.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2, err
    assert len(err) == 1 and err[0].startswith("error: "), err
    for needle in needles:
        assert needle in err[0]
    return err[0]


def test_unreadable_measured_files_are_named_and_stop_the_run(tmp_path, capsys):
    """A truncated repeat does not vanish: every unreadable file is named and nothing runs."""
    meas = tmp_path / "meas"
    measured(meas)
    (meas / "b.json").write_text(json.dumps(RESULT)[:30])  # a repeat cut short
    (meas / "c.json").write_bytes(b"\xff\xfe\x00")
    err = fails(capsys, FAST + dirs(tmp_path) + ["--measured-dir", str(meas)],
                "2 unreadable", str(meas / "b.json"), str(meas / "c.json"), "--skip-unreadable")
    assert str(meas / "a.json") not in err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


def test_skip_unreadable_names_each_skipped_file_and_uses_the_rest(tmp_path, capsys):
    meas = tmp_path / "meas"
    measured(meas)
    measured(meas, "b.json", request_throughput=5.0)
    (meas / "c.json").write_text(json.dumps(RESULT)[:30])
    (meas / "notes.json").write_text("[1, 2]")  # valid JSON, not a result
    df = validate.main(FAST + dirs(tmp_path) + ["--measured-dir", str(meas), "--skip-unreadable"])
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if str(meas / "c.json") in line and "skipped" in line]
    assert [line for line in err if str(meas / "notes.json") in line and "skipped" in line]
    thr = df[df["metric"] == "request_throughput"]
    assert len(thr) == 1 and thr["repeats"].iloc[0] == 2 and thr["measured"].iloc[0] == 4.0
    assert (tmp_path / "out" / "validation.csv").exists()


@pytest.mark.parametrize("fields, needle", [
    ({"num_prompts": "abc"}, "num_prompts"),
    ({"num_prompts": -5}, "num_prompts"),
    ({"num_prompts": 2.5}, "num_prompts"),
    ({"seed": "x"}, "seed"),
    ({"request_throughput": "abc"}, "request_throughput"),
    ({"median_ttft_ms": [1]}, "median_ttft_ms"),
    ({"p99_tpot_ms": True}, "p99_tpot_ms"),
    ({"request_rate": "abc"}, "request_rate"),
    ({"request_rate": -1}, "request_rate"),
    ({"num_scheduler_steps": "x"}, "num_scheduler_steps"),
    ({"policy": "multistep", "num_steps": 4}, "policy 'multistep'"),
    ({"schedlab": "x"}, "schedlab"),
    ({"schedlab": {"policy": "single_step", "workload": "x"}}, "workload"),
])
def test_bad_measured_result_is_one_line_naming_file_and_setting(tmp_path, capsys, fields,
                                                                 needle):
    path = measured(tmp_path / "meas", **fields)
    fails(capsys, FAST + dirs(tmp_path) + ["--measured-dir", str(tmp_path / "meas")],
          str(path), needle)
    assert not (tmp_path / "runs").exists()


def test_measured_configurations_outside_the_grid_are_named(tmp_path, capsys):
    path = measured(tmp_path / "meas", request_rate=20)
    with pytest.raises(SystemExit) as exc:
        validate.main(FAST + dirs(tmp_path) + ["--measured-dir", str(tmp_path / "meas")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if "not in the grid" in line]
    assert f"{path} (single_step k=None rate=20)" in line
    # the grid's configuration without a measurement: one line for all of them
    (line,) = [line for line in err.splitlines() if "no measured result" in line]
    assert "1 of 1 configurations" in line and "single_step rate=inf" in line


@pytest.mark.parametrize("override, needle", [
    ("foo=1", "Could not override 'foo'"),
    ("a=[", "no viable alternative"),
    ("model=nope", "Could not find 'model/nope'"),
    ("policy.num_steps=3", "Could not override 'policy.num_steps'"),  # single_step has none
])
def test_override_typo_is_one_line_naming_the_override(tmp_path, capsys, override, needle):
    measured(tmp_path / "meas")
    fails(capsys, FAST + dirs(tmp_path) + ["--measured-dir", str(tmp_path / "meas"),
                                           "--override", override],
          f"--override {override}:", needle)
    assert not (tmp_path / "runs").exists()  # refused before anything ran


def test_model_and_workload_typos_name_their_flag(tmp_path, capsys):
    measured(tmp_path / "meas")
    base = FAST + dirs(tmp_path) + ["--measured-dir", str(tmp_path / "meas")]
    fails(capsys, base + ["--model", "nope"], "--model model=nope", "tiny")
    fails(capsys, base + ["--workload", "nope"], "--workload workload=nope", "synthetic")


def test_a_setting_of_the_wrong_type_is_one_line_naming_it(tmp_path, capsys):
    measured(tmp_path / "meas")
    fails(capsys, FAST + dirs(tmp_path) + ["--measured-dir", str(tmp_path / "meas"),
                                           "--override", "workload.num_prompts=abc"],
          "single_step_k1_rateinf", "workload.num_prompts")


@pytest.mark.parametrize("flag", ["--hardware", "--overhead"])
def test_profile_that_is_not_a_yaml_profile_is_one_line(tmp_path, capsys, flag):
    measured(tmp_path / "meas")
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n1,2\n")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("a: [\n")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("name: x\nfoo: 1\n")
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    base = FAST + dirs(tmp_path) + ["--measured-dir", str(tmp_path / "meas")]
    for path, needle in ((tmp_path / "missing.csv", "not found"), (csv, "not a YAML profile"),
                         (bad_yaml, "line 2"), (unknown, "no setting 'foo'"),
                         (folder, "directory")):
        fails(capsys, base + [flag, str(path)], f"{flag} {path}:", needle)
    assert not (tmp_path / "runs").exists()


def test_output_directory_that_is_a_file_is_one_line(tmp_path, capsys):
    measured(tmp_path / "meas")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    base = FAST + ["--measured-dir", str(tmp_path / "meas")]
    fails(capsys, base + ["--runs", str(a_file), "--out", str(tmp_path / "out")],
          f"--runs {a_file}", "not a directory")
    fails(capsys, base + ["--runs", str(tmp_path / "runs"), "--out", str(a_file)],
          f"--out {a_file}", "not a directory")
    fails(capsys, base + ["--runs", str(tmp_path / "runs"), "--out", str(a_file / "sub")],
          f"--out {a_file / 'sub'}", "cannot write")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root writes into read-only directories")
def test_read_only_output_directory_is_one_line(tmp_path, capsys):
    measured(tmp_path / "meas")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        base = FAST + ["--measured-dir", str(tmp_path / "meas")]
        fails(capsys, base + ["--runs", str(locked), "--out", str(tmp_path / "out")],
              f"--runs {locked}", "cannot write")
        fails(capsys, base + ["--runs", str(tmp_path / "runs"), "--out", str(locked / "sub")],
              f"--out {locked / 'sub'}", "cannot write")
    finally:
        locked.chmod(0o755)


def test_without_cuda_the_real_side_is_refused_before_anything_runs(tmp_path, capsys,
                                                                    monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fails(capsys, FAST + dirs(tmp_path) + ["--num-prompts", "2"],
          "--device cuda", "no CUDA GPU", "--measured-dir")
    fails(capsys, FAST + dirs(tmp_path) + ["--num-prompts", "2", "--device", "cpu",
                                           "--real-override", "backend.device=cuda:0"],
          "--real-override backend.device=cuda:0", "no CUDA GPU")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, needle", [
    (["--num-prompts", "0"], "--num-prompts"),
    (["--num-prompts", "-3"], "--num-prompts"),
    (["--sim-repeats", "0"], "--sim-repeats"),
    (["--sim-spread", "-0.1"], "--sim-spread"),
    (["--sim-spread", "nan"], "--sim-spread"),
    (["--policies", "multi_step:x"], "'multi_step:x'"),
    (["--policies", "multi_step:0"], "'multi_step:0'"),
    (["--policies", "single_step,foo"], "unknown policy 'foo'"),
    (["--policies", "multi_step"], "multi_step needs a step count"),
    (["--policies", "single_step:4"], "single_step takes no step count"),
    (["--rates", "0"], "--rates"),
    (["--rates", "inf,abc"], "'abc'"),
    (["--seed", "-1"], "--seed"),
])
def test_bad_argument_is_one_line_naming_it(tmp_path, capsys, args, needle):
    measured(tmp_path / "meas")
    fails(capsys, FAST + dirs(tmp_path) + ["--measured-dir", str(tmp_path / "meas")] + args,
          needle)


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    def interrupted(cfg, run_dir):
        raise KeyboardInterrupt

    monkeypatch.setattr(validate, "run", interrupted)
    measured(tmp_path / "meas")
    with pytest.raises(SystemExit) as exc:
        validate.main(FAST + dirs(tmp_path) + ["--measured-dir", str(tmp_path / "meas")])
    assert exc.value.code == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "interrupted" in err[0]
    assert not (tmp_path / "out" / "validation.csv").exists()


def test_a_run_cut_short_leaves_no_result_under_an_earlier_stamp(tmp_path, monkeypatch):
    """A directory's stamp names the configuration of its result.json: a rerun with other
    settings that dies after writing its result must not pass for the earlier run."""
    def finished(thr: float, then_interrupt: bool = False):
        def fake_run(cfg, run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "result.json").write_text(json.dumps({"request_throughput": thr}))
            if then_interrupt:
                raise KeyboardInterrupt
            return {"request_throughput": thr}
        return fake_run

    first, other = ["model=tiny"], ["model=tiny", "workload.seed=3"]
    monkeypatch.setattr(validate, "run", finished(1.0))
    assert validate.run_one(first, tmp_path / "d")["request_throughput"] == 1.0
    assert validate.run_one(first, tmp_path / "d")["request_throughput"] == 1.0  # resumed
    monkeypatch.setattr(validate, "run", finished(2.0, then_interrupt=True))
    with pytest.raises(KeyboardInterrupt):
        validate.run_one(other, tmp_path / "d")
    monkeypatch.setattr(validate, "run", finished(3.0))
    assert validate.run_one(first, tmp_path / "d")["request_throughput"] == 3.0  # run again


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.validate", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_cli_truncated_measured_file_is_one_line_and_exit_2(tmp_path):
    meas = tmp_path / "meas"
    measured(meas)
    (meas / "b.json").write_text(json.dumps(RESULT)[:30])
    p = cli(*FAST, *dirs(tmp_path), "--measured-dir", str(meas))
    assert p.returncode == 2 and "Traceback" not in p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and str(meas / "b.json") in err[0]


def test_cli_override_typo_and_bad_argument_are_one_line_and_exit_2(tmp_path, capsys):
    """Through main() in this process: the command line's own exit and stderr are the test
    above's."""
    measured(tmp_path / "meas")
    base = [*FAST, *dirs(tmp_path), "--measured-dir", str(tmp_path / "meas")]
    for extra, needle in ((["--override", "foo=1"], "--override foo=1"),
                          (["--num-prompts", "0"], "--num-prompts")):
        fails(capsys, [*base, *extra], needle)


def test_a_config_file_edited_after_a_compose_is_read_again(tmp_path, monkeypatch):
    """validate composes a configuration once, but not across an edit of a config file."""
    import shutil

    from experiments import validate

    conf = tmp_path / "conf"
    shutil.copytree(validate.CONF_DIR, conf, ignore=shutil.ignore_patterns("calibration"))
    monkeypatch.setattr(validate, "CONF_DIR", str(conf))
    first = validate.compose_config(["model=tiny"])
    assert validate.compose_config(["model=tiny"]) == first  # (from the cache)
    spec = conf / "model" / "tiny.yaml"
    spec.write_text(spec.read_text().replace(f"num_layers: {first['model']['num_layers']}",
                                             f"num_layers: {first['model']['num_layers'] + 1}"))
    again = validate.compose_config(["model=tiny"])
    assert again["model"]["num_layers"] == first["model"]["num_layers"] + 1
