"""Speculative decoding's acceptance process: how many of a step's drafted tokens the target
accepts, drawn from the workload's setting (``workload.acceptance``) rather than from model
weights, so that every backend and the simulator given the same windows apply the same outcome.

A model with random weights accepts nothing worth measuring, so acceptance is a controlled
variable: a draft of k tokens accepts its first ``a`` (0 <= a <= k) and the step emits a + 1
(the target's own token after the accepted prefix). ``a`` is a pure function of (the workload's
seed, the request's id, its output tokens before the step, k), so a request's draws do not
depend on which other requests share its windows, and a rerun draws the same.

The settings (``workload.acceptance``):
- ``{rate: r}``: each drafted token is accepted with probability r given that the tokens before
  it were (drafting stops at the first rejection: P(a >= i) = r^i).
- ``{rates: [r1, r2, ...]}``: the same, position i's token accepted with probability ``ri`` given
  the ones before it were; positions past the list take its last rate.
- ``{trace: file.csv}``: measured drafts, one a row, columns ``num_draft_tokens`` and
  ``num_accepted``; a step draws one row (seeded as above) and accepts min(num_accepted, k),
  which needs every row's num_draft_tokens >= k (checked when the scheduler is made).
"""

from __future__ import annotations

import csv
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from hashlib import blake2b
from pathlib import Path
from typing import Any

SETTING = "workload.acceptance"
_PACK = struct.Struct("<4Q").pack
_M64 = (1 << 64) - 1
_UNIT = 1 << 64
_WORDS = 8  # 64-bit words of one 64-byte digest: the positions one draw covers


@dataclass(frozen=True, slots=True)
class AcceptanceProcess:
    """The draws of ``workload.acceptance``: ``rates`` (per position, conditional on the ones
    before; the last one repeats) or a trace's measured drafts (``trace_accepted``, each row's
    accepted count, and ``trace_draft_tokens``, the fewest tokens any row drafted)."""

    seed: int
    rates: tuple[float, ...] = ()
    trace_accepted: tuple[int, ...] = ()
    trace_draft_tokens: int = 0
    source: str = ""  # the setting as given, for messages and result.json
    # each rate as a 64-bit threshold: a position's token is accepted when its word is below
    _thresholds: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_thresholds", tuple(min(int(r * _UNIT), _UNIT)
                                                      for r in self.rates))

    def num_accepted(self, request_id: int, num_output_tokens: int, k: int) -> int:
        """Drafted tokens (of ``k``) the target accepts at the step a request takes with
        ``num_output_tokens`` tokens already emitted: a BLAKE2b digest of those four numbers
        gives a 64-bit uniform word per draft position (a second digest past the eighth)."""
        if k <= 0:
            return 0
        key = _PACK(self.seed & _M64, request_id & _M64, num_output_tokens & _M64, k)
        words = memoryview(blake2b(key).digest()).cast("Q")
        if self.trace_accepted:
            rows = self.trace_accepted
            a = rows[words[0] % len(rows)]
            return a if a < k else k
        limits = self._thresholds
        last = len(limits) - 1
        for i in range(k):
            if i and i % _WORDS == 0:  # positions past the digest's words: the next digest
                words = memoryview(blake2b(key, salt=(i // _WORDS).to_bytes(16, "little"))
                                   .digest()).cast("Q")
            if words[i % _WORDS] >= limits[i if i < last else last]:
                return i
        return k

    def check_num_tokens(self, k: int) -> None:
        """A one-line error where a trace's drafts are shorter than ``spec.num_tokens``."""
        if self.trace_accepted and k > self.trace_draft_tokens:
            raise ValueError(f"spec.num_tokens = {k} exceeds what {SETTING}'s trace "
                             f"{self.source} drafted ({self.trace_draft_tokens} tokens in its "
                             "shortest draft): its acceptance past that is not measured")

    def expected_accepted(self, k: int) -> float:
        """The mean number accepted of a k-token draft under this process."""
        if self.trace_accepted:
            rows = self.trace_accepted
            return sum(min(a, k) for a in rows) / len(rows)
        total, reach, last = 0.0, 1.0, len(self.rates) - 1
        for i in range(k):
            reach *= self.rates[min(i, last)]
            total += reach
        return total


def _rate(value: Any, setting: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{setting} must be a number in [0, 1], got {value!r}")
    return float(value)


def acceptance_process(setting: Any, seed: int) -> AcceptanceProcess | None:
    """The process ``workload.acceptance`` names (None: not given); a bad one is one line."""
    if setting is None:
        return None
    if not isinstance(setting, Mapping) or len(setting) != 1 \
            or next(iter(setting)) not in ("rate", "rates", "trace"):
        raise ValueError(f"{SETTING} must be null or one of {{rate: r}}, {{rates: [r1, r2, ...]}}, "
                         f"{{trace: file.csv}}, got {dict(setting) if isinstance(setting, Mapping) else setting!r}")
    (key, value), = setting.items()
    if key == "rate":
        return AcceptanceProcess(seed, (_rate(value, f"{SETTING}.rate"),), source=f"rate={value}")
    if key == "rates":
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__") or not list(value):
            raise ValueError(f"{SETTING}.rates must be a non-empty list of numbers in [0, 1], "
                             f"got {value!r}")
        rates = tuple(_rate(r, f"{SETTING}.rates[{i}]") for i, r in enumerate(value))
        return AcceptanceProcess(seed, rates, source=f"rates={list(rates)}")
    return _from_trace(value, seed)


def _from_trace(value: Any, seed: int) -> AcceptanceProcess:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ValueError(f"{SETTING}.trace must be a CSV file's path, got {value!r}")
    path = Path(os.path.expanduser(os.fspath(value)))
    if not path.is_file():
        raise ValueError(f"{SETTING}.trace: no such file {path}")
    accepted: list[int] = []
    shortest = None
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = {"num_draft_tokens", "num_accepted"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{SETTING}.trace {path}: no column {sorted(missing)[0]!r} (it "
                             "needs num_draft_tokens and num_accepted, one draft a row)")
        for line, row in enumerate(reader, start=2):
            try:
                k, a = int(row["num_draft_tokens"]), int(row["num_accepted"])
            except (TypeError, ValueError):
                raise ValueError(f"{SETTING}.trace {path}:{line}: num_draft_tokens and "
                                 "num_accepted must be integers") from None
            if not 0 <= a <= k or k < 1:
                raise ValueError(f"{SETTING}.trace {path}:{line}: needs 0 <= num_accepted <= "
                                 f"num_draft_tokens and num_draft_tokens >= 1, got {a} of {k}")
            accepted.append(a)
            shortest = k if shortest is None else min(shortest, k)
    if not accepted:
        raise ValueError(f"{SETTING}.trace {path}: no drafts (one a row)")
    return AcceptanceProcess(seed, trace_accepted=tuple(accepted), trace_draft_tokens=shortest,
                             source=str(path))
