"""A model of the paged KV cache, slot by slot, under every policy with prefix caching: each
window runs in the order it was formed (with overlap, one window behind), writes the identity
of the prefix each new position encodes, and every position a step attends to must hold the
right prefix. Shared, evicted, preempted, aborted and early-stopped (EOS) blocks included."""

from __future__ import annotations

import random

import pytest
from test_policy_properties import PARAMS
from test_policy_properties import stand_in_step_time as stand_in

from policies import Request, SchedulerConfig, make_scheduler


def tokens(r):
    """The prompt as (key, offset) per token: equal pairs are equal tokens."""
    return [(k, j) for k, n in r.prefix_segments for j in range(n)]


def content(r, p, cache):
    """The identity of the KV at position p of r: the whole prefix up to p (an output token
    is the request's own)."""
    key = (r.request_id, p)
    if key in cache:
        return cache[key]
    toks = cache.setdefault(("toks", r.request_id), tokens(r))
    ident = 0
    for i in range(p + 1):
        t = toks[i] if i < r.prompt_len else ("out", r.request_id, i)
        ident = hash((ident, t))
    cache[key] = ident
    return ident


def sampled_for(batch):
    """Seeded ids per step (token 7 is some requests' EOS: early stops)."""
    out = []
    for x in batch.seqs:
        req = x.request
        start = req.num_output_tokens
        out.append([random.Random(req.request_id * 1000 + start + j).randrange(16) for j in range(x.num_steps)])
    return out


def run(seed, policy, overlap, abort_p=0.0):
    """One random workload (shared system prompt, families of equal prompts, small caches)."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    n = rng.randint(2, 14)
    fam = rng.randint(1, 4)
    shared = rng.randint(0, 20)
    reqs = []
    for i in range(n):
        plen = rng.randint(1, 40)
        r = Request(i, float(rng.randint(0, 20)), plen, rng.randint(1, 20))
        sh = min(shared, plen)
        f = rng.randrange(fam)
        segs = [(7, sh)] if sh else []
        if plen > sh:
            segs.append((1000 + f, plen - sh))  # same family: same content
        r.prefix_segments = tuple(segs)
        if rng.random() < 0.5:
            r.eos_token_id = 7
        reqs.append(r)
    k = PARAMS[policy].get("num_steps", 1)
    need = max(-(-(r.prompt_len + r.max_tokens + k) // bs) for r in reqs)
    nb = need + rng.randint(0, 10)
    chunks = make_scheduler(policy, PARAMS[policy], SchedulerConfig(), 1, 4096,
                            step_time_fn=stand_in).policy.chunk_prefills
    # a budget below a prompt splits it into chunks (for the policies that chunk)
    budget = rng.randint(8, 96) if chunks else rng.randint(64, 96)
    cfg = SchedulerConfig(max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=budget,
                          block_size=bs, watermark=0.0, overlap=overlap)
    s = make_scheduler(policy, PARAMS[policy], cfg, nb, max_model_len=4096, step_time_fn=stand_in)
    phys = {}
    cc = {}
    def execute(batch, snap):
        kmax = batch.num_steps
        for j in range(kmax):
            part = [(x, t) for x, t in zip(batch.seqs, snap) if x.num_steps > j]
            for x, t in part:
                c, q = x.num_cached_tokens, x.num_query_tokens
                pos = range(c, c + q) if j == 0 else [c + q + j - 1]
                for p in pos:
                    phys[(t[p // bs], p % bs)] = content(x.request, p, cc)
            for x, t in part:
                c, q = x.num_cached_tokens, x.num_query_tokens
                r = x.request
                upto = c + q + j
                for p in range(upto):
                    want = content(r, p, cc)
                    got = phys.get((t[p // bs], p % bs))
                    if got != want:
                        raise AssertionError(f"seed {seed} {policy} overlap={overlap}: window {batch.window_id} step {j}: "
                                             f"request {r.request_id} reads position {p} (block {t[p//bs]}) "
                                             f"holding wrong KV (cached={c}, q={q})")
    pending = sorted(reqs, key=lambda r: r.arrival_time)
    now, last, nwin = 0.0, None, 0
    while pending or s.has_unfinished or last is not None:
        while pending and pending[0].arrival_time <= now:
            s.add_request(pending.pop(0))
        if abort_p and rng.random() < abort_p:
            live = list(s.running) + list(s.waiting)
            if live:
                s.abort(rng.choice(live).request_id)
        batch = s.schedule(now)
        snap = None
        if batch is not None:
            nwin += 1
            assert nwin < 5000
            snap = [list(x.request.block_table) for x in batch.seqs]
            for x, t in zip(batch.seqs, snap):
                assert len(t) * bs >= x.num_cached_tokens + x.num_slots, "table too short"
            s.block_manager.check(s.running + s.finishing)
        if not overlap:
            if batch is None:
                if not pending:
                    assert not s.has_unfinished, "stuck"
                    continue
                now = pending[0].arrival_time
                continue
            execute(batch, snap)
            s.update(batch, [now + j + 1.0 for j in range(batch.num_steps)], sampled_for(batch))
            s.block_manager.check(s.running + s.finishing)
            now += batch.num_steps
            continue
        if last is not None:
            lb, ls = last
            execute(lb, ls)
            s.update(lb, [now + j + 1.0 for j in range(lb.num_steps)], sampled_for(lb))
            s.block_manager.check(s.running + s.finishing)
            now += lb.num_steps
        elif batch is None:
            if not pending:
                assert not s.has_unfinished, "stuck"
                continue
            now = pending[0].arrival_time
        last = (batch, snap) if batch is not None else None
    assert s.block_manager.num_free_blocks == nb and not s.block_manager._refs
    return s


@pytest.mark.parametrize("policy", sorted(PARAMS))
@pytest.mark.parametrize("overlap", [False, True])
def test_every_read_finds_the_kv_of_its_prefix(policy, overlap):
    for seed in range(25):
        run(seed, policy, overlap, abort_p=0.05 if seed % 2 else 0.0)
