"""A request's lifecycle: its prompt, state, computed tokens, output tokens and timestamps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from policies.sampling_params import SamplingParams


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV is recomputed on re-admission
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One generation request as the scheduler sees it.

    ``num_computed_tokens`` counts tokens whose KV is in the cache. The sequence is the prompt
    followed by the output tokens; after a preemption (recompute) the whole sequence is
    prefilled again, so a prefill may cover output tokens too.
    """

    request_id: int
    arrival_time: float
    prompt_len: int
    max_tokens: int
    prompt_token_ids: list[int] | None = None
    eos_token_id: int | None = None  # None: generate exactly max_tokens (benchmark_serving)
    state: RequestState = RequestState.WAITING
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    # filled when the backend samples; () for a simulated request (the simulator samples none)
    output_token_ids: list[int] | tuple[()] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # delivery time of each output token
    first_scheduled_time: float | None = None
    finish_time: float | None = None
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # Overlap scheduling: output tokens that windows still in flight will sample for it (vLLM
    # V1's output placeholders); the scheduler counts them as generated until update() knows.
    num_output_placeholders: int = 0
    # A Mooncake trace's block hashes (equal leading ids: a shared prompt prefix, one id per
    # block of the trace's block size), for prefix caching; None where the workload has none.
    hash_ids: tuple[int, ...] | None = None
    # What the prompt is made of, for prefix caching (policies/prefix_cache.py): (content key,
    # tokens) pieces whose lengths sum to prompt_len, equal keys meaning equal tokens (an int
    # names a workload's content; bytes are a served prompt's token ids themselves); None:
    # nothing is known (no block of it is ever shared).
    prefix_segments: tuple[tuple[int | bytes, int], ...] | None = None
    # A later turn of a conversation: the request id of the turn it follows; the client sends
    # it think_time seconds after that turn's last token (common/client.py).
    previous_turn: int | None = None
    think_time: float = 0.0
    # Prefix caching: the full prompt blocks' keys (computed once), how many of its block
    # table's blocks are in the cache's index, and the prompt tokens found cached when it was
    # first admitted (the hit count).
    block_hashes: list[bytes] | None = None
    num_hashed_blocks: int = 0
    num_cached_prompt_tokens: int = 0
    # The conversation a request is a turn of (prefix_affinity keeps a conversation on one
    # replica); None where the workload does not say.
    conversation_id: int | str | None = None
    # What a workload may say of a request, for the policies that read it: its priority (lower
    # is served first, as vLLM's), its SLO class and that class's TTFT and TPOT targets.
    priority: int = 0
    slo_class: str | None = None
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    # Queueing: since when the request waits (None while admitted), and its longest wait so far
    waiting_since: float | None = None
    max_wait: float = 0.0
    # Its own sampling settings (the HTTP server's per-request temperature, top_p, top_k,
    # seed, penalties, and the logprobs it asks for); None: the backend's sampling, as every
    # offline run's request
    sampling: SamplingParams | None = None
    # The simulator's decode group (policies/decode_group.py): its position when the request
    # joined, None while it is not a member. A member's computed and output tokens, token times
    # and block table are as they were then; it has decoded one token a position since.
    group_offset: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_token_ids is not None:
            self.prompt_len = len(self.prompt_token_ids)
        if self.prompt_len < 1:
            raise ValueError(f"request {self.request_id}: prompt_len must be >= 1, got {self.prompt_len}")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens must be >= 1, got {self.max_tokens}")
        if self.arrival_time < 0:
            raise ValueError(f"request {self.request_id}: arrival_time must be >= 0, got {self.arrival_time}")

    @property
    def seq_len(self) -> int:
        """Tokens known so far: prompt plus generated."""
        return self.prompt_len + self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def in_prefill(self) -> bool:
        """Whether it still prefills (a prompt, or a recompute) rather than decodes: it has
        sampled nothing yet, or tokens other than the newest one lack KV. A window in flight's
        placeholders (overlap) count as sampled tokens. The one definition of a decoding
        request, for the scheduler and the policies alike."""
        outputs = self.num_output_tokens + self.num_output_placeholders
        return outputs == 0 or self.num_computed_tokens < self.prompt_len + outputs - 1

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids at sequence positions [start, end) (needs prompt_token_ids)."""
        if self.prompt_token_ids is None:
            raise ValueError(f"request {self.request_id} carries no prompt token ids")
        p = self.prompt_len
        if end <= p:
            return self.prompt_token_ids[start:end]
        head = self.prompt_token_ids[start:p] if start < p else []
        return head + self.output_token_ids[max(start - p, 0):end - p]
