"""The scheduler's limits (``SchedulerConfig``: vLLM V0's, overlap, prefix caching) and the
counters it keeps over a run (``SchedulerStats``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.checks import check_bool, check_int, check_number, check_settings


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of the vLLM V0 scheduler; ``max_num_batched_tokens=None`` takes vLLM's default."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    watermark: float = 0.01
    # Overlap scheduling (vLLM V1's async scheduling, SGLang's overlap scheduler), a mode of the
    # engine loop under any policy: the next window is formed while the last one is still on
    # the GPU, so the CPU's work hides behind the GPU's (the contract is on ``schedule``).
    overlap: bool = False
    # With overlap, when no request waits: form the next window just before the one in flight
    # ends rather than as it starts, so that arrivals meanwhile join it
    # (policies/late_schedule.py); false forms it at once (SGLang's and vLLM V1's order).
    overlap_late_schedule: bool = True
    # Automatic prefix caching (vLLM V1's default): a request admitted while the full blocks
    # of its prompt's prefix are cached starts after them (policies/block_manager.py). It acts
    # on requests whose content the workload describes (Request.prefix_segments).
    enable_prefix_caching: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SchedulerConfig:
        check_settings("scheduler", d, cls.__dataclass_fields__)
        return cls(**d)

    def __post_init__(self) -> None:
        check_int("scheduler.max_num_seqs", self.max_num_seqs, 1)
        if self.max_num_batched_tokens is not None:
            check_int("scheduler.max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("scheduler.block_size", self.block_size, 1)
        check_number("scheduler.watermark", self.watermark, minimum=0)
        if not self.watermark < 1.0:
            raise ValueError(f"scheduler.watermark must be in [0, 1), got {self.watermark}")
        check_bool("scheduler.overlap", self.overlap)
        check_bool("scheduler.overlap_late_schedule", self.overlap_late_schedule)
        check_bool("scheduler.enable_prefix_caching", self.enable_prefix_caching)


@dataclass(slots=True)
class SchedulerStats:
    num_invocations: int = 0  # schedule() calls that returned a window
    num_windows: int = 0
    num_steps: int = 0  # GPU steps over all windows
    num_preemptions: int = 0
    num_wasted_steps: int = 0  # decode slots run after a request had all its tokens
    num_late_stop_steps: int = 0  # overlap: of those, slots of windows formed before a stop was known
