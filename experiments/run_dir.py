"""A run directory's life: unique by default, made and locked before Hydra writes into it, and
finished only when its result carries the stamp of the config now asked for."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

# Settings that change how a run is driven, never its result. They name no run directory
# (conf/config.yaml lists them in override_dirname.exclude_keys, a test checks it) and are left
# out of the config stamp, so a re-run with another value replaces or skips the same run.
CONTROL_KEYS = ("skip_existing", "progress")
LOCK_FILE = ".run.lock"
STAMP_KEY = "config_sha256"  # in result.json's schedlab section

# Locks held by this process. Module state, not the callback's: Hydra pickles its callbacks to
# the joblib launcher's workers, and an open file does not pickle.
_held: dict[Path, int] = {}

# ${pid:} in conf/config.yaml: default run and sweep directories are <time>-<pid>, so two runs
# started in the same second never share one. Cached, so a sweep's workers see the parent's.
if not OmegaConf.has_resolver("pid"):
    OmegaConf.register_new_resolver("pid", os.getpid, use_cache=True)


class RunDirError(Exception):
    """A run directory that cannot be made, written or locked; the message is one line."""


def claim(path: str | os.PathLike[str], setting: str = "hydra.run.dir") -> Path:
    """Make ``path`` and hold its lock until release() or exit; a directory another run holds,
    a file in its place, or one this process cannot write, is a RunDirError naming it."""
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


def release(path: str | os.PathLike[str]) -> None:
    fd = _held.pop(Path(path).absolute(), None)
    if fd is not None:
        os.close(fd)  # closing the last descriptor drops the lock (as exiting does)


def _claim_or_exit(config: DictConfig, setting: str) -> None:
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
            for name in ("aggregate.csv", "aggregate.parquet"):
                (path / name).unlink(missing_ok=True)
    except (RunDirError, IsADirectoryError) as err:
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
        release(str(config.hydra.sweep.dir))


def config_stamp(cfg: Mapping[str, Any]) -> str:
    """The sha256 of the resolved config without the control keys: runs with equal stamps are
    runs of one configuration (profiles included, so an edited hardware file changes it)."""
    data = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    data = {k: v for k, v in data.items() if k not in CONTROL_KEYS}
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
