"""A workload's request before any backend touches it (RequestSpec), and the Request made of it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from experiments.workload.classes import SLOClass
from policies.request import Request


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload, before any backend touches it."""

    arrival_time: float
    prompt_len: int
    output_len: int
    prompt_token_ids: tuple[int, ...] | None = None
    # A Mooncake trace's block hashes: equal ids at the start of two prompts mark a shared
    # prefix (one id per block of the trace's block size), passed on to the Request.
    hash_ids: tuple[int, ...] | None = None
    slo_class: SLOClass | None = None  # its priority and targets (workload.classes)
    # What the prompt is made of, for prefix caching: (content key, tokens) pieces whose
    # lengths sum to prompt_len; equal keys at equal places mean equal tokens (a shared system
    # prompt, a conversation's earlier turns, a trace's block hashes). None: unique content.
    segments: tuple[tuple[int, int], ...] | None = None
    conversation_id: int | None = None  # the conversation it is a turn of (multi-turn)
    # A later turn of a conversation: the index (in the workload's list) of the turn it
    # follows; it is sent think_time seconds after that turn's last token, and not before
    # arrival_time.
    previous_turn: int | None = None
    think_time: float = 0.0

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(
                f"RequestSpec needs prompt_len >= 1 and output_len >= 1, "
                f"got {self.prompt_len} and {self.output_len}")
        if not self.arrival_time >= 0:  # also refuses NaN
            raise ValueError(f"RequestSpec.arrival_time must be >= 0, got {self.arrival_time}")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            raise ValueError(
                f"RequestSpec has {len(self.prompt_token_ids)} prompt token ids "
                f"but prompt_len {self.prompt_len}")
        if self.segments is not None and sum(n for _, n in self.segments) != self.prompt_len:
            raise ValueError(f"RequestSpec's segments cover {sum(n for _, n in self.segments)} "
                             f"tokens but prompt_len is {self.prompt_len}")
        if not self.think_time >= 0:
            raise ValueError(f"RequestSpec.think_time must be >= 0, got {self.think_time}")
        if self.hash_ids is not None and not isinstance(self.hash_ids, tuple):
            raise ValueError(f"RequestSpec.hash_ids must be a tuple or None, "
                             f"got {type(self.hash_ids).__name__}")


def to_request(spec: RequestSpec, request_id: int, with_token_ids: bool) -> Request:
    """A fresh Request asking for exactly ``output_len`` tokens, as benchmark_serving does;
    ``request_id`` is the spec's index in its workload (a later turn names its previous turn's).
    Without token ids (the simulator's requests) no output id is ever sampled: its
    output_token_ids is an empty tuple, not a list per request (a long run's memory)."""
    token_ids: list[int] | None = None
    if with_token_ids:
        if spec.prompt_token_ids is None:
            raise ValueError(
                f"request {request_id} carries no prompt token ids; "
                f"build the workload with vocab_size set")
        token_ids = list(spec.prompt_token_ids)
    req = Request(request_id=request_id, arrival_time=spec.arrival_time,
                  prompt_len=spec.prompt_len, max_tokens=spec.output_len,
                  prompt_token_ids=token_ids, hash_ids=spec.hash_ids,
                  output_token_ids=[] if with_token_ids else ())
    if spec.segments is not None:
        req.prefix_segments = spec.segments
    if spec.conversation_id is not None:
        req.conversation_id = spec.conversation_id
    if spec.previous_turn is not None:
        req.previous_turn = spec.previous_turn
        req.think_time = spec.think_time
    c = spec.slo_class
    if c is not None:
        req.priority, req.slo_class = c.priority, c.name
        req.ttft_slo_ms, req.tpot_slo_ms = c.ttft_ms, c.tpot_ms
    return req


def plain_requests(arrivals: Sequence[float], prompt_lens: Sequence[int],
                   output_lens: Sequence[int]) -> list[Request]:
    """``to_request(RequestSpec(a, p, o), i, with_token_ids=False)`` of each i, with no spec
    made between (a million frozen specs cost more than the requests): for a workload of
    lengths and send times alone, checked as RequestSpec checks them."""
    n = len(arrivals)
    if len(prompt_lens) != n or len(output_lens) != n:
        raise ValueError(f"{n} arrival times for {len(prompt_lens)} prompt lengths and "
                         f"{len(output_lens)} output lengths")
    return list(map(partial(Request, output_token_ids=()), range(n), arrivals, prompt_lens,
                    output_lens))
