"""docs/policies.md's reference of what a hook may read names exactly what exists: every field
and public property of `Request`, every `sched.*` attribute it lists on a real `Scheduler`, and
every hook and class flag of `Policy`."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

from policies import make_policy
from policies.base import Policy
from policies.block_manager import BlockManager
from policies.request import Request
from policies.scheduler import Scheduler
from policies.scheduler_config import SchedulerConfig

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "docs" / "policies.md").read_text()
SECTION = TEXT.split("\n## What a hook may read\n", 1)[1].split("\n## ", 1)[0]


def first_cells(after: str) -> list[str]:
    """The first column of the table that follows the line starting with ``after``."""
    lines = SECTION.split(f"\n{after}", 1)[1].split("\n\n", 2)[1].splitlines()
    return [line.split("|")[1].strip() for line in lines[2:]]  # after the header and its rule


def public_members(cls: type) -> set[str]:
    own = {name for name, _ in inspect.getmembers(cls) if not name.startswith("_")}
    return own - {"__post_init__"}


def test_every_request_field_and_property_is_documented_and_exists():
    names = {re.sub(r"\(.*\)", "", cell.strip("`")) for cell in first_cells("`req`, a `Request`")}
    fields = {f.name for f in dataclasses.fields(Request)}
    public = fields | public_members(Request)
    assert names == public, (sorted(public - names), sorted(names - public))


def test_every_scheduler_attribute_the_reference_names_exists():
    sched = Scheduler(make_policy("multi_step"), SchedulerConfig(), num_blocks=64,
                      max_model_len=2048)
    cells = first_cells("`sched`, the `Scheduler`")
    names = [n for cell in cells for n in re.findall(r"`sched\.(\w+)", cell)]
    assert len(names) >= 10
    missing = [n for n in names if not hasattr(sched, n)]
    assert not missing, missing
    block_manager_row = next(c for c in SECTION.splitlines() if c.startswith("| `sched.block_"))
    for name in re.findall(r"`(\w+)(?:\([^`]*\))?`", block_manager_row.split("|")[2]):
        assert hasattr(BlockManager, name), name


def test_every_hook_and_class_flag_of_policy_is_named():
    paragraph = SECTION.split("The hooks a policy overrides", 1)[1]
    named = set(re.findall(r"`(\w+)(?:\(\))?`", paragraph)) - {"Policy"}
    public = public_members(Policy) | {"__post_init__"}
    assert named == public, (sorted(public - named), sorted(named - public))
