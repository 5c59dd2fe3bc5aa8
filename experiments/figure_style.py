"""How figures draw each setting: a colour per policy, a marker per GPU, load or k, overlap's
line and fill, and the one legend of a figure."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from experiments.files import atomic_path
from experiments.labels import HUMAN_NAMES, counts_conversations

# Colours are the policy's everywhere (tab10 in this order), so figures can be read side by side.
# the ten of matplotlib's cycle, then colours apart from them for the policies past ten
_PALETTE = [f"C{i}" for i in range(10)] + ["black", "saddlebrown", "deeppink", "teal", "navy"]
POLICY_COLOURS = {p: _PALETTE[i % len(_PALETTE)] for i, p in enumerate(HUMAN_NAMES["policy"])}
EXTRA_COLOURS = ("olive", "magenta", "lime", "gold", "cyan", "pink")  # policies not named above
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "h")  # one per GPU (steps) or per k / load
# overlap off: solid line, filled marker; on: dashed line, open marker (a point alone has no line)
OVERLAP_STYLES = {False: "-", True: "--"}


def marker_face(colour: str, overlap: bool) -> str:
    """A marker's fill: the series' colour, or white (an open marker) with overlap on."""
    return "white" if overlap else colour


def overlap_on(value: Any) -> bool:
    """Whether a table's overlap cell says on: a bool, numpy bool, 1 / 1.0, or CSV text."""
    return str(value).lower() in ("true", "1", "1.0")


def policy_colours(policies: Iterable[str]) -> dict[str, str]:
    """The fixed colour of each named policy; others take the extra colours in name order."""
    colours = {p: POLICY_COLOURS[p] for p in policies if p in POLICY_COLOURS}
    for i, p in enumerate(sorted(set(policies) - set(colours))):
        colours[p] = EXTRA_COLOURS[i % len(EXTRA_COLOURS)]
    return colours


def policy_order(policy: str) -> tuple[int, str]:
    """A sort key: the named policies in their table's order, then the others by name."""
    names = list(HUMAN_NAMES["policy"])
    return (names.index(policy) if policy in names else len(names), policy)


@dataclass(frozen=True)
class Style:
    """How one series is drawn."""

    colour: str
    marker: str
    linestyle: str
    face: str  # the marker's fill


def figure_legend(fig: Figure, groups: list[list[tuple[Any, str]]], note: str,
                  spare: Axes | None = None) -> None:
    """The figure's one legend, a column per group (policies, GPUs, overlap), its title saying
    what the points and bars are: in ``spare`` (an empty panel) if given, else under the
    figure."""
    groups = [g for g in groups if g]
    if len(groups) == 1:  # one kind of entry: in a row, not a column
        groups = [[entry] for entry in groups[0]]
    rows = max(len(g) for g in groups)
    handles, labels = [], []
    for g in groups:
        for handle, label in g + [(Line2D([], [], alpha=0), "")] * (rows - len(g)):
            handles.append(handle)
            labels.append(label)
    style = dict(ncol=len(groups), frameon=False, title=note, title_fontsize=8, fontsize=9)
    if spare is None:
        fig.legend(handles, labels, loc="outside lower center", **style)
    else:
        spare.axis("off")
        spare.legend(handles, labels, loc="center", **style)


OFFERED_LABEL = "offered load"


def draw_offered(ax: Axes, df: pd.DataFrame) -> None:
    """The offered load on a req/s axis over the configured rate (``request_rate``, x): the
    line y = x where that rate counts requests; where it starts conversations, the requests
    sent per second (the table's ``offered_rate``, mean per rate; none in a table without)."""
    if not counts_conversations(df.get("workload", [])):
        rates = sorted(df["request_rate"].unique())
        ax.plot(rates, rates, color="0.6", linestyle=":", label=OFFERED_LABEL)
    elif "offered_rate" in df and df["offered_rate"].notna().any():
        sent = df.groupby("request_rate")["offered_rate"].mean().sort_index()
        ax.plot(sent.index, sent.values, color="0.6", linestyle=":",
                label=f"{OFFERED_LABEL} (requests sent/s)")


def save(fig: Figure, out: Path, stem: str) -> list[Path]:
    """PNG and SVG, each written to a temporary file first so no half figure is left behind;
    drawing one table twice gives the same files."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    try:
        for ext in ("png", "svg"):
            path = out / f"{stem}.{ext}"
            # no date and fixed element ids: the same figure gives the same SVG file
            with atomic_path(path) as tmp, plt.rc_context({"svg.hashsalt": "schedlab"}):
                fig.savefig(tmp, format=ext, dpi=150, bbox_inches="tight",
                            metadata={"Date": None} if ext == "svg" else None)
            paths.append(path)
    finally:
        plt.close(fig)
    return paths
