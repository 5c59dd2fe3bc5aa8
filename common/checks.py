"""The checks of a config section's settings every layer uses: names, integers, numbers and
flags, each refused in one line naming the setting."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any


def check_settings(section: str, given: Iterable[str], known: Iterable[str]) -> None:
    """A one-line error naming the first setting of ``section`` that is not one of ``known``."""
    known = set(known)
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"{section} has no setting {unknown[0]!r}; its settings: "
                         + (", ".join(sorted(known)) or "none"))


def check_int(setting: str, value: Any, minimum: int) -> int:
    """``value`` if it is an integer >= ``minimum`` (1.5, 2.0, "3" and True are refused: a
    setting silently rounded or cast runs a different configuration than the one recorded)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{setting} must be an integer >= {minimum}, got {value!r}")
    return value


def check_number(setting: str, value: Any, *, minimum: float | None = None,
                 positive: bool = False, maximum: float | None = None) -> float:
    """``value`` if it is a finite real number (>= ``minimum``; > 0 if ``positive``; <=
    ``maximum``)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value)):
        raise ValueError(f"{setting} must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{setting} must be > 0, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{setting} must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{setting} must be <= {maximum:g}, got {value!r}")
    return value


def check_bool(setting: str, value: Any) -> bool:
    """``value`` if it is true or false (1, "yes" and None are refused)."""
    if not isinstance(value, bool):
        raise ValueError(f"{setting} must be true or false, got {value!r}")
    return value


def check_steps(setting: str, value: Any) -> int:
    return check_int(f"policy.{setting}", value, 1)


@contextmanager
def settings_at(where: str, sections: Iterable[str]) -> Iterator[None]:
    """Check settings given at ``where`` rather than at the config's top level (a replica
    group's, ``cluster.groups[0]``) with the top level's own checks: a one-line error of theirs
    about one of ``sections`` names the setting where it was given (``scheduler.max_num_seqs``
    becomes ``cluster.groups[0].scheduler.max_num_seqs``), any other begins with ``where``."""
    try:
        yield
    except ValueError as err:
        text = str(err)
        head = re.match(r"\w+", text)
        named = head is not None and head.group() in set(sections)
        raise ValueError(f"{where}.{text}" if named else f"{where}: {text}") from None
