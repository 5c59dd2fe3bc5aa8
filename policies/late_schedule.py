"""Overlap's late schedule: when to form window n+1 so that it still leaves the GPU no gap.

With overlap scheduling the next window is formed while the one in flight runs. Formed at once,
it closes one window early: a request arriving during the window in flight waits for the window
after next. When nothing is waiting (``Scheduler.defers_schedule``), both backends instead form
the next window just before the one in flight ends: at its GPU start plus a low estimate of its
GPU time, less the time the last schedule-and-launch took and a margin. The estimate is the
longest recent decode-only window of as many steps and no more sequences, or for a window with
prefills the longest recent one with no more prefill tokens (a window with more sequences or
tokens runs at least as long). An estimate too long
would leave the GPU idle; too short only forms the window a little early, so every choice here
errs short.
"""

from __future__ import annotations

from collections import deque

from policies.batch import Batch

MARGIN_S = 300e-6  # early by this much: a decode window's GPU time wanders window to window
RECENT_WINDOWS = 64  # of each kind: the batch and its contexts drift slowly


class LateSchedule:
    """The backends' shared estimate of when the window in flight ends on the GPU."""

    def __init__(self, margin_s: float = MARGIN_S) -> None:
        self.margin_s = margin_s
        # k -> (sequences, GPU seconds) of recent decode-only windows of k steps
        self._decode: dict[int, deque[tuple[int, float]]] = {}
        # (prefill tokens, GPU seconds) of recent one-step windows with prefills
        self._prefill: deque[tuple[int, float]] = deque(maxlen=RECENT_WINDOWS)
        self._form_s: float | None = None  # the last schedule() + input preparation + launch

    def observe_window(self, batch: Batch, gpu_s: float) -> None:
        """A window left the GPU after ``gpu_s`` seconds of GPU time."""
        if not batch.has_prefill:
            recent = self._decode.setdefault(batch.num_steps, deque(maxlen=RECENT_WINDOWS))
            recent.append((len(batch.seqs), gpu_s))
        elif batch.num_steps == 1:
            self._prefill.append((batch.num_prefill_tokens, gpu_s))

    def observe_form(self, seconds: float) -> None:
        """Forming and launching a window took ``seconds`` of CPU time."""
        self._form_s = seconds

    def gpu_time(self, batch: Batch) -> float | None:
        """A low estimate of ``batch``'s GPU time, or None without one."""
        if not batch.has_prefill:
            n = len(batch.seqs)
            return max((g for m, g in self._decode.get(batch.num_steps, ()) if m <= n),
                       default=None)
        if batch.num_steps > 1:
            return None
        tokens = batch.num_prefill_tokens
        return max((g for t, g in self._prefill if t <= tokens), default=None)

    def schedule_at(self, in_flight: Batch, gpu_start: float) -> float | None:
        """When to form the next window, given the window in flight and its GPU start; None:
        at once (no estimate for it)."""
        gpu_s = self.gpu_time(in_flight)
        if gpu_s is None or self._form_s is None:
            return None
        return gpu_start + gpu_s - self._form_s - self.margin_s
