"""Prefill/decode disaggregation (simulator/disaggregation.py, simulator/link.py,
Scheduler.add_prefilled): a request prefilled on one replica continues on another with its KV
sent over a link; a colocated cluster is what it was (tests/test_sim_results_unchanged.py)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_cluster import _conf, _requests, _spec  # noqa: E402

from policies import SchedulerConfig, make_policy  # noqa: E402
from policies.request import Request  # noqa: E402
from policies.routers import make_router  # noqa: E402
from policies.scheduler import Scheduler  # noqa: E402
from simulator.disaggregation import HandoffLog  # noqa: E402
from simulator.engine import simulate_cluster  # noqa: E402
from simulator.link import LinkSpec, kv_transfer_bytes, transfer_span  # noqa: E402


def _pd(n_prefill=1, n_decode=1, policy="multi_step", params=None, **kw):
    params = {"num_steps": 4} if params is None and policy == "multi_step" else params
    return ([dataclasses.replace(_spec(policy, params, **kw), role="prefill")
             for _ in range(n_prefill)]
            + [dataclasses.replace(_spec(policy, params, **kw), role="decode")
               for _ in range(n_decode)])


def _link(name="rdma", **over):
    return LinkSpec.from_dict({**_conf("link", name), **over})


def _run(reqs, specs, link=None, **kw):
    log = HandoffLog(reqs)
    res = simulate_cluster(reqs, specs, make_router("round_robin"), progress=False,
                           link=link or _link(), handoffs=log, **kw)
    return res, log


def test_a_request_is_prefilled_on_one_replica_and_decoded_on_another():
    reqs = _requests(120, 20.0)
    res, log = _run(reqs, _pd())
    assert res.total.num_finished == len(reqs)
    for r in reqs:
        assert len(r.token_times) == r.max_tokens
        assert all(a <= b for a, b in zip(r.token_times, r.token_times[1:], strict=False))
    handed = [i for i, r in enumerate(reqs) if r.max_tokens > 1]
    assert all(res.replica_of[i] == 1 for i in handed)  # finished on the decode replica
    assert (log.prefill_replica == 0).all()
    assert (log.transfer_s[handed] > 0).all() and (log.transfer_queue_s[handed] >= 0).all()
    # the decode replica computes no prompt: its windows prefill nothing (no preemption)
    assert res.replicas[1].stats.num_preemptions == 0
    assert not any(row["num_prefill_seqs"] for row in res.replicas[1].steps)
    # and the prefill replica decodes nothing: every window of its is one step of prefills
    assert all(row["k"] == 1 for row in res.replicas[0].steps)


def test_the_transfer_delays_the_second_token_by_its_time():
    """A slow link: each request's second token comes no sooner than its transfer ends."""
    fast, _ = _run(_requests(60, 5.0), _pd())
    reqs = _requests(60, 5.0)
    res, log = _run(reqs, _pd(), link=_link(bandwidth_gb_s=0.5))
    for i, r in enumerate(reqs):
        if r.max_tokens > 1:
            # the second token is decoded after the KV is there (first token: GPU done <= its
            # delivery; the transfer started at that GPU time)
            assert r.token_times[1] - r.token_times[0] >= log.transfer_s[i] - 0.05
    assert np.nanmean(log.transfer_s) > 20 * np.nanmean(_run(_requests(60, 5.0), _pd())[1]
                                                         .transfer_s)


def test_the_prefill_replica_holds_the_blocks_until_the_kv_is_sent():
    """While a transfer is under way the prefill replica holds the request's blocks though it
    runs nothing (a slow link: the transfers queue)."""
    seen = []

    def monitor(env, sim):
        prefill = sim.replicas[0]
        while True:
            sched = prefill.schedulers[0]
            if not sched.running and not sched.waiting:
                seen.append(prefill.load.kv_blocks_used)
            yield env.timeout(0.002)

    reqs = _requests(60, 20.0)
    res, _ = _run(reqs, _pd(), link=_link(bandwidth_gb_s=0.5), processes=[monitor])
    assert res.total.num_finished == len(reqs)
    assert max(seen) > 0
    assert res.replicas[0].steps  # and every block came back at the end
    assert all(r.block_table in ([], ()) for r in reqs)


def test_link_contention_queues_transfers_on_one_prefill_replica():
    link = _link(bandwidth_gb_s=1.0)
    start, end = transfer_span(link, 10**9, 32, ready=2.0, prefill_start=1.0, link_free=2.5)
    assert (start, end) == (2.5, pytest.approx(3.5 + 5e-6))
    # layer-wise: from the first layer's end; only the last layer's share after the prefill
    lw = dataclasses.replace(link, layerwise=True)
    start, end = transfer_span(lw, 10**6, 32, ready=2.0, prefill_start=1.0, link_free=0.0)
    assert start == pytest.approx(1.0 + 1 / 32) and end == pytest.approx(2.0 + (1e-3 + 5e-6) / 32)
    assert kv_transfer_bytes(17, 16, 10) == 320  # whole blocks


def test_decode_replicas_take_their_share_and_the_run_ends():
    reqs = _requests(200, 40.0)
    res, _ = _run(reqs, _pd(n_prefill=2, n_decode=3), decode_router=make_router("least_kv"))
    assert res.total.num_finished == len(reqs)
    assert all(res.replicas[i].num_finished > 0 for i in (2, 3, 4))


def test_add_prefilled_admits_a_decoder_with_its_kv():
    """The scheduler's mechanism: a prefilled request is admitted with its KV present (blocks
    for its computed tokens) and decodes in the next window, grouped or not."""
    for group in (False, True):
        sched = Scheduler(make_policy("multi_step", num_steps=4), SchedulerConfig(), 100, 4096)
        if group:
            sched.group_decodes()
        req = Request(0, 0.0, 40, 10)
        req.num_output_tokens, req.token_times = 1, []
        sched.add_prefilled(req, 0.5)
        assert sched.has_unfinished and sched.num_running == 0
        batch = sched.schedule(1.0)
        assert sched.num_running == 1 and req.max_wait == 0.5
        assert not any(s.is_prefill for s in batch.seqs)
        seqs = sched.window_seqs(batch)
        assert [(q, c, k, p) for _, q, c, k, p in seqs] == [(1, 40, 4, False)]
        sched.update(batch, [1.1, 1.2, 1.3, 1.4])
        batch = sched.schedule(2.0)  # where it stands: 44 tokens computed
        assert [c for _, _, c, _, _ in sched.window_seqs(batch)] == [44]
        assert sched.update(batch, [2.1, 2.2, 2.3, 2.4]) == []
        batch = sched.schedule(3.0)
        assert sched.update(batch, [3.1, 3.2, 3.3, 3.4]) == [req]
        assert (req.num_output_tokens, req.num_computed_tokens, req.finish_time) == (10, 52, 3.1)
        assert sched.block_manager.num_free_blocks == 100 and not sched.has_unfinished


@pytest.mark.parametrize("roles,err", [
    (("prefill", "oops"), "replica 1: role must be one of mixed, prefill, decode, got 'oops'"),
    (("decode", "mixed"), "a decode group needs a prefill group"),
    (("prefill", "mixed"), "a prefill group needs a decode group"),
])
def test_bad_roles_are_one_line_errors(roles, err):
    specs = [dataclasses.replace(_spec(params={"num_steps": 4}), role=r) for r in roles]
    with pytest.raises(ValueError, match=err):
        simulate_cluster(_requests(5, 5.0), specs, make_router("round_robin"), progress=False,
                         link=_link())


def test_bad_link_settings_are_one_line_errors():
    with pytest.raises(ValueError, match=r"cluster.link.bandwidth_gb_s must be > 0, got -1"):
        _link(bandwidth_gb_s=-1)
    with pytest.raises(ValueError, match=r"cluster.link.latency_us must be >= 0"):
        _link(latency_us=-3)
    with pytest.raises(ValueError, match=r"cluster.link has no setting 'speed'"):
        _link(speed=3)
    with pytest.raises(ValueError, match=r"cluster.link: a disaggregated cluster needs a link"):
        simulate_cluster(_requests(5, 5.0), _pd(), make_router("round_robin"), progress=False)


def test_kv_balance_fills_decode_replicas_of_different_kv_sizes_alike():
    """A decode pool of a large and a small KV cache: kv_balance sends the small one its share
    by its capacity and it never preempts; the routers that look at KV in use now (least_kv)
    or at counts overfill it."""
    def run(router):
        reqs = _requests(400, 60.0)
        specs = [dataclasses.replace(_spec(params={"num_steps": 4}), role="prefill")
                 for _ in range(2)]
        specs += [dataclasses.replace(_spec(params={"num_steps": 4}, num_blocks=nb),
                                      role="decode") for nb in (2400, 600)]
        res, _ = _run(reqs, specs, decode_router=router)
        assert res.total.num_finished == len(reqs)
        return res.replicas[3]

    small = run(make_router("kv_balance", module="policies.kv_balance"))
    assert small.stats.num_preemptions == 0
    assert run(make_router("least_kv")).stats.num_preemptions > 0
    assert run(make_router("round_robin")).stats.num_preemptions > 0


def _overload(early_rejection):
    reqs = _requests(300, 200.0)  # far past one prefill replica's capacity
    for r in reqs:
        r.ttft_slo_ms = 200.0
    res, log = _run(reqs, _pd(), early_rejection=early_rejection)
    return reqs, res, log


def test_early_rejection_turns_away_what_would_miss_its_ttft():
    reqs, res, log = _overload((None, None))
    rejected = np.flatnonzero(log.rejected)
    assert 0 < len(rejected) < len(reqs)
    assert res.total.num_finished == len(reqs) - len(rejected)
    assert all(res.replica_of[i] == -1 and not reqs[i].token_times for i in rejected)
    served = [r for r, no in zip(reqs, log.rejected, strict=True) if not no]
    ttft = np.array([r.token_times[0] - r.arrival_time for r in served])
    _, _, log_off = _overload(None)
    assert not log_off.rejected.any()
    off = [r.token_times[0] - r.arrival_time for r in _overload(None)[0]]
    # the requests it admits mostly meet the target; without it most would not
    assert np.mean(ttft <= 0.2) > 0.8 > np.mean(np.array(off) <= 0.2)


def _run_cli(tmp_path, *overrides: str) -> dict:
    import contextlib
    import io
    import json

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from experiments.run import CONF_DIR, run

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = OmegaConf.to_container(compose("config", overrides=[
            "workload=synthetic", "workload.num_prompts=120", "workload.request_rate=30",
            "progress=false", *overrides]), resolve=True)
    with contextlib.redirect_stdout(io.StringIO()):
        run(cfg, tmp_path)
    return json.loads((tmp_path / "result.json").read_text())


def test_a_disaggregated_run_reports_its_transfers_pools_and_rejections(tmp_path):
    import csv

    res = _run_cli(tmp_path, "+experiment=pd_cluster", "workload=synthetic",
                   "workload.num_prompts=120", "workload.request_rate=400",
                   "cluster.early_rejection=true", "goodput.ttft_ms=100")
    pd = res["disaggregation"]
    assert pd["link"]["name"] == "nvlink" and pd["link"]["source"].startswith("published")
    assert pd["decode_router"] == "kv_balance"
    assert set(pd["pools"]) == {"prefill", "decode"}
    assert 0 < pd["num_rejected"] < 120
    assert pd["num_transfers"] + pd["num_rejected"] == 120
    assert res["completed"] == 120 - pd["num_rejected"]
    assert [r["role"] for r in res["replicas"]] == ["prefill", "decode"]
    with open(tmp_path / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert sum(r["rejected"] == "True" for r in rows) == pd["num_rejected"]
    sent = [r for r in rows if r["rejected"] == "False"]
    assert all(r["prefill_replica"] == "0" and r["replica"] == "1" and float(r["transfer_s"]) > 0
               for r in sent)
    assert all(r["transfer_s"] == "" and r["ttft"] == "" for r in rows if r["rejected"] == "True")


@pytest.mark.parametrize("override,message", [
    ("cluster.groups=[{replicas:1,role:prefil},{replicas:1,role:decode}]",
     "cluster.groups[0].role must be one of mixed, prefill, decode, got 'prefil'"),
    ("cluster.groups=[{replicas:1,role:decode},{replicas:1}]",
     "cluster.groups: a decode group needs a prefill group"),
    ("cluster.groups=[{replicas:1,role:prefill},{replicas:1,role:decode}] "
     "cluster.link={name:rdma,bandwidth_gb_s:-1}", "cluster.link.bandwidth_gb_s must be > 0"),
    ("cluster.groups=[{replicas:1,role:prefill},{replicas:1,role:decode}] cluster.link=wifi",
     "no link config 'wifi'"),
    ("cluster.num_replicas=2 cluster.early_rejection=true",
     "cluster.early_rejection applies to a disaggregated cluster only"),
    ("cluster.groups=[{replicas:1,role:prefill},{replicas:1,role:decode}] "
     "cluster.decode_router=nope", "unknown router 'nope'"),
    ("cluster.groups=[{replicas:1,role:prefill,scheduler:{overlap:true}},{replicas:1,role:decode}]",
     "cluster.groups[0].scheduler.overlap: a prefill group's requests leave once prefilled"),
])
def test_bad_disaggregation_settings_are_one_line_errors(tmp_path, override, message):
    with pytest.raises(ValueError) as err:
        _run_cli(tmp_path, *override.split(" "))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_layout_figure_draws_a_line_per_layout():
    import pandas as pd

    from experiments.plot_cluster import layout_figure

    rows = [{"layout": layout, "num_replicas": 2, "request_rate": rate, "workload": "sharegpt",
             "request_goodput": rate * f, "goodput_ttft_ms": 250.0, "goodput_tpot_ms": 50.0}
            for layout, f in ((None, 0.9), ("1 prefill + 1 decode", 0.8)) for rate in (10, 20)]
    fig = layout_figure(pd.DataFrame(rows))
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels[:2] == ["2 colocated", "1 prefill + 1 decode"]


def test_a_decode_replica_of_another_split_takes_its_own_shard_over_the_link(tmp_path):
    """A 2-GPU prefill replica sends half a token's KV from each GPU, but the 1-GPU decode
    replica takes the whole of it over its one link: the transfer is the 1-GPU one's."""
    from test_cluster import _run

    def transfer(prefill: str, decode: str) -> float:
        groups = (f"cluster.groups=[{{replicas:1,role:prefill{prefill}}},"
                  f"{{replicas:1,role:decode{decode}}}]")
        out = _run(tmp_path / f"{len(prefill)}-{len(decode)}", groups, "cluster.link=pcie")
        return out["disaggregation"]["transfer_s"]["mean"]

    tp2 = ",parallel:{tensor_parallel_size:2}"
    assert transfer(tp2, "") == pytest.approx(transfer("", ""), rel=1e-9)
    assert transfer(tp2, tp2) < transfer("", "")
