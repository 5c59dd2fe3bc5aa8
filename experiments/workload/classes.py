"""SLO classes: each request's priority and TTFT/TPOT targets, drawn from a seeded distribution
(``workload.classes``: each class's share) or named per request by a trace's ``slo_class``.

Where requests are drawn, every class gives its share and the shares sum to 1: a class without
one would get no request, and shares summing to something else would be renormalised, either
way a mix other than the one written. A trace that names every request's class draws none, and
there a class may leave its share out."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from policies.base import check_int, check_number

CLASS_KEYS = ("share", "priority", "ttft_ms", "tpot_ms")
# How far from 1 the shares' sum may be: written to a few digits (0.333, 0.333, 0.334).
SHARE_SUM_TOLERANCE = 1e-6
# The draw's own stream: adding classes to a workload moves none of its lengths or arrivals.
_STREAM = 0x510C1A55


@dataclass(frozen=True, slots=True)
class SLOClass:
    """A class of requests: its share of a drawn workload (None: not given, a class a trace
    names), priority (lower first, as vLLM's) and TTFT / TPOT targets in ms (None: no target
    of that kind)."""

    name: str
    share: float | None
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
        share = None if spec.get("share") is None else \
            float(check_number(f"{where}.share", spec["share"], minimum=0))
        priority = check_int(f"{where}.priority", spec.get("priority", 0), -2**31)
        targets = [None if spec.get(k) is None else
                   check_number(f"{where}.{k}", spec[k], positive=True)
                   for k in ("ttft_ms", "tpot_ms")]
        out.append(SLOClass(str(name), share, priority, *targets))
    return out


def check_shares(classes: Sequence[SLOClass], drawn: str = "requests are") -> None:
    """The classes requests are drawn from: each has a share, and the shares sum to 1
    (``drawn``: which requests are drawn, for the message)."""
    for c in classes:
        if c.share is None:
            raise ValueError(f"workload.classes.{c.name} has no share: {drawn} drawn by share, "
                             "so give every class one (0 for a class drawn for none)")
    total = math.fsum(c.share for c in classes)
    if not math.isclose(total, 1.0, rel_tol=0.0, abs_tol=SHARE_SUM_TOLERANCE):
        each = ", ".join(f"{c.name} {c.share:g}" for c in classes)
        raise ValueError(f"workload.classes: the shares sum to {total:g} ({each}), not 1; give "
                         "shares that sum to 1")


def assign_classes(classes: Sequence[SLOClass], n: int, seed: int,
                   named: Sequence[str | None] | None = None,
                   where: Sequence[str] | None = None) -> list[SLOClass]:
    """Each of ``n`` requests' class: the one a trace names (``named``, ``where`` saying which
    file line), else drawn by share with ``seed`` (the shares checked: ``check_shares``)."""
    by_name = {c.name: c for c in classes}
    unnamed = 0 if named is None else next((i for i, x in enumerate(named) if x is None), None)
    draw = None
    if unnamed is not None:  # some requests are drawn
        if named is not None:
            at = where[unnamed] if where is not None else f"request {unnamed}"
            check_shares(classes, f"{at} names no slo_class, and such requests are")
        else:
            check_shares(classes)
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
