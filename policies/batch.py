"""What one scheduler invocation hands a backend: a window of k steps over a frozen batch."""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.decode_group import DecodeWindow
from policies.request import Request


@dataclass(slots=True, eq=False)
class ScheduledSeq:
    """One request's part in a window.

    In step 1 it computes ``num_query_tokens`` tokens at positions
    ``num_cached_tokens .. num_cached_tokens + num_query_tokens - 1`` (a prefill chunk, or the
    single newest token of a decode). In steps 2..num_steps it decodes one token per step.
    It samples a token at every step it takes part in, except when its prefill chunk leaves
    part of the sequence uncomputed (then num_steps == 1 and nothing is sampled).
    """

    request: Request
    num_query_tokens: int
    num_cached_tokens: int
    num_steps: int
    is_prefill: bool
    # Overlap scheduling: the tokens this window is expected to sample for the request (its
    # steps, capped by max_tokens), counted as placeholders until update(); 0 without overlap.
    num_placeholders: int = 0

    @property
    def samples(self) -> bool:
        return self.num_cached_tokens + self.num_query_tokens >= self.request.seq_len

    @property
    def num_slots(self) -> int:
        """KV slots the window writes for this request (lookahead included)."""
        return self.num_query_tokens + self.num_steps - 1


@dataclass(slots=True, eq=False)
class Batch:
    """A window: ``seqs`` run for ``num_steps`` (k) steps without returning to the scheduler.
    A decode group's window (the simulator's: Scheduler.group_decodes) has no ``seqs`` but
    ``decodes``, its totals."""

    seqs: list[ScheduledSeq]
    num_steps: int
    window_id: int = 0
    preempted: list[Request] = field(default_factory=list)
    num_wasted_steps: int = 0  # filled by Scheduler.update: steps run past a request's end
    decodes: DecodeWindow | None = None

    @property
    def num_seqs(self) -> int:
        """Requests taking part."""
        return len(self.seqs) + (self.decodes.num_seqs if self.decodes is not None else 0)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_query_tokens for s in self.seqs if s.is_prefill)

    @property
    def num_decode_seqs(self) -> int:
        return sum(1 for s in self.seqs if not s.is_prefill)

    @property
    def has_prefill(self) -> bool:
        return any(s.is_prefill for s in self.seqs)

    def seqs_in_step(self, step: int) -> list[ScheduledSeq]:
        """Requests taking part in step ``step`` (0-based)."""
        return [s for s in self.seqs if s.num_steps > step]

    def __len__(self) -> int:
        return self.num_seqs
