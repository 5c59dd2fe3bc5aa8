"""The OpenAI API's request bodies (completions, chat completions) as checked models, and its
error and response shapes."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

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
# Strict: a JSON value of the wrong type is refused, never coerced ("3" or true as max_tokens,
# "0" as logprobs, "yes" as stream, [true, false] as token ids).
STRICT = ConfigDict(extra="forbid", strict=True)


# The fields this engine does not implement, each with the one value it is accepted at: the
# value that asks for nothing (OpenAI's and vLLM's defaults; vLLM's benchmark client always
# sends repetition_penalty 1.0 and logprobs null). Absent or null is accepted too. Any other
# value is refused, naming the field, rather than served as if it were absent.
NEUTRAL: dict[str, Any] = {"n": 1, "best_of": 1, "presence_penalty": 0.0,
                           "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
                           "logprobs": False, "echo": False}


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
    top_k: Int64 | None = None  # vLLM's extension; -1 or 0: whole vocabulary
    ignore_eos: bool = False  # vLLM's extension; benchmark clients set it
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Count = 1
    best_of: Count | None = None
    stop: None | str | list[str] = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    min_p: float | None = None  # vLLM's extension
    logprobs: bool | Int64 | None = None
    user: str | None = None
    seed: Int64 | None = None  # a request's own: its samples depend on it and position alone

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, top_k: int | None) -> int | None:
        """top_k, with vLLM's 0 (its default, which its benchmark client may send) read as
        the whole vocabulary, as -1 is here."""
        if top_k is not None and top_k < -1:
            raise PydanticCustomError("top_k", "must be -1 or 0 (the whole vocabulary) or >= 1, "
                                      "got {top_k}", {"top_k": top_k})
        return -1 if top_k == 0 else top_k

    @field_validator(*NEUTRAL, check_fields=False)  # echo is CompletionRequest's
    @classmethod
    def _neutral_only(cls, value: Any, info: ValidationInfo) -> Any:
        """``value`` if it is its field's neutral value (NEUTRAL) or null, else the one-line
        refusal. A bool and a number are never each other's neutral value: logprobs 0 asks
        for logprobs although 0 == False."""
        neutral = NEUTRAL[info.field_name]
        if value is None or (isinstance(value, bool) == isinstance(neutral, bool)
                             and value == neutral):
            return value
        raise PydanticCustomError(
            "not_implemented", "not implemented: this server accepts only {neutral} (or "
            "absent), got {value}", {"neutral": json.dumps(neutral), "value": json.dumps(value)})

    def sampling(self, served: SamplingParams) -> SamplingParams | None:
        """The request's sampling: each of temperature, top_p and top_k it gives, else the
        server's ``backend.sampling``, and its seed; None where that is the server's setting
        unseeded (the engine then samples its row as it samples an offline run's). Settings
        the engine does not implement were refused when the body was read (NEUTRAL)."""
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
        """The one prompt of the request (no batched prompts)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(f"prompt: {len(p)} prompts in one request; send one",
                               param="prompt")
            p = p[0]
        if not p:
            raise APIError("prompt is empty", param="prompt")
        return p


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant"]
    # a string, or OpenAI's list of content parts (vLLM's benchmark client sends one text part)
    content: str | list[TextPart]
    name: str | None = None  # absent or null only (ChatCompletionRequest.turns)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """Refuses a part of another kind (an image, audio) as not implemented, in one line,
        before the union reports it as a shape error."""
        for i, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise PydanticCustomError(
                    "not_implemented", "part {i}: {kind} parts are not implemented (text parts "
                    "only)", {"i": i, "kind": json.dumps(kind)})
        return content

    @property
    def text(self) -> str:
        """The content as one text: text parts joined by newlines, as vLLM joins them for a
        chat template that takes a string."""
        c = self.content
        return c if isinstance(c, str) else "\n".join(part.text for part in c)


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
        return [(m.role, m.text) for m in self.messages]

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
        for j, name in enumerate(loc[:-1]):  # a union's member's tag follows the field's name
            if name in UNIONS and isinstance(loc[j + 1], str):
                where = ".".join(str(p) for p in loc[:j + 1])
                raise APIError(f"{where}: must be {UNIONS[name]}", param=where) from None
        where = ".".join(str(p) for p in loc)
        raise APIError(f"{where}: {e['msg']}", param=where) from None


# the fields of several types, said in words (pydantic names the first type's failure only)
UNIONS = {"prompt": "a string, a list of token ids, or a list of one of these",
          "logprobs": "a boolean or an integer", "stop": "a string or a list of strings",
          "content": 'a string or a list of text parts ({"type": "text", "text": ...})'}


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
