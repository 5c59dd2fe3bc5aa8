"""experiments.search: the layout search over colocated and disaggregated clusters."""

from __future__ import annotations

import pandas as pd
import pytest

from experiments.search import Layout, goodput_per_gpu, layouts, main, pareto
from simulator.cluster import replica_groups


def test_the_candidates_are_every_split_of_each_gpu_count():
    got = layouts(3, 1, [("multi_step", 8), ("chunked_prefill", None)])
    assert sorted(got) == [1, 2, 3]
    assert [c.name() for c in got[3]] == [
        "3 colocated multi_step k=8", "1P+2D multi_step k=8", "2P+1D multi_step k=8",
        "3 colocated chunked_prefill", "1P+2D chunked_prefill", "2P+1D chunked_prefill"]
    assert layouts(4, 2, [("multi_step", 8)]).keys() == {2, 4}  # tp=2 replicas


def test_a_candidate_s_groups_are_cluster_groups():
    import yaml

    run = {"policy": {"name": "multi_step", "num_steps": 4}}
    groups = yaml.safe_load(Layout(prefill=1, decode=2).groups().replace(":", ": ")
                            .replace(",", ", "))
    out = replica_groups({"groups": groups}, run, lambda g, n: {"name": n})
    assert [(n, s["role"], s["policy"]["num_steps"]) for n, s in out] == [
        (1, "prefill", 8), (2, "decode", 8)]


def test_a_layout_s_gpus_count_each_group_s_replicas_times_their_split():
    """DistServe's placement, 1 prefill replica at tp=2 + 1 decode replica, takes 3 GPUs; its
    groups give the prefill group its own parallel, and result.json's layout names it."""
    import yaml

    cand = Layout(prefill=1, decode=1, prefill_tp=2)
    assert cand.gpus() == 3 and Layout(prefill=2, decode=1).gpus() == 3
    assert Layout(prefill=1, decode=2, decode_tp=2).gpus(2) == 10
    groups = yaml.safe_load(cand.groups().replace(":", ": ").replace(",", ", "))
    out = replica_groups({"groups": groups}, {"parallel": {"tensor_parallel_size": 1}},
                         lambda g, n: {"name": n})
    assert [s["parallel"]["tensor_parallel_size"] for _, s in out] == [2, 1]
    got = layouts(3, 1, [("multi_step", 8)], prefill_tp=[1, 2])
    assert [c.name() for c in got[3]] == ["1P(tp2)+1D multi_step k=8",
                                          "3 colocated multi_step k=8",
                                          "1P+2D multi_step k=8", "2P+1D multi_step k=8"]
    assert all(c.prefill_tp == 1 for c in got[2])  # 1P(tp2)+2D would take 4


def test_the_search_counts_a_role_s_own_parallelism(tmp_path, capsys):
    """--prefill-tp 2: the 3-GPU sweep runs 1P(tp2)+1D, its goodput per GPU over 3 GPUs."""
    main(["--out", str(tmp_path), "--max-gpus", "3", "--prefill-tp", "2",
          "--rates-per-gpu", "5", "--", "workload=synthetic", "workload.num_prompts=30"])
    table = pd.read_csv(tmp_path / "search.csv").set_index("layout")
    row = table.loc["1P(tp2)+1D multi_step k=8"]
    assert (row["gpus"], row["runs"], row["goodput_per_gpu"]) == (3, 1, 5.0)
    runs = pd.read_csv(tmp_path / "3gpu" / "aggregate.csv")
    assert "1 prefill (tp=2) + 1 decode" in set(runs["layout"])
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--gpus-per-replica", "2", "--prefill-tp", "2"])
    assert "leave --gpus-per-replica at 1" in capsys.readouterr().err


def test_goodput_per_gpu_is_the_highest_rate_meeting_the_attainment():
    rows = pd.DataFrame({"request_rate": [10, 20, 40], "num_prompts": [100] * 3,
                         "duration": [10.0, 5.0, 5.0], "request_goodput": [10.0, 19.0, 12.0]})
    assert goodput_per_gpu(rows, 2, 0.9) == 10.0  # 20 req/s: 95% met; 40: 60%
    assert goodput_per_gpu(rows, 2, 0.99) == 5.0
    table = pd.DataFrame({"layout": ["a", "b", "c", "d"], "gpus": [1, 2, 2, 3],
                          "goodput_per_gpu": [30.0, 25.0, 20.0, 15.0]})
    assert list(pareto(table)["layout"]) == ["a", "b"]  # 3 GPUs sustain 45 < 2's 50


def test_the_search_runs_its_sweeps_and_prints_the_best_and_the_front(tmp_path, capsys):
    main(["--out", str(tmp_path), "--max-gpus", "2", "--rates-per-gpu", "5", "--",
          "workload=synthetic", "workload.num_prompts=30"])
    out = capsys.readouterr().out
    assert "best: " in out and "Pareto front (GPUs, goodput sustained): 1: " in out
    table = pd.read_csv(tmp_path / "search.csv")
    assert list(table["layout"]) == ["1 colocated multi_step k=8", "2 colocated multi_step k=8",
                                     "1P+1D multi_step k=8"]
    assert (table["runs"] == 1).all() and (table["goodput_per_gpu"] == 5.0).all()
    assert (tmp_path / "search_pareto.png").is_file()


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--max-gpus", "0"])
    assert "--max-gpus must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        main(["--out", str(tmp_path), "--max-gpus", "1", "--rates-per-gpu", "5", "--",
              "model=nope"])
    assert err.value.code == 2
    assert "error: the 1-GPU sweep failed" in capsys.readouterr().err
