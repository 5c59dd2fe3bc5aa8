"""A run's result text made by pyarrow from columns: requests.csv's and steps.csv's rows (a
``CsvFile`` each, written on a thread of its own while the run goes on) and result.json's
per-request lists of numbers.

The text is the csv module's and json's: each number's own ``str()`` (an int 0 reads "0", a
float its shortest repr, "0.0"), empty for a null. pyarrow formats a float as Python's repr
does except where repr uses its own notation: a float with no fraction (pyarrow writes 0.0 as
"0", 3.0 as "3": such a float below 1e10 is written as its int and ".0"), below 1e-4 and from
1e10 on (exponents: "1e-07" against "1e-7"; these, rare in a run's times, Python formats).
pyarrow does its work with the GIL released, so a file's thread overlaps the simulation.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import operator
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from experiments.files import atomic_path, note_written


# A column: numbers or bools (a numpy array; ``Numbers``: with those written empty) or the
# values themselves (a sequence of ints, floats, None or strings, each written
# as str() does, None empty); a pyarrow array is taken as it is
class Numbers(NamedTuple):
    """A column of numbers, ``empty`` (a mask) those written empty."""

    values: np.ndarray
    empty: np.ndarray


Column = np.ndarray | Numbers | pa.Array | Sequence[Any]

# where pyarrow's text of a float with a fraction is Python's repr (beyond: Python formats it)
_PYARROW_LOW, _PYARROW_HIGH = 1e-4, 1e10
_FEW = 4096  # such floats in a column, at most, that Python writes one by one
# pyarrow's buffers here are a batch's, freed as it is written: the system allocator gives them
# back, where pyarrow's default (mimalloc) keeps a heap a thread resident (BENCHMARKS.md)
_POOL = pa.system_memory_pool()
_OPTIONS = pacsv.WriteOptions(include_header=False, quoting_style="none")
# one cell a line: a JSON list's items once the line ends become ", " (WriteOptions' own eol
# would do it, but an older pyarrow, as a GPU host may have, has no such option)
_ITEMS = pacsv.WriteOptions(include_header=False, quoting_style="none", delimiter=";")


def _arrow(x: np.ndarray, null: np.ndarray | None = None) -> pa.Array:
    """A numpy array of numbers (or bools) as pyarrow's, ``null`` (a mask) its nulls. Made from
    its buffers: pyarrow's own conversions import pandas, which a run does not otherwise load."""
    if x.dtype == bool:
        data = pa.py_buffer(np.packbits(x, bitorder="little"))
    else:
        x = np.ascontiguousarray(x)
        data = pa.py_buffer(x)
    valid = None if null is None or not null.any() else \
        pa.py_buffer(np.packbits(~null, bitorder="little"))
    kind = pa.bool_() if x.dtype == bool else pa.from_numpy_dtype(x.dtype)
    return pa.Array.from_buffers(kind, len(x), [valid, data])


def _strings(texts: Sequence[str], null: np.ndarray | None = None) -> pa.Array:
    """Python strings as a pyarrow string array (``_arrow``'s reason), ``null`` its nulls."""
    data = [t.encode() for t in texts]
    offsets = np.zeros(len(data) + 1, np.int32)
    np.cumsum(np.fromiter(map(len, data), np.int32, len(data)), out=offsets[1:])
    valid = None if null is None or not null.any() else \
        pa.py_buffer(np.packbits(~null, bitorder="little"))
    return pa.Array.from_buffers(pa.string(), len(data), [valid, pa.py_buffer(offsets),
                                                          pa.py_buffer(b"".join(data))])


def _written_otherwise(x: np.ndarray, null: np.ndarray | None) -> np.ndarray:
    """Which floats of ``x`` pyarrow may write otherwise than str() (``null``: none of those
    written empty): no fraction, below 1e-4, from 1e10 (and NaN and the infinities, which
    both write alike)."""
    size = np.abs(x)
    with np.errstate(invalid="ignore"):
        other = (x == np.floor(x)) | ~((size >= _PYARROW_LOW) & (size < _PYARROW_HIGH))
    if null is not None:
        other &= ~null
    return other


def number_text(x: np.ndarray, null: np.ndarray | None = None,
                given: Sequence[Any] | None = None) -> pa.Array:
    """Each number of ``x`` (ints or floats) as its ``str()``, a string array; ``null``: those
    written empty; ``given``: the values as the caller holds them, where ints and floats mix
    (an int among floats keeps its own text)."""
    text = pc.cast(_arrow(x, null), pa.string(), memory_pool=_POOL)
    if x.dtype.kind != "f":
        return text
    special = _written_otherwise(x, null)
    where = np.flatnonzero(special)
    if not len(where):
        return text
    if len(where) <= _FEW:  # Python writes them: fewer numpy steps, so fewer takings of the GIL
        own = [str(given[i]) for i in where.tolist()] if given is not None \
            else list(map(repr, x[where].tolist()))
        return pc.replace_with_mask(text, _arrow(special), _strings(own), memory_pool=_POOL)
    size = np.abs(x)
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(x) if null is None else np.isfinite(x) & ~null
        integral = finite & (x == np.floor(x))
        # no fraction, below 1e10 (not -0.0): its int's text, and ".0" for a float
        whole = integral & (size < _PYARROW_HIGH) & ~((x == 0) & np.signbit(x))
        python = finite & ~whole & (integral | (size < _PYARROW_LOW) | (size >= _PYARROW_HIGH))
    if whole.any():
        at = np.flatnonzero(whole)
        point = np.ones(len(at), bool) if given is None else \
            np.fromiter((type(given[i]) is not int for i in at.tolist()), bool, len(at))
        digits = pc.cast(_arrow(x[at].astype(np.int64)), pa.string(), memory_pool=_POOL)
        own = pc.binary_join_element_wise(digits, _marks(point, ".0"),
                                          _marks(np.zeros(len(at), bool), ""), memory_pool=_POOL)
        text = pc.replace_with_mask(text, _arrow(whole), own, memory_pool=_POOL)
    where = np.flatnonzero(python)
    if not len(where):
        return text
    own = [str(given[i]) for i in where.tolist()] if given is not None \
        else list(map(repr, x[where].tolist()))
    return pc.replace_with_mask(text, _arrow(python), _strings(own), memory_pool=_POOL)


class _Values(NamedTuple):
    """A column as numbers for ``number_text``: its values, those written empty (None: none),
    and the values as given where ints and floats mix (None: they do not)."""

    values: np.ndarray
    empty: np.ndarray | None = None
    given: Sequence[Any] | None = None


def _values(column: Column, name: str) -> _Values | pa.Array:
    """A column as numbers (``_Values``), or its cells where they are not numbers."""
    if isinstance(column, pa.Array):
        return column
    if isinstance(column, Numbers):
        return _Values(column.values, column.empty)
    if isinstance(column, np.ndarray):
        if column.dtype == bool:  # str(): "True", "False"
            return pc.take(_strings(["False", "True"]), _arrow(column.astype(np.int64)),
                           memory_pool=_POOL)
        return _Values(column)
    types = set(map(type, column))
    if types <= {int}:
        return _Values(np.fromiter(column, np.int64, len(column)))
    none = np.fromiter(map(operator.is_, column, itertools.repeat(None)), bool, len(column)) \
        if type(None) in types else None
    if types <= {int, float, type(None)}:  # (floats alone: each one's str() is its repr)
        return _Values(np.array(column, float), none,
                       column if int in types and float in types else None)
    if types <= {str, type(None)}:
        return _strings(["" if t is None else t for t in column], none)
    raise ValueError(f"result column {name or '?'} holds values of types "
                     f"{sorted(t.__name__ for t in types)}; a CSV cell holds a number, a "
                     f"string or nothing")


def cells(column: Column, name: str = "") -> pa.Array:
    """A column's CSV cells (strings; null: empty), each value as the csv module writes it."""
    values = _values(column, name)
    return values if isinstance(values, pa.Array) else number_text(*values)


def csv_text(names: Sequence[str], columns: Sequence[Column]) -> str:
    """The CSV text of these columns under a header of ``names``."""
    buf = io.BytesIO()
    pacsv.write_csv(_batch(names, columns), buf, _OPTIONS, memory_pool=_POOL)
    return ",".join(names) + "\n" + buf.getvalue().decode()


def _batch(names: Sequence[str], columns: Sequence[Column]) -> pa.RecordBatch:
    """The columns' cells as a record batch. Int columns, and float columns whose every value
    pyarrow writes as str() does, stay numbers: the CSV writer formats them itself, in one call
    that lets the GIL go (on a file's thread each numpy or pyarrow step takes the GIL back, and
    waits for the simulation to give it up: BENCHMARKS.md). The float columns are checked end
    to end, in one pass; the others' cells are made here."""
    out: list[pa.Array | None] = []
    floats: list[tuple[int, _Values]] = []
    for name, column in zip(names, columns, strict=True):
        values = _values(column, name)
        if not isinstance(values, pa.Array):
            kind = values.values.dtype.kind
            if kind in "iu":  # (pyarrow writes an int as str() does)
                values = _arrow(values.values, values.empty)
            elif kind == "f" and values.given is None:
                floats.append((len(out), values))
                values = None
            else:
                values = number_text(*values)
        out.append(values)
    rows = {len(v.values) for _, v in floats}
    if len(rows) == 1:  # (columns of unequal lengths: from_arrays says so)
        empty = None
        if any(v.empty is not None for _, v in floats):
            empty = np.concatenate([np.zeros(len(v.values), bool) if v.empty is None
                                    else v.empty for _, v in floats])
        other = _written_otherwise(np.concatenate([v.values for _, v in floats]), empty)
        any_other = other.reshape(len(floats), rows.pop()).any(axis=1).tolist()
    else:
        any_other = [True] * len(floats)
    for (i, v), text in zip(floats, any_other, strict=True):
        out[i] = number_text(v.values, v.empty) if text else _arrow(v.values, v.empty)
    return pa.RecordBatch.from_arrays(out, names=list(names))


class CsvFile:
    """A CSV file written a batch of rows at a time (``write``: its columns) on a thread of its
    own, into a temporary copy (``experiments.files.atomic_path``) that ``close`` puts in place
    once every batch is written; ``discard`` removes it. A batch that fails is raised by the
    next call, naming the file, and the copy is removed."""

    def __init__(self, path: str | os.PathLike[str], names: Sequence[str]) -> None:
        self.path, self.names = Path(path), list(names)
        self._stack = contextlib.ExitStack()
        self._pending: list[Future[None]] = []
        # the bytes' sha256 as they are written (hashlib lets the GIL go on a batch's), for
        # the run directory's manifest (experiments.files.note_written)
        self._sha256 = hashlib.sha256()
        try:
            self._copy = self._stack.enter_context(atomic_path(self.path))
            # pyarrow's own file: its writes need no GIL (a Python file object's would)
            self._sink = self._stack.enter_context(pa.OSFile(str(self._copy), "wb"))
            self._put((",".join(self.names) + "\n").encode())
            self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"write {self.path.name}")
            self._stack.callback(self._thread.shutdown, cancel_futures=True)
        except BaseException:
            self.discard()
            raise

    def write(self, columns: Sequence[Column]) -> None:
        """A batch of rows, given as its columns (in ``names``' order), to be written after
        those before it."""
        self._raise_failed(wait=False)
        self._pending.append(self._thread.submit(self._write, columns))

    def _write(self, columns: Sequence[Column]) -> None:
        text = pa.BufferOutputStream(memory_pool=_POOL)
        pacsv.write_csv(_batch(self.names, columns), text, _OPTIONS, memory_pool=_POOL)
        self._put(text.getvalue())

    def _put(self, data: bytes | pa.Buffer) -> None:
        self._sha256.update(data)
        self._sink.write(data)

    def _raise_failed(self, *, wait: bool) -> None:
        done = [f for f in self._pending if wait or f.done()]
        self._pending = [f for f in self._pending if f not in done]
        for future in done:
            err = future.exception()
            if err is not None:
                self.discard()
                if isinstance(err, OSError):  # (pyarrow's words for an errno: the OS's)
                    reason = os.strerror(err.errno) if err.errno else err.strerror
                    raise OSError(err.errno, reason, str(self.path)) from err
                raise type(err)(f"writing {self.path}: {err}") from err

    def wait(self) -> None:
        """Every batch written and on disk (on an error, the copy removed)."""
        try:
            self._raise_failed(wait=True)
            self._sink.flush()
            os.fsync(self._sink.fileno())
        except BaseException:
            self.discard()
            raise

    def close(self) -> None:
        """Every batch written, the file put in place (or, on an error, removed)."""
        self.wait()
        self._stack.close()
        note_written(self.path, self._sha256.hexdigest())

    def discard(self) -> None:
        """The copy removed, the batches not written dropped; ``path`` left as it was. Once."""
        stack, self._stack = self._stack, contextlib.ExitStack()
        with contextlib.suppress(_Discarded):
            stack.__exit__(_Discarded, _Discarded(), None)


class _Discarded(Exception):
    """What CsvFile.discard leaves its copy with: the error that removes it."""


def _items(text: pa.Array) -> str:
    """Strings joined by ", " (a JSON list's items)."""
    buf = io.BytesIO()
    pacsv.write_csv(pa.RecordBatch.from_arrays([text], names=["items"]), buf, _ITEMS,
                    memory_pool=_POOL)
    return buf.getvalue()[:-1].replace(b"\n", b", ").decode()


def json_numbers(values: np.ndarray) -> str:
    """A JSON list's numbers, without its brackets (finite ones: ``json_is_plain``)."""
    return _items(number_text(values))


def json_number_lists(values: np.ndarray, bounds: np.ndarray) -> str:
    """The JSON lists of ``values`` (finite numbers) cut at ``bounds`` (list i:
    values[bounds[i]:bounds[i + 1]]), without the outer brackets."""
    counts = np.diff(bounds)
    if not len(counts):
        return ""
    cells_each = np.maximum(counts, 1)  # an empty list is one item, "[]"
    first = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(cells_each, out=first[1:])
    first = first[:-1]
    # item k of list i is value bounds[i] + k; an empty list's item, the "[]" after the values
    index = np.arange(int(cells_each.sum())) - np.repeat(first - bounds[:-1], cells_each)
    empty = counts == 0
    index[first[empty]] = len(values)
    items = pc.take(pa.concat_arrays([number_text(values), _strings(["[]"])], memory_pool=_POOL),
                    _arrow(index), memory_pool=_POOL)
    opens, closes = np.zeros(len(index), bool), np.zeros(len(index), bool)
    opens[first[~empty]] = True
    closes[(first + cells_each - 1)[~empty]] = True
    items = pc.binary_join_element_wise(_marks(opens, "["), items, _marks(closes, "]"),
                                        _marks(np.zeros(len(index), bool), ""),
                                        memory_pool=_POOL)
    return _items(items)


def _marks(where: np.ndarray, mark: str) -> pa.Array:
    """A string array of ``mark`` where ``where`` is set, "" elsewhere."""
    offsets = np.zeros(len(where) + 1, np.int32)
    np.cumsum(where * len(mark), out=offsets[1:])
    return pa.Array.from_buffers(pa.string(), len(where),
                                 [None, pa.py_buffer(offsets),
                                  pa.py_buffer(mark.encode() * int(where.sum()))])


def json_is_plain(values: np.ndarray) -> bool:
    """Whether json_numbers writes these numbers (finite ones: json writes the rest as strings)."""
    return values.dtype.kind in "iu" or bool(np.isfinite(values).all())
