"""The link a finished prefill's KV crosses to its decode replica (prefill/decode
disaggregation, simulator/disaggregation.py): bandwidth each way and latency per link kind
(conf/link/*.yaml: NVLink within a node, PCIe, RDMA between nodes, the same GPU), the bytes a
request's KV takes, and when its transfer ends on a link it shares with the replica's other
transfers (a FIFO, one transfer at a time; optionally pipelined with the prefill's layers)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.checks import check_bool, check_number, check_settings

LINK_KEYS = ("name", "bandwidth_gb_s", "latency_us", "layerwise", "source")


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One link kind: ``bandwidth_gb_s`` (GB/s, 1e9 bytes, each way, per GPU: a tensor-parallel
    replica's GPUs each send their own shard over their own link), ``latency_us`` (per
    transfer), ``layerwise`` (the KV of each layer is sent once the prefill has computed it,
    so only the last layer's share is exposed when the link keeps up) and ``source`` (where the
    figures come from: "published: ..." or "measured: BENCHMARKS.md ...")."""

    name: str
    bandwidth_gb_s: float
    latency_us: float = 0.0
    layerwise: bool = False
    source: str = ""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], setting: str = "cluster.link") -> LinkSpec:
        """A link from its config (conf/link/<name>.yaml, with settings over it), checked: one
        line naming the setting."""
        check_settings(setting, d, LINK_KEYS)
        name = d.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{setting}.name must be a link kind's name, got {name!r}")
        bandwidth = check_number(f"{setting}.bandwidth_gb_s", d.get("bandwidth_gb_s"),
                                 positive=True)
        latency = check_number(f"{setting}.latency_us", d.get("latency_us", 0.0), minimum=0.0)
        layerwise = check_bool(f"{setting}.layerwise", d.get("layerwise", False))
        source = d.get("source", "")
        if not isinstance(source, str):
            raise ValueError(f"{setting}.source must be a string saying where the figures come "
                             f"from, got {source!r}")
        return cls(name, float(bandwidth), float(latency), layerwise, source)

    def seconds(self, nbytes: int) -> float:
        """One transfer of ``nbytes`` alone on the link."""
        return self.latency_us * 1e-6 + nbytes / (self.bandwidth_gb_s * 1e9)


def kv_transfer_bytes(tokens: int, block_size: int, bytes_per_token: int) -> int:
    """The bytes a request's KV of ``tokens`` tokens takes on one GPU, in whole blocks (paged
    KV is sent block by block)."""
    return -(-tokens // block_size) * block_size * bytes_per_token


def transfer_span(link: LinkSpec, nbytes: int, num_layers: int, ready: float,
                  prefill_start: float, link_free: float) -> tuple[float, float]:
    """(start, end) of a transfer on a FIFO link that is free from ``link_free``, of KV whose
    last layer is computed at ``ready``. Without ``layerwise`` it starts once the KV is all
    there; with it, once the first layer is (the prefill from ``prefill_start`` to ``ready``,
    its layers alike), and ends no sooner than the last layer's share after ``ready``: the
    link's time is all exposed only where the link is slower than the prefill."""
    duration = link.seconds(nbytes)
    if not link.layerwise or num_layers <= 1 or ready <= prefill_start:
        start = max(ready, link_free)
        return start, start + duration
    start = max(prefill_start + (ready - prefill_start) / num_layers, link_free)
    return start, max(start + duration, ready + duration / num_layers)
