"""The configs and profiles the command lines read and write (conf/<group>/<name>.yaml or a
file), and the one-line input error they all end with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from common.paths import conf_dir
from experiments.files import write_text_atomic

CONF_DIR = str(conf_dir())


class InputError(SystemExit):
    """A mistake in the settings or the input files: main() prints it as one line, exit code 2."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def one_line(err: BaseException | str) -> str:
    """An error's message on one line (Hydra's and YAML's run over several, with the config
    search path after the point)."""
    lines = []
    for line in str(err).splitlines():
        if line.strip().startswith("Config search path"):
            break
        lines.append(line.strip())
    return " ".join(line for line in lines if line)


def write_yaml(path: Path, data: dict[str, Any], header: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    write_text_atomic(path, comment + yaml.safe_dump(data, sort_keys=False))


def load_conf(group: str, name_or_path: str, conf_dir: str = CONF_DIR) -> dict[str, Any]:
    path = Path(name_or_path)
    if not path.suffix:
        path = Path(conf_dir) / group / f"{name_or_path}.yaml"
    if not path.exists():
        raise ValueError(f"{group} profile {name_or_path!r} not found ({path})")
    return yaml.safe_load(path.read_text())


def load_profile(group: str, name_or_path: str) -> dict[str, Any]:
    """A hardware or overhead profile (a name in conf/ or a YAML file), checked in full."""
    from simulator.hardware import HardwareSpec
    from simulator.overhead import OverheadSpec

    try:
        conf = load_conf(group, name_or_path)
    except (ValueError, OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise InputError(f"--{group} {name_or_path}: {one_line(err)}") from None
    if not isinstance(conf, dict):
        raise InputError(f"--{group} {name_or_path}: not a YAML profile (a mapping of "
                         f"{group} settings, as in conf/{group}/)")
    try:
        (HardwareSpec if group == "hardware" else OverheadSpec).from_dict(dict(conf))
    except (ValueError, TypeError) as err:
        raise InputError(f"--{group} {name_or_path}: {one_line(err)}") from None
    return conf
