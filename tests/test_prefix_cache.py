"""Prefix caching in the block manager: block hashes, hits against an independent reference,
reference counts under preemption, LRU eviction, and lpm's order."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.workload.trace import hash_id_segments
from policies import BlockManager, Request, SchedulerConfig, make_scheduler
from policies.prefix_cache import block_hashes, token_segments


def req(i: int, segments, max_tokens: int = 4, arrival: float = 0.0) -> Request:
    r = Request(i, arrival, sum(n for _, n in segments), max_tokens)
    r.prefix_segments = tuple(segments)
    return r


def run(reqs, policy="single_step", params=None, *, num_blocks=400, block_size=4,
        caching=True, budget=None):
    cfg = SchedulerConfig(block_size=block_size, watermark=0.0, enable_prefix_caching=caching,
                          max_num_batched_tokens=budget)
    s = make_scheduler(policy, params or {}, cfg, num_blocks, max_model_len=4096)
    pending = sorted(reqs, key=lambda r: r.arrival_time)
    now, admitted = 0.0, []
    while pending or s.has_unfinished:
        while pending and pending[0].arrival_time <= now:
            s.add_request(pending.pop(0))
        batch = s.schedule(now)
        if batch is None:
            now = pending[0].arrival_time
            continue
        admitted += [x.request for x in batch.seqs
                     if x.is_prefill and x.request not in admitted]
        s.block_manager.check(s.running)
        times = [now + j + 1.0 for j in range(batch.num_steps)]
        s.update(batch, times)
        s.block_manager.check(s.running)
        now = times[-1]
    assert s.block_manager.num_free_blocks == num_blocks and not s.block_manager._refs
    return s, admitted


def test_hashes_follow_content_not_the_way_it_is_cut():
    a = req(0, [(1, 6), (2, 10)])
    b = req(1, [(1, 6), (2, 4), (3, 6)])
    c = req(2, [(1, 5), (9, 11)])
    ha, hb, hc = (block_hashes(r, 4) for r in (a, b, c))
    assert len(ha) == 4 and len(hb) == 4  # full blocks only
    assert ha[:2] == hb[:2] and ha[2] != hb[2]  # tokens 8..11: key 2 against 2 then 3
    assert hc[0] == ha[0] and hc[1] != ha[1]  # tokens 4..7 differ from token 5 on
    assert ha[3] != hb[3]  # a chain: a block's hash names everything before it
    assert block_hashes(req(3, [(1, 3)]), 4) == []
    # a served prompt's segment is its token ids: equal runs, equal keys
    ids = list(range(30))
    x, y = Request(4, 0.0, 30, 2), Request(5, 0.0, 30, 2)
    x.prefix_segments = token_segments(ids)
    y.prefix_segments = token_segments(ids[:20] + [99] * 10)
    assert block_hashes(x, 4)[:5] == block_hashes(y, 4)[:5]
    assert block_hashes(x, 4)[5] != block_hashes(y, 4)[5]
    z = Request(6, 0.0, 30, 2)  # the same ids in two segments: the same keys
    z.prefix_segments = token_segments(ids[:7]) + token_segments(ids[7:])
    assert block_hashes(z, 4) == block_hashes(x, 4) and block_hashes(z, 3) == block_hashes(x, 3)


def test_a_shared_system_prompt_is_computed_once():
    reqs = [req(i, [(1, 17), (100 + i, 5)]) for i in range(6)]
    s, _ = run(reqs)
    # the first computes it; the others (even in the same window) start after its 4 full blocks
    assert [r.num_cached_prompt_tokens for r in reqs] == [0] + [16] * 5
    off, _ = run([req(i, [(1, 17), (100 + i, 5)]) for i in range(6)], caching=False)
    assert off.stats.num_steps >= s.stats.num_steps


def test_the_last_token_is_always_computed():
    reqs = [req(i, [(1, 16)]) for i in range(2)]  # equal prompts of exactly 4 blocks
    run(reqs)
    assert reqs[1].num_cached_prompt_tokens == 12  # the 4th block holds the sampled token


def test_a_preempted_request_keeps_nothing_another_holds_away():
    # 2 requests share 3 blocks; the cache is too small for both to decode: one is preempted,
    # its shared blocks stay with the other, and it finds them again when re-admitted
    reqs = [req(i, [(1, 12), (50 + i, 2)], max_tokens=40) for i in range(2)]
    s, _ = run(reqs, "multi_step", {"num_steps": 4}, num_blocks=17)
    assert s.stats.num_preemptions > 0
    assert reqs[1].num_cached_prompt_tokens == 12
    assert all(r.num_output_tokens == 40 for r in reqs)


def test_eviction_takes_the_least_recently_freed_block_first():
    bm = BlockManager(4, block_size=2, watermark=0.0, enable_caching=True)
    a, b = req(0, [(1, 3)]), req(1, [(2, 3)])
    for r in (a, b):
        assert bm.ensure_slots(r, 3)
        bm.cache_blocks(r, 3)  # one full block each is indexed
        bm.free(r)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    c = req(2, [(3, 8)])
    assert bm.ensure_slots(c, 6)  # the 2 never-indexed blocks, then a's (freed first)
    assert bm.match(req(3, [(1, 3)])) == [] and len(bm.match(req(4, [(2, 3)]))) == 1
    bm.check([c])


def test_caching_off_finds_nothing():
    reqs = [req(i, [(1, 17), (100 + i, 5)]) for i in range(4)]
    run(reqs, caching=False)
    assert all(r.num_cached_prompt_tokens == 0 for r in reqs)


def test_lpm_runs_the_request_with_the_longest_cached_prefix_first():
    cfg = SchedulerConfig(block_size=4, watermark=0.0, max_num_seqs=1)
    s = make_scheduler("lpm", {}, cfg, 100, max_model_len=4096)
    s.add_request(req(0, [(1, 16), (2, 4)], max_tokens=2))
    batch = s.schedule(0.0)
    s.update(batch, [1.0])
    s.add_request(req(1, [(8, 20)], max_tokens=2, arrival=1.0))
    s.add_request(req(2, [(1, 16), (3, 4)], max_tokens=2, arrival=1.5))
    batch = s.schedule(2.0)  # request 0 still decodes alone (max_num_seqs=1)
    s.update(batch, [3.0])
    batch = s.schedule(3.0)
    assert [x.request.request_id for x in batch.seqs] == [2]
    assert batch.seqs[0].num_cached_tokens == 16


# --- against an independent reference: with a cache large enough never to evict, a request's
# hit is its longest common run of full blocks with any request admitted before it -----------

def _tokens(r: Request) -> list[tuple[int, int]]:
    """The prompt as (key, offset) per token: equal pairs are equal tokens."""
    return [(key, j) for key, n in r.prefix_segments for j in range(n)]


def _reference_hits(admitted: list[Request], block_size: int) -> dict[int, int]:
    hits, seen = {}, []
    for r in admitted:
        mine = _tokens(r)
        best = 0
        for other in seen:
            common = 0
            while common < min(len(mine), len(other)) and mine[common] == other[common]:
                common += 1
            best = max(best, common // block_size)
        hits[r.request_id] = min(best, (len(mine) - 1) // block_size) * block_size
        seen.append(mine)
    return hits


prompts = st.lists(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 9)), min_size=1,
                            max_size=4), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(prompts, st.sampled_from([1, 2, 4]), st.sampled_from(["single_step", "multi_step"]),
       st.integers(0, 3))
def test_hits_equal_an_independent_reference(segs, block_size, policy, spread):
    # segments keyed by (content, length) so that one key always has one length
    reqs = [req(i, [(k * 100 + n, n) for k, n in s], max_tokens=3, arrival=float(i % (spread + 1)))
            for i, s in enumerate(segs)]
    _, admitted = run(reqs, policy, {"num_steps": 3} if policy == "multi_step" else {},
                      num_blocks=2000, block_size=block_size)
    want = _reference_hits(admitted, block_size)
    assert {r.request_id: r.num_cached_prompt_tokens for r in reqs} == want


# --- the policies that size or preempt by blocks and time see the cached prefix --------------

def _prio(i, segments, max_tokens, priority, arrival=0.0):
    r = req(i, segments, max_tokens, arrival)
    r.priority = priority
    return r


def test_priority_preempts_nobody_for_a_request_its_cached_prefix_lets_in():
    cfg = SchedulerConfig(block_size=4, watermark=0.0)
    s = make_scheduler("priority", {}, cfg, 20, max_model_len=4096)
    low = _prio(0, [(7, 44), (100, 4)], 8, 1)
    s.add_request(low)
    for t in (0.0, 1.0):
        s.update(s.schedule(t), [t + 1.0])
    s.add_request(_prio(1, [(7, 44), (200, 4)], 2, 0, arrival=2.0))  # 11 of 12 blocks cached
    batch = s.schedule(2.0)
    assert batch.preempted == [] and low.num_preemptions == 0
    assert [x.num_cached_tokens for x in batch.seqs] == [44]


def test_priority_counts_only_the_blocks_a_victim_frees():
    """Two running requests share 10 blocks: preempting one frees only its own block, so both
    go at once for a waiting request of higher priority that needs 20."""
    cfg = SchedulerConfig(block_size=4, watermark=0.0)
    s = make_scheduler("priority", {}, cfg, 30, max_model_len=4096)
    for i, own in enumerate((100, 101)):
        s.add_request(_prio(i, [(7, 40), (own, 4)], 30, 1 + i))
    s.update(s.schedule(0.0), [1.0])
    s.add_request(_prio(2, [(9, 80)], 2, 0, arrival=1.0))
    batch = s.schedule(1.0)
    assert sorted(r.request_id for r in batch.preempted) == [0, 1]
    assert [x.request.request_id for x in batch.seqs if x.is_prefill] == [2]


def test_sarathi_prices_a_first_chunk_with_its_cached_context():
    from policies.step_budget import step_seconds

    def step_time(decodes, decode_kv, longest, chunks):  # attention grows with the context
        return 1e-5 * (decodes + sum(q for q, _, _ in chunks)) \
            + 2e-9 * sum(q * c for q, c, _ in chunks)

    cfg = SchedulerConfig(block_size=16, watermark=0.0)
    s = make_scheduler("sarathi", {"tpot_slo_ms": 20.0}, cfg, 2000, max_model_len=16384,
                       step_time_fn=step_time)
    first = req(0, [(1, 7990), (2, 10)], 2)
    s.add_request(first)
    while first.num_output_tokens == 0:
        batch = s.schedule(0.0)
        s.update(batch, [1.0] * batch.num_steps)
    s.add_request(req(1, [(1, 7990), (3, 3010)], 2, arrival=1.0))
    batch = s.schedule(1.0)
    (chunk,) = [x for x in batch.seqs if x.request.request_id == 1]
    assert chunk.num_cached_tokens == 7984
    s.forming = [x for x in batch.seqs if x is not chunk]
    assert step_seconds(s, (chunk.num_query_tokens, chunk.num_cached_tokens, chunk.samples)) \
        <= 20e-3 + 1e-12


# --- keys are digests of the content, not Python's hash() -----------------------------------
# CPython's tuple hash (Objects/tupleobject.c, xxHash-based since 3.8): per item
# acc = rotl31(acc + hash(item) * P2) * P1 from acc = P5, then the length is mixed in. Each
# round can be inverted, so the last item of a tuple of any hash is solved for in a few steps.
_M = 2**64
_P1, _P2, _P5 = 11400714785074694791, 14029467366897019727, 2870177450012600261


def colliding(head: list[int], target: int) -> list[int]:
    """``head`` (its last id changed if need be) and one more id, whose tuple hash is
    ``target``: the hash's last round inverted for the last item, as an attacker would."""
    for tweak in range(64):
        items = [*head[:-1], head[-1] + tweak]
        acc = _P5
        for item in items:
            acc = (acc + hash(item) % _M * _P2) % _M
            acc = (acc << 31 | acc >> 33) % _M * _P1 % _M
        last = (target - ((len(items) + 1) ^ _P5 ^ 3527539)) % _M  # before the length's mix
        last = last * pow(_P1, -1, _M) % _M
        last = (last >> 31 | last << 33) % _M  # rotate right 31
        lane = (last - acc) * pow(_P2, -1, _M) % _M
        if lane < 2**61 - 1:  # an int below 2**61 - 1 hashes to itself
            return [*items, lane]
    raise AssertionError("no colliding tuple found")


def served(i: int, ids: list[int], arrival: float = 0.0) -> Request:
    """A prompt as the HTTP server keys it (real_backend/serving/inbox.py)."""
    r = Request(i, arrival, len(ids), 2, prompt_token_ids=list(ids))
    r.prefix_segments = token_segments(ids)
    return r


def test_blocks_with_equal_tuple_hashes_get_different_keys():
    """Two different 16-token blocks with equal tuple hashes: the old key of a served block
    (its tuple hash, then chained with hash()) was equal, so prompt B was served from prompt
    A's KV; their digests differ, and B computes its own block."""
    a = list(range(16))
    b = colliding(list(range(100, 115)), hash(tuple(a)))
    assert a != b and hash(tuple(a)) == hash(tuple(b))
    first, other, again = served(0, a + [7]), served(1, b + [7], 1.0), served(2, a + [9], 2.0)
    assert block_hashes(first, 16) != block_hashes(other, 16)
    run([first, other, again], block_size=16)
    assert other.num_cached_prompt_tokens == 0
    assert again.num_cached_prompt_tokens == 16  # the cache still finds equal blocks


def test_content_keys_are_compared_by_value_not_by_python_hash():
    """hash(1) == hash(2**61): two workload contents whose keys differ only by the modulus of
    Python's int hash shared a block's KV."""
    assert hash(1) == hash(2**61)
    a, b = req(0, [(1, 17)]), req(1, [(2**61, 17)], arrival=1.0)
    run([a, b], block_size=16)
    assert b.num_cached_prompt_tokens == 0


def test_served_tokens_never_share_a_key_with_a_trace_block():
    """A Mooncake trace's block is named content (its hash id's content key); a served block
    is its token ids. The old served key was the tuple hash of the ids, in the same space as
    content keys: ids whose tuple hash is a trace block's key were served from its KV."""
    segments = hash_id_segments((7,), 17, 16, 0)
    ids = colliding(list(range(15)), segments[0][0])
    assert hash(tuple(ids)) == segments[0][0]
    trace_req, served_req = req(0, segments), served(1, ids + [3], 1.0)
    run([trace_req, served_req], block_size=16)
    assert served_req.num_cached_prompt_tokens == 0
    # nor do a served block and a named one whose ids are the named piece's numbers
    assert block_hashes(served(2, [5, 0, 3]), 3) != block_hashes(req(3, [(5, 3)]), 3)


def test_a_segment_key_that_is_no_key_is_named():
    r = req(7, [("system", 8)])
    with pytest.raises(ValueError, match=r"^request 7: prefix segment key 'system' is neither "
                                         r"an int in \[-2\*\*63, 2\*\*63\) nor token id bytes"):
        block_hashes(r, 4)
