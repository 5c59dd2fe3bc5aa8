"""Host profiles: benchmarks/scheduler_speed.py measures a host once and writes
conf/host/NAME.yaml; a run with host=NAME scales its overhead profile's CPU costs by it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments.profiles import InputError
from experiments.validate import compose_config, load_profile, run_one
from simulator.overhead import _COSTS, OverheadSpec

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "scheduler_speed.py"


def _module():
    spec = importlib.util.spec_from_file_location("scheduler_speed", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ss = _module()


def test_a_profile_is_written_and_read_back(tmp_path):
    """The probe times every case; the factor is the median ratio to the reference host's
    times (the calibration host's Scheduler bench by default, or another profile)."""
    measured = ss.probe(repeats=1, windows=3)
    assert set(measured) == {"k1", "k8"}
    assert all(set(by_n) == set(ss.PROBE_SEQS) and min(by_n.values()) > 0
               for by_n in measured.values())
    ref = ss.reference_window_us()
    assert ref["k1"][256] == pytest.approx(153, abs=1)  # conf/calibration/h200_calibrated.csv
    slower = {k: {n: 1.5 * us for n, us in by_n.items()} for k, by_n in ref.items()}
    prof = ss.host_profile("box", slower)
    assert prof["cpu_factor"] == pytest.approx(1.5)
    assert "schedlab_h200" in prof["reference"] and "code" in prof["reference"]
    path = ss.write_host_profile(prof, tmp_path)
    assert path == tmp_path / "host" / "box.yaml"
    assert path.read_text().startswith("# @package overhead.host\n")
    assert ss.read_host_profile(path) == prof
    # against another host profile: the ratio of the two hosts' times
    faster = {k: {n: 0.5 * us for n, us in by_n.items()} for k, by_n in ref.items()}
    assert ss.host_profile("quick", faster, path)["cpu_factor"] == pytest.approx(1 / 3, abs=1e-4)


def test_the_command_writes_conf_host_name_yaml(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--host", "box", "--conf-dir",
                          str(tmp_path), "--repeats", "1"], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    prof = ss.read_host_profile(tmp_path / "host" / "box.yaml")
    assert prof["name"] == "box" and prof["machine"]["cores"] >= 1
    assert out.stdout.strip() == (f"{tmp_path / 'host' / 'box.yaml'}: cpu_factor "
                                  f"{prof['cpu_factor']:g} against the reference host")


@pytest.mark.parametrize(("text", "message"), [
    ("name: box\ncpu_factor: fast\nwindow_us: {k1: {1: 3.0}}\n",
     "cpu_factor must be a number > 0, got 'fast'"),
    ("name: box\ncpu_factor: 0\nwindow_us: {k1: {1: 3.0}}\n",
     "cpu_factor must be a number > 0, got 0"),
    ("name: box\ncpu_factor: 1.2\nwindow_us: {k1: {1: -3.0}}\n",
     "window_us must map k1/k8 to {num_seqs: us > 0}"),
    ("- just a list\n", "not a host profile (no name)"),
    ("name: [unclosed\n", "not a readable host profile"),
])
def test_a_bad_profile_is_a_one_line_error(tmp_path, capsys, text, message):
    """read_host_profile's error, and the command's: exit 2 and that one line, nothing written
    (the first case through the command line, the others through its main() in this
    process)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ss.HostProfileError) as err:
        ss.read_host_profile(bad)
    assert str(err.value).startswith(f"{bad}: {message}")
    assert len(str(err.value).splitlines()) == 1
    argv = ["--host", "box", "--reference", str(bad), "--conf-dir", str(tmp_path)]
    if message.startswith("cpu_factor must be a number > 0, got 'fast'"):
        out = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True,
                             text=True, cwd=ROOT)
        code, stderr = out.returncode, out.stderr
    else:
        with pytest.raises(SystemExit) as exc:
            ss.main(argv)
        code, stderr = exc.value.code, capsys.readouterr().err
    assert code == 2 and len(stderr.strip().splitlines()) == 1
    assert stderr.startswith(f"error: {bad}: {message}")
    assert not (tmp_path / "host").exists()  # nothing written


def test_a_bad_host_setting_is_a_one_line_error():
    base = load_profile("overhead", "schedlab_h200")
    with pytest.raises(ValueError, match=r"^overhead.host.cpu_factor must be a number > 0, got "
                                         r"'fast' \(conf/host/box.yaml\)$"):
        OverheadSpec.from_dict({**base, "host": {"name": "box", "cpu_factor": "fast"}})
    with pytest.raises(ValueError, match="^overhead.host must be a host profile"):
        OverheadSpec.from_dict({**base, "host": "box"})
    with pytest.raises(InputError, match="^override host=nope: .*host/nope"):
        compose_config(["host=nope"])


def test_host_scales_the_overhead_profiles_cpu_costs(tmp_path):
    """host=NAME puts the profile under overhead.host: every CPU cost times cpu_factor, the
    name says which host, nothing else moves; without it the profile is as fitted."""
    base = load_profile("overhead", "schedlab_h200")
    host = {"name": "box", "cpu_factor": 1.5, "window_us": {"k1": {1: 4.5}}}
    spec = OverheadSpec.from_dict({**base, "host": host})
    plain = OverheadSpec.from_dict(base)
    assert spec.name == "schedlab_h200@box"
    for field in OverheadSpec.__dataclass_fields__:
        want = getattr(plain, field) * 1.5 if field in _COSTS else getattr(plain, field)
        if field != "name":
            assert getattr(spec, field) == pytest.approx(want), field
    assert plain.schedule_base_us > 0 and plain.name == "schedlab_h200"
    # through the config: the committed profile of the CPU box
    committed = ss.read_host_profile(ROOT / "conf" / "host" / "cpu_box.yaml")
    cfg = compose_config(["overhead=schedlab_h200", "host=cpu_box"])
    assert cfg["overhead"]["host"] == committed
    assert "host" not in compose_config(["overhead=schedlab_h200"])["overhead"]
    # a run: the same workload, its CPU time between windows scaled
    ov = ["model=llama3_8b", "hardware=h200_calibrated", "overhead=schedlab_h200",
          "policy=single_step", "workload=synthetic", "workload.num_prompts=8",
          "progress=false"]
    cpu = {}
    for name, extra in (("plain", []), ("host", ["host=cpu_box"])):
        run_one(ov + extra, tmp_path / name, quiet=True)
        s = pd.read_csv(tmp_path / name / "steps.csv")
        cpu[name] = float((s["t_start"].shift(-1) - s["t_start"] - s["gpu_s"]).sum())
    assert cpu["host"] / cpu["plain"] == pytest.approx(committed["cpu_factor"], rel=0.02)
