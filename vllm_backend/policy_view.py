"""What a policy's hooks read of vLLM's scheduler, in schedlab's terms: the attributes of
policies/scheduler.py's Scheduler (``waiting``, ``running``, ``now``, ``forming``,
``block_manager``, ...) over vLLM's queues, requests and KV block pool."""

from __future__ import annotations

from collections import deque
from typing import Any

from policies.base import Policy, StepTimeFn
from policies.batch import ScheduledSeq
from policies.request import Request
from policies.scheduler import Scheduler, SchedulerConfig, token_budget


class VllmBlocks:
    """The block manager's questions a policy asks (policies/preemption.py, lpm), answered
    from vLLM's KV cache manager. vLLM keeps no watermark."""

    watermark_blocks = 0

    def __init__(self, kv_cache_manager: Any, block_size: int, vllm_of: dict[int, Any]) -> None:
        self._kv = kv_cache_manager
        self.block_size = block_size
        self._vllm_of = vllm_of  # schedlab request id -> vLLM's Request

    @property
    def num_free_blocks(self) -> int:
        return self._kv.block_pool.get_num_free_blocks()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match(self, req: Request) -> list[Any]:
        """The cached blocks of the request's longest cached prefix (vLLM's prefix cache,
        which leaves the last token to compute, as schedlab's)."""
        blocks, _, _ = self._kv.get_computed_blocks(self._vllm_of[req.request_id])
        return list(blocks.blocks[0]) if blocks.blocks else []

    def blocks_needed(self, num_tokens: int, hits: list[Any] | None = None) -> int:
        """Free blocks a request of ``num_tokens`` slots takes: a cached block another request
        holds is shared; a free cached one leaves the free pool all the same."""
        return self.blocks_for(num_tokens) - sum(1 for b in hits or () if b.ref_cnt > 0)

    def blocks_freed_by(self, req: Request) -> int:
        """Blocks that preempting ``req`` returns: those no other request holds."""
        blocks = self._kv.get_blocks(self._vllm_of[req.request_id].request_id).blocks
        return sum(1 for b in (blocks[0] if blocks else ()) if b.ref_cnt == 1)


class PolicyView:
    """The scheduler a policy's hooks are given inside vLLM. ``waiting`` and ``running`` are
    schedlab Requests mirroring vLLM's, in the policy's order (VllmPolicyScheduler keeps them
    in step); ``forming`` is the step being formed, as far as vLLM has formed it."""

    # one home for the arrival-rate estimate the policies read (adaptive, slo_adaptive)
    arrival_rate = Scheduler.arrival_rate

    def __init__(self, policy: Policy, config: SchedulerConfig, max_model_len: int,
                 block_manager: VllmBlocks, step_time_fn: StepTimeFn | None) -> None:
        self.policy = policy
        self.config = config
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = token_budget(policy, config, max_model_len)
        self.block_manager = block_manager
        self.step_time_fn = step_time_fn
        if policy.needs_step_time and step_time_fn is None:
            raise ValueError(f"policy {policy.name} sizes windows by time and needs a hardware "
                             "profile's cost model (additional_config's schedlab.step_time)")
        self.overlap = False  # vLLM's CPU platform schedules synchronously
        self.now = 0.0
        self.step_time: float | None = None
        self.recent_arrivals: deque[float] = deque(maxlen=256)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.forming: list[ScheduledSeq] = []
