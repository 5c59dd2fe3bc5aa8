"""A run directory's life: unique by default, named safely, made and locked before Hydra writes
into it, finished only when its result carries the stamp of the config now asked for, and
cleared of nothing but the files schedlab recorded writing there (its manifest)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from experiments.files import stale_copies, write_text_atomic, written_sha256

# Settings that change how a run is driven, never its result. They name no run directory
# (conf/config.yaml lists them in override_dirname.exclude_keys, a test checks it) and are left
# out of the config stamp, so a re-run with another value replaces or skips the same run.
CONTROL_KEYS = ("skip_existing", "progress")
LOCK_FILE = ".run.lock"
STAMP_KEY = "config_sha256"  # in result.json's schedlab section

# Locks held by this process. Module state, not the callback's: Hydra pickles its callbacks to
# the joblib launcher's workers, and an open file does not pickle.
_held: dict[Path, int] = {}
_sweep_dirs: list[Path] = []  # the sweep directories this process claimed (sweeping())

# ${pid:} in conf/config.yaml: default run and sweep directories are <time>-<pid>, so two runs
# started in the same second never share one. Cached, so a sweep's workers see the parent's.
if not OmegaConf.has_resolver("pid"):
    OmegaConf.register_new_resolver("pid", os.getpid, use_cache=True)


# A sweep job's directory name: its overrides as written (policy.num_steps=4,policy=cp1), with
# any other character than these made "_" (a "/" would make "..": a way out of the sweep dir).
_DIRNAME_CHARS = re.compile(r"[^A-Za-z0-9._,=+@:%\[\]{}-]")
MAX_DIRNAME = 200  # characters; file systems allow 255 bytes


def safe_dirname(overrides: str) -> str:
    """``${safe_dirname:${hydra.job.override_dirname}}`` in conf/config.yaml: one path component
    that stays inside the sweep dir. Ordinary overrides keep their name; a changed or shortened
    one ends in a digest of the original, so two runs never share a directory."""
    name = _DIRNAME_CHARS.sub("_", overrides)
    if name in (".", ".."):
        name = name.replace(".", "_")
    if name != overrides or len(name) > MAX_DIRNAME:
        digest = hashlib.sha256(overrides.encode()).hexdigest()[:10]
        name = f"{name[:MAX_DIRNAME - len(digest) - 1]}-{digest}"
    return name


if not OmegaConf.has_resolver("safe_dirname"):
    OmegaConf.register_new_resolver("safe_dirname", safe_dirname)


class RunDirError(Exception):
    """A run directory that cannot be made, written, locked or cleared; the message is one line."""


def claim(path: str | os.PathLike[str], setting: str = "hydra.run.dir") -> Path:
    """Make ``path`` and hold its lock until release() or exit; a directory another run holds,
    a file in its place, or one this process cannot write, is a RunDirError naming it."""
    if not str(path).strip():  # Path("") is the current directory
        raise RunDirError(f"{setting} is empty; give a directory ({setting}=DIR)")
    path = Path(path).absolute()
    if path in _held:
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunDirError(f"{setting}={path} is a file, not a directory") from None
    except OSError as err:
        raise RunDirError(f"cannot create {setting}={path}: {err.strerror}") from None
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise RunDirError(f"cannot write into {setting}={path}: {err.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        raise RunDirError(f"{setting}={path} is in use by another run"
                          + (f" (pid {holder})" if holder.isdigit() else "")
                          + f"; wait for it to finish or choose another {setting}") from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError as err:  # a full disk: Hydra would fail later, deep in its config writer
        os.close(fd)
        raise RunDirError(f"cannot write into {setting}={path}: {err.strerror}") from None
    _held[path] = fd
    return path


def sweeping() -> bool:
    """Whether this process runs a sweep (it claimed a sweep directory), under any launcher:
    an interrupted sweep's message tells of the runs that finished."""
    return bool(_sweep_dirs)


def release(path: str | os.PathLike[str]) -> None:
    fd = _held.pop(Path(path).absolute(), None)
    if fd is not None:
        os.close(fd)  # closing the last descriptor drops the lock (as exiting does)


def _claim_or_exit(config: DictConfig, setting: str) -> None:
    path = None
    try:
        path = claim(str(OmegaConf.select(config, setting)), setting)
        subdir = OmegaConf.select(config, "hydra.output_subdir")
        if setting == "hydra.run.dir" and subdir and (path / subdir).exists() \
                and not (path / subdir).is_dir():  # Hydra writes its config files there next
            raise RunDirError(f"{path / subdir} is a file; Hydra keeps the run's config in a "
                              f"directory of that name: remove it or choose another {setting}")
        if setting == "hydra.sweep.dir":
            # A sweep that fails or is interrupted never reaches the aggregate callback: the
            # tables of an earlier sweep into this directory go now, so none is left stale.
            remove_recorded(path, AGGREGATE_FILES, setting)
            _sweep_dirs.append(path)
    except (RunDirError, IsADirectoryError) as err:
        if path is not None:  # refused after the claim: the directory is not this run's
            release(path)
        # Hydra turns a callback's exception into a warning; only an exit stops the run.
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


class RunDirCallback(Callback):
    """Claims the run (or sweep) directory before Hydra writes its .hydra files into it."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _claim_or_exit(config, "hydra.run.dir")

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        release(str(config.hydra.run.dir))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _claim_or_exit(config, "hydra.sweep.dir")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra ends callbacks in reverse order: the aggregate callback has written its tables
        path = Path(str(config.hydra.sweep.dir))
        try:
            record(path, [n for n in AGGREGATE_FILES if (path / n).is_file()])
        finally:
            release(path)


def config_stamp(cfg: Mapping[str, Any]) -> str:
    """The sha256 of the resolved config without the control keys: runs with equal stamps are
    runs of one configuration (profiles included, so an edited hardware file changes it)."""
    data = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    data = {k: v for k, v in data.items() if k not in CONTROL_KEYS}
    # speculation off is left out, so that a run's stamp is the one it had before speculative
    # decoding's settings existed (skip_existing still finds its result)
    spec = data.get("spec")
    if isinstance(spec, dict) and spec.get("method") in ("off", False):
        del data["spec"]
    workload = data.get("workload")
    if isinstance(workload, dict) and "acceptance" in workload and workload["acceptance"] is None:
        data["workload"] = {k: v for k, v in workload.items() if k != "acceptance"}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def finished(run_dir: str | os.PathLike[str], stamp: str) -> bool:
    """Whether run_dir holds the result of the configuration stamped ``stamp``: a missing,
    unreadable, unstamped or differently stamped result.json means the run is to be done."""
    try:
        result = json.loads((Path(run_dir) / "result.json").read_text())
    except (OSError, ValueError):
        return False
    ext = result.get("schedlab") if isinstance(result, dict) else None
    return isinstance(ext, dict) and ext.get(STAMP_KEY) == stamp


# ---------------------------------------------------------------------------------------------
# The manifest: what schedlab wrote in a directory, so that only those files are ever removed
# ---------------------------------------------------------------------------------------------

MANIFEST = ".schedlab-manifest.json"
AGGREGATE_FILES = ("aggregate.csv", "aggregate.parquet")  # a sweep dir's tables


def _fingerprint(path: Path) -> dict[str, Any]:
    sha256 = written_sha256(path)  # (a file hashed as it was written is not read again)
    if sha256 is None:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        sha256 = digest.hexdigest()
    return {"size": path.stat().st_size, "sha256": sha256}


def _recorded(directory: Path) -> dict[str, Any]:
    try:
        files = json.loads((directory / MANIFEST).read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):
        return {}  # none, unreadable or not ours: nothing in the directory counts as ours
    return files if isinstance(files, dict) else {}


def record(directory: str | os.PathLike[str], names: Iterable[str]) -> None:
    """List ``names``, files schedlab has just written in ``directory``, in its manifest (size
    and sha256), beside the entries of its other files that are still there."""
    directory = Path(directory)
    files = {n: e for n, e in _recorded(directory).items() if (directory / n).is_file()}
    files.update({n: _fingerprint(directory / n) for n in names})
    if files:
        write_text_atomic(directory / MANIFEST, json.dumps({"files": files}, indent=1) + "\n")
    else:
        (directory / MANIFEST).unlink(missing_ok=True)


def unrecorded(directory: str | os.PathLike[str], names: Iterable[str]) -> list[str]:
    """Those of ``names`` present in ``directory`` that its manifest does not list, or that
    changed since: files schedlab did not write there, never to be removed or replaced."""
    directory = Path(directory)
    files = _recorded(directory)
    present = [n for n in names if (directory / n).exists() or (directory / n).is_symlink()]
    return [n for n in present if (directory / n).is_symlink() or not (directory / n).is_file()
            or files.get(n) != _fingerprint(directory / n)]


def remove_recorded(directory: str | os.PathLike[str], names: Sequence[str],
                    setting: str) -> None:
    """Remove a previous run's ``names`` from ``directory`` (in their order), if schedlab wrote
    every one of them there, and the temporary copies of them a killed run left; one it did not
    write (or that changed since) is a RunDirError naming it, before anything is removed."""
    directory = Path(directory)
    foreign = unrecorded(directory, names)
    if foreign:
        them = "it" if len(foreign) == 1 else "them"
        raise RunDirError(f"{directory} holds {', '.join(foreign)}, which schedlab did not write "
                          f"there or which changed since ({MANIFEST} lists what it wrote); "
                          f"move {them} away or choose another {setting}")
    for name in names:
        (directory / name).unlink(missing_ok=True)
        for copy in stale_copies(directory / name):  # of a run killed while it wrote them
            copy.unlink(missing_ok=True)
    record(directory, [])


def check_inputs_outside(cfg: Any, directory: str | os.PathLike[str], names: Iterable[str],
                         setting: str) -> None:
    """Refuse (RunDirError) a run whose input (any file a setting names, a trace or arrivals
    file) is one of the files ``names`` it writes into ``directory``: it would replace it."""
    directory = Path(directory)
    targets = {}
    for name in names:
        try:
            st = (directory / name).stat()
        except OSError:
            continue
        targets[(st.st_dev, st.st_ino)] = name

    def walk(node: Any, key: str) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, list | tuple):
            for i, v in enumerate(node):
                walk(v, f"{key}[{i}]")
        elif isinstance(node, str | os.PathLike) and targets:
            try:
                st = os.stat(node)
            except (OSError, ValueError):
                return
            name = targets.get((st.st_dev, st.st_ino))
            if name is not None:
                raise RunDirError(f"{key}={node} is {directory / name}, a file this run writes; "
                                  f"choose another {setting} (or move the input)")

    walk(OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg, "")
