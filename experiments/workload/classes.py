"""SLO classes: each request's priority and TTFT/TPOT targets, drawn from a seeded distribution
(``workload.classes``: each class's share) or named per request by a trace's ``slo_class``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from policies.base import check_int, check_number

CLASS_KEYS = ("share", "priority", "ttft_ms", "tpot_ms")
# The draw's own stream: adding classes to a workload moves none of its lengths or arrivals.
_STREAM = 0x510C1A55


@dataclass(frozen=True, slots=True)
class SLOClass:
    """A class of requests: its share of a drawn workload, priority (lower first, as vLLM's)
    and TTFT / TPOT targets in ms (None: no target of that kind)."""

    name: str
    share: float
    priority: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None


def read_classes(raw: Any) -> list[SLOClass] | None:
    """``workload.classes`` checked: a mapping of class name to its settings, or null."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or not raw:
        raise ValueError("workload.classes must map class names to {share, priority, ttft_ms, "
                         f"tpot_ms}}, got {raw!r}")
    out = []
    for name, spec in raw.items():
        where = f"workload.classes.{name}"
        if not isinstance(spec, Mapping):
            raise ValueError(f"{where} must be a mapping of {', '.join(CLASS_KEYS)}, got {spec!r}")
        unknown = sorted(set(spec) - set(CLASS_KEYS))
        if unknown:
            raise ValueError(f"{where} has no setting {unknown[0]!r}; its settings: "
                             + ", ".join(CLASS_KEYS))
        share = check_number(f"{where}.share", spec.get("share", 0.0), minimum=0)
        priority = check_int(f"{where}.priority", spec.get("priority", 0), -2**31)
        targets = [None if spec.get(k) is None else
                   check_number(f"{where}.{k}", spec[k], positive=True)
                   for k in ("ttft_ms", "tpot_ms")]
        out.append(SLOClass(str(name), float(share), priority, *targets))
    if sum(c.share for c in out) <= 0:
        raise ValueError("workload.classes: the shares sum to 0; give each class its share")
    return out


def assign_classes(classes: Sequence[SLOClass], n: int, seed: int,
                   named: Sequence[str | None] | None = None,
                   where: Sequence[str] | None = None) -> list[SLOClass]:
    """Each of ``n`` requests' class: the one a trace names (``named``, ``where`` saying which
    file line), else drawn by share with ``seed``."""
    by_name = {c.name: c for c in classes}
    shares = np.array([c.share for c in classes], dtype=float)
    draw = np.random.default_rng([seed, _STREAM]).choice(len(classes), size=n,
                                                        p=shares / shares.sum())
    out = []
    for i in range(n):
        name = named[i] if named is not None else None
        if name is None:
            out.append(classes[draw[i]])
        elif name in by_name:
            out.append(by_name[name])
        else:
            at = where[i] if where is not None else f"request {i}"
            raise ValueError(f"{at}: slo_class {name!r} is not one of workload.classes "
                             f"({', '.join(by_name)})")
    return out
