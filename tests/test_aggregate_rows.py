"""The aggregate's row of one result.json: settings read from every generation of result file."""

from __future__ import annotations

from pathlib import Path

from experiments.aggregate import row_of


def _result(ext: dict) -> dict:
    return {"request_throughput": 1.0, "completed": 4,
            "schedlab": {"backend": "real", "policy": "multi_step", "k": 4, **ext,
                         "workload": {"kind": "sharegpt", "request_rate": "inf"}}}


def test_overlap_of_older_results_comes_from_the_policy_settings():
    path = Path("r/result.json")
    assert row_of(_result({"policy_settings": {"overlap": True}}), path)["overlap"] is True
    assert row_of(_result({"policy_settings": {"overlap": False}}), path)["overlap"] is False
    assert row_of(_result({"policy_settings": {"num_steps": 4}}), path)["overlap"] is False
    assert row_of(_result({}), path)["overlap"] is False  # before overlap existed: off
    # the top-level key, where a result has it, wins
    assert row_of(_result({"overlap": True, "policy_settings": {}}), path)["overlap"] is True
