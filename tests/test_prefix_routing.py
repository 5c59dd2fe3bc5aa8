"""prefix_affinity with the prefix cache's block hashes: a request goes where the longest run
of its leading prompt blocks was served, so requests sharing a prompt prefix find it cached."""

from __future__ import annotations

from test_cluster import _spec

from policies.request import Request
from policies.routers import make_router
from simulator.engine import simulate_cluster


def _family_requests(n: int, families: int, shared: int = 0) -> list[Request]:
    """Each request: an optional prompt every family shares, then its family's 256-token
    prompt, then its own 40 tokens."""
    out = []
    for i in range(n):
        segments = (((1, shared),) if shared else ()) + ((10 + i % families, 256), (1000 + i, 40))
        req = Request(i, 0.02 * i, sum(k for _, k in segments), 30)
        req.prefix_segments = segments
        out.append(req)
    return out


def test_a_shared_prefix_stays_on_one_replica_and_is_found_there():
    reqs = _family_requests(60, 4)
    res = simulate_cluster(reqs, [_spec() for _ in range(4)],
                           make_router("prefix_affinity", load_cap_abs=10_000), progress=False)
    for f in range(4):
        assert len({res.replica_of[i] for i in range(f, 60, 4)}) == 1
    # after its family's first request, every request finds the family's 16 blocks cached
    assert all(r.num_cached_prompt_tokens == 256 for r in reqs[4:])
    # three families over four replicas: round robin spreads each family over all of them
    hits = {}
    for router in ("prefix_affinity", "round_robin"):
        reqs = _family_requests(60, 3)
        simulate_cluster(reqs, [_spec() for _ in range(4)],
                         make_router(router, **({"load_cap_abs": 10_000}
                                                if router == "prefix_affinity" else {})),
                         progress=False)
        hits[router] = sum(r.num_cached_prompt_tokens for r in reqs)
    assert hits["prefix_affinity"] == 57 * 256 > hits["round_robin"]


def test_the_longest_match_wins_over_a_prefix_every_request_shares():
    """With one system prompt on every request, the family's blocks after it decide."""
    reqs = _family_requests(40, 4, shared=64)
    res = simulate_cluster(reqs, [_spec() for _ in range(4)],
                           make_router("prefix_affinity", load_cap_abs=2, load_cap_rel=1.0),
                           progress=False)
    for f in range(4):
        assert len({res.replica_of[i] for i in range(f + 4, 40, 4)}) == 1
    assert len(set(res.replica_of)) > 1  # the load cap spread the families


def test_a_request_admitted_after_a_cache_hit_leaves_the_router_s_queue():
    """least_kv reads the prompt tokens routed and not admitted yet: a request that starts
    after a cached prefix leaves that count when admitted, as any other does."""
    seen = []

    class Spy:
        name = "spy"
        inner = make_router("least_kv")

        def route(self, req, replicas, now):
            seen[:] = [replicas]
            return self.inner.route(req, replicas, now)

    reqs = _family_requests(60, 3, shared=64)
    simulate_cluster(reqs, [_spec() for _ in range(2)], Spy(), progress=False)
    assert sum(r.num_cached_prompt_tokens for r in reqs) > 0
    assert [load.queued_prompt_tokens for load in seen[0]] == [0, 0]


def test_prefix_affinity_remembers_at_most_max_prefixes():
    router = make_router("prefix_affinity", max_prefixes=40)
    reqs = _family_requests(30, 30)
    simulate_cluster(reqs, [_spec() for _ in range(2)], router, progress=False)
    assert len(router._owner) == 40
