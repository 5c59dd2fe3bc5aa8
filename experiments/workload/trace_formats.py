"""Trace file formats: each one's columns, time unit and per-row checks, read as a row stream."""

from __future__ import annotations

import csv
import json
import math
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, NamedTuple

from experiments.workload.arrivals import MILLISECONDS, SECONDS, TimeUnit

CSV_COLUMNS = ("arrival_time", "prompt_len", "output_len")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Log Type")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")
# A Mooncake line holds one request's lengths and block hashes (a few KiB at 128k tokens);
# a longer line is a file of another kind, not read into memory whole.
MAX_JSONL_LINE = 16 << 20
# Tokens per block hash in Mooncake's traces: a request's hash_ids are its prompt's blocks, one
# per 512 tokens or part of them (kvcache-ai/Mooncake, FAST'25 trace README).
MOONCAKE_BLOCK_SIZE = 512
# vLLM's timed-trace dataset (vllm bench serve --dataset-name timed_trace --self-timed): the
# same keys, its timestamp in seconds (--timed-trace-sec-multiplier 1, its default), and each
# hash one --timed-trace-chunk-hash-size block (16 tokens by default), with no fixed count.
TIMED_TRACE_KEYS = MOONCAKE_KEYS
# Integers beyond this are no time or length: Python could not even make them floats.
MAX_JSON_INT = 2**63 - 1
# UTC offsets in use run from -12:00 to +14:00; a larger one is a typo, not a time zone.
MAX_UTC_OFFSET_S = 14 * 3600


class TraceRow(NamedTuple):
    """One request as its file gives it: the time in the format's unit, and its line."""

    time: float
    prompt_len: int
    output_len: int
    line: int
    hash_ids: tuple[int, ...] | None = None
    slo_class: str | None = None  # the optional slo_class column (workload.classes)


@dataclass(frozen=True, slots=True)
class RowFilter:
    """Which rows of a trace a run replays."""

    models: frozenset[str] | None = None  # BurstGPT's Model; None: every model
    log_types: frozenset[str] | None = None  # BurstGPT's Log Type; None: every type
    # Rows with no output tokens are failed requests (BurstGPT says so; an Azure row like it is
    # taken alike). Kept, they replay as requests for one token: the least a request can ask.
    keep_failed: bool = False


@dataclass(slots=True)
class RowCounts:
    """What a reader saw, for the messages that say why rows are missing."""

    rows: int = 0
    failed: int = 0  # dropped: no output tokens
    filtered: int = 0  # dropped: another model or log type
    models: set[str] = field(default_factory=set)  # seen, where rows are filtered
    log_types: set[str] = field(default_factory=set)


Reader = Callable[[str, RowFilter, RowCounts], Iterator[TraceRow]]


@dataclass(frozen=True, slots=True)
class TraceFormat:
    name: str
    time_column: str
    unit: TimeUnit
    read: Reader  # rows in file order; every row's fields checked
    columns: tuple[str, ...] = ()  # a CSV format's header columns
    block_size: int | None = None  # the tokens of each of a row's hash_ids, where it keeps them


# --------------------------------------------------------------------------- CSV formats

def _csv_fields(path: str, fmt: str, columns: Sequence[str], optional: Sequence[str] = ()
                ) -> Iterator[tuple[int, Any]]:
    """(line, the fields of ``columns``, then of ``optional`` ones: None where the header lacks
    them) per non-blank row of a CSV trace; the header, the encoding and each row's field count
    checked."""
    try:
        # utf-8-sig drops the byte-order mark that spreadsheet exports put before the header.
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                raise ValueError(f"{path}: empty trace, expected a header '{','.join(columns)}'")
            header = [h.strip() for h in header]
            _check_text(header, path, 1)
            fields = operator.itemgetter(*_header_columns(header, path, fmt, columns))
            extra = [header.index(c) if c in header else None for c in optional]
            width = len(header)
            for row in reader:
                line = reader.line_num
                text = "".join(row)  # one C call each for the two checks below
                if not text.strip():
                    continue
                if "\x00" in text:
                    _check_text(row, path, line)
                if len(row) != width:
                    raise ValueError(f"{path}:{line}: expected {width} fields, got {len(row)}")
                if optional:
                    yield line, (*fields(row), *(None if j is None else row[j].strip() or None
                                                 for j in extra))
                else:
                    yield line, fields(row)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a UTF-8 text file (byte 0x{e.object[e.start]:02x} "
                         f"cannot be decoded); a trace is a CSV file") from None
    except csv.Error as e:
        raise ValueError(f"{path}: unreadable CSV: {e}") from None


def _header_columns(header: list[str], path: str, fmt: str, columns: Sequence[str]
                    ) -> list[int]:
    seen: set[str] = set()
    for h in header:
        if h in seen:  # which of the two columns is meant cannot be told
            raise ValueError(f"{path}:1: trace header has column {h!r} twice")
        seen.add(h)
    missing = [c for c in columns if c not in seen]
    if missing:
        # A public trace read under the default format is the likely slip: name the right one.
        other = [f.name for f in FORMATS.values()
                 if f.columns and f.name != fmt and set(f.columns) <= seen]
        hint = f"; it looks like workload.format={other[0]}" if other else ""
        raise ValueError(f"{path}:1: trace header lacks column {missing[0]!r} (format={fmt} "
                         f"needs {', '.join(columns)}; got {', '.join(header)}){hint}")
    return [header.index(c) for c in columns]


def _check_text(fields: list[str], path: str, line: int) -> None:
    # Valid UTF-8 can still be binary (NUL bytes); the csv module would pass them through.
    if any("\x00" in f for f in fields):
        raise ValueError(f"{path}:{line}: NUL byte in a text field; a trace is a CSV text file")


def _number(text: str, path: str, line: int, column: str, *, integer: bool) -> float:
    if integer:
        try:
            return int(text)  # the common case, and the fastest
        except ValueError:
            pass  # "12.0" is an integer too; "12.5", "x" are errors below
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{path}:{line}: {column} is not a number: {text.strip()!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{path}:{line}: {column} must be finite, got {text.strip()!r}")
    if integer and v != int(v):
        raise ValueError(f"{path}:{line}: {column} must be an integer, got {text.strip()!r}")
    return v


def _check_lengths(prompt_len: float, output_len: float, path: str, line: int,
                   names: tuple[str, str], *, failed_allowed: bool = False) -> None:
    if prompt_len < 1:
        raise ValueError(f"{path}:{line}: {names[0]} must be >= 1, got {prompt_len:g}")
    least = 0 if failed_allowed else 1
    if output_len < least:
        raise ValueError(f"{path}:{line}: {names[1]} must be >= {least}, got {output_len:g}")


def _replayed_output(output_len: float, flt: RowFilter, counts: RowCounts) -> int | None:
    """The output length a row replays with, or None for a failed request dropped."""
    if output_len >= 1:
        return int(output_len)
    if flt.keep_failed:
        return 1
    counts.failed += 1
    return None


def _row_with_failures(arrival: float, prompt: str, output: str, names: tuple[str, str],
                       path: str, line: int, flt: RowFilter,
                       counts: RowCounts) -> TraceRow | None:
    """A row of a trace that records failed requests (no output tokens: Azure, BurstGPT), or
    None for a failed one that is dropped."""
    prompt_len = _number(prompt, path, line, names[0], integer=True)
    output_len = _number(output, path, line, names[1], integer=True)
    _check_lengths(prompt_len, output_len, path, line, names, failed_allowed=True)
    replayed = _replayed_output(output_len, flt, counts)
    return None if replayed is None else TraceRow(arrival, int(prompt_len), replayed, line)


def _read_csv(path: str, flt: RowFilter, counts: RowCounts) -> Iterator[TraceRow]:
    for line, (t, p, o, slo_class) in _csv_fields(path, "csv", CSV_COLUMNS, ("slo_class",)):
        counts.rows += 1
        arrival = _number(t, path, line, "arrival_time", integer=False)
        prompt_len = _number(p, path, line, "prompt_len", integer=True)
        output_len = _number(o, path, line, "output_len", integer=True)
        if arrival < 0:
            raise ValueError(f"{path}:{line}: arrival_time must be >= 0, got {arrival}")
        _check_lengths(prompt_len, output_len, path, line, ("prompt_len", "output_len"))
        yield TraceRow(arrival, int(prompt_len), int(output_len), line, None, slo_class)


# "2023-11-16 18:15:46.6805900" (2023: no zone, 7 fractional digits) or
# "2024-05-10 00:00:00.009930+00:00" (2024: UTC offset, 6 digits or none). Parsed here rather
# than by datetime.fromisoformat, which takes 7 digits only from Python 3.11 on.
_AZURE_TIME = re.compile(r"\s*(\d{4}-\d\d-\d\d[ T]\d\d:\d\d):(\d\d(?:\.\d+)?)"
                         r"(Z|[+-]\d\d:?\d\d)?\s*")


def _azure_time(text: str, path: str, line: int, minutes: dict[str, float]) -> float:
    """Seconds since the Unix epoch (a time without a zone is taken as UTC). ``minutes`` caches
    each minute's start: a trace's rows share it, and strptime is the slow part."""
    m = _AZURE_TIME.fullmatch(text)
    seconds = float(m[2]) if m else math.inf
    minute = minutes.get(m[1]) if m else None
    if m and minute is None:
        try:
            minute = datetime.strptime(m[1].replace("T", " "), "%Y-%m-%d %H:%M").replace(
                tzinfo=timezone.utc).timestamp()
        except ValueError:  # month 13, hour 25
            seconds = math.inf
        else:
            if len(minutes) > 1024:  # rows come in time order: old minutes do not recur
                minutes.clear()
            minutes[m[1]] = minute
    if minute is None or seconds >= 61:  # 60.x: a leap second
        raise ValueError(f"{path}:{line}: TIMESTAMP is not a date and time: {text.strip()!r} "
                         f"(expected e.g. 2023-11-16 18:15:46.6805900)")
    zone = m[3]
    offset = 0
    if zone and zone != "Z":
        hours, mins = int(zone[1:3]), int(zone[-2:])
        offset = (1 if zone[0] == "+" else -1) * (hours * 3600 + mins * 60)
        if mins >= 60 or abs(offset) > MAX_UTC_OFFSET_S:
            raise ValueError(f"{path}:{line}: TIMESTAMP has no such UTC offset: {zone!r} in "
                             f"{text.strip()!r} (offsets run from -12:00 to +14:00)")
    return minute + seconds - offset


def _read_azure(path: str, flt: RowFilter, counts: RowCounts) -> Iterator[TraceRow]:
    minutes: dict[str, float] = {}
    for line, (t, p, o) in _csv_fields(path, "azure", AZURE_COLUMNS):
        counts.rows += 1
        arrival = _azure_time(t, path, line, minutes)
        row = _row_with_failures(arrival, p, o, ("ContextTokens", "GeneratedTokens"), path, line,
                                 flt, counts)
        if row is not None:
            yield row


def _read_burstgpt(path: str, flt: RowFilter, counts: RowCounts) -> Iterator[TraceRow]:
    for line, (t, model, p, o, log_type) in _csv_fields(path, "burstgpt", BURSTGPT_COLUMNS):
        counts.rows += 1
        if flt.models is not None or flt.log_types is not None:
            model, log_type = model.strip(), log_type.strip()
            counts.models.add(model)
            counts.log_types.add(log_type)
            if (flt.models is not None and model not in flt.models) or \
                    (flt.log_types is not None and log_type not in flt.log_types):
                counts.filtered += 1
                continue
        arrival = _number(t, path, line, "Timestamp", integer=False)
        if arrival < 0:
            raise ValueError(f"{path}:{line}: Timestamp must be >= 0, got {arrival:g}")
        row = _row_with_failures(arrival, p, o, ("Request tokens", "Response tokens"), path,
                                 line, flt, counts)
        if row is not None:
            yield row


# --------------------------------------------------------------------------- Mooncake JSONL

def _read_mooncake(path: str, flt: RowFilter, counts: RowCounts) -> Iterator[TraceRow]:
    return _read_jsonl(path, counts, "Mooncake", MOONCAKE_BLOCK_SIZE)


def _read_timed_trace(path: str, flt: RowFilter, counts: RowCounts) -> Iterator[TraceRow]:
    # its hash_ids are checked but not kept: their block size is a vLLM command-line setting,
    # not the file's, and schedlab's block hashes are Mooncake's 512-token ones
    return _read_jsonl(path, counts, "vLLM timed-trace", None)


def _read_jsonl(path: str, counts: RowCounts, name: str, block_size: int | None
                ) -> Iterator[TraceRow]:
    """Rows of a JSON-lines trace with Mooncake's keys (``name``: the format's, for errors);
    ``block_size``: the tokens of each hash_ids entry, kept on the request (None: checked,
    not kept)."""
    with open(path, "rb") as f:
        line = 0
        while raw := f.readline(MAX_JSONL_LINE + 1):
            line += 1
            if len(raw) > MAX_JSONL_LINE:
                raise ValueError(f"{path}:{line}: a line longer than {MAX_JSONL_LINE >> 20} MiB; "
                                 f"a {name} trace has one JSON object per line")
            if line == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            if not raw.strip():
                continue
            counts.rows += 1
            yield _mooncake_row(raw, path, line, name, block_size)


def _mooncake_row(raw: bytes, path: str, line: int, name: str = "Mooncake",
                  block_size: int | None = MOONCAKE_BLOCK_SIZE) -> TraceRow:
    if b"\x00" in raw:
        raise ValueError(f"{path}:{line}: NUL byte; a {name} trace is JSON lines text")
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}); "
                         f"a {name} trace is JSON lines") from None
    except json.JSONDecodeError as e:
        if not raw.endswith(b"\n"):
            raise ValueError(f"{path}:{line}: the last line is cut short (incomplete JSON, no "
                             f"newline); the file may be partly written or copied") from None
        raise ValueError(f"{path}:{line}: not a JSON object ({e.msg}, column {e.colno})"
                         ) from None
    except RecursionError:
        raise ValueError(f"{path}:{line}: JSON nested too deep to read; a {name} request "
                         f"is one flat object") from None
    except ValueError as e:  # Python's 4,300-digit limit on integers
        raise ValueError(f"{path}:{line}: a number too long to read "
                         f"({str(e).partition(':')[0]})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{line}: a JSON {type(record).__name__}, expected an object "
                         f"with {', '.join(MOONCAKE_KEYS)}")
    missing = [k for k in MOONCAKE_KEYS if k not in record]
    if missing:
        raise ValueError(f"{path}:{line}: no {missing[0]!r} (a {name} request needs "
                         f"{', '.join(MOONCAKE_KEYS)}; got {', '.join(record) or 'nothing'})")
    arrival = _json_number(record, "timestamp", path, line, integer=False)
    if arrival < 0:
        raise ValueError(f"{path}:{line}: timestamp must be >= 0, got {arrival:g}")
    prompt_len = _json_number(record, "input_length", path, line, integer=True)
    output_len = _json_number(record, "output_length", path, line, integer=True)
    _check_lengths(prompt_len, output_len, path, line, ("input_length", "output_length"))
    hash_ids = record.get("hash_ids")
    if hash_ids is not None:
        if not isinstance(hash_ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
            raise ValueError(f"{path}:{line}: hash_ids must be a list of integers")
        if block_size is None:
            hash_ids = None  # blocks of a size the file does not say: checked, not kept
        else:
            # one hash a block of the prompt: any other count is not this request's prefix
            blocks = -(-int(prompt_len) // block_size)
            if len(hash_ids) != blocks:
                raise ValueError(f"{path}:{line}: {len(hash_ids)} hash_ids for input_length "
                                 f"{int(prompt_len)}; a Mooncake request has one per "
                                 f"{block_size}-token block of its prompt ({blocks})")
            hash_ids = tuple(hash_ids)
    slo_class = record.get("slo_class")
    if slo_class is not None and not isinstance(slo_class, str):
        raise ValueError(f"{path}:{line}: slo_class must be a class name (text), got "
                         f"{type(slo_class).__name__}")
    return TraceRow(float(arrival), int(prompt_len), int(output_len), line, hash_ids, slo_class)


def _json_number(record: dict[str, Any], key: str, path: str, line: int, *, integer: bool
                 ) -> float:
    v = record[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        text = repr(v) if len(repr(v)) <= 40 else f"a JSON {type(v).__name__}"
        raise ValueError(f"{path}:{line}: {key} must be a number, got {text}")
    if isinstance(v, int) and abs(v) > MAX_JSON_INT:
        raise ValueError(f"{path}:{line}: {key} must be below 2**63, got an integer of "
                         f"{len(str(v))} digits")
    if not math.isfinite(v):
        raise ValueError(f"{path}:{line}: {key} must be finite, got {v!r}")
    if integer and v != int(v):
        raise ValueError(f"{path}:{line}: {key} must be an integer, got {v!r}")
    return v


FORMATS: dict[str, TraceFormat] = {f.name: f for f in (
    TraceFormat("csv", "arrival_time", SECONDS, _read_csv, CSV_COLUMNS),
    # TIMESTAMP is a date and time; as seconds since the Unix epoch here.
    TraceFormat("azure", "TIMESTAMP", SECONDS, _read_azure, AZURE_COLUMNS),
    TraceFormat("burstgpt", "Timestamp", SECONDS, _read_burstgpt, BURSTGPT_COLUMNS),
    TraceFormat("mooncake", "timestamp", MILLISECONDS, _read_mooncake,
                block_size=MOONCAKE_BLOCK_SIZE),
    TraceFormat("timed_trace", "timestamp", SECONDS, _read_timed_trace),
)}
