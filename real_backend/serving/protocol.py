"""The OpenAI API's request bodies (completions, chat completions) as checked models, and its
error and response shapes (choices, and their logprobs in each endpoint's format, as vLLM's)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from policies.sampling_params import MAX_LOGPROBS, MAX_PENALTY, Logprob, SamplingParams

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_N = 128  # OpenAI's limit of choices per request

# OpenAI's floor for a logprob (JSON has no -inf), as vLLM's
MIN_LOGPROB = -9999.0

# The one wording of every refusal of what this server does not support, on either endpoint
# (a field at a value it does not implement, a field it does not know, a chat message's name,
# a content part that is not text, several prompts): "FIELD: " and this.
NOT_SUPPORTED = "not supported: this server takes {accepted} only, got {got}"


def not_supported(where: str, accepted: str, got: Any) -> APIError:
    """The refusal of ``got`` at ``where`` (NOT_SUPPORTED), a 400 naming the field."""
    return APIError(f"{where}: " + NOT_SUPPORTED.format(accepted=accepted, got=_shown(got)),
                    param=where)


def _shown(value: Any) -> str:
    """A value as JSON, cut to 60 characters (a refusal is one short line)."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


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


# The fields this engine does not implement, each with what it is accepted at: the value that
# asks for nothing (OpenAI's and vLLM's defaults), and, for best_of, what vLLM V1 takes (it
# has no best_of). Absent or null is accepted too. Any other value is refused, naming the
# field, rather than served as if it were absent.
NEUTRAL: dict[str, tuple[Any, str]] = {"best_of": (1, "1 or null (as vLLM V1)"),
                                       "min_p": (0.0, "0 or null"),
                                       "suffix": (None, "null")}


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
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1  # choices: n requests sharing the prompt
    best_of: Count | None = None
    stop: None | str | list[str] = None
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY,
                                           allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY,
                                            allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0,  # vLLM's extension
                                             allow_inf_nan=False)
    min_p: float | None = None  # vLLM's extension
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

    @field_validator(*NEUTRAL, check_fields=False)  # suffix is CompletionRequest's
    @classmethod
    def _neutral_only(cls, value: Any, info: ValidationInfo) -> Any:
        """``value`` if it is its field's neutral value (NEUTRAL) or null, else the one-line
        refusal. A bool and a number are never each other's neutral value."""
        neutral, accepted = NEUTRAL[info.field_name]
        if value is None or (neutral is not None
                             and isinstance(value, bool) == isinstance(neutral, bool)
                             and value == neutral):
            return value
        raise PydanticCustomError("not_supported", NOT_SUPPORTED,
                                  {"accepted": accepted, "got": _shown(value)})

    # what each endpoint reads from its own fields (CompletionRequest, ChatCompletionRequest)
    @property
    def num_logprobs(self) -> int | None:
        """The top logprobs asked for with each sampled token (0: its own alone; None: no
        logprobs)."""
        return None

    @property
    def echo_prompt(self) -> bool:
        return False

    @property
    def prompt_only(self) -> bool:
        return False

    def sampling(self, served: SamplingParams, index: int = 0) -> SamplingParams | None:
        """Choice ``index``'s sampling: each of temperature, top_p and top_k the request
        gives, else the server's ``backend.sampling``; its seed (plus ``index``, as vLLM
        seeds the n sequences of one request), penalties and logprobs (and, with echo, its
        prompt's); None where that is the server's setting unseeded (the engine then samples
        its row as it samples an offline run's). Settings the engine does not implement were
        refused when the body was read (NEUTRAL)."""
        self.stop_strings()
        given = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k",
                                                        "presence_penalty", "frequency_penalty",
                                                        "repetition_penalty")
                 if getattr(self, name) is not None}
        logprobs = self.num_logprobs
        params = SamplingParams(**{"temperature": served.temperature, "top_k": served.top_k,
                                   "top_p": served.top_p, **given},
                                seed=None if self.seed is None else self.seed + index,
                                logprobs=logprobs,
                                prompt_logprobs=logprobs if self.echo_prompt else None)
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


def _logprobs_count(value: int | None, field: str) -> int | None:
    """A number of top logprobs, 0 to vLLM's max_logprobs, or the one-line refusal."""
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise PydanticCustomError(field, "must be 0 to {max} (vLLM's max_logprobs), got {value}",
                                  {"max": MAX_LOGPROBS, "value": value})
    return value


class CompletionRequest(_Common):
    prompt: str | list[Int64] | list[str] | list[list[Int64]]
    # 0 with echo: the prompt alone, with its logprobs (scoring a text), as vLLM serves it
    max_tokens: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    echo: bool = False  # the prompt before the reply (and, with logprobs, its logprobs)
    suffix: str | None = None
    # the top logprobs with each token (false or null: none), as vLLM takes it
    logprobs: bool | Int64 | None = None

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: bool | int | None) -> int | None:
        if value is True:
            raise PydanticCustomError("logprobs", "must be a number of top logprobs, 0 to "
                                      "{max}, or false or null, got true", {"max": MAX_LOGPROBS})
        return None if value is False else _logprobs_count(value, "logprobs")

    @model_validator(mode="after")
    def _zero_needs_echo(self) -> CompletionRequest:
        """As vLLM: no reply at all is asked for only with echo (the prompt alone)."""
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError("max_tokens", "max_tokens: must be at least 1, or 0 with "
                                      "echo: true (the prompt alone), got 0")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_prompt(self) -> bool:
        return self.echo

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt alone is returned; the engine still samples one
        token, which is not shown but is counted in the usage (vLLM's)."""
        return self.echo and self.max_tokens == 0

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request (no batched prompts)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise not_supported("prompt", "one prompt per request", f"{len(p)} prompts")
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
                raise PydanticCustomError("not_supported", NOT_SUPPORTED, {
                    "accepted": "text parts", "got": f"a {json.dumps(kind)} part (part {i})"})
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
    logprobs: bool | None = None  # each token's logprob
    top_logprobs: Int64 | None = None  # and the most likely tokens' (needs logprobs)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None) -> int | None:
        return _logprobs_count(value, "top_logprobs")

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        """As vLLM: top logprobs are asked for with ``logprobs: true``."""
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("top_logprobs", "top_logprobs: needs logprobs: true "
                                      "(got top_logprobs {n} without it)",
                                      {"n": self.top_logprobs})
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def turns(self) -> list[tuple[str, str]]:
        """The messages as the chat template's (role, content) turns. Llama-3's template has
        no place for a participant's name, so a message with one is refused, not served as
        if it had none."""
        for i, m in enumerate(self.messages):
            if m.name is not None:
                raise not_supported(f"messages.{i}.name",
                                    "null (the Llama-3 chat template has no place for a name)",
                                    m.name)
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
            if e["type"] in MODEL_CHECKS:  # a model's own check across its fields
                raise APIError(e["msg"], param=e["type"]) from None
            raise APIError("the request body must be a JSON object") from None
        if e["type"] == "extra_forbidden":
            raise not_supported(".".join(str(p) for p in loc), "the fields docs/serving.md "
                                "lists", e["input"]) from None
        for j, name in enumerate(loc[:-1]):  # a union's member's tag follows the field's name
            if name in UNIONS and isinstance(loc[j + 1], str):
                where = ".".join(str(p) for p in loc[:j + 1])
                raise APIError(f"{where}: must be {UNIONS[name]}", param=where) from None
        where = ".".join(str(p) for p in loc)
        raise APIError(f"{where}: {e['msg']}", param=where) from None


# the checks of a model across its fields (their errors have no location), each named by the
# field it refuses
MODEL_CHECKS = ("top_logprobs", "max_tokens")

# the fields of several types, said in words (pydantic names the first type's failure only)
UNIONS = {"prompt": "a string, a list of token ids, or a list of one of these",
          "logprobs": "a number of top logprobs, or false or null",
          "stop": "a string or a list of strings",
          "content": 'a string or a list of text parts ({"type": "text", "text": ...})'}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(chat: bool, chunk: bool, index: int, text: str, finish: str | None,
           logprobs: dict[str, Any] | None, first: bool = False) -> dict[str, Any]:
    """One choice of a response (``chunk=False``) or of an SSE chunk, of either endpoint;
    ``first``: a chat stream's first chunk of this choice, which names the role."""
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if chunk:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": finish}


def completion_body(rid: str, model: str, chat: bool, choices: list[dict[str, Any]],
                    use: dict[str, int] | None, *, chunk: bool) -> dict[str, Any]:
    """One response (``chunk=False``) or one SSE chunk of either endpoint."""
    if chat:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model,
            "choices": choices, "usage": use}


@dataclasses.dataclass(frozen=True, slots=True)
class TokenText:
    """How a token is shown in logprobs: its text (its bytes decoded, a partial UTF-8
    character as U+FFFD) and its bytes."""

    text: Callable[[int], str]
    bytes: Callable[[int], bytes]


def _ranked(token: int, entry: Logprob) -> list[tuple[int, float]]:
    """A token's logprobs as vLLM orders them: the token itself first, then the most likely
    tokens (one that is the token itself keeps the first place), each floored at -9999."""
    own, ids, values = entry
    ranked = {token: own}
    for t, v in zip(ids, values, strict=True):
        ranked[t] = v
    return [(t, max(v, MIN_LOGPROB)) for t, v in ranked.items()]


def completion_logprobs(tokens: Sequence[tuple[int, Logprob | None]], num: int, show: TokenText,
                        offset: int = 0) -> dict[str, list[Any]]:
    """The completions API's logprobs of ``tokens`` (each with its logprobs, or None: an echoed
    prompt's first token): each token's text, its logprob, up to ``num`` + 1 tokens' logprobs
    keyed by their text (the token's own and the ``num`` most likely; of tokens that share a
    text, the likelier's: vLLM keeps the last's), and where its text starts, counting from
    ``offset`` by the tokens' texts, as vLLM counts."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}
    for token, entry in tokens:
        text = show.text(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(max(entry[0], MIN_LOGPROB))
        top: dict[str, float] = {}
        for t, v in _ranked(token, entry)[:num + 1]:  # tokens of one text: the likelier's
            top.setdefault(show.text(t), v)
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(tokens: Sequence[tuple[int, Logprob | None]], num: int,
                  show: TokenText) -> dict[str, list[dict[str, Any]]]:
    """The chat API's logprobs of ``tokens``: each token's text, logprob and bytes, and
    ``num`` tokens' (the first ``num`` of the token's own and the most likely, as vLLM
    lists them); a token without logprobs has -9999 and none (as vLLM's)."""
    def item(t: int, v: float) -> dict[str, Any]:
        return {"token": show.text(t), "logprob": v, "bytes": list(show.bytes(t))}

    return {"content": [
        {**item(token, MIN_LOGPROB), "top_logprobs": []} if entry is None else
        {**item(token, max(entry[0], MIN_LOGPROB)),
         "top_logprobs": [item(t, v) for t, v in _ranked(token, entry)[:num]]}
        for token, entry in tokens]}
