"""The policy interface (every scheduling decision, each with vLLM V0's FCFS as its default)
and the registry that picks a policy by name."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

from common.checks import (  # noqa: F401  (the policies' settings are checked with these)
    check_bool,
    check_int,
    check_number,
    check_settings,
    check_steps,
)
from policies.user_code import call_user, users, where

if TYPE_CHECKING:
    from policies.request import Request
    from policies.scheduler import Scheduler

POLICIES: dict[str, type[Policy]] = {}
# settings that were the policy's and are the scheduler's now (a one-line error says where)
MOVED_SETTINGS = ("overlap", "overlap_late_schedule")


def register(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls


# GPU seconds of one forward step from the window being formed, for policies that size their
# windows by time (sarathi, slo_adaptive): (decoding sequences, their KV tokens, the longest
# one's, prefill chunks as (query tokens, cached tokens, samples), and optionally the tokens
# the decodes compute, where a decode computes several: one each if left out). The run builds
# it from its hardware profile's cost model, the same for both backends.
StepTimeFn = Callable[..., float]


@dataclass(frozen=True)
class Policy:
    """Every scheduling decision; the Scheduler keeps the mechanism (queues, KV blocks, lookahead
    slots, overlap's placeholders, update()). Each hook's default is vLLM V0's FCFS scheduler,
    so a policy overrides only the decisions it changes (docs/policies.md: what each may
    answer, checked for a policy defined outside schedlab by policies/hooks.py).

    ``mixed_batches``: decodes and prefills share a batch (the chunked-prefill family); else a
    batch is prefill-only (one step) or decode-only (a window of ``num_steps`` steps).
    ``chunk_prefills``: a prompt may be split over several batches.
    ``orders_queue``: ``queue_key`` orders the waiting queue before each window (and the running
    queue too for a ``preemptive`` policy, so that its tail is the first victim); otherwise the
    queue is FCFS, preempted requests at its head.
    ``preemptive``: ``preempt_for_waiting`` may preempt running requests for waiting ones.
    ``reads_running``: a hook reads a running request's progress (its computed or output
    tokens, token times or block table); a policy class whose hooks do not says False in its
    own body (a subclass, which may add hooks, says it again), and the simulator then keeps
    its decoders as one group (policies/decode_group.py). True, the default, is always correct.
    Overlap scheduling is not a policy's trait but a mode of the engine loop that every policy
    runs under (``SchedulerConfig.overlap``).
    """

    name: ClassVar[str] = ""
    mixed_batches: ClassVar[bool] = False
    chunk_prefills: ClassVar[bool] = False
    orders_queue: ClassVar[bool] = False
    preemptive: ClassVar[bool] = False
    needs_step_time: ClassVar[bool] = False  # the run must give the scheduler a StepTimeFn
    reads_running: ClassVar[bool] = True

    def __post_init__(self) -> None:
        """Check the policy's settings (each policy extends this with its own)."""

    # ---------------------------------------------------------------- window length
    @property
    def max_steps(self) -> int:
        """The longest window this policy runs: decodes reserve that many slots (lookahead)."""
        return 1

    def window_steps(self, sched: Scheduler, has_prefill: bool) -> int:
        """k for the window being formed: 1 to ``max_steps``."""
        return 1

    def prefill_steps(self, k: int) -> int:
        """Steps (1 to k) of a k-step window that a request whose prefill completes in it takes
        part in."""
        return 1

    # ---------------------------------------------------------------- order and admission
    def queue_key(self, req: Request, sched: Scheduler) -> Any:
        """With ``orders_queue``: the sort key of ``req`` (lowest first; ties keep queue order)."""
        return 0

    def window_budget(self, sched: Scheduler) -> tuple[int, int]:
        """(tokens, sequences) the window being formed may hold: the scheduler's limits
        (tokens >= 1; sequences at most ``scheduler.max_num_seqs``)."""
        return sched.max_num_batched_tokens, sched.config.max_num_seqs

    def admit(self, req: Request, sched: Scheduler) -> bool:
        """Whether waiting ``req`` may join the window being formed; False passes it over this
        time (admission control) and the next one in order is tried."""
        return True

    def chunk_size(self, req: Request, num_new: int, budget: int, sched: Scheduler) -> int:
        """Prefill tokens ``req`` computes in the window being formed (of ``num_new`` it still
        lacks, ``budget`` tokens left), at most both; 0: it does not fit, and admission stops
        there. Without ``chunk_prefills``: 0 or ``num_new``."""
        if self.chunk_prefills:
            return min(num_new, budget)
        return num_new if num_new <= budget else 0

    # ---------------------------------------------------------------- preemption
    def preemption_victim(self, sched: Scheduler, req: Request) -> Request:
        """The running request to preempt (recompute) when ``req``'s decode slots find no free
        KV block: the last admitted (or last in order, for a preemptive policy)."""
        return sched.running[-1]

    def preempt_for_waiting(self, sched: Scheduler) -> list[Request]:
        """Running requests (distinct) to preempt before the window is formed, to make room for
        waiting ones (preemptive policies, with ``orders_queue`` having sorted both queues)."""
        return []

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **{f.name: getattr(self, f.name) for f in fields(self)
                                      if f.init}}


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


def make_policy(name: str, module: str | None = None, **params: Any) -> Policy:
    """Build a policy by registry name; unknown names and settings are one-line errors.

    ``module`` (``policy.module``): a policy defined outside schedlab, as a dotted module name
    importable from the working directory or a path to a ``.py`` file; importing it registers
    its classes (``@register``), docs/policies.md shows one."""
    for key in MOVED_SETTINGS:
        if key in params:
            raise ValueError(f"policy.{key} is now scheduler.{key}: overlap scheduling is a mode "
                             "of the engine loop, for every policy")
    return build_registered("policy", POLICIES, name, module, params)


def build_registered(kind: str, registry: dict[str, type], name: str, module: str | None,
                     params: dict[str, Any]) -> Any:
    """An instance of ``registry[name]`` (a policy or a router) with ``params``, a user's
    ``<kind>.module`` imported first; unknown names and settings are one-line errors."""
    if module is not None:
        import_user_module(module, f"{kind}.module")
    cls = registry.get(name)
    if cls is None:
        raise ValueError(f"unknown {kind} {name!r} ({kind}.name); choose one of: "
                         + ", ".join(sorted(registry)))
    check_settings(f"{kind} {name}", params, (f.name for f in fields(cls) if f.init))
    if users(cls):  # its own checks of its settings raise ValueError; anything else is a bug
        return call_user(f"{kind} {cls.__name__}", cls, **params)
    return cls(**params)


def import_user_module(module: str, setting: str) -> ModuleType:
    """Import a user's module (of policies, routers or a simulation's processes: a dotted name
    or a .py path) once, and return it; its errors are one line naming ``setting``
    (policy.module, router.module, backend.processes)."""
    if not isinstance(module, str) or not module:
        raise ValueError(f"{setting} must be a module name or a .py file, got {module!r}")
    if module in _IMPORTED:
        return _IMPORTED[module]
    path = Path(module).expanduser()
    try:
        if module.endswith(".py"):
            if not path.is_file():
                raise ValueError(f"{setting} {module}: no such file")
            spec = importlib.util.spec_from_file_location(f"schedlab_user_{path.stem}", path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            spec.loader.exec_module(mod)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            mod = importlib.import_module(module)
    except ValueError:
        raise
    except Exception as err:  # the user's code: its error, in one line
        line = "" if isinstance(err, SyntaxError) else where(err.__traceback__)  # (it says it)
        raise ValueError(f"{setting} {module} failed to import: "
                         f"{type(err).__name__}: {err}{line}") from None
    _IMPORTED[module] = mod
    return mod


_IMPORTED: dict[str, ModuleType] = {}
