"""The OpenAI API's request bodies (completions, chat completions) as checked models, and its
error and response shapes."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from policies.sampling_params import SamplingParams

MAX_STOP_STRINGS = 4  # OpenAI's limit


class APIError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.kind, self.param = message, status, kind, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}


# Integers in 64 bits: a 4,000-digit one is refused here, not at its first use (str() of it
# raises). A count the API allows only at 1 (n, best_of) is an int, not a Literal[1], which
# would take true and 1.0 for 1.
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]
Count = Annotated[int, Field(ge=1, lt=2**63)]
One = Annotated[int, Field(ge=1, le=1)]
# Strict: a JSON value of the wrong type is refused, never coerced ("3" or true as max_tokens,
# "0" as logprobs, "yes" as stream, [true, false] as token ids).
STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (guidellm asks for it)


class _Common(BaseModel):
    """The fields both endpoints share. Unknown fields are refused rather than ignored, and
    fields this engine does not implement are accepted only at their no-op values, so a
    request is never silently served as something else."""

    model_config = STRICT
    model: str | None = None
    max_tokens: Count | None = None
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: Int64 | None = None  # vLLM's extension; -1: whole vocabulary
    ignore_eos: bool = False  # vLLM's extension; benchmark clients set it
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: One = 1
    best_of: One | None = None
    stop: None | str | list[str] = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | Int64 | None = None
    user: str | None = None
    seed: Int64 | None = None  # a request's own: its samples depend on it and position alone

    def sampling(self, served: SamplingParams) -> SamplingParams | None:
        """The request's sampling: each of temperature, top_p and top_k it gives, else the
        server's ``backend.sampling``, and its seed; None where that is the server's setting
        unseeded (the engine then samples its row as it samples an offline run's). Settings
        the engine does not implement are refused, naming the field."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(f"{name}: not supported (0 or absent only)", param=name)
        # `is`, not `in (None, False)`: 0 == False, and logprobs=0 asks for logprobs
        if not (self.logprobs is None or self.logprobs is False):
            raise APIError("logprobs: not supported", param="logprobs")
        if self.top_k is not None and (self.top_k == 0 or self.top_k < -1):
            raise APIError(f"top_k must be -1 (the whole vocabulary) or >= 1, got {self.top_k}",
                           param="top_k")
        self.stop_strings()
        given = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k")
                 if getattr(self, name) is not None}
        params = SamplingParams(**{"temperature": served.temperature, "top_k": served.top_k,
                                   "top_p": served.top_p, **given}, seed=self.seed)
        return None if params == served else params

    def stop_strings(self) -> list[str]:
        """The stop sequences (a string or a list of up to 4), checked: none may be empty."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(f"stop: at most {MAX_STOP_STRINGS} stop sequences, got {len(stop)}",
                           param="stop")
        if any(not s for s in stop):
            raise APIError("stop: a stop sequence is empty", param="stop")
        return stop

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common):
    prompt: str | list[Int64] | list[str] | list[list[Int64]]
    echo: bool = False
    suffix: None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request (n=1, no batched prompts, no echo)."""
        if self.echo:
            raise APIError("echo: not supported (false or absent only)", param="echo")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(f"prompt: {len(p)} prompts in one request; send one",
                               param="prompt")
            p = p[0]
        if not p:
            raise APIError("prompt is empty", param="prompt")
        return p


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None  # absent or null only (ChatCompletionRequest.turns)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None

    def turns(self) -> list[tuple[str, str]]:
        """The messages as the chat template's (role, content) turns. Llama-3's template has
        no place for a participant's name, so a message with one is refused, not served as
        if it had none."""
        for i, m in enumerate(self.messages):
            if m.name is not None:
                raise APIError(f"messages.{i}.name: not supported: the Llama-3 chat template "
                               "has no place for a name (absent or null only)",
                               param=f"messages.{i}.name")
        return [(m.role, m.content) for m in self.messages]

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def parse(model: type[BaseModel], body: bytes) -> Any:
    """The JSON ``body`` as ``model``, or a 400 naming the first bad field.

    pydantic's own JSON parser reads it: it refuses what Python's json module lets through
    to fail later, as a 500 (lone surrogates, which no tokenizer encodes; nesting beyond 200
    levels, which json.loads meets with a RecursionError; integers of thousands of digits)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        e = err.errors()[0]
        if e["type"] == "json_invalid":
            raise APIError(f"the request body is not JSON: {e['msg']}") from None
        loc = e["loc"]
        if not loc:
            raise APIError("the request body must be a JSON object") from None
        if loc[0] in UNIONS and len(loc) > 1 and isinstance(loc[1], str):  # a member's tag
            raise APIError(f"{loc[0]}: must be {UNIONS[loc[0]]}", param=loc[0]) from None
        where = ".".join(str(p) for p in loc)
        raise APIError(f"{where}: {e['msg']}", param=where) from None


# the fields of several types, said in words (pydantic names the first type's failure only)
UNIONS = {"prompt": "a string, a list of token ids, or a list of one of these",
          "logprobs": "a boolean or an integer", "stop": "a string or a list of strings"}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, chat: bool, text: str, finish: str | None,
                    use: dict[str, int] | None, *, chunk: bool, first: bool = False
                    ) -> dict[str, Any]:
    """One response (``chunk=False``) or one SSE chunk of either endpoint."""
    if chat:
        if chunk:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish}
        kind = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model,
            "choices": [choice], "usage": use}


def usage_chunk(rid: str, model: str, chat: bool, use: dict[str, int]) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model,
            "choices": [], "usage": use}
