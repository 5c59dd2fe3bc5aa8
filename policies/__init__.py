"""The shared scheduling core: requests, the paged KV block manager, the scheduler and policies."""

from __future__ import annotations

from typing import Any

from common.model_spec import ModelSpec
from policies import (  # noqa: F401  (importing registers each policy)
    adaptive,
    chunked_prefill,
    cp1,
    cp2,
    cp_promote,
    edf,
    lpm,
    mlfq,
    multi_step,
    priority,
    sarathi,
    single_step,
    sjf,
    slo_adaptive,
    smartspec,
    spec_fixed,
    spec_off_under_load,
)
from policies.base import POLICIES, KStepPolicy, Policy, StepTimeFn, make_policy, register
from policies.batch import Batch, ScheduledSeq
from policies.block_manager import BlockManager
from policies.request import Request, RequestState
from policies.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from policies.speculation import Speculation, make_speculation


def make_scheduler(policy_name: str, policy_params: dict[str, Any] | None,
                   config: SchedulerConfig, num_blocks: int, max_model_len: int,
                   step_time_fn: StepTimeFn | None = None,
                   speculation: Speculation | None = None) -> Scheduler:
    """A scheduler running the named policy over a KV cache of ``num_blocks`` blocks (with
    ``speculation``: speculative decoding, policies/speculation.py)."""
    policy = make_policy(policy_name, **(policy_params or {}))
    return Scheduler(policy, config, num_blocks, max_model_len, step_time_fn, speculation)


__all__ = [
    "POLICIES", "Batch", "BlockManager", "KStepPolicy", "ModelSpec", "Policy", "Request",
    "RequestState", "StepTimeFn", "register",
    "ScheduledSeq", "Scheduler", "SchedulerConfig", "SchedulerStats", "make_policy",
    "make_scheduler", "Speculation", "make_speculation",
]
