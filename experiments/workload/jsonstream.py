"""A streaming reader of a top-level JSON array: records and byte offsets, a cut tail tolerated."""

from __future__ import annotations

import codecs
import json
import os
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

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
        except RecursionError:
            raise r.error(r.pos, "JSON nested too deep to read") from None
        except ValueError as e:  # Python's 4,300-digit limit on integers
            raise r.error(r.pos, f"a number too long to read ({str(e).partition(':')[0]})"
                          ) from None


def _open_reader(f: BinaryIO, path: str, chunk_size: int) -> _ArrayReader:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _ArrayReader(f, path, chunk_size, codecs.getincrementaldecoder("utf-8")(),
                        bytes_read=f.tell(), mark_bytes=f.tell())


def iter_json_array(path: str | os.PathLike[str], *, chunk_size: int = 1 << 20,
                    cut_short_note: Callable[[int], str] | None = None
                    ) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (byte offset, record) for each complete object of a top-level JSON array.

    Reads ``chunk_size`` bytes at a time, so a multi-GB file never sits in memory. A file cut
    short (the bundled ShareGPT copy is) ends the iteration with one warning: by default naming
    the file, the complete records used and the incomplete one dropped; ``cut_short_note``
    (given the number of complete records) words it for a file the caller knows. Anything else
    malformed raises ValueError naming the file and byte offset.
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
        partial = False  # the cut falls inside a record
        while r.skip_ws():  # False: cut after '[', ',' or a record
            if n == 0 and r.buf[r.pos] == "]":
                r.pos += 1
                _check_trailing(r)
                return
            decoded = _decode_value(r)
            if decoded is None:
                partial = True
                break
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
    if cut_short_note is not None:
        warnings.warn(cut_short_note(n), RuntimeWarning, stacklevel=2)
        return
    records = f"{n} complete record{'' if n == 1 else 's'}"
    kept = (f"the file ends partway through record {n + 1}; using the {records} before it "
            f"and dropping the incomplete one") if partial else \
        f"the file ends before its JSON array closes; using all {records} it holds"
    warnings.warn(f"{path_s} is cut short: {kept}", RuntimeWarning, stacklevel=2)


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

