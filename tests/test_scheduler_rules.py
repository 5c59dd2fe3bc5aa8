"""The scheduler's rules each have one home: whether a request decodes (``Request.in_prefill``),
tokens to blocks (``BlockManager.blocks_for``), and the way a request leaves and gives its
blocks back (``Scheduler._free``); and the window that preempts a request mid-prefill for a
decode's block gives it no chunk."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from policies import Request, RequestState, SchedulerConfig, make_scheduler

POLICIES = Path(__file__).resolve().parent.parent / "policies"


def sched(name, params=None, *, overlap=False, blocks=40, bs=4, tokens=64):
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=tokens, block_size=bs,
                          watermark=0.0, overlap=overlap)
    return make_scheduler(name, params or {}, cfg, blocks, 256)


def functions(path: Path) -> list[tuple[str, ast.AST]]:
    """(name of the function it is in, node) of every node of ``path``."""
    out = []

    def walk(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else where
            out.append((name, child))
            walk(child, name)

    walk(ast.parse(path.read_text()), "")
    return out


def test_in_prefill_counts_a_window_in_flight_placeholders():
    """Overlap: a request whose prefill window is in flight decodes in the next window."""
    s = sched("multi_step", {"num_steps": 2}, overlap=True)
    r = Request(0, 0.0, 6, 8)
    s.add_request(r)
    w1 = s.schedule(0.0)
    assert r.num_output_tokens == 0 and r.num_output_placeholders == 1
    assert not r.in_prefill
    w2 = s.schedule(0.0)  # the scheduler decodes it (it reads the same definition)
    assert [(x.request, x.is_prefill) for x in w2.seqs] == [(r, False)]
    s.update(w1, [1.0], [[5]])
    assert not r.in_prefill


def test_in_prefill_of_a_chunked_prompt():
    s = sched("chunked_prefill", tokens=8)
    r = Request(0, 0.0, 20, 4)
    s.add_request(r)
    s.update(s.schedule(0.0), [1.0])  # 8 of 20 prompt tokens
    assert r.in_prefill and r.num_computed_tokens == 8
    while r.num_output_tokens == 0:
        s.update(s.schedule(0.0), [1.0])
    assert not r.in_prefill


def test_block_rounding_is_written_once():
    """``-(-n // block_size)`` appears in BlockManager.blocks_for only: a request's blocks are
    counted by calling it (the decode group counts its members' new blocks by their offset
    within a block, policies/decode_group.py)."""
    for path in POLICIES.glob("*.py"):
        for where, node in functions(path):
            if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
                    and isinstance(node.operand, ast.BinOp)
                    and isinstance(node.operand.op, ast.FloorDiv)):
                assert (path.name, where) == ("block_manager.py", "blocks_for"), \
                    f"{path.name}:{node.lineno} rounds tokens to blocks in {where}"


def test_decoding_test_is_written_once():
    """No scheduler code compares a request's computed tokens with its prompt length: whether
    it decodes is ``Request.in_prefill``."""
    for path in POLICIES.glob("*.py"):
        if path.name == "request.py":
            continue
        for where, node in functions(path):
            if isinstance(node, ast.Compare):
                names = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
                assert not {"num_computed_tokens", "prompt_len"} <= names, \
                    f"{path.name}:{node.lineno} ({where}) tests whether a request decodes"


def test_every_request_leaves_through_free():
    """Finish, abort and preemption all give blocks back in Scheduler._free, the one place
    that also returns the blocks a decode group took by count."""
    calls = [(where, node.lineno) for where, node in functions(POLICIES / "scheduler.py")
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == "free"]
    assert [where for where, _ in calls] == ["_free"], calls


def test_a_request_preempted_mid_prefill_gets_no_chunk_in_that_window():
    """Chunked prefill: the decoder at the head needs a block, none is free, and the victim
    (the tail) is still prefilling: it is preempted, its chunk is not formed, and it waits at
    the queue's head."""
    s = sched("chunked_prefill", blocks=6, bs=4, tokens=3)
    a, b = Request(0, 0.0, 3, 20), Request(1, 0.0, 16, 2)
    s.add_request(a)
    s.update(s.schedule(0.0), [1.0])
    s.add_request(b)  # its whole prompt's blocks taken at admission: none left after a's next
    t = 1.0
    while s.block_manager.num_free_blocks or a.num_computed_tokens < len(a.block_table) * 4:
        batch = s.schedule(t)
        assert [(x.request, x.is_prefill) for x in batch.seqs] == [(a, False), (b, True)]
        t += 1.0
        s.update(batch, [t])
    assert b.in_prefill and b.num_computed_tokens > 0
    batch = s.schedule(t)
    assert batch.preempted == [b] and b.state is RequestState.PREEMPTED
    assert [(x.request, x.is_prefill) for x in batch.seqs] == [(a, False)]
    assert list(s.waiting) == [b] and not b.block_table
    s.block_manager.check(s.running)


def test_decodes_reserved_before_a_shortage_keep_their_slots():
    """Separate batches, the middle decoder short of a block: the tail is preempted for it;
    the head keeps the slots it reserved in the same pass."""
    s = sched("multi_step", {"num_steps": 4}, blocks=8, bs=4)
    a, b, c = Request(0, 0.0, 4, 20), Request(1, 0.0, 7, 20), Request(2, 0.0, 4, 20)
    for r in (a, b, c):
        s.add_request(r)
    s.update(s.schedule(0.0), [1.0])  # the three prompts (a: 1 block, b: 2, c: 1)
    batch = s.schedule(1.0)  # four decode steps each: one more block each
    assert batch.preempted == [] and s.block_manager.num_free_blocks == 1
    s.update(batch, [2.0, 3.0, 4.0, 5.0])
    batch = s.schedule(2.0)  # a takes the last block; b finds none: c (the tail) goes
    assert batch.preempted == [c]
    assert [x.request for x in batch.seqs] == [a, b]
    s.block_manager.check(s.running)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("name,params", [("single_step", {}), ("multi_step", {"num_steps": 4}),
                                         ("priority", {}), ("sjf", {}), ("mlfq", {})])
def test_separate_batches_run_only_decoders(name, params, overlap):
    """Under separate batches a prefill window prefills whole prompts, so at every schedule()
    each running request decodes (the reservation pass does not ask): with preemptions, and a
    window in flight (overlap) whose placeholders count as sampled."""
    rng = random.Random(3)
    s = sched(name, params, overlap=overlap, blocks=30, bs=4)
    reqs = [Request(i, 0.0, rng.randint(2, 20), rng.randint(1, 12), priority=rng.randint(0, 3))
            for i in range(40)]
    for r in reqs:
        s.add_request(r)
    in_flight, t = [], 0.0
    while s.has_unfinished or in_flight:
        assert not [r.request_id for r in s.running if r.in_prefill]
        batch = s.schedule(t) if len(in_flight) < 1 + overlap else None
        if batch is not None:
            in_flight.append(batch)
        if batch is None or len(in_flight) > overlap:
            done = in_flight.pop(0)
            t += 1.0
            s.update(done, [t] * done.num_steps, [[1] * done.num_steps] * len(done.seqs))
    assert s.stats.num_preemptions > 0
    assert all(r.num_output_tokens == r.max_tokens for r in reqs)
