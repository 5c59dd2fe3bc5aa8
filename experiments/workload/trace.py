"""Trace files: requests replayed from a CSV of arrival times and lengths."""

from __future__ import annotations

import csv
import math
import os
from typing import Any

from experiments.workload.arrivals import trace_arrival_times

# The settings kind=trace reads besides the common ones.
TRACE_KEYS = frozenset({"trace_path"})
TRACE_COLUMNS = ("arrival_time", "prompt_len", "output_len")


def read_trace(path: str | os.PathLike[str], *, max_requests: int | None = None
               ) -> list[tuple[float, int, int]]:
    """(arrival_time, prompt_len, output_len) rows of a CSV trace, sorted by arrival time, the
    times relative to the first arrival (trace_arrival_times).

    Other columns are ignored; a UTF-8 byte-order mark is allowed. A file with more than
    ``max_requests`` rows is refused as soon as the row after the last allowed one is read.
    """
    path_s = os.fspath(path)
    try:
        # utf-8-sig drops the byte-order mark that spreadsheet exports put before the header.
        with open(path_s, newline="", encoding="utf-8-sig") as f:
            rows = _read_rows(csv.reader(f), path_s, max_requests)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path_s}: not a UTF-8 text file (byte 0x{e.object[e.start]:02x} "
                         f"cannot be decoded); a trace is a CSV file") from None
    except csv.Error as e:
        raise ValueError(f"{path_s}: unreadable CSV: {e}") from None
    rows.sort(key=lambda r: r[0])  # stable: ties keep file order
    times = trace_arrival_times([r[0] for r in rows], [r[3] for r in rows], path_s)
    return [(t, r[1], r[2]) for t, r in zip(times, rows, strict=True)]


def _read_rows(reader: Any, path: str, max_requests: int | None
               ) -> list[tuple[float, int, int, int]]:
    """(arrival_time, prompt_len, output_len, line) per request, in file order."""
    header = next(reader, None)
    if header is None:
        raise ValueError(f"{path}: empty trace, expected a header "
                         f"'{','.join(TRACE_COLUMNS)}'")
    header = [h.strip() for h in header]
    _check_text(header, path, 1)
    seen: set[str] = set()
    for h in header:
        if h in seen:  # which of the two columns is meant cannot be told
            raise ValueError(f"{path}:1: trace header has column {h!r} twice")
        seen.add(h)
    missing = [c for c in TRACE_COLUMNS if c not in header]
    if missing:
        raise ValueError(f"{path}:1: trace header lacks column {missing[0]!r} "
                         f"(needs {', '.join(TRACE_COLUMNS)}; got {', '.join(header)})")
    cols = [header.index(c) for c in TRACE_COLUMNS]
    rows: list[tuple[float, int, int, int]] = []
    for row in reader:
        line = reader.line_num
        if not row or all(not c.strip() for c in row):
            continue
        _check_text(row, path, line)
        if len(row) != len(header):
            raise ValueError(f"{path}:{line}: expected {len(header)} fields, got {len(row)}")
        if max_requests is not None and len(rows) == max_requests:
            raise ValueError(f"{path}:{line}: the trace has more than {max_requests} requests, "
                             f"the most whose replay fits in the memory available")
        arrival = _parse_number(row[cols[0]], path, line, "arrival_time", integer=False)
        prompt_len = _parse_number(row[cols[1]], path, line, "prompt_len", integer=True)
        output_len = _parse_number(row[cols[2]], path, line, "output_len", integer=True)
        if arrival < 0:
            raise ValueError(f"{path}:{line}: arrival_time must be >= 0, got {arrival}")
        for name, v in (("prompt_len", prompt_len), ("output_len", output_len)):
            if v < 1:
                raise ValueError(f"{path}:{line}: {name} must be >= 1, got {v}")
        rows.append((float(arrival), int(prompt_len), int(output_len), line))
    if not rows:
        raise ValueError(f"{path}: trace has a header but no requests")
    return rows


def _check_text(fields: list[str], path: str, line: int) -> None:
    # Valid UTF-8 can still be binary (NUL bytes); the csv module would pass them through.
    if any("\x00" in f for f in fields):
        raise ValueError(f"{path}:{line}: NUL byte in a text field; a trace is a CSV text file")


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
