"""Atomic file writes: a reader, or a crash, sees the old file or the whole new one, never half."""

from __future__ import annotations

import glob
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


def _copy_affixes(path: Path) -> tuple[str, str]:
    """How a temporary copy of ``path`` is named: its start and end (mkstemp puts eight
    characters between)."""
    return f".{path.name}.", ".tmp"


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside ``path`` (same directory, so the rename is atomic) that replaces
    ``path`` when the block finishes, and is removed if the block raises. An OS error that names
    no file (a full disk says only "[Errno 28] No space left on device") is raised naming
    ``path``."""
    path = Path(path)
    tmp = None
    try:
        prefix, suffix = _copy_affixes(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=suffix)
        os.close(fd)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open() would create it (mkstemp makes it private)
        yield Path(tmp)
        os.replace(tmp, path)
    except OSError as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        # The temporary name means nothing to a reader; mkstemp's own failures leave tmp unset.
        if err.errno is not None and (tmp is None or err.filename in (None, tmp)):
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise


def stale_copies(path: str | os.PathLike[str]) -> list[Path]:
    """The temporary copies of ``path`` that atomic writes left beside it when their process
    was killed (SIGKILL, the OOM killer) before it could remove them: files named as
    ``atomic_path`` names them (mkstemp's eight characters between)."""
    path = Path(path)
    prefix, suffix = _copy_affixes(path)
    return sorted(p for p in path.parent.glob(glob.escape(prefix) + "?" * 8 + suffix)
                  if p.is_file() and not p.is_symlink())


@contextmanager
def atomic_text_file(path: str | os.PathLike[str]) -> Iterator[IO[str]]:
    """A text file open for writing in place of ``path``: fsynced, then renamed over it when the
    block finishes (``atomic_path``); a long text can be written a piece at a time."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` via a temporary file, fsync it, then rename it over ``path``."""
    with atomic_text_file(path) as f:
        f.write(text)


NOTES_MARK = "<!-- notes: kept when the table is rebuilt -->"


def write_table_markdown(path: str | os.PathLike[str], generated: str) -> None:
    """Write a generated table's markdown to ``path``, keeping what the file it replaces holds
    below NOTES_MARK (hand-written notes: how the runs were made, what the table shows)."""
    path = Path(path)
    notes = ""
    if path.exists() and NOTES_MARK in (old := path.read_text()):
        notes = "\n" + NOTES_MARK + old.split(NOTES_MARK, 1)[1]
    write_text_atomic(path, generated + notes)
