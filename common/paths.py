"""Where schedlab's configs are: the one place that locates conf/, in a checkout or an install."""

from __future__ import annotations

from pathlib import Path


def conf_dir() -> Path:
    """The conf/ directory every run reads (Hydra's primary config directory, the profiles and
    the calibration tables they name).

    It is found beside the experiments package, as ``experiments/conf``, so that it moves with
    the packages:
    in a checkout (and an editable install) ``experiments/conf`` is a symlink to the top-level
    ``conf/`` users edit; a built wheel (``pip install .``) carries a copy of its files there
    (pyproject.toml's package data), so an installed ``schedlab-run`` works from any directory.
    """
    return (Path(__file__).resolve().parent.parent / "experiments" / "conf").resolve()
