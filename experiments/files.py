"""Atomic file writes: a reader, or a crash, sees the old file or the whole new one, never half;
and Ctrl-C held off a short section that makes several files one unit (``interrupts_held``)."""

from __future__ import annotations

import glob
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def _copy_affixes(path: Path) -> tuple[str, str]:
    """How a temporary copy of ``path`` is named: its start and end (mkstemp puts eight
    characters between)."""
    return f".{path.name}.", ".tmp"


def _naming(path: Path, err: OSError, copy: str | None) -> OSError | None:
    """``err`` naming ``path`` where it names no file (a full disk says only "[Errno 28] No
    space left on device") or only ``copy``, the temporary copy, whose name means nothing to a
    reader (None: mkstemp's own failure, which names the copy it tried); None where ``err``
    names a file of its own."""
    if err.errno is not None and (copy is None or err.filename in (None, copy)):
        return OSError(err.errno, err.strerror, str(path))
    return None


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
        named = _naming(path, err, tmp)
        if named is None:
            raise
        raise named from err
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise


# Files this process wrote whole and hashed as it wrote them: path -> (inode, size, mtime in ns,
# sha256 of the bytes), for the run directory's manifest (experiments/run_dir.py), which then
# does not read them again
_WRITTEN: dict[str, tuple[int, int, int, str]] = {}


def note_written(path: str | os.PathLike[str], sha256: str) -> None:
    """``path`` has just been written whole, and ``sha256`` is its bytes' digest."""
    st = os.stat(path)
    _WRITTEN[os.path.abspath(path)] = (st.st_ino, st.st_size, st.st_mtime_ns, sha256)


def written_sha256(path: str | os.PathLike[str]) -> str | None:
    """The digest ``note_written`` was given for ``path``, if the file is still the one it was
    given for (the same inode, size and modification time); else None."""
    entry = _WRITTEN.get(os.path.abspath(path))
    if entry is None:
        return None
    st = os.stat(path)
    return entry[3] if entry[:3] == (st.st_ino, st.st_size, st.st_mtime_ns) else None


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


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C (SIGINT) and SIGTERM held while the block runs, then acted on as they would have
    been at its end (their handlers called: a KeyboardInterrupt raised there): for a short
    section that must not be cut in two, such as a run's result files becoming its own with
    its manifest (a message saying no result was written, with the files in place, was the
    alternative). Outside the main thread, which never runs a signal handler, the block just
    runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous: dict[int, Any] = {}
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(signum)
            if handler is not None and handler != signal.SIG_IGN:  # (None: not Python's)
                previous[signum] = signal.signal(signum, lambda s, _: held.append(s))
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(held):
            handler = previous[signum]
            if callable(handler):
                handler(signum, None)
            else:  # SIG_DFL: the default action, now that it is back
                os.kill(os.getpid(), signum)


NOTES_MARK = "<!-- notes: kept when the table is rebuilt -->"


def write_table_markdown(path: str | os.PathLike[str], generated: str) -> None:
    """Write a generated table's markdown to ``path``, keeping what the file it replaces holds
    below NOTES_MARK (hand-written notes: how the runs were made, what the table shows)."""
    path = Path(path)
    notes = ""
    if path.exists() and NOTES_MARK in (old := path.read_text()):
        notes = "\n" + NOTES_MARK + old.split(NOTES_MARK, 1)[1]
    write_text_atomic(path, generated + notes)
