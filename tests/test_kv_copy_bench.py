"""benchmarks/kv_copy.py's transfers move the right blocks (checked on CPU tensors; the GPU
times are BENCHMARKS.md's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

from common.model_spec import ModelSpec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import kv_copy  # noqa: E402


def _pools(blocks: int) -> kv_copy.Pools:
    spec = ModelSpec.from_dict(yaml.safe_load(open(ROOT / "conf" / "model" / "tiny.yaml")))
    return kv_copy.Pools(spec, block_size=4, max_blocks=blocks, device="cpu")


@pytest.mark.parametrize("count", [1, 3, 8])
def test_every_transfer_copies_the_drawn_blocks(count):
    kv_copy.check(_pools(8), count, torch.Generator().manual_seed(count))


def test_a_transfer_that_misses_a_layer_is_caught(monkeypatch):
    pools = _pools(8)
    real = kv_copy.Pools.h2d

    def h2d_without_last_layer(self, ids):
        saved = self.dst[-1].clone()
        real(self, ids)
        self.dst[-1].copy_(saved)

    monkeypatch.setattr(kv_copy.Pools, "h2d", h2d_without_last_layer)
    with pytest.raises(SystemExit, match="d2h \\+ h2d of 4 blocks copied wrong data"):
        kv_copy.check(pools, 4, torch.Generator().manual_seed(0))


def test_bad_counts_are_one_line():
    with pytest.raises(SystemExit):
        kv_copy.parse_args(["--counts", "0,4"])
