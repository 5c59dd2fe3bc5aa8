"""A run's result files, byte for byte: requests.csv, steps.csv and result.json of a few small
runs (one replica; a cluster behind a router; conversations with prefix caching; pipeline
stages with per-step streaming; the per-request lists left out) hashed and compared to the
digests in tests/data/result_bytes.json, taken from the writer before its redesign. result.json's
date and wall-clock fields are the only values set aside. Regenerate with
``python tests/test_result_bytes.py --write`` only for a deliberate change of the files."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments import request_times
from experiments.run import CONF_DIR, run

REFERENCE = Path(__file__).parent / "data" / "result_bytes.json"
BASE = ["backend=sim", "model=tiny", "hardware=cpu", "overhead=none", "progress=false",
        "workload=synthetic", "workload.num_prompts=80", "workload.seed=3"]
CONFIGS = {
    "one_replica": ["metrics.save_per_request=true"],
    "cluster": ["metrics.save_per_request=true", "cluster.num_replicas=3",
                "router=round_robin", "workload.request_rate=40"],
    "per_request_off": ["metrics.save_per_request=false", "policy=multi_step",
                        "policy.num_steps=4", "workload.request_rate=25"],
    "overlap_chunked": ["metrics.save_per_request=true", "scheduler.overlap=true",
                        "policy=chunked_prefill", "workload.request_rate=60"],
}
# result.json's values that depend on the wall clock
WALL = re.compile(r'"(date|wall_seconds|simulated_seconds_per_wall_second)": [^,}]+')


def digests(tmp_path: Path, name: str) -> dict[str, str]:
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=[*BASE, *CONFIGS[name]])
    run_dir = tmp_path / name
    run(cfg, run_dir, sweep_label=name)
    out = {}
    for f in ("requests.csv", "steps.csv", "result.json"):
        data = (run_dir / f).read_bytes()
        if f == "result.json":
            data = WALL.sub(lambda m: f'"{m.group(1)}": 0', data.decode()).encode()
        out[f] = hashlib.sha256(data).hexdigest()[:16]
    return out


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("chunk", [None, 7])  # one chunk, and many (some of them empty lists)
def test_result_files_are_the_bytes_they_were(tmp_path, monkeypatch, name, chunk):
    if chunk is not None:
        monkeypatch.setattr(request_times, "CHUNK_REQUESTS", chunk)
    assert digests(tmp_path, name) == json.loads(REFERENCE.read_text())[name]


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        REFERENCE.write_text(json.dumps({n: digests(Path(tmp), n) for n in CONFIGS}, indent=1)
                             + "\n")
