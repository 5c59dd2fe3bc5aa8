"""Workloads whose prompts share prefixes: ShareGPT as multi-turn conversations, a system prompt
shared by every request, a Mooncake trace's block hashes as segments, and requests longer than
the model dropped."""

from __future__ import annotations

import json
import logging

import pytest

from experiments.workload import _fitting, build_workload, footprint, load_tokenizer
from experiments.workload.multiturn import BOS_KEY, message_key
from experiments.workload.synthetic import SYSTEM_PROMPT_KEY
from experiments.workload.trace import hash_id_segments

LLAMA3_BOS = 128000
SYN = {"kind": "synthetic", "num_prompts": 6, "seed": 1,
       "lengths": {"dist": "uniform", "prompt_min": 5, "prompt_max": 40, "output_min": 2,
                   "output_max": 9}}


def said(text: str) -> str:
    """A message of ``text``, long enough that no two messages tokenize alike."""
    return f"{text}: " + " ".join(f"{text}{i}" for i in range(6))


def conversation(name: str, turns: int) -> list[dict[str, str]]:
    return [m for t in range(turns) for m in ({"from": "human", "value": said(f"{name}q{t}")},
                                             {"from": "gpt", "value": said(f"{name}a{t}")})]


RECORDS = [
    {"id": "a_0", "conversations": conversation("a", 3)},
    {"id": "b_0", "conversations": conversation("b", 1)},
    # a continued part opens with a reply: the turns start at its first human message
    {"id": "c_1", "conversations": [{"from": "gpt", "value": "earlier"}]
     + conversation("c", 2)},
    # the turns stop where human and gpt stop alternating
    {"id": "d_0", "conversations": conversation("d", 2)[:3] + conversation("e", 2)},
    {"id": "f_0", "conversations": conversation("f", 4)},
    # no usable turn: a human message without a reply, then a system message
    {"id": "g_0", "conversations": [{"from": "human", "value": "hi"},
                                    {"from": "system", "value": "x"}]},
]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SCHEDLAB_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def sharegpt_file(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(RECORDS))
    return path


def multiturn(path, **kw) -> dict:
    return {"kind": "sharegpt_multiturn", "dataset_path": str(path), "num_conversations": 5,
            "request_rate": 2.0, **kw}


def mooncake(tmp_path, rows) -> dict:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"kind": "trace", "format": "mooncake", "trace_path": str(path)}


# --------------------------------------------------------------------------- multi-turn

def test_every_turn_is_the_conversation_so_far(sharegpt_file):
    specs = build_workload(multiturn(sharegpt_file, think_time=1.5), vocab_size=1000)
    # a: 3 turns, b: 1, c: 2, d: 1 (cut where the roles stop alternating), f: 4; g has none
    turns = {}
    for s in specs:
        turns[s.conversation_id] = turns.get(s.conversation_id, 0) + 1
    assert sorted(turns.values()) == [1, 1, 2, 3, 4]
    enc = load_tokenizer("meta-llama/Meta-Llama-3-8B")
    for i, s in enumerate(specs):
        assert sum(n for _, n in s.segments) == s.prompt_len == len(s.prompt_token_ids)
        assert s.segments[0] == (BOS_KEY, 1) and s.prompt_token_ids[0] == LLAMA3_BOS % 1000
        if s.previous_turn is None:
            assert s.think_time == 0
            continue
        prev = specs[s.previous_turn]
        assert s.previous_turn < i and prev.conversation_id == s.conversation_id
        assert s.segments[:len(prev.segments)] == prev.segments
        assert s.prompt_token_ids[:prev.prompt_len] == prev.prompt_token_ids
        assert s.think_time == 1.5 and s.arrival_time == prev.arrival_time
        # the previous prompt, its reply (as the dataset has it) and this turn's message
        reply, message = s.segments[len(prev.segments):]
        assert reply[1] == prev.output_len and s.prompt_len == prev.prompt_len + reply[1] + \
            message[1]
    # every turn of a conversation follows the one before it, the first follows none
    firsts = [i for i, s in enumerate(specs) if s.previous_turn is None]
    assert len(firsts) == 5 and [specs[i].conversation_id for i in firsts] == list(range(5))
    assert [s.arrival_time for s in specs] == sorted(s.arrival_time for s in specs)
    assert len({specs[i].arrival_time for i in firsts}) == 5  # a start per conversation
    # record 0's first turn: BOS and its first message's tokens, asking for its reply's
    a = next(s for s in specs if s.segments[1][0] == message_key(0, 0))
    question = enc.encode_ordinary(said("aq0"))
    assert a.prompt_token_ids[1:] == tuple(t % 1000 for t in question)
    assert a.output_len == len(enc.encode_ordinary(said("aa0")))


def test_same_seed_same_workload_and_another_seed_another_order(sharegpt_file):
    cfg = multiturn(sharegpt_file, seed=3)
    first = build_workload(cfg, vocab_size=500)
    assert first == build_workload(cfg, vocab_size=500)
    # the simulator's workload is the real engine's, without the ids
    assert [s.segments for s in build_workload(cfg)] == [s.segments for s in first]
    other = build_workload({**cfg, "seed": 4})
    assert [s.segments for s in other] != [s.segments for s in first]


def test_limits_cut_conversations(sharegpt_file):
    specs = build_workload(multiturn(sharegpt_file, max_turns=2))
    assert max(sum(s.conversation_id == c for s in specs) for c in range(5)) == 2
    # a prompt limit between the first and second turns' lengths leaves one turn each
    firsts = [s.prompt_len for s in build_workload(multiturn(sharegpt_file))
              if s.previous_turn is None]
    specs = build_workload(multiturn(sharegpt_file, max_prompt_len=max(firsts) + 1))
    assert all(s.previous_turn is None for s in specs)
    specs = build_workload(multiturn(sharegpt_file, fixed_output_len=3, max_total_len=10**6))
    assert {s.output_len for s in specs} == {3}
    with pytest.raises(ValueError, match=r"workload\.num_conversations = 6, but only 5 "):
        build_workload(multiturn(sharegpt_file, num_conversations=6))


# --------------------------------------------------------------------------- shared prefix

def test_a_shared_prefix_starts_every_prompt(sharegpt_file, tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("arrival_time,prompt_len,output_len\n0,5,2\n1,7,3\n")
    kinds = [SYN, {"kind": "sharegpt", "dataset_path": str(sharegpt_file), "num_prompts": 3},
             multiturn(sharegpt_file), {"kind": "trace", "trace_path": str(csv)},
             mooncake(tmp_path, [{"timestamp": 0, "input_length": 600, "output_length": 2,
                                  "hash_ids": [1, 2]}])]
    for cfg in kinds:
        plain = build_workload(cfg, vocab_size=1000)
        shared = build_workload({**cfg, "shared_prefix_len": 20}, vocab_size=1000)
        system = shared[0].prompt_token_ids[:20]
        for p, s in zip(plain, shared, strict=True):
            assert s.prompt_len == p.prompt_len + 20
            assert s.prompt_token_ids == system + p.prompt_token_ids
            assert s.segments[0] == (SYSTEM_PROMPT_KEY, 20)
            assert s.segments[1:] == (p.segments or ((s.segments[1][0], p.prompt_len),))
            assert (s.arrival_time, s.output_len, s.previous_turn) == \
                (p.arrival_time, p.output_len, p.previous_turn)
        # a request's own tokens have a key no other request has
        if plain[0].segments is None:
            assert len({s.segments[1][0] for s in shared}) == len(shared)


def test_no_shared_prefix_leaves_the_workload_as_it_was(sharegpt_file, tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("arrival_time,prompt_len,output_len\n0,5,2\n1,7,3\n")
    for cfg in (SYN, {"kind": "sharegpt", "dataset_path": str(sharegpt_file), "num_prompts": 3},
                {"kind": "trace", "trace_path": str(csv)}):
        specs = build_workload(cfg, vocab_size=100)
        assert specs == build_workload({**cfg, "shared_prefix_len": 0, "drop_too_long": False},
                                       vocab_size=100)
        assert all(s.segments is None and s.conversation_id is None and s.previous_turn is None
                   for s in specs)
        assert specs.num_dropped == 0


# --------------------------------------------------------------------------- Mooncake

def test_mooncake_hash_ids_become_segments(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 2, "hash_ids": [7, 8, 9]},
            {"timestamp": 1, "input_length": 1024, "output_length": 2, "hash_ids": [7, 8]},
            {"timestamp": 2, "input_length": 10, "output_length": 2}]
    a, b, c = build_workload(mooncake(tmp_path, rows))
    assert [n for _, n in a.segments] == [512, 512, 76] and [n for _, n in b.segments] == [512,
                                                                                           512]
    assert a.segments[:2] == b.segments and a.hash_ids == (7, 8, 9)  # equal ids, equal keys
    assert a.segments[0] is b.segments[0]  # one pair for a block every request shares
    assert c.segments is None
    # keys are not the trace's ids, nor any other kind's
    assert not {k for k, _ in a.segments} & {7, 8, 9, BOS_KEY, SYSTEM_PROMPT_KEY}


def test_a_trace_s_token_ids_follow_its_block_hashes(tmp_path):
    """The real engine reuses a cached block's KV for every prompt with its hash: its token
    ids must be equal there, and differ where the hashes do."""
    rows = [{"timestamp": 0, "input_length": 1030, "output_length": 2, "hash_ids": [46, 47, 49]},
            {"timestamp": 1, "input_length": 1030, "output_length": 2, "hash_ids": [46, 47, 48]},
            {"timestamp": 2, "input_length": 600, "output_length": 2, "hash_ids": [46, 50]}]
    a, b, c = build_workload(mooncake(tmp_path, rows), vocab_size=1000)
    assert a.prompt_token_ids[:1024] == b.prompt_token_ids[:1024]
    assert a.prompt_token_ids[1024:] != b.prompt_token_ids[1024:]
    assert c.prompt_token_ids[:512] == a.prompt_token_ids[:512]
    assert c.prompt_token_ids[512:] != a.prompt_token_ids[512:600]
    assert len(c.prompt_token_ids) == 600 and max(a.prompt_token_ids) < 1000


def test_hash_ids_past_or_short_of_the_prompt():
    more = hash_id_segments((1, 2, 3), 600, 512, index=0)
    assert [n for _, n in more] == [512, 88]
    assert more == hash_id_segments((1, 2), 600, 512, index=5)
    fewer = hash_id_segments((1,), 1300, 512, index=0)
    assert [n for _, n in fewer] == [512, 788] and fewer[0] == more[0]
    assert hash_id_segments((1,), 1300, 512, index=1)[1][0] != fewer[1][0]  # the request's own


def test_segments_count_against_memory(tmp_path, sharegpt_file, monkeypatch):
    cfg = {**SYN, "num_prompts": 100}
    need = footprint.run_bytes(100, 100 * 40, 100 * 9, with_token_ids=False)
    monkeypatch.setattr(footprint, "available_memory", lambda: need + 1000)
    build_workload(cfg)
    with pytest.raises(ValueError, match=r"workload\.num_prompts: 100 requests .* would take"):
        build_workload({**cfg, "shared_prefix_len": 1})
    monkeypatch.setattr(footprint, "available_memory", lambda: 1000)
    with pytest.raises(ValueError, match=r"^workload\.num_conversations: 5 requests"):
        build_workload(multiturn(sharegpt_file))


# --------------------------------------------------------------------------- drop_too_long

def test_too_long_requests_are_an_error_or_dropped(caplog, monkeypatch):
    cfg = {**SYN, "num_prompts": 50}
    specs = build_workload(cfg)
    limit = sorted(s.prompt_len + s.output_len for s in specs)[25]
    with pytest.raises(ValueError, match=r"model\.max_model_len = .*drop_too_long=true"):
        build_workload(cfg, max_model_len=limit)
    monkeypatch.setattr(logging.getLogger("experiments.workload"), "disabled", False)
    with caplog.at_level("WARNING", logger="experiments.workload"):
        kept = build_workload({**cfg, "drop_too_long": True}, max_model_len=limit)
    fits = [s for s in specs if s.prompt_len + s.output_len <= limit]
    assert kept == fits and kept.num_dropped == 50 - len(fits) > 0
    assert caplog.messages == [f"workload.drop_too_long: dropped {kept.num_dropped} of 50 "
                               f"requests whose prompt_len + output_len exceeds "
                               f"model.max_model_len = {limit}"]
    assert build_workload({**cfg, "drop_too_long": True}).num_dropped == 0
    with pytest.raises(ValueError, match=r"^workload\.drop_too_long: every request"):
        build_workload({**cfg, "drop_too_long": True}, max_model_len=2)


def test_a_dropped_turn_drops_the_rest_of_its_conversation(sharegpt_file):
    specs = build_workload(multiturn(sharegpt_file))
    limit = sorted(s.prompt_len + s.output_len for s in specs)[len(specs) // 2]
    kept = build_workload(multiturn(sharegpt_file, drop_too_long=True), max_model_len=limit)
    assert 0 < kept.num_dropped == len(specs) - len(kept) < len(specs)
    for c in range(5):  # each conversation keeps its turns before the first that does not fit
        turns = [s for s in specs if s.conversation_id == c]
        cut = next((t for t, s in enumerate(turns) if s.prompt_len + s.output_len > limit),
                   len(turns))
        assert [(s.segments, s.output_len) for s in kept if s.conversation_id == c] == \
            [(s.segments, s.output_len) for s in turns[:cut]]
    for i, s in enumerate(kept):  # renumbered: the turn before it, in the kept list
        if s.previous_turn is not None:
            prev = kept[s.previous_turn]
            assert s.previous_turn < i and prev.conversation_id == s.conversation_id
            assert s.segments[:len(prev.segments)] == prev.segments
        else:
            assert i == 0 or kept[i - 1].conversation_id != s.conversation_id


def test_the_turns_after_a_dropped_one_go_even_when_they_fit():
    # (a later ShareGPT turn never is shorter, but the rule holds whatever the lengths)
    keep = _fitting([10, 1, 1, 1], [1, 1, 1, 1], 0, 5, [None, 0, 1, None], drop=True)
    assert keep == [False, False, False, True]
    assert _fitting([1, 1], [1, 1], 0, 5, [None, 0], drop=True) is None


# --------------------------------------------------------------------------- settings

@pytest.mark.parametrize("extra, match", [
    ({"num_conversations": 0}, r"workload\.num_conversations must be >= 1"),
    ({"num_conversations": "x"}, r"workload\.num_conversations must be an integer"),
    ({"num_prompts": 5}, r"workload\.num_prompts is not a setting of kind=sharegpt_multiturn"),
    ({"max_turn": 2}, r"workload\.max_turn is not a setting"),
    ({"max_turns": 0}, r"workload\.max_turns must be >= 1"),
    ({"max_turns": 1.5}, r"workload\.max_turns must be an integer"),
    ({"think_time": -1}, r"workload\.think_time must be a number of seconds >= 0"),
    ({"think_time": "soon"}, r"workload\.think_time must be a number"),
    ({"think_time": float("nan")}, r"workload\.think_time must be"),
    ({"think_time": 1e300}, r"workload\.think_time must be at most 2\^32 s, got 1e\+300: "),
    # each wait is within the bound, a conversation's turns together are not
    ({"think_time": 4e9, "request_rate": float("inf")},
     r"workload\.think_time = 4000000000\.0 sends the last of conversation [0-9]+'s [0-9]+ turns "
     r"[0-9.e+]+ s or more into the run: "),
    ({"max_prompt_len": 0}, r"workload\.max_prompt_len must be >= 1"),
    ({"max_total_len": -5}, r"workload\.max_total_len must be >= 2"),
    ({"fixed_output_len": 0}, r"workload\.fixed_output_len must be >= 1"),
    ({"shared_prefix_len": -1}, r"workload\.shared_prefix_len must be >= 0"),
    ({"shared_prefix_len": 2.5}, r"workload\.shared_prefix_len must be an integer"),
    ({"drop_too_long": "yes"}, r"workload\.drop_too_long must be true or false"),
    ({"tokenizer": ""}, r"workload\.tokenizer must be"),
])
def test_bad_settings_are_one_line_errors_naming_them(sharegpt_file, extra, match):
    with pytest.raises(ValueError, match=match) as err:
        build_workload(multiturn(sharegpt_file, **extra))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("extra, match", [
    ({"shared_prefix_len": -1}, r"workload\.shared_prefix_len must be >= 0"),
    ({"shared_prefix_len": True}, r"workload\.shared_prefix_len must be an integer"),
    ({"drop_too_long": 1}, r"workload\.drop_too_long must be true or false"),
    ({"think_time": 1}, r"workload\.think_time is not a setting of kind=synthetic"),
])
def test_other_kinds_check_the_new_settings_too(extra, match):
    with pytest.raises(ValueError, match=match) as err:
        build_workload({**SYN, **extra})
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- build_requests

def test_the_run_requests_are_to_request_of_each_spec(sharegpt_file, tmp_path):
    """build_requests (a run's Requests; a workload of lengths and times alone made with no
    spec between) equals to_request of each of build_workload's specs, field for field: every
    kind, t = 0 and Poisson, a shared prefix, classes, turns, hash ids, dropped requests, and
    the real backend's token ids."""
    import dataclasses

    from experiments.workload import build_requests, to_request

    csv = tmp_path / "t.csv"
    csv.write_text("arrival_time,prompt_len,output_len\n0,5,2\n1,7,3\n2.5,900,9\n")
    classes = {"a": {"share": 0.5, "priority": 0, "ttft_ms": 100}, "b": {"share": 0.5}}
    kinds = [SYN, {**SYN, "request_rate": 3.0}, {**SYN, "classes": classes},
             {**SYN, "shared_prefix_len": 16},
             {"kind": "sharegpt", "dataset_path": str(sharegpt_file), "num_prompts": 3},
             multiturn(sharegpt_file), {"kind": "trace", "trace_path": str(csv)},
             {"kind": "trace", "trace_path": str(csv), "drop_too_long": True},  # 909 > 512
             mooncake(tmp_path, [{"timestamp": 0, "input_length": 600, "output_length": 2,
                                  "hash_ids": [1, 2]}])]
    for cfg in kinds:
        for vocab in (None, 1000):
            longest = 512 if cfg.get("drop_too_long") else 4096
            specs = build_workload(cfg, vocab_size=vocab, max_model_len=longest)
            expected = [to_request(s, i, with_token_ids=vocab is not None)
                        for i, s in enumerate(specs)]
            got, dropped = build_requests(cfg, vocab_size=vocab, max_model_len=longest)
            assert dropped == specs.num_dropped == (1 if cfg.get("drop_too_long") else 0)
            assert [dataclasses.astuple(r) for r in got] == \
                [dataclasses.astuple(r) for r in expected], (cfg, vocab)
