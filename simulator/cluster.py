"""A cluster's shape and results: the replica groups a ``cluster`` section describes (each group
its own model, hardware, parallelism, overhead, policy and scheduler settings), and one summary
per replica.

The engine that runs the replicas is simulator/engine.py (``simulate_cluster``); the router that
spreads requests over them is policies/routers.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from policies.base import check_int, check_settings

# The sections a replica group may set; the rest of a run's config is the cluster's.
GROUP_SECTIONS = ("model", "hardware", "parallel", "overhead", "policy", "scheduler")
GROUP_KEYS = ("replicas", *GROUP_SECTIONS, "gpu_memory_utilization", "num_blocks", "role")
# decode_router, link and early_rejection apply to a disaggregated cluster (docs/cluster.md)
CLUSTER_KEYS = ("num_replicas", "groups", "decode_router", "link", "early_rejection")
ROLES = ("mixed", "prefill", "decode")

# load_section(group, name): conf/<group>/<name>.yaml as a dict
LoadSection = Callable[[str, str], dict[str, Any]]


def replica_groups(cluster: Mapping[str, Any] | None, run: Mapping[str, Any],
                   load_section: LoadSection) -> list[tuple[int, dict[str, Any]]]:
    """``(replicas, settings)`` per group: ``settings`` are the run's sections (``run``: model,
    hardware, parallel, overhead, policy, scheduler, gpu_memory_utilization, num_blocks) with the
    group's own on top. A group's section is a config name (``hardware: h200``) or settings over
    the run's (``policy: {num_steps: 4}``, ``parallel: {tensor_parallel_size: 2}``, which has no
    config names; a policy naming another policy starts from that one's config). Without groups the cluster is ``num_replicas`` replicas of the run's settings."""
    cluster = dict(cluster or {})
    check_settings("cluster", cluster, CLUSTER_KEYS)
    num = check_int("cluster.num_replicas", cluster.get("num_replicas", 1), 1)
    groups = cluster.get("groups")
    if groups is None:
        return [(num, dict(run))]
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or not groups:
        raise ValueError("cluster.groups must be a non-empty list of replica groups, e.g. "
                         "[{replicas: 4, hardware: h200}, {replicas: 4, hardware: h100_sxm, "
                         f"policy: chunked_prefill}}], got {groups!r}")
    out = []
    for i, group in enumerate(groups):
        where = f"cluster.groups[{i}]"
        if not isinstance(group, Mapping):
            raise ValueError(f"{where} must be a mapping such as {{replicas: 4, hardware: h200}}, "
                             f"got {group!r}")
        check_settings(where, group, GROUP_KEYS)
        n = check_int(f"{where}.replicas", group.get("replicas"), 1)
        settings = dict(run)
        for key in GROUP_SECTIONS:
            value = group.get(key)
            if value is None:
                continue
            if isinstance(value, str) and key not in ("scheduler", "parallel"):
                settings[key] = load_section(key, value)
            elif isinstance(value, Mapping):
                base = run.get(key) or {}
                name = value.get("name")
                if key == "policy" and name is not None and name != base.get("name"):
                    base = load_section(key, name)
                settings[key] = {**base, **value}
            elif key == "parallel":
                raise ValueError(f"{where}.parallel must be a mapping of settings over the run's "
                                 f"parallel, such as {{tensor_parallel_size: 2}}, got {value!r}")
            else:
                raise ValueError(f"{where}.{key} must be a config name or a mapping of settings, "
                                 f"got {value!r}")
        for key in ("gpu_memory_utilization", "num_blocks"):
            if group.get(key) is not None:
                settings[key] = group[key]
        role = group.get("role", "mixed")
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
        settings["role"] = role
        out.append((n, settings))
    total = sum(n for n, _ in out)
    if num != 1 and num != total:
        raise ValueError(f"cluster.num_replicas = {num} but cluster.groups have {total} replicas "
                         "(leave num_replicas at 1, or give the groups' sum)")
    return out


def replica_summaries(result: Any, ttft: np.ndarray, output_len: np.ndarray,
                      completed: np.ndarray, labels: Sequence[Mapping[str, Any]]
                      ) -> list[dict[str, Any]]:
    """result.json's ``replicas``: per replica its group's labels, requests, throughput over the
    cluster's duration, median and p99 TTFT, KV use (blocks in use over its blocks, at each
    window's close: mean and peak) and time busy (GPU, engine thread).

    ``result``: simulate_cluster's ClusterResult; ``ttft``, ``output_len`` and ``completed``:
    per request in the order given (only a completed request's count)."""
    duration = result.total.duration
    where = np.asarray(result.replica_of)
    kv: list[list[int]] = [[] for _ in result.replicas]
    steps = result.total.steps
    for replica, used in zip(steps.column("replica"), steps.column("kv_blocks_used"),
                             strict=True):
        kv[replica].append(used)
    out = []
    for i, rep in enumerate(result.replicas):
        pp = max(1, result.specs[i].hw.pp)
        blocks = rep.num_blocks * pp
        use = np.asarray(kv[i], dtype=float) / blocks if kv[i] else np.zeros(1)
        mine = (where == i) & completed
        a = np.asarray(ttft[mine], dtype=float) * 1e3
        tokens = int(output_len[mine].sum())
        out.append({
            "replica": i, **labels[i],
            "requests": len(rep.requests), "completed": rep.num_finished,
            "request_throughput": rep.num_finished / duration if duration > 0 else 0.0,
            "output_throughput": tokens / duration if duration > 0 else 0.0,
            "median_ttft_ms": float(np.median(a)) if len(a) else 0.0,
            "p99_ttft_ms": float(np.percentile(a, 99)) if len(a) else 0.0,
            "num_blocks": blocks, "kv_use_mean": float(use.mean()),
            "kv_use_peak": float(use.max()),
            "gpu_busy_s": rep.gpu_busy_fraction * rep.duration,
            "gpu_busy_fraction": (rep.gpu_busy_fraction * rep.duration / duration
                                  if duration > 0 else 0.0),
            "cpu_busy_fraction": (rep.cpu_busy_fraction * rep.duration / duration
                                  if duration > 0 else 0.0),
            "num_windows": rep.num_windows, "num_preemptions": rep.stats.num_preemptions,
        })
    return out


def disaggregation_summary(replicas: Sequence[Mapping[str, Any]], log: Any, link: Any,
                           decode_router: str, early_rejection: bool) -> dict[str, Any]:
    """result.json's ``disaggregation``: the link (its figures and their source), the decode
    router, the requests rejected at arrival, the KV transfers' time on the link and wait for
    it (mean and p99 over the requests handed off), and per pool (role) its replicas, their
    mean GPU busy fraction and KV use (of the cluster's duration) and the requests they
    completed. ``replicas``: result.json's per-replica summaries (``replica_summaries``, each
    with its role); ``log``: the run's simulator.disaggregation.HandoffLog."""
    sent = ~np.isnan(log.transfer_s)

    def spread(values: np.ndarray) -> dict[str, float]:
        if not len(values):
            return {"mean": 0.0, "p99": 0.0}
        return {"mean": float(values.mean()), "p99": float(np.percentile(values, 99))}

    pools = {}
    for role in ROLES:
        mine = [r for r in replicas if r.get("role") == role]
        if not mine:
            continue
        pools[role] = {
            "replicas": len(mine),
            "gpu_busy_fraction": float(np.mean([r["gpu_busy_fraction"] for r in mine])),
            "kv_use_mean": float(np.mean([r["kv_use_mean"] for r in mine])),
            "completed": int(sum(r["completed"] for r in mine)),
        }
    pools.get("prefill", {})["prefilled"] = int((log.prefill_replica >= 0).sum())
    return {
        "link": {"name": link.name, "bandwidth_gb_s": link.bandwidth_gb_s,
                 "latency_us": link.latency_us, "layerwise": link.layerwise,
                 "source": link.source},
        "decode_router": decode_router, "early_rejection": early_rejection,
        "num_rejected": int(log.rejected.sum()),
        "num_transfers": int(sent.sum()),
        "transfer_s": spread(log.transfer_s[sent]),
        "transfer_queue_s": spread(log.transfer_queue_s[sent]),
        "pools": pools,
    }
