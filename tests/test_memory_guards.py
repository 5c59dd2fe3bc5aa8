"""Settings that ask for more memory than a host has are refused, or cost nothing until used."""

from __future__ import annotations

import random
import tracemalloc

import pytest
from hydra import compose, initialize_config_dir

from experiments.run import CONF_DIR, run
from policies.block_manager import BlockManager
from policies.request import Request


def run_with(tmp_path, *overrides: str) -> dict:
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=["workload=synthetic", "progress=false", *overrides])
    return run(cfg, tmp_path)


def test_block_manager_memory_does_not_grow_with_the_cache() -> None:
    tracemalloc.start()
    bm = BlockManager(10**7)
    req = Request(0, 0.0, 32, 8)
    assert bm.ensure_slots(req, 40)
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert size < 100_000, size
    assert req.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 10**7 - 3


def test_block_manager_hands_out_blocks_in_the_order_of_one_free_list() -> None:
    """The reference is the free list [n-1, ..., 0] popped from the end, freed blocks pushed back
    in reverse: the order every committed run was made with."""
    n, rng = 97, random.Random(3)
    bm, free = BlockManager(n, block_size=4, watermark=0.0), list(range(n - 1, -1, -1))
    live: list[tuple[Request, list[int]]] = []
    for i in range(2000):
        if live and rng.random() < 0.4:
            req, table = live.pop(rng.randrange(len(live)))
            bm.free(req)
            free.extend(reversed(table))
            continue
        req = Request(i, 0.0, 1, 1)
        tokens = rng.randint(1, 40)
        need = -(-tokens // 4)
        ok = bm.ensure_slots(req, tokens)
        assert ok == (need <= len(free))
        if ok:
            table = [free.pop() for _ in range(need)]
            assert req.block_table == table
            live.append((req, table))
        bm.check([r for r, _ in live])
        assert bm.num_free_blocks == len(free)
    with pytest.raises(RuntimeError, match="freed twice"):
        req = live[0][0]
        stale = list(req.block_table)
        bm.free(req)
        req.block_table = stale
        bm.free(req)


def test_a_window_longer_than_the_context_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError) as err:
        run_with(tmp_path, "workload.num_prompts=4", "policy.num_steps=100000")
    assert str(err.value) == (
        "policy.num_steps = 100000 exceeds model.max_model_len 8192: a window cannot run more "
        "steps than a sequence has positions")


@pytest.mark.parametrize("setting", ["backend.num_blocks=2000000000", "hardware.hbm_gib=100000"])
def test_a_huge_simulated_cache_costs_no_memory(tmp_path, setting) -> None:
    tracemalloc.start()
    result = run_with(tmp_path, "workload.num_prompts=20", setting)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert result["completed"] == 20
    assert peak < 200 * 2**20, peak


def test_a_real_cache_larger_than_the_host_is_refused(tmp_path) -> None:
    pytest.importorskip("torch")
    with pytest.raises(ValueError) as err:
        run_with(tmp_path, "backend=real", "model=tiny", "backend.device=cpu",
                 "workload.num_prompts=2", "backend.num_blocks=2000000000")
    assert str(err.value).startswith("backend.num_blocks 2000000000 needs 32768.0 GB of KV cache "
                                     "but the host has"), err.value


def test_can_allocate_is_the_free_blocks_less_those_needed() -> None:
    """can_allocate, written out for speed, is num_free_blocks - blocks_needed >= the
    watermark: over free, fresh, returned, evictable and unassigned blocks and every kind of
    prefix-cache hit (none, empty, held and evictable blocks, one not in the cache)."""
    rng = random.Random(0)
    for _ in range(1500):
        bm = BlockManager(rng.randint(1, 60), rng.choice([1, 4, 16]),
                          rng.choice([0.0, 0.01, 0.2, 0.5]))
        bm._next_fresh = rng.randint(0, bm.num_blocks)
        used = list(range(bm._next_fresh))
        rng.shuffle(used)
        k = rng.randint(0, len(used))
        bm._returned, rest = used[:k], used[k:]
        for b in rest[:rng.randint(0, len(rest))]:
            bm._evictable[b] = None
        bm.unassigned = rng.randint(0, 5)
        for hits in (None, [], rest[:rng.randint(0, len(rest))], [10**6]):
            for n in (0, 1, 15, 16, 17, rng.randint(0, 2000)):
                expected = bm.num_free_blocks - bm.blocks_needed(n, hits) >= bm.watermark_blocks
                assert bm.can_allocate(n, hits) == expected
