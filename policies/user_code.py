"""A user's code (a policy, router or process defined outside schedlab): whether a class is
one, where an error in it was raised, and a call into it whose exception is one line
(``HookError``). Below the policy interface (policies/base.py), which builds a user's classes,
and the hooks' contracts (policies/hooks.py), which call them."""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

# schedlab's packages: a class whose module is in one of them is schedlab's own
_PACKAGES = ("common", "policies", "simulator", "real_backend", "vllm_backend", "experiments",
             "benchmarks")
_ROOT = Path(__file__).resolve().parents[1]
# frames in these files are no user's code (schedlab's, Python's and installed libraries')
_NOT_USERS = tuple(str(_ROOT / p) + os.sep for p in _PACKAGES) + tuple(
    os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib", "purelib",
                                                          "platlib"))


class HookError(ValueError):
    """A policy's or router's hook broke its contract or raised: a one-line error (a
    ValueError, so a run reports it as its one-line error and exit code 2)."""


def users(cls: type) -> bool:
    """Whether ``cls`` is defined outside schedlab, so its hooks are checked."""
    return cls.__module__.partition(".")[0] not in _PACKAGES


def where(tb: TracebackType | None) -> str:
    """`` (file:line)`` of the last frame of ``tb`` in a user's code (outside schedlab, Python
    and installed libraries), else of its last frame in a file; "" if none."""
    last = users_last = ""
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not name.startswith("<"):
            last = f" ({name}:{tb.tb_lineno})"
            if not os.path.abspath(name).startswith(_NOT_USERS):
                users_last = last
        tb = tb.tb_next
    return users_last or last


def raised(owner: str, err: Exception) -> HookError:
    """The one-line error for ``err``, raised in ``owner`` (``policy Mine.chunk_size``)."""
    text = " ".join(str(err).split())  # one line, whatever the message
    return HookError(f"{owner} raised {type(err).__name__}{': ' + text if text else ''}"
                     f"{where(err.__traceback__)}")


def call_user(owner: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, a user's code, with an exception in it as one line naming
    ``owner``; a ValueError or TypeError (a setting refused) passes as it is."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError):
        raise
    except Exception as err:
        raise raised(owner, err) from err
