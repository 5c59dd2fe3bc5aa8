"""benchmarks/vllm_published.py and docs/validation/vllm_published.md say the same: the doc's
table holds the script's rows, RFC #6854's gains are the quotients of its published
throughputs, and the A10G runs the doc explains give what the doc quotes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import vllm_published as vp  # noqa: E402

DOC = ROOT / "docs" / "validation" / "vllm_published.md"


def doc_rows() -> list[list[str]]:
    lines = DOC.read_text().splitlines()
    start = lines.index("| # | source | hardware | model | workload | config | metric | published "
                        "| predicted | error |")
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_doc_table_holds_the_scripts_rows():
    rows = doc_rows()
    assert len(rows) == len(vp.ROWS)
    for i, (cells, row) in enumerate(zip(rows, vp.ROWS, strict=True), 1):
        assert cells[:8] == [str(i), row.source, row.hardware, row.model, row.workload,
                             row.config, row.metric, f"{row.published:.5g}"], i


def test_rfc_rows_are_its_table():
    rfc = [r for r in vp.ROWS if r.source == "#6854 (RFC)"]
    published = {(r.hardware, r.model, r.config): r.published for r in rfc}
    for (hw, model), key in {("1xA10G", "Llama 8B"): "a10g_8b",
                             ("1xH100", "Llama 8B"): "h100_8b"}.items():
        single, ms8, ms16 = vp.RFC_6854[key]
        assert published[(hw, model, "single step (v0.5)")] == single
        assert published[(hw, model, "multi-step 8 / single step (v0.5)")] == ms8 / single
        if ms16 is not None:
            assert published[(hw, model, "multi-step 16 / single step (v0.5)")] == ms16 / single
    # the A10G rows run on the A10G profile, the H100 rows on the H100 one, all with v0.5 costs
    for r in rfc:
        for run in r.runs:
            settings = dict(o.split("=", 1) for o in vp.overrides(run))
            assert settings["hardware"] == ("a10g" if r.hardware == "1xA10G" else "h100_sxm")
            assert settings["overhead"] == "vllm_v0_5"
            assert settings["workload"] == "sharegpt" and "workload.num_prompts" not in settings


@pytest.mark.parametrize("policy", [vp.V05_SINGLE, vp.V05_MS8], ids=["single_step", "ms8"])
def test_a10g_runs_give_what_the_doc_quotes(policy):
    run = vp.SHAREGPT_1000 + vp.A10G + policy
    line = next(ln for ln in DOC.read_text().splitlines() if f"`{vp.command(run)}`" in ln)
    quoted = re.search(r"; ([\d.]+) req/s, .*, (\d+) preemptions\)$", line)
    res = vp.simulate(run)
    assert f"{res['request_throughput']:.2f}" == quoted.group(1)
    assert res["schedlab"]["num_preemptions"] == int(quoted.group(2))
