"""The docs' validation tables say what docs/validation/validation.csv says: every cell of
validation.md, its worst-error line, the README's summary table with its claim, and the
figures BENCHMARKS.md and docs/validation/README.md quote from it."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
VALIDATION = ROOT / "docs" / "validation"
SUMMARY_METRICS = {"request throughput": "request_throughput", "median TTFT": "median_ttft_ms",
                   "median TPOT": "median_tpot_ms"}
TARGETS = {"request_throughput": 0.03, "median_ttft_ms": 0.10, "median_tpot_ms": 0.10}


@pytest.fixture(scope="module")
def table() -> pd.DataFrame:
    df = pd.read_csv(VALIDATION / "validation.csv")
    df["k"] = df["k"].fillna(1).astype(int)  # single_step has no k: the tables show 1
    df["rate"] = df["request_rate"].map(lambda r: "inf" if math.isinf(r) else f"{r:g}")
    return df


def pct(x: float) -> str:
    return f"{x:+.1%}"


def markdown_rows(text: str, first_cell: str) -> tuple[list[str], list[list[str]]]:
    """The header and body rows of the markdown table whose header starts with first_cell."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_cell} |"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows[0], rows[2:]  # after the header and its rule


def test_every_cell_of_validation_md_is_the_csv_error(table):
    text = (VALIDATION / "validation.md").read_text()
    header, rows = markdown_rows(text, "policy")
    metrics = header[3:]
    assert rows and set(metrics) <= set(table["metric"])
    err = table.set_index(["policy", "k", "rate", "metric"])["rel_error"]
    seen = set()
    for row in rows:
        policy, k, rate = row[0], int(row[1]), row[2]
        for metric, cell in zip(metrics, row[3:], strict=True):
            assert cell == pct(err[(policy, k, rate, metric)]), (policy, k, rate, metric)
        seen.add((policy, k, rate))
    assert seen == set(zip(table["policy"], table["k"], table["rate"], strict=True))
    worst = re.search(r"Worst absolute error over the grid: (.*)", text).group(1)
    found = re.findall(r"(\w+) ([\d.]+)%", worst)
    assert [m for m, _ in found] == metrics
    for metric, value in found:
        assert float(value) == pytest.approx(
            round(100 * table.loc[table["metric"] == metric, "rel_error"].abs().max(), 1))


def test_readme_summary_is_the_worst_csv_error_per_load(table):
    text = (ROOT / "README.md").read_text()
    header, rows = markdown_rows(text, "load")
    assert header[1:] == list(SUMMARY_METRICS)
    loads = {}
    for row in rows:
        if row[0].startswith("all at t=0"):
            loads["inf"] = row
        elif m := re.match(r"Poisson (\d+) req/s", row[0]):
            loads[m.group(1)] = row
        elif row[0].startswith("the measurement's own spread"):
            for name, cell in zip(SUMMARY_METRICS.values(), row[1:], strict=True):
                spread = table.loc[table["metric"] == name, "measured_spread"].max()
                assert float(cell.split("%")[0]) == pytest.approx(round(100 * spread, 1)), name
    assert set(loads) == set(table["rate"])
    for rate, row in loads.items():
        here = table[table["rate"] == rate]
        configs = int(re.search(r"(\d+) configs", row[0]).group(1))
        assert configs == len(here.groupby(["policy", "k"]))
        for name, cell in zip(SUMMARY_METRICS.values(), row[1:], strict=True):
            worst = here.loc[here["metric"] == name, "rel_error"].abs().max()
            assert float(cell.split("%")[0]) == pytest.approx(round(100 * worst, 1)), (rate, name)
    # the claim under the table
    claim = re.search(r"All (\d+) configurations meet the targets", text)
    if claim:
        assert int(claim.group(1)) == len(table.groupby(["policy", "k", "rate"]))
        for name, target in TARGETS.items():
            assert (table.loc[table["metric"] == name, "rel_error"].abs() <= target).all(), name


def test_readme_server_table_is_the_server_validation_csv():
    """docs/validation/README.md's table for the engine behind its HTTP server is what
    experiments.validate wrote to server/off and server/on, every cell."""
    text = (VALIDATION / "README.md").read_text()
    section = text[text.index("## The engine behind its HTTP server"):]
    header, rows = markdown_rows(section, "configuration")
    metrics = [SUMMARY_METRICS[h] for h in header[2:]]
    names = {"single_step": ("off", "single_step", 1), "multi_step k=8": ("off", "multi_step", 8),
             "single_step + overlap": ("on", "single_step", 1)}
    seen, missed = set(), 0
    for row in rows:
        part, policy, k = names[row[0]]
        df = pd.read_csv(VALIDATION / "server" / part / "validation.csv")
        df["k"] = df["k"].fillna(1).astype(int)
        df["rate"] = df["request_rate"].map(lambda r: "t=0" if math.isinf(r) else f"{r:g}")
        err = df.set_index(["policy", "k", "rate", "metric"])["rel_error"]
        for metric, cell in zip(metrics, row[2:], strict=True):
            value = err[(policy, k, row[1], metric)]
            over = abs(value) > TARGETS[metric]  # an error over target is shown in bold
            assert cell == (f"**{pct(value)}**" if over else pct(value)), (row[0], row[1], metric)
            missed += over
        seen.add((row[0], row[1]))
    assert len(seen) == 6
    assert ("All six configurations meet the targets" in section) == (missed == 0)


def _worst(table: pd.DataFrame, column: str) -> list[float]:
    """Per summary metric, the largest |value| of ``column`` over the grid, in percent."""
    return [round(100 * table.loc[table["metric"] == m, column].abs().max(), 1)
            for m in SUMMARY_METRICS.values()]


def test_benchmarks_and_validation_readme_quote_the_csv(table):
    """BENCHMARKS.md's paragraph on the validation and docs/validation/README.md's result table
    quote the grid's worst errors and both sides' spreads: the numbers of validation.csv."""
    text = " ".join((ROOT / "BENCHMARKS.md").read_text().split())
    m = re.search(r"Worst errors over the whole grid: request throughput ([\d.]+)%, median TTFT "
                  r"([\d.]+)%, median TPOT ([\d.]+)%", text)
    assert [float(v) for v in m.groups()] == _worst(table, "rel_error")
    m = re.search(r"own spread reaches ([\d.]+)%, ([\d.]+)% and ([\d.]+)%; the simulated runs' "
                  r"([\d.]+)%, ([\d.]+)% and ([\d.]+)%", text)
    values = [float(v) for v in m.groups()]
    assert values[:3] == _worst(table, "measured_spread")
    assert values[3:] == _worst(table, "predicted_spread")
    readme = (VALIDATION / "README.md").read_text()
    section = readme[readme.index("## Result: every configuration within the targets"):]
    _, rows = markdown_rows(section, "load")
    loads = {"all at t=0": "inf", "Poisson 20 req/s": "20", "Poisson 40 req/s": "40"}
    seen = set()
    for row in rows:
        cells = [float(c.split("%")[0].removeprefix("up to ")) for c in row[1:]]
        rate = next((r for label, r in loads.items() if row[0].startswith(label)), None)
        if rate is not None:
            assert cells == _worst(table[table["rate"] == rate], "rel_error"), row[0]
        elif row[0].startswith("spread of the measured"):
            assert cells == _worst(table, "measured_spread")
        else:
            assert row[0].startswith("spread of the 9 simulated"), row[0]
            assert cells == _worst(table, "predicted_spread")
        seen.add(row[0].split(" (")[0])
    assert len(seen) == 5


def test_readme_overlap_table_is_the_overlap_validation_csv():
    """docs/validation/README.md's table for the overlap configurations is what
    experiments.validate wrote to overlap/, every cell, an error over target in bold."""
    text = (VALIDATION / "README.md").read_text()
    section = text[text.index("## Overlap scheduling"):]
    header, rows = markdown_rows(section, "configuration")
    metrics = [SUMMARY_METRICS[h] for h in header[2:]]
    names = {"single_step + overlap": ("single_step", 1),
             "multi_step k=4 + overlap": ("multi_step", 4),
             "chunked_prefill + overlap": ("chunked_prefill", 1)}
    df = pd.read_csv(VALIDATION / "overlap" / "validation.csv")
    df["k"] = df["k"].fillna(1).astype(int)
    df["rate"] = df["request_rate"].map(lambda r: "t=0" if math.isinf(r) else f"{r:g}")
    err = df.set_index(["policy", "k", "rate", "metric"])["rel_error"]
    met = 0
    for row in rows:
        policy, k = names[row[0]]
        over = [abs(err[(policy, k, row[1], m)]) > TARGETS[m] for m in metrics]
        for metric, cell, miss in zip(metrics, row[2:], over, strict=True):
            value = pct(err[(policy, k, row[1], metric)])
            assert cell == (f"**{value}**" if miss else value), (row[0], row[1], metric)
        met += not any(over)
    assert len(rows) == len(df.groupby(["policy", "k", "rate"])) == 9
    counts = ["No", "One", "Two", "Three", "Four", "Five", "Six", "Seven", "Eight"]
    claim = ("All nine configurations meet the targets" if met == 9
             else f"{counts[met]} of the nine configurations meet the targets")
    assert claim in section


def test_readme_models_table_is_the_leave_one_out_csv():
    """docs/validation/README.md's leave-one-model-out summary is docs/validation/models.csv: per model and
    metric the worst held-out error, the old profile's in brackets, and the count of cells
    over target."""
    text = (VALIDATION / "README.md").read_text()
    header, rows = markdown_rows(text, "model (held out)")
    metrics = [SUMMARY_METRICS[h] for h in header[1:]]
    df = pd.read_csv(VALIDATION / "models.csv")
    names = {"Llama-3.2-1B": "llama3_2_1b", "Llama-3.2-3B": "llama3_2_3b",
             "Llama-3-8B": "llama3_8b", "Llama-2-13B (MHA)": "llama2_13b",
             "LLaMA-30B (MHA)": "llama_30b"}
    assert {names[row[0]] for row in rows} == set(df["model"])
    for row in rows:
        here = df[df["model"] == names[row[0]]]
        for metric, cell in zip(metrics, row[1:], strict=True):
            new, old = re.match(r"([\d.]+)% \(([\d.]+)%", cell).groups()
            for profile, value in (("h200_ops (held out)", new),
                                   ("h200_calibrated + schedlab_h200", old)):
                worst = here.loc[(here["profile"] == profile) & (here["metric"] == metric),
                                 "rel_error"].abs().max()
                assert float(value) == pytest.approx(round(100 * worst, 1)), (row[0], metric)
    held = df[(df["profile"] == "h200_ops (held out)")
              & df["metric"].isin(list(SUMMARY_METRICS.values()))]
    counts = ["No", "One", "Two", "Three", "Four", "Five", "Six", "Seven", "Eight", "Nine", "Ten",
              "Eleven", "Twelve"]
    over = int(held["over_target"].sum())
    assert f"{counts[over]} of the {len(held)} held-out cells miss the targets" in text


@pytest.mark.parametrize("name", ["policies", "prefix_cache"])
def test_the_policy_tables_rebuild_from_their_csv_and_keep_their_notes(tmp_path, name):
    """validate_policies' markdown of the committed CSV, written over a copy of the committed
    file, is that file: the generated table is the CSV's and the notes below the mark stay."""
    from experiments.files import NOTES_MARK, write_table_markdown
    from experiments.validate_policies import markdown

    committed = (VALIDATION / f"{name}.md").read_text()
    command = re.search(r"Generated by `(.+?)`", committed).group(1)
    copy = tmp_path / f"{name}.md"
    copy.write_text(committed)
    write_table_markdown(copy, markdown(pd.read_csv(VALIDATION / f"{name}.csv"), command, name))
    assert copy.read_text() == committed and NOTES_MARK in committed
    assert committed.split(NOTES_MARK, 1)[1].strip()  # the notes: how the runs were made
