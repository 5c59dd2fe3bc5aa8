"""What the front end serves (``ServedModel``: the model's name, limits and default sampling)
and its HTTP guards (``HTTPSettings``: the ``server`` section), shared by the app and the
front-end process."""

from __future__ import annotations

from dataclasses import dataclass

from policies.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    max_model_len: int
    vocab_size: int
    sampling: SamplingParams
    tokenizer: str | None  # model.tokenizer (None: the Llama-3 tokenizer)
    # the longest request (prompt + output) the scheduler admits: model.max_model_len, the KV
    # cache less the lookahead, the token budget of a policy that does not chunk prefills
    max_request_tokens: int


@dataclass(frozen=True, slots=True)
class HTTPSettings:
    """The ``server`` section's guards of the front end (docs/serving.md, "Limits")."""

    host: str = "127.0.0.1"  # server.host: a name here is an allowed Host too
    allowed_hosts: tuple[str, ...] = ()  # Host names beyond IP addresses and localhost; "*": any
    api_key: str | None = None  # Authorization: Bearer, on /v1/*
    max_body_bytes: int = 16 * 2**20
    request_timeout_s: float = 30.0  # a request's headers and body, from their first byte
    keep_alive_timeout_s: float = 5.0  # an idle connection between requests
    max_connections: int = 4096
    access_log: bool = True  # a line per request on stdout (id, tokens, TTFT, E2EL, finish)
