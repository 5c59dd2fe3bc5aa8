"""Async output processing: each step's sampled ids go to pinned host memory behind a CUDA event on
a side stream and are pythonized when ready, so step n's output work overlaps step n+1 on the GPU."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from time import perf_counter

import torch


class StepOutputs:
    """Collects one window's per-step sampled ids and the wall time each became Python ints.

    ``push`` queues step j's device-to-host copy and returns at once; ``poll`` pythonizes the
    steps whose copy has finished (never blocks); ``drain`` blocks for the rest. With
    ``async_output=False`` every ``push`` blocks until its step is pythonized (vLLM before #7921).
    """

    def __init__(self, device: torch.device, clock: Callable[[], float], async_output: bool) -> None:
        self.device = device
        self.clock = clock
        self.async_output = async_output
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._host = torch.empty(0, dtype=torch.int64)
        self.start(0, 0)

    def start(self, num_steps: int, max_rows: int) -> None:
        self.ids: list[list[int]] = [[] for _ in range(num_steps)]
        # step -> what came with its ids (logprobs): each named tensor as nested lists
        self.extra: list[dict[str, list]] = [{} for _ in range(num_steps)]
        self.times = [0.0] * num_steps
        self.pythonize_s = 0.0
        self._pending: deque[tuple[int, torch.Tensor, torch.cuda.Event,
                                   dict[str, torch.Tensor]]] = deque()
        self._keep: list[torch.Tensor] = []  # device ids stay alive until their copy has run
        if self.cuda and self._host.numel() < num_steps * max_rows:
            # Reused across windows: drain() guarantees every copy into it has finished.
            self._host = torch.empty(num_steps * max_rows, dtype=torch.int64, pin_memory=True)
        self._row_stride = max_rows

    def push(self, step: int, sampled: torch.Tensor,
             extra: dict[str, torch.Tensor] | None = None) -> None:
        """Queue step ``step``'s ids, and the ``extra`` tensors that come with them (the
        logprobs a request asked for: only windows that have some pay for their copy)."""
        extra = extra or {}
        if not self.cuda:
            self._deliver(step, sampled, extra)
            return
        ready = torch.cuda.Event()
        ready.record()
        n = sampled.shape[0]
        host = self._host[step * self._row_stride: step * self._row_stride + n]
        hosts = {name: torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                 for name, t in extra.items()}
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(ready)
            host.copy_(sampled, non_blocking=True)
            for name, t in extra.items():
                hosts[name].copy_(t, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        self._keep.append(sampled)
        self._keep.extend(extra.values())
        self._pending.append((step, host, copied, hosts))
        if not self.async_output:
            self.drain()

    @property
    def pending(self) -> bool:
        """Whether a step's ids are not pythonized yet."""
        return bool(self._pending)

    def poll(self) -> None:
        while self._pending and self._pending[0][2].query():
            step, host, _, extra = self._pending.popleft()
            self._deliver(step, host, extra)

    def drain(self) -> None:
        while self._pending:
            step, host, copied, extra = self._pending.popleft()
            copied.synchronize()
            self._deliver(step, host, extra)
        self._keep.clear()

    def _deliver(self, step: int, host: torch.Tensor, extra: dict[str, torch.Tensor]) -> None:
        t = perf_counter()
        self.ids[step] = host.tolist()
        self.times[step] = self.clock()
        if extra:
            self.extra[step] = {name: x.tolist() for name, x in extra.items()}
        self.pythonize_s += perf_counter() - t
