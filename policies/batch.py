"""What one scheduler invocation hands a backend: a window of k steps over a frozen batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from policies.decode_group import DecodeWindow
from policies.request import Request


@dataclass(slots=True, eq=False, init=False)
class ScheduledSeq:
    """One request's part in a window: the tokens it computes and may emit at each step.

    In step 1 it computes ``num_query_tokens`` tokens (vLLM's num_scheduled_tokens) at
    positions ``num_cached_tokens .. num_cached_tokens + num_query_tokens - 1``: a prefill
    chunk, or a decode's ``num_decode_tokens``. In steps 2..num_steps it decodes
    ``num_decode_tokens`` tokens a step. A decode step computes its tokens and may emit as many
    (1 today: the newest token in, the next one out; a draft of k tokens verified by the target
    makes it k + 1); a prefill chunk may emit one token if it completes the sequence, else
    none (then num_steps == 1). Every count of a window's slots, tokens and times reads these.
    """

    request: Request
    num_query_tokens: int
    num_cached_tokens: int
    num_steps: int
    is_prefill: bool
    # Overlap scheduling: the tokens this window is expected to sample for the request (its
    # emitted tokens, capped by max_tokens), counted as placeholders until update(); 0 without
    # overlap.
    num_placeholders: int
    # Tokens each decode step computes and may emit (a decode's step 1 is one: its
    # num_query_tokens is this number).
    num_decode_tokens: int
    # Tokens step 1 may emit: 0 for a chunk that leaves part of the sequence uncomputed, 1 for
    # a prefill chunk that completes it, num_decode_tokens for a decode (a decoding request's
    # tokens are all computed but its newest). Set when the window is formed (update() changes
    # the request's length, not what the window computed).
    num_sampled_tokens: int
    # Speculative decoding: the draft tokens accepted at each of the window's decode steps (a
    # step emits its accepted tokens plus the target's own), drawn from the workload's
    # acceptance process when the window is formed, so that every backend and the simulator
    # apply the same outcome; None without speculation, or where the engine's verification
    # decides (greedy, real weights: the engine writes them here before update(), which
    # reads them to grow the request, emit its tokens and free its rejected slots' blocks).
    num_accepted: list[int] | None

    # Written out rather than generated with a __post_init__: one is formed per request per
    # window, and the extra call would cost the scheduler's hot path (the speed rule).
    def __init__(self, request: Request, num_query_tokens: int, num_cached_tokens: int,
                 num_steps: int, is_prefill: bool, num_placeholders: int = 0,
                 num_decode_tokens: int = 1) -> None:
        self.request = request
        self.num_query_tokens = num_query_tokens
        self.num_cached_tokens = num_cached_tokens
        self.num_steps = num_steps
        self.is_prefill = is_prefill
        self.num_placeholders = num_placeholders
        self.num_decode_tokens = num_decode_tokens
        self.num_accepted = None
        if not is_prefill:
            self.num_sampled_tokens = num_decode_tokens
        elif num_cached_tokens + num_query_tokens < request.prompt_len + request.num_output_tokens:
            self.num_sampled_tokens = 0  # part of the sequence stays uncomputed
        else:
            self.num_sampled_tokens = 1

    @property
    def samples(self) -> bool:
        """Step 1 completes the sequence (as the window was formed): it emits tokens."""
        return self.num_sampled_tokens > 0

    @property
    def num_slots(self) -> int:
        """KV slots the window writes for this request: every token it computes in every step
        (lookahead and draft tokens included)."""
        return self.num_query_tokens + (self.num_steps - 1) * self.num_decode_tokens

    @property
    def num_kept_slots(self) -> int:
        """KV slots still valid after the window: its ``num_slots`` less the rejected draft
        tokens' (a step keeps its accepted tokens and the newest one), by which the request's
        computed tokens grow."""
        acc = self.num_accepted
        if acc is None:
            return self.num_slots
        return sum(acc) + len(acc)

    @property
    def num_emitted_tokens(self) -> int:
        """Tokens the window may emit for the request over its steps (before max_tokens)."""
        acc = self.num_accepted
        if acc is not None:  # each step its accepted draft tokens and the target's own
            return sum(acc) + len(acc)
        first = self.num_sampled_tokens
        return first + (self.num_steps - 1) * self.num_decode_tokens if first else 0

    def steps_for(self, tokens: int) -> int:
        """The steps the request takes part in to emit its first ``tokens`` (>= 1) tokens."""
        acc = self.num_accepted
        if acc is not None:
            for i, a in enumerate(acc):
                tokens -= a + 1
                if tokens <= 0:
                    return i + 1
            return len(acc)
        first = self.num_sampled_tokens
        if tokens <= first:
            return 1
        w = self.num_decode_tokens
        return 1 + (tokens - first + w - 1) // w

    def step_tokens(self, tokens: int) -> list[int]:
        """The tokens it emits at each of its steps to emit its first ``tokens`` (>= 1)."""
        acc = self.num_accepted
        if acc is not None:
            out = []
            for a in acc:
                n = a + 1 if a + 1 < tokens else tokens
                out.append(n)
                tokens -= n
                if tokens <= 0:
                    break
            return out
        first, w = self.num_sampled_tokens, self.num_decode_tokens
        if tokens <= first:
            return [tokens]
        steps = self.steps_for(tokens)
        return [first] + [w] * (steps - 2) + [tokens - first - (steps - 2) * w]

    def emit_times(self, step_times: Sequence[float]) -> Sequence[float]:
        """The time of each token the window may emit for the request: its step's time."""
        acc = self.num_accepted
        if acc is not None:
            return [t for a, t in zip(acc, step_times, strict=False) for _ in range(a + 1)]
        first, w = self.num_sampled_tokens, self.num_decode_tokens
        if first == 1 and w == 1:  # one token a step
            return step_times
        return [step_times[0]] * first + [t for t in step_times[1:self.num_steps]
                                          for _ in range(w)]


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
