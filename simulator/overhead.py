"""The CPU-overhead model: the engine thread's time per scheduler invocation (schedule, input
preparation, H2D copy) and per step (output processing, the API server's streaming, the hand-off
to a front end of its own), each a linear model of the window's shape whose terms and where
they land docs/simulator.md ("The CPU-overhead model") writes out."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from policies.base import check_settings

_US = 1e-6
_COSTS = ("schedule_base_us", "schedule_per_seq_us", "schedule_per_token_us",
          "schedule_per_kv_token_us", "output_base_us",
          "output_per_seq_us", "api_per_token_us", "schedule_multi_step_us",
          "schedule_multi_step_per_seq_us", "schedule_overlap_us", "schedule_mixed_us",
          "schedule_mixed_per_seq_us", "schedule_prefill_per_layer_us",
          "output_pythonize_per_seq_us", "output_per_token_us",
          "api_per_chunk_us", "api_per_request_us", "handoff_per_window_us",
          "handoff_per_chunk_us")


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
    schedule_prefill_per_layer_us: float = 0.0  # per model layer, in windows with prefill tokens
    # the output path's terms (module docstring); false: one processing call per step
    output_per_window: bool = False
    output_pythonize_per_seq_us: float = 0.0  # per sequence and step: sampled ids to Python
    output_per_token_us: float = 0.0  # per delivered token: append, detokenize, stop checks
    api_per_chunk_us: float = 0.0  # per SSE chunk: one response object, JSON, one HTTP write
    api_per_request_us: float = 0.0  # per request received: HTTP parsing, tokenization, submit
    # the API server streams one chunk per request per window (schedlab's server), not one per
    # token; output_per_window implies it
    api_chunk_per_window: bool = False
    # the engine thread's hand-over of the tokens to stream to a front end in another process
    handoff_per_window_us: float = 0.0  # per message: a window's (a step's, streamed per step)
    handoff_per_chunk_us: float = 0.0  # ... and per chunk in it

    def __post_init__(self) -> None:
        for name in _COSTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ValueError(f"overhead.{name} must be a number, got {value!r}")
            if value < 0:
                raise ValueError(f"overhead.{name} must be >= 0, got {value}")
        for name in ("async_output_processing", "defer_last_output",
                     "api_server_on_critical_path", "output_per_window",
                     "api_chunk_per_window"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"overhead.{name} must be true or false, "
                                 f"got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OverheadSpec:
        d = dict(d)
        host = d.pop("host", None)  # a host profile (conf/host/NAME.yaml, ``host=NAME``)
        check_settings("overhead", d, (f.name for f in fields(cls)))
        spec = cls(**d)
        return spec if host is None else on_host(spec, host)


def on_host(spec: OverheadSpec, host: Any) -> OverheadSpec:
    """The profile's CPU costs on a host ``cpu_factor`` times slower than the one it was fitted
    on (a host profile, measured by benchmarks/scheduler_speed.py); its name says which."""
    name = host.get("name") if isinstance(host, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"overhead.host must be a host profile (conf/host/NAME.yaml) with a "
                         f"name, got {host!r}")
    f = host.get("cpu_factor")
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < float("inf"):
        raise ValueError(f"overhead.host.cpu_factor must be a number > 0, got {f!r} "
                         f"(conf/host/{name}.yaml)")
    return replace(scale_overhead(spec, f), name=f"{spec.name}@{name}")


def scale_overhead(spec: OverheadSpec, factor: float) -> OverheadSpec:
    """Every CPU cost multiplied by ``factor`` (the what-if knob of a slower or faster CPU)."""
    if factor < 0:
        raise ValueError(f"overhead scale factor must be >= 0, got {factor}")
    return replace(spec, name=f"{spec.name}x{factor:g}",
                   **{name: getattr(spec, name) * factor for name in _COSTS})


def schedule_time(spec: OverheadSpec, num_seqs: int, num_tokens: int,
                  kv_tokens: int = 0, num_steps: int = 1, overlap: bool = False,
                  num_prefill_seqs: int = 0, num_layers: int = 0) -> float:
    """Seconds of one scheduler invocation with its input preparation (and launch);
    ``num_prefill_seqs``: the first step's sequences that prefill (a prompt or a chunk);
    ``num_layers``: the model's decoder layers."""
    t = (spec.schedule_base_us + spec.schedule_per_seq_us * num_seqs
         + spec.schedule_per_token_us * num_tokens + spec.schedule_per_kv_token_us * kv_tokens)
    if num_steps > 1:
        t += (spec.schedule_multi_step_us
              + spec.schedule_multi_step_per_seq_us * num_seqs * (num_steps - 1))
    if overlap:
        t += spec.schedule_overlap_us
    if 0 < num_prefill_seqs < num_seqs:
        t += spec.schedule_mixed_us + spec.schedule_mixed_per_seq_us * num_seqs
    if num_prefill_seqs > 0:
        t += spec.schedule_prefill_per_layer_us * num_layers
    return t * _US


def output_time(spec: OverheadSpec, num_seqs: int, num_delivered: int) -> float:
    """Engine-thread seconds of one single-step window's output processing (the API server's
    share too when it runs on the engine thread): one call, one chunk per delivered token.
    A step nobody takes part in costs nothing."""
    return window_output_times(spec, [num_seqs], [num_delivered], [num_delivered])[0]


def sse_chunks(spec: OverheadSpec, streaming: list[int], stream_per_step: bool) -> list[int]:
    """SSE chunks each step of a window hands the API server, from the sequences that deliver
    tokens at each step (``streaming`` never grows along a window: a sequence that stops stays
    stopped; one that emits several tokens a step sends them in one chunk)."""
    if (spec.output_per_window or spec.api_chunk_per_window) and not stream_per_step:
        # one per request, at the window's end
        return [0] * (len(streaming) - 1) + [streaming[0]]
    return list(streaming)  # one chunk per request and step


def window_output_times(spec: OverheadSpec, seqs: list[int], delivered: list[int],
                        chunks: list[int]) -> list[float]:
    """Engine-thread seconds of each step's output processing in one window, per step:
    ``seqs`` taking part, tokens ``delivered`` to the client, SSE ``chunks`` (sse_chunks).
    Per window (``output_per_window``) the processing call is charged to the last step."""
    api = spec.api_server_on_critical_path
    per_window = spec.output_per_window
    base, per_seq = spec.output_base_us, spec.output_per_seq_us
    pythonize, per_token = spec.output_pythonize_per_seq_us, spec.output_per_token_us
    # the call's own terms, in microseconds (summed before scaling: integer coefficients
    # give the same seconds whichever way the call is split); a step like the one before it
    # (a decode window's steps mostly are) costs what it did
    call_us = [0.0] * len(seqs)
    last = t = None
    for j, step in enumerate(zip(seqs, delivered, chunks, strict=True)):
        n, d, c = step
        if n == 0:  # a step nobody takes part in runs nothing
            continue
        if step != last:
            t = 0.0 if per_window else base + per_seq * n
            t += pythonize * n + per_token * d
            if api:
                t += spec.api_per_chunk_us * c + spec.api_per_token_us * d
            elif c:  # the front end in its own process: one message to it
                t += spec.handoff_per_window_us + spec.handoff_per_chunk_us * c
            last = step
        call_us[j] = t
    if per_window and seqs[0]:  # the window's sequences all take part in step 1
        call_us[-1] += base + per_seq * seqs[0]
    return [t * _US for t in call_us]


def request_time(spec: OverheadSpec) -> float:
    """Seconds the front end spends on one request it receives, before the scheduler sees it."""
    return spec.api_per_request_us * _US


def api_time(spec: OverheadSpec, num_delivered: int, num_chunks: int) -> float:
    """Seconds the separate API-server process spends streaming ``num_delivered`` tokens in
    ``num_chunks`` SSE chunks."""
    if spec.api_server_on_critical_path:
        return 0.0
    return (spec.api_per_chunk_us * num_chunks + spec.api_per_token_us * num_delivered) * _US
