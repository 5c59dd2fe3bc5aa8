"""docs/policies.md's table of the policies cannot rot: it lists every registered policy, and
for each every setting of its conf/policy YAML with the YAML's value (and no other), which are
the policy class's settings."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import yaml

from policies import POLICIES

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf" / "policy"


def table_rows() -> dict[str, dict[str, str]]:
    """The table under "## The policies": each row's cells by column name, by policy name."""
    text = (ROOT / "docs" / "policies.md").read_text()
    section = text.split("\n## The policies\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip().strip("|").split("|")),
                         strict=True))
        rows[cells["`policy=`"].strip("`")] = cells
    return rows


def yaml_text(value: object) -> str:
    """A YAML value as the table writes it: true, 1000.0, [64, 128]."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(map(yaml_text, value)) + "]"
    return str(value)


def test_the_table_lists_every_registered_policy_and_only_those():
    assert set(table_rows()) == set(POLICIES) == {p.stem for p in CONF.glob("*.yaml")}


def test_each_row_gives_every_setting_of_the_policy_s_yaml_with_its_value():
    for name, cells in table_rows().items():
        conf = yaml.safe_load((CONF / f"{name}.yaml").read_text())
        assert conf.pop("name") == name
        # the settings cell: `key=value` for each, "none" where the policy has none
        written = dict(m.split("=", 1) for m in re.findall(r"`([a-z_]+=[^`]*)`",
                                                               cells["settings (`conf/policy/`)"]))
        assert written == {k: yaml_text(v) for k, v in conf.items()}, name
        if not conf:
            assert cells["settings (`conf/policy/`)"].startswith("none"), name
        # which are the class's settings: a setting added to the class shows up here
        assert set(conf) == {f.name for f in fields(POLICIES[name]) if f.init}, name
        assert cells["decides"] and cells["source"], name
