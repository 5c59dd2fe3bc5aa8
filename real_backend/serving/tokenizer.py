"""Text in and out of the served model: the Llama-3 tokenizer (quicktok), the Llama-3 chat
template, incremental detokenization of streamed ids, and stop sequences found in that text."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from common.tokenizer import load_tokenizer

LLAMA3_TOKENIZER = "meta-llama/Meta-Llama-3-8B"


class Tokenizer:
    """Encodes prompts for a model of ``vocab_size`` tokens and decodes what it samples.

    Text is encoded as the Hugging Face Llama-3 tokenizer does for a completion prompt
    (``<|begin_of_text|>`` then the text, special-token text kept as plain text), which is how
    experiments.workload counts ShareGPT prompts, so a served prompt has the length the
    simulator gives it. A model with a smaller vocabulary than the tokenizer's (the tiny test
    model) sees each id folded modulo its vocabulary, as experiments.workload folds them.
    """

    def __init__(self, name: str | None, vocab_size: int) -> None:
        self.enc: Any = load_tokenizer(name or LLAMA3_TOKENIZER)
        self.vocab_size = vocab_size
        self.name = self.enc.name
        self.bos_id = self._special("<|begin_of_text|>")
        self.eos_id = self._special("<|end_of_text|>")  # a completion's end
        self.eot_id = self._special("<|eot_id|>")  # an assistant turn's end

    def _special(self, text: str) -> int | None:
        try:
            return int(self.enc.encode_single_token(text))
        except (KeyError, ValueError):
            return None

    def fold(self, ids: Sequence[int]) -> list[int]:
        v = self.vocab_size
        return [i % v for i in ids] if any(i >= v for i in ids) else list(ids)

    def encode_prompt(self, text: str) -> list[int]:
        bos = [] if self.bos_id is None else [self.bos_id]
        return self.fold(bos + list(self.enc.encode_ordinary(text)))

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """The Llama-3 Instruct chat template (tokenizer_config.json's), ending in the
        assistant header so that the model writes the reply:

            <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>
            ... <|start_header_id|>assistant<|end_header_id|>\\n\\n

        Message contents are plain text: a special token's text inside one is not a token.
        """
        ids = [] if self.bos_id is None else [self.bos_id]
        enc = self.enc
        for role, content in [*messages, ("assistant", None)]:
            ids += [enc.encode_single_token("<|start_header_id|>"), *enc.encode_ordinary(role),
                    enc.encode_single_token("<|end_header_id|>"), *enc.encode_ordinary("\n\n")]
            if content is not None:
                ids += [*enc.encode_ordinary(content.strip()),
                        enc.encode_single_token("<|eot_id|>")]
        return self.fold(ids)

    def stop_id(self, chat: bool) -> int | None:
        """The id that ends a reply, where the model can sample it."""
        stop = self.eot_id if chat else self.eos_id
        return stop if stop is not None and stop < self.vocab_size else None

    def detokenizer(self, skip: int | None) -> Detokenizer:
        return Detokenizer(self.enc, skip)

    def token_bytes(self, token: int) -> bytes:
        """A token's bytes; a special token's are its text."""
        return token_bytes(self.enc, token)

    def token_text(self, token: int) -> str:
        """A token's text as logprobs show it: its bytes decoded, a partial UTF-8 character
        as U+FFFD (as vLLM shows it)."""
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (an echoed prompt of token ids), special tokens as their text."""
        return Detokenizer(self.enc, None)(ids, final=True)


def token_bytes(enc: Any, token: int) -> bytes:
    """``token``'s bytes in ``enc``; U+FFFD's for an id it lacks (a model vocabulary larger
    than the tokenizer's)."""
    try:
        return enc.decode_single_token_bytes(token)
    except KeyError:
        return "\ufffd".encode()


class Detokenizer:
    """Text of a growing list of ids, a piece at a time: the bytes of a character split over
    two tokens come out with the second one; ``skip`` (the stop id) adds no text."""

    def __init__(self, enc: Any, skip: int | None) -> None:
        self.enc, self.skip = enc, skip
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, ids: Sequence[int], final: bool = False) -> str:
        out = []
        for i in ids:
            if i == self.skip:
                continue
            out.append(self.utf8.decode(token_bytes(self.enc, i)))
        if final:
            out.append(self.utf8.decode(b"", final=True))
        return "".join(out)


class StopStrings:
    """A reply's text as it streams, cut before the first stop sequence (OpenAI's and vLLM's
    rule: the stop sequence itself is not returned). Text that may be the start of a stop
    sequence is held back until the next piece says whether it is one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.stopped = False
        self._held = ""

    def feed(self, text: str) -> str:
        """The text that can be sent now; once a stop sequence is found, the text before it
        (``stopped`` is then True, and the rest of the reply is dropped)."""
        if not self.stops or self.stopped:
            return "" if self.stopped else text
        text = self._held + text
        cut = min((i for s in self.stops if (i := text.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return text[:cut]
        hold = next((n for n in range(min(len(text), max(map(len, self.stops)) - 1), 0, -1)
                     if any(s.startswith(text[-n:]) for s in self.stops)), 0)
        self._held = text[len(text) - hold:]
        return text[:len(text) - hold]

    def flush(self) -> str:
        """The text held back, at the reply's end."""
        held, self._held = self._held, ""
        return held
