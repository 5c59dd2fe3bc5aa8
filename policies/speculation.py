"""Speculative decoding's decisions: how many tokens each decode drafts (the speculation length,
per window and per request), the speculation policies' registry, the ``spec`` settings
(``Speculation``) and the counters a run keeps of drafts and acceptance (``SpecDecodeStats``,
in vLLM's metric names). docs/speculative_decoding.md is the reference."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from common.checks import check_int, check_settings
from common.model_spec import ModelSpec
from common.spec_acceptance import AcceptanceProcess
from policies.base import StepTimeFn, import_user_module
from policies.user_code import call_user

if TYPE_CHECKING:
    from policies.request import Request
    from policies.scheduler import Scheduler

SPECULATION_POLICIES: dict[str, type[SpeculationPolicy]] = {}
METHODS = ("off", "draft", "ngram")
# the spec section's own keys; the rest are its policy's settings
SPEC_KEYS = ("method", "num_tokens", "draft_model", "policy")


def register_speculation(cls: type[SpeculationPolicy]) -> type[SpeculationPolicy]:
    SPECULATION_POLICIES[cls.name] = cls
    return cls


@dataclass(frozen=True)
class SpeculationPolicy:
    """How much to speculate: ``window_tokens`` picks k (0 to ``num_tokens``) for the window
    being formed, ``request_tokens`` each decode's k (0 to the window's) within it. A decode
    drafting k tokens computes k + 1 a step (ScheduledSeq.num_decode_tokens) and reserves their
    KV slots; 0 is a plain one-token decode. The defaults draft ``num_tokens`` everywhere.

    ``needs_step_time``: the policy prices steps (``sched.step_time_fn`` for the target and
    ``sched.speculation.draft_step_time`` for the draft); the run must give a hardware
    profile's cost model."""

    name: ClassVar[str] = ""
    needs_step_time: ClassVar[bool] = False
    num_tokens: int = 4  # spec.num_tokens: the longest draft

    def __post_init__(self) -> None:
        check_int("spec.num_tokens", self.num_tokens, 1)

    def window_tokens(self, sched: Scheduler) -> int:
        """k for the window being formed: 0 (no speculation) to ``num_tokens``."""
        return self.num_tokens

    def request_tokens(self, req: Request, k: int, sched: Scheduler) -> int:
        """k for running ``req`` in the window being formed, whose k is ``k``: 0 to ``k``."""
        return k

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **{f.name: getattr(self, f.name) for f in fields(self)
                                      if f.init}}


@dataclass(slots=True)
class SpecDecodeStats:
    """Drafts and their acceptance over a run, counted as verified (each decode step a request
    took part in until its last token), in vLLM's names (``metrics``)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rejected_drafts: int = 0  # drafts with a token rejected (the rest were accepted whole)
    # drafts by their length k, and by the tokens they accepted: each position's counts follow
    drafts_of_length: list[int] = field(default_factory=list)
    drafts_accepting: list[int] = field(default_factory=list)

    def record(self, accepted: list[int], k: int, steps: int) -> None:
        """The first ``steps`` steps of a decode drafting ``k`` tokens a step, each accepting
        ``accepted[i]`` of them."""
        by_length, by_accepted = self.drafts_of_length, self.drafts_accepting
        if len(by_length) <= k:
            by_length += [0] * (k + 1 - len(by_length))
            by_accepted += [0] * (k + 1 - len(by_accepted))
        by_length[k] += steps
        total = 0
        for a in accepted[:steps]:
            total += a
            by_accepted[a] += 1
            if a < k:
                self.num_rejected_drafts += 1
        self.num_accepted_tokens += total
        self.num_drafts += steps
        self.num_draft_tokens += k * steps

    def add(self, other: SpecDecodeStats) -> None:
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                     "num_rejected_drafts"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.drafts_of_length, other.drafts_of_length),
                             (self.drafts_accepting, other.drafts_accepting)):
            mine += [0] * (len(theirs) - len(mine))
            for i, n in enumerate(theirs):
                mine[i] += n

    def rate_estimate(self, prior: float, min_drafts: int) -> float:
        """The per-token acceptance rate a constant-rate process would have (its maximum
        likelihood estimate: accepted tokens over accepted tokens plus rejections), ``prior``
        until ``min_drafts`` drafts are verified."""
        if self.num_drafts < min_drafts:
            return prior
        trials = self.num_accepted_tokens + self.num_rejected_drafts
        return self.num_accepted_tokens / trials if trials else prior

    def per_position_acceptance_rates(self) -> list[float | None]:
        """Position i's (from 0) acceptance rate: the drafts that accepted its token over the
        drafts that drafted it (those of length > i)."""
        rates = []
        drafted = sum(self.drafts_of_length)
        accepted = sum(self.drafts_accepting)
        for i in range(len(self.drafts_of_length) - 1):
            drafted -= self.drafts_of_length[i]  # drafts of length > i
            accepted -= self.drafts_accepting[i]  # drafts accepting > i tokens
            rates.append(accepted / drafted if drafted else None)
        return rates

    def metrics(self) -> dict[str, Any]:
        """vLLM's spec_decode_* metrics: acceptance rate (accepted over drafted tokens),
        acceptance length (tokens emitted per draft: 1 + accepted per draft), the counts, and
        each draft position's acceptance rate (accepted over drafts reaching it)."""
        n, drafted = self.num_drafts, self.num_draft_tokens
        return {
            "spec_decode_num_drafts": n,
            "spec_decode_draft_tokens": drafted,
            "spec_decode_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_acceptance_rate": self.num_accepted_tokens / drafted if drafted else None,
            "spec_decode_acceptance_length": 1 + self.num_accepted_tokens / n if n else None,
            "spec_decode_per_position_acceptance_rate": self.per_position_acceptance_rates(),
        }


def draft_steps_time(draft_step: StepTimeFn, num_tokens: int,
                     groups: Mapping[int, Sequence[int]]) -> float:
    """Seconds the draft model takes to draft for one verify step, as the engine runs it
    (real_backend/speculative.py): ``num_tokens`` + 1 one-token steps (spec.num_tokens, the
    longest draft, whatever k each row drafts; the last step keeps the draft's KV whole when all
    are accepted) over every drafting row, each priced by ``draft_step`` (the draft model's
    step time); at step i a row drafting k attends over its context and its first min(k, i)
    drafts. ``groups``: per k, (rows, their contexts summed, the longest context), a row's
    context being its tokens through its newest."""
    n = ctx = 0
    for count, ctx_sum, _ in groups.values():
        n += count
        ctx += ctx_sum
    t = 0.0
    for i in range(num_tokens + 1):
        kv, longest = ctx, 0
        for k, (count, _, top) in groups.items():
            d = k if k < i else i
            kv += count * d
            if top + d > longest:
                longest = top + d
        t += draft_step(n, kv, longest, ())
    return t


@dataclass(frozen=True)
class Speculation:
    """The ``spec`` section of a run with speculation on: the method (``draft``: a draft model
    on the same GPU, ``ngram``: prompt lookup), the longest draft, the draft model's config
    name (``same``: the target), the policy, and the workload's acceptance process (None: the
    engine verifies for real; the simulator refuses that). ``draft_step_time``: the cost
    model's price of one draft-model step (None for ngram: its lookup is a few dozen small
    device ops a step, left unpriced; docs/speculative_decoding.md)."""

    method: str
    num_tokens: int
    draft_model: str | None
    policy: SpeculationPolicy
    acceptance: AcceptanceProcess | None = None
    draft_step_time: StepTimeFn | None = None
    draft: ModelSpec | None = None  # the draft model's shape (its weights and KV share the GPU)

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "num_tokens": self.num_tokens,
                "draft_model": self.draft_model, "policy": self.policy.describe(),
                "acceptance": None if self.acceptance is None else self.acceptance.source}


def make_speculation(spec: Mapping[str, Any] | None,
                     acceptance: AcceptanceProcess | None = None,
                     draft_step_time: StepTimeFn | None = None,
                     draft: ModelSpec | None = None) -> Speculation | None:
    """The run's Speculation from its ``spec`` section (None: speculation off); a bad setting
    is one line naming it."""
    if spec is None:
        return None
    spec = dict(spec)
    method = spec.get("method", "off")
    if method is False:  # YAML reads a bare off as false
        method = "off"
    if method not in METHODS:
        raise ValueError(f"spec.method must be one of {', '.join(METHODS)}, got {method!r}")
    if method == "off":
        return None
    k = spec.get("num_tokens")
    check_int("spec.num_tokens", k, 1)
    name_of_draft = spec.get("draft_model")
    if method == "draft" and (not isinstance(name_of_draft, str) or not name_of_draft):
        raise ValueError(f"spec.draft_model must name a conf/model config (or `same`: the target "
                         f"itself) with spec.method=draft, got {name_of_draft!r}")
    name = spec.get("policy")
    if not isinstance(name, str) or not name:
        raise ValueError(f"spec.policy must name a speculation policy ({', '.join(sorted(SPECULATION_POLICIES))}) "
                         f"or a .py file defining one, got {name!r}")
    settings = {key: v for key, v in spec.items() if key not in SPEC_KEYS}
    policy = _build_policy(name, k, settings)
    if acceptance is not None:
        acceptance.check_num_tokens(k)
    if method != "draft":
        return Speculation(method, k, None, policy, acceptance)
    return Speculation(method, k, name_of_draft, policy, acceptance, draft_step_time, draft)


def _build_policy(name: str, k: int, settings: dict[str, Any]) -> SpeculationPolicy:
    """The policy ``spec.policy`` names: a registered one, or the one speculation policy a
    ``.py`` file (or dotted module) defines, its settings checked."""
    cls = SPECULATION_POLICIES.get(name)
    if cls is None and (name.endswith(".py") or "." in name):
        mod = import_user_module(name, "spec.policy")
        found = [c for c in vars(mod).values() if isinstance(c, type)
                 and issubclass(c, SpeculationPolicy) and c.__module__ == mod.__name__]
        if len(found) != 1:
            raise ValueError(f"spec.policy {name} must define one speculation policy (a subclass "
                             f"of policies.speculation.SpeculationPolicy), found {len(found)}")
        cls = found[0]
    if cls is None:
        raise ValueError(f"unknown speculation policy {name!r} (spec.policy); choose one of: "
                         + ", ".join(sorted(SPECULATION_POLICIES)) + ", or a .py file")
    check_settings(f"spec (policy {name})", settings,
                   (f.name for f in fields(cls) if f.init and f.name != "num_tokens"))
    return call_user(f"speculation policy {cls.__name__}", cls, num_tokens=k, **settings)
