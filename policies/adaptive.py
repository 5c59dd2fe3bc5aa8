"""adaptive: multi-step whose window length k is chosen per window from the scheduler's state.

The rule, and why:

1. A window containing a prefill runs one step, as in ``multi_step``: prefill batches cannot be
   advanced on the GPU without the scheduler.
2. With nobody waiting, k maximises useful tokens per unit of time over the window,

       goodput(k) = sum_i min(k, remaining_i) / (overhead_steps + k),

   where remaining_i is the number of tokens request i still owes and ``overhead_steps`` is the
   CPU cost of one scheduler invocation in units of one GPU decode step (about 1 for vLLM
   v0.5 on an 8B model on an H100; a calibrated overhead profile gives the value for a setup).
   Long windows amortise the CPU cost; once requests start to run out of tokens the extra
   steps are wasted slots and the numerator stops growing, so k stops there. This bounds k by
   the remaining outputs without letting one nearly-done request force k = 1.
3. While requests wait (their prompts did not fit the free blocks or seats), every step the
   window runs past the first finish keeps a finished request's seat and blocks away from
   them: k shrinks to the earliest finish, but not below ``backlog_min_steps``, so a steady
   trickle of finishes cannot collapse the window to a few steps and give back the CPU
   overhead (offline, with a long queue, every window would otherwise end after 1-2 steps).

4. Requests that arrive during a window wait for its end (up to k - 1 steps of TTFT). From
   the arrival rate of the last second (lambda) and the measured time per step (s), a window
   of k steps expects lambda * s * k arrivals; k is capped so that about
   ``arrivals_per_window`` of them wait (never below ``min_steps``). Offline, nothing arrives
   after the start and the cap vanishes; under online load, windows shorten as load rises
   until the backlog itself (rule 3) takes over.

5. With overlap scheduling (``scheduler.overlap``), the scheduler invocation runs while the
   previous window is on the GPU, so a window costs max(overhead_steps, k) steps instead of
   overhead_steps + k: k only has to
   grow until the window outlasts the CPU's work (k = 1 once that is under one step).
   Remaining tokens then leave out those the window in flight will produce.

Remaining tokens are an upper bound when requests stop on EOS; the rule then errs toward
longer windows, whose cost is wasted slots, not wrong tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import KStepPolicy, check_number, check_steps, register


@register
@dataclass(frozen=True)
class Adaptive(KStepPolicy):
    name = "adaptive"
    num_steps: int = 16  # the longest window (k_max)
    min_steps: int = 2
    overhead_steps: float = 1.0
    arrivals_per_window: float = 0.5
    backlog_min_steps: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        check_steps("min_steps", self.min_steps)
        check_steps("backlog_min_steps", self.backlog_min_steps)
        check_number("policy.overhead_steps", self.overhead_steps, minimum=0)
        check_number("policy.arrivals_per_window", self.arrivals_per_window, positive=True)

    def window_steps(self, sched, has_prefill: bool) -> int:
        if has_prefill:
            return 1
        k_max = self.num_steps
        # count[j]: decoding requests owing exactly j tokens (j == k_max: k_max or more)
        count = [0] * (k_max + 1)
        n = 0
        shortest = k_max
        for req in sched.running:
            rem = req.max_tokens - req.num_output_tokens - req.num_output_placeholders
            if rem < 1:
                continue
            n += 1
            if rem < shortest:
                shortest = rem
            count[min(rem, k_max)] += 1
        if n == 0:
            return 1
        best_k, best, useful, alive = 1, -1.0, 0, n
        for k in range(1, k_max + 1):
            useful += alive  # requests still owing tokens at step k
            alive -= count[k]
            cost = max(self.overhead_steps, k) if sched.overlap else self.overhead_steps + k
            rate = useful / cost
            if rate > best * (1 + 1e-9):
                best_k, best = k, rate
        floor = min(self.min_steps, k_max)
        if sched.waiting:
            best_k = min(best_k, max(shortest, min(self.backlog_min_steps, k_max)))
        rate, step = sched.arrival_rate(), sched.step_time
        if rate > 0 and step:
            best_k = min(best_k, max(floor, int(self.arrivals_per_window / (rate * step))))
        return best_k
