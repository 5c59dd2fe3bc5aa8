"""The policy interface and the registry that picks a policy by name."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from policies.scheduler import Scheduler

POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls


@dataclass(frozen=True)
class Policy:
    """What distinguishes one scheduling policy from another; the Scheduler does the rest.

    ``mixed_batches``: decodes and prefills share a batch (the chunked-prefill family); else a
    batch is prefill-only (one step) or decode-only (a window of ``num_steps`` steps).
    ``chunk_prefills``: a prompt may be split over several batches.
    ``overlap``: overlap scheduling (vLLM V1's async scheduling, SGLang's overlap scheduler):
    the next window is formed while the last one is still on the GPU, so the CPU's work hides
    behind the GPU's (the contract is on ``Scheduler.schedule``).
    ``overlap_late_schedule`` (with overlap): when no request is waiting, the next window is
    formed just before the one in flight ends rather than as it starts, so that requests
    arriving meanwhile join it (policies/late_schedule.py); false forms it at once (SGLang's and
    vLLM V1's order).
    """

    name: ClassVar[str] = ""
    mixed_batches: ClassVar[bool] = False
    chunk_prefills: ClassVar[bool] = False
    # keyword-only: a policy's own settings keep their positions
    overlap: bool = field(default=False, kw_only=True)
    overlap_late_schedule: bool = field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        check_bool("policy.overlap", self.overlap)
        check_bool("policy.overlap_late_schedule", self.overlap_late_schedule)

    @property
    def max_steps(self) -> int:
        """The longest window this policy runs: decodes reserve that many slots (lookahead)."""
        return 1

    def window_steps(self, sched: Scheduler, has_prefill: bool) -> int:
        """k for the window being formed."""
        return 1

    def prefill_steps(self, k: int) -> int:
        """Steps of a k-step window that a request whose prefill completes in it takes part in."""
        return 1

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **{f.name: getattr(self, f.name) for f in fields(self)}}


@dataclass(frozen=True)
class KStepPolicy(Policy):
    """A policy with a window length ``num_steps`` (k)."""

    num_steps: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        check_steps("num_steps", self.num_steps)

    @property
    def max_steps(self) -> int:
        return self.num_steps


def check_settings(section: str, given: Iterable[str], known: Iterable[str]) -> None:
    """A one-line error naming the first setting of ``section`` that is not one of ``known``."""
    known = set(known)
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"{section} has no setting {unknown[0]!r}; its settings: "
                         + (", ".join(sorted(known)) or "none"))


def check_int(setting: str, value: Any, minimum: int) -> int:
    """``value`` if it is an integer >= ``minimum`` (1.5, 2.0, "3" and True are refused: a
    setting silently rounded or cast runs a different configuration than the one recorded)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{setting} must be an integer >= {minimum}, got {value!r}")
    return value


def check_number(setting: str, value: Any, *, minimum: float | None = None,
                 positive: bool = False) -> float:
    """``value`` if it is a finite real number (>= ``minimum``; > 0 if ``positive``)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value)):
        raise ValueError(f"{setting} must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{setting} must be > 0, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{setting} must be >= {minimum}, got {value!r}")
    return value


def check_bool(setting: str, value: Any) -> bool:
    """``value`` if it is true or false (1, "yes" and None are refused)."""
    if not isinstance(value, bool):
        raise ValueError(f"{setting} must be true or false, got {value!r}")
    return value


def check_steps(setting: str, value: Any) -> int:
    return check_int(f"policy.{setting}", value, 1)


def make_policy(name: str, **params: Any) -> Policy:
    """Build a policy by registry name; unknown names and settings are one-line errors."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r} (policy.name); choose one of: "
                         + ", ".join(sorted(POLICIES)))
    check_settings(f"policy {name}", params, (f.name for f in fields(cls)))
    return cls(**params)
