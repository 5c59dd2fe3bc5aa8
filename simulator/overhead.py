"""The CPU-overhead model: the engine thread's time per scheduler invocation and per step.

Per scheduler invocation (once per window): schedule + input preparation + H2D copy,

    t_schedule = schedule_base_us + schedule_per_seq_us * num_seqs
               + schedule_per_token_us * num_tokens
               + schedule_per_kv_token_us * kv_tokens
             [ + schedule_multi_step_us
                 + schedule_multi_step_per_seq_us * num_seqs * (num_steps - 1) ]
             [ + schedule_overlap_us ]
             [ + schedule_mixed_us + schedule_mixed_per_seq_us * num_seqs ]

(num_tokens: the query tokens of the window's first step; kv_tokens: the KV-cache tokens it
attends over, whose block tables and slot mappings the engine builds; the bracket: windows of
more than one step, whose preparation schedlab's engine measures dearer and whose update()
appends num_steps tokens to every sequence; the second bracket: windows formed with overlap
scheduling, whose inputs also gather each sequence's newest token on the device; the third:
windows whose first step mixes prefill (or prefill-chunk) sequences with decodes, whose
preparation builds both kinds of attention metadata and runs the piecewise-graph path). Per step:
output processing
(device-to-host copy, pythonization, detokenization, stop checks, building outputs),

    t_output = output_base_us + output_per_seq_us * num_seqs  [+ api_per_token_us * delivered]

The API server (HTTP/SSE streaming) costs ``api_per_token_us`` per delivered token. When
``api_server_on_critical_path`` it shares the engine thread (vLLM <= 0.5: one asyncio process)
and the bracketed term is engine CPU time; otherwise it is a separate serial process (vLLM 0.6's
multiprocessing front end) that delays delivery without stalling the engine.
``async_output_processing``: a step's output processing overlaps the next GPU step. With
overlap scheduling (``policy.overlap``) a window's output processing always waits for the next
window's launch, so that setting and ``defer_last_output`` do not apply (simulator/engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from policies.base import check_settings

_US = 1e-6
_COSTS = ("schedule_base_us", "schedule_per_seq_us", "schedule_per_token_us",
          "schedule_per_kv_token_us", "output_base_us",
          "output_per_seq_us", "api_per_token_us", "schedule_multi_step_us",
          "schedule_multi_step_per_seq_us", "schedule_overlap_us", "schedule_mixed_us",
          "schedule_mixed_per_seq_us")


@dataclass(frozen=True, slots=True)
class OverheadSpec:
    """CPU costs of one engine generation, in microseconds; ``none`` is all zeros."""

    name: str = "none"
    schedule_base_us: float = 0.0
    schedule_per_seq_us: float = 0.0
    schedule_per_token_us: float = 0.0
    output_base_us: float = 0.0
    output_per_seq_us: float = 0.0
    api_per_token_us: float = 0.0
    async_output_processing: bool = False
    # async: the last step's outputs wait until the next window is scheduled and launched
    # (vLLM 0.6); false: they are processed as the window ends (schedlab's engine drains them)
    defer_last_output: bool = True
    api_server_on_critical_path: bool = True
    schedule_per_kv_token_us: float = 0.0  # added last: positional construction keeps its meaning
    schedule_multi_step_us: float = 0.0  # more per window of k > 1 steps
    schedule_multi_step_per_seq_us: float = 0.0  # ... and per sequence and step beyond the first
    schedule_overlap_us: float = 0.0  # more per window formed with overlap scheduling
    schedule_mixed_us: float = 0.0  # more per window mixing prefill and decode sequences
    schedule_mixed_per_seq_us: float = 0.0  # ... and per sequence of such a window

    def __post_init__(self) -> None:
        for name in _COSTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ValueError(f"overhead.{name} must be a number, got {value!r}")
            if value < 0:
                raise ValueError(f"overhead.{name} must be >= 0, got {value}")
        for name in ("async_output_processing", "defer_last_output",
                     "api_server_on_critical_path"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"overhead.{name} must be true or false, "
                                 f"got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OverheadSpec:
        check_settings("overhead", d, (f.name for f in fields(cls)))
        return cls(**d)


def scale_overhead(spec: OverheadSpec, factor: float) -> OverheadSpec:
    """Every CPU cost multiplied by ``factor`` (the what-if knob of a slower or faster CPU)."""
    if factor < 0:
        raise ValueError(f"overhead scale factor must be >= 0, got {factor}")
    return replace(spec, name=f"{spec.name}x{factor:g}",
                   **{name: getattr(spec, name) * factor for name in _COSTS})


def schedule_time(spec: OverheadSpec, num_seqs: int, num_tokens: int,
                  kv_tokens: int = 0, num_steps: int = 1, overlap: bool = False,
                  num_prefill_seqs: int = 0) -> float:
    """Seconds of one scheduler invocation with its input preparation (and launch);
    ``num_prefill_seqs``: the first step's sequences that prefill (a prompt or a chunk)."""
    t = (spec.schedule_base_us + spec.schedule_per_seq_us * num_seqs
         + spec.schedule_per_token_us * num_tokens + spec.schedule_per_kv_token_us * kv_tokens)
    if num_steps > 1:
        t += (spec.schedule_multi_step_us
              + spec.schedule_multi_step_per_seq_us * num_seqs * (num_steps - 1))
    if overlap:
        t += spec.schedule_overlap_us
    if 0 < num_prefill_seqs < num_seqs:
        t += spec.schedule_mixed_us + spec.schedule_mixed_per_seq_us * num_seqs
    return t * _US


def output_time(spec: OverheadSpec, num_seqs: int, num_delivered: int) -> float:
    """Engine-thread seconds of one step's output processing (the API server's share too when
    it runs on the engine thread). A step nobody takes part in costs nothing."""
    if num_seqs == 0:
        return 0.0
    t = spec.output_base_us + spec.output_per_seq_us * num_seqs
    if spec.api_server_on_critical_path:
        t += spec.api_per_token_us * num_delivered
    return t * _US


def api_time(spec: OverheadSpec, num_delivered: int) -> float:
    """Seconds the separate API-server process spends streaming ``num_delivered`` tokens."""
    if spec.api_server_on_critical_path:
        return 0.0
    return spec.api_per_token_us * num_delivered * _US
