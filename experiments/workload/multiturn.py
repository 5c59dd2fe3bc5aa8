"""ShareGPT conversations as multi-turn requests, as vLLM's benchmarks/multi_turn sends them:
every human message is a request whose prompt is the conversation so far."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from experiments.workload.arrivals import CLOCK_RULE, MAX_CLOCK
from experiments.workload.jsonstream import read_record_at
from experiments.workload.settings import get_float, get_int
from experiments.workload.sharegpt import (
    _bos_id,
    _count_tokens,
    _encode,
    cache_dir,
    fixed_output_len,
    sharegpt_source,
)
from experiments.workload.synthetic import content_key

# The settings kind=sharegpt_multiturn reads besides the common ones and the arrival process's.
MULTITURN_KEYS = frozenset({"num_conversations", "dataset_path", "tokenizer", "max_turns",
                            "max_prompt_len", "max_total_len", "fixed_output_len",
                            "think_time"})

# The roles of ShareGPT's "from" field, as vLLM's convert_sharegpt_to_openai.py maps them.
HUMAN_ROLES = frozenset({"human", "user"})
GPT_ROLES = frozenset({"gpt", "chatgpt", "bing", "bard"})

BOS_KEY = content_key("bos")


def message_key(record: int, message: int) -> int:
    """The content key of message ``message`` of the file's ``record``-th record."""
    return content_key("sharegpt message", record, message)


@dataclass(frozen=True, slots=True)
class Conversation:
    """One sampled conversation. Its prompt pieces are BOS (where the tokenizer adds one) and
    its messages in order, human, gpt, human, ..., each a segment (content key, tokens; a
    message of no tokens has none); turn t's prompt is the first ``ends[t]`` of them, so every
    turn's prompt starts with the whole prompt of the turn before it."""

    record: int  # its index in the file (a row of sharegpt_token_counts' table)
    segments: tuple[tuple[int, int], ...]
    messages: tuple[int, ...]  # per segment: its message's index in the record, -1 for BOS
    ends: tuple[int, ...]  # per turn
    prompt_lens: tuple[int, ...]  # per turn
    output_lens: tuple[int, ...]  # per turn: its gpt reply's tokens, or fixed_output_len


@dataclass(frozen=True, slots=True)
class ConversationSample:
    """The conversations a kind=sharegpt_multiturn section samples, and where their text is.
    Its requests (the properties, and prompt_token_ids) are the turns, conversation by
    conversation, each conversation's in order."""

    path: Path
    enc: Any
    counts: np.ndarray  # sharegpt_token_counts' table
    conversations: list[Conversation]

    @property
    def prompt_lens(self) -> list[int]:
        return [n for c in self.conversations for n in c.prompt_lens]

    @property
    def output_lens(self) -> list[int]:
        return [n for c in self.conversations for n in c.output_lens]

    @property
    def segments(self) -> list[tuple[tuple[int, int], ...]]:
        # slices of one tuple: a later turn's pairs are its earlier turns', not copies
        return [c.segments[:end] for c in self.conversations for end in c.ends]

    @property
    def conversation_ids(self) -> list[int]:
        return [i for i, c in enumerate(self.conversations) for _ in c.ends]

    @property
    def previous_turns(self) -> list[int | None]:
        """Per request: the index of the turn it follows, None for a first turn."""
        out: list[int | None] = []
        for c in self.conversations:
            out.extend([None] + list(range(len(out), len(out) + len(c.ends) - 1)))
        return out

    def arrival_times(self, starts: list[float]) -> list[float]:
        """Per request: its conversation's start (a later turn waits for the one before it)."""
        return [t for c, t in zip(self.conversations, starts, strict=True) for _ in c.ends]

    def check_waits(self, starts: list[float], think_time: float) -> None:
        """Refuse a think time that sends a conversation's last turn past MAX_CLOCK: it goes
        no sooner than its conversation's start and a think time after each turn before it."""
        if not think_time:
            return
        for i, (c, start) in enumerate(zip(self.conversations, starts, strict=True)):
            last = start + (len(c.ends) - 1) * think_time
            if not last <= MAX_CLOCK:
                raise ValueError(
                    f"workload.think_time = {think_time!r} sends the last of conversation {i}'s "
                    f"{len(c.ends)} turns {last:.4g} s or more into the run: {CLOCK_RULE}")

    def prompt_token_ids(self, vocab_size: int) -> list[tuple[int, ...]]:
        """Per request: BOS and its messages' ids, as the tokenizer gave their lengths, folded
        modulo ``vocab_size``; a later turn's ids are its earlier turns' int objects."""
        bos_id = _bos_id(self.enc)
        out = []
        for c in self.conversations:
            offset = int(self.counts[c.record, 2])
            where = f"{self.path}: record {c.record} at byte {offset}"
            texts = dict(_messages(read_record_at(self.path, offset), where))
            pieces = []
            for (_, n), j in zip(c.segments, c.messages, strict=True):
                text = "" if j < 0 else texts.get(j)
                if text is None:
                    raise ValueError(f"{where}: record changed since its token counts were "
                                     f"cached; delete {cache_dir()} and retry")
                ids = [bos_id] if j < 0 else _encode(self.enc, text)
                if len(ids) != n:
                    raise ValueError(f"{self.path}: record {c.record} message {j} tokenizes to "
                                     f"{len(ids)} tokens, its count said {n}; delete "
                                     f"{cache_dir()} and retry")
                pieces.append(tuple(x % vocab_size for x in ids))
            out.extend(tuple(chain.from_iterable(pieces[:end])) for end in c.ends)
        return out


def _messages(record: dict[str, Any], where: str) -> list[tuple[int, str]]:
    """(index, text) of the messages a conversation's turns are made of: from its first human
    message on (a continued part of a split conversation opens with a gpt reply) while human
    and gpt alternate, ending with a gpt reply."""
    conv = record.get("conversations")
    if not isinstance(conv, list):
        raise ValueError(f"{where} has no 'conversations' list")
    out: list[tuple[int, str]] = []
    for j, message in enumerate(conv):
        role = message.get("from") if isinstance(message, dict) else None
        if role not in (HUMAN_ROLES if len(out) % 2 == 0 else GPT_ROLES):
            if out:
                break
            continue
        value = message.get("value")
        if not isinstance(value, str):
            raise ValueError(f"{where}: message {j} has no string 'value'")
        out.append((j, value))
    return out[:len(out) // 2 * 2]


def _conversation(record: int, messages: list[tuple[int, str]], enc: Any, *,
                  max_turns: int | None, max_prompt_len: int, max_total_len: int,
                  fixed_output_len: int | None) -> Conversation | None:
    """A record's turns within the limits: it is cut at max_turns and at the first turn that
    breaks one (a prompt over max_prompt_len, prompt + output over max_total_len, a reply of
    no tokens); None without a turn left."""
    counts = _count_tokens(enc, [text for _, text in messages]).tolist()
    bos = _bos_id(enc) is not None
    segments: list[tuple[int, int]] = [(BOS_KEY, 1)] if bos else []
    indices = [-1] if bos else []
    ends: list[int] = []
    prompt_lens: list[int] = []
    output_lens: list[int] = []

    def add(message: int) -> None:
        if counts[message]:
            index = messages[message][0]
            segments.append((message_key(record, index), counts[message]))
            indices.append(index)

    history = int(bos)
    for t in range(len(messages) // 2):
        human, reply = 2 * t, 2 * t + 1
        prompt_len = history + counts[human]
        output_len = counts[reply] if fixed_output_len is None else fixed_output_len
        if (t == max_turns or prompt_len < 1 or output_len < 1 or prompt_len > max_prompt_len
                or prompt_len + output_len > max_total_len):
            break
        add(human)
        ends.append(len(segments))
        add(reply)  # the next turn's history
        prompt_lens.append(prompt_len)
        output_lens.append(output_len)
        history = prompt_len + counts[reply]
    if not ends:
        return None
    last = ends[-1]  # the last reply is no prompt's
    return Conversation(record, tuple(segments[:last]), tuple(indices[:last]), tuple(ends),
                        tuple(prompt_lens), tuple(output_lens))


def sample_conversations(path: Path, enc: Any, counts: np.ndarray, num_conversations: int,
                         seed: int, *, max_turns: int | None = None, max_prompt_len: int = 4096,
                         max_total_len: int = 8192, fixed_output_len: int | None = None
                         ) -> list[Conversation]:
    """``num_conversations`` conversations of the ShareGPT file at ``path``: its records
    shuffled with ``random.seed(seed)`` as benchmark_serving shuffles them (so the first ones
    are the sharegpt kind's), each taken with its turns within the limits, a record with no
    such turn skipped."""
    eligible = [int(i) for i in np.flatnonzero(counts[:, 0] >= 0)]  # 2 messages or more
    random.Random(seed).shuffle(eligible)
    taken: list[Conversation] = []
    for i in eligible:
        if len(taken) == num_conversations:
            break
        offset = int(counts[i, 2])
        messages = _messages(read_record_at(path, offset), f"{path}: record {i} at byte {offset}")
        conv = _conversation(i, messages, enc, max_turns=max_turns,
                             max_prompt_len=max_prompt_len, max_total_len=max_total_len,
                             fixed_output_len=fixed_output_len) if messages else None
        if conv is not None:
            taken.append(conv)
    if len(taken) < num_conversations:
        raise ValueError(f"workload.num_conversations = {num_conversations}, but only "
                         f"{len(taken)} conversations of {path} have a turn within the "
                         f"length limits")
    return taken


def think_time(cfg: Mapping[str, Any]) -> float:
    """``workload.think_time``: seconds from a turn's last token to the next turn's send."""
    v = get_float(cfg, "think_time", 0.0)
    if not (v >= 0 and math.isfinite(v)):
        raise ValueError(f"workload.think_time must be a number of seconds >= 0, got {v!r}")
    if v > MAX_CLOCK:
        raise ValueError(f"workload.think_time must be at most 2^32 s, got {v!r}: {CLOCK_RULE}")
    return v


def sample_conversations_section(cfg: Mapping[str, Any], num_conversations: int, seed: int
                                 ) -> ConversationSample:
    """The conversations of a kind=sharegpt_multiturn ``workload`` section, its settings
    checked."""
    max_turns = None if cfg.get("max_turns") is None else get_int(cfg, "max_turns", None, 1)
    max_prompt_len = get_int(cfg, "max_prompt_len", 4096, 1)
    max_total_len = get_int(cfg, "max_total_len", 8192, 2)
    fixed = fixed_output_len(cfg)
    path, enc, counts = sharegpt_source(cfg)
    conversations = sample_conversations(
        path, enc, counts, num_conversations, seed, max_turns=max_turns,
        max_prompt_len=max_prompt_len, max_total_len=max_total_len, fixed_output_len=fixed)
    return ConversationSample(path, enc, counts, conversations)
