"""Workloads: the streaming JSON reader, ShareGPT sampling as benchmark_serving does it, the
token-count cache, synthetic lengths, arrivals and trace replay."""

from __future__ import annotations

import json
import os
import random
import warnings
from pathlib import Path

import numpy as np
import pytest

from experiments import workload as wl
from experiments.workload import (
    RequestSpec,
    arrival_times,
    build_workload,
    bundled_sharegpt_path,
    iter_json_array,
    read_trace,
    sharegpt,
    to_request,
)

# The bundled file's cut tail is reported when its token counts are built, in whichever test
# comes first; tests of the warning itself catch it with pytest.warns.
pytestmark = pytest.mark.filterwarnings("ignore:.* is cut short:RuntimeWarning")

DATA = Path(__file__).parent / "data"
LLAMA3_BOS = 128000


@pytest.fixture(autouse=True)
def _shared_cache(tmp_path_factory, monkeypatch):
    # One cache for the whole test run: the bundled file's counts are built once, never in ~/.cache.
    monkeypatch.setenv("SCHEDLAB_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def enc():
    return wl.load_tokenizer("meta-llama/Meta-Llama-3-8B")


def records_of(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return [r for _, r in iter_json_array(path, **kw)]


# --------------------------------------------------------------------------- streaming reader

RECORDS = [
    {"id": "a\u00e9\U0001F600", "conversations": [
        {"from": "human", "value": "x\"\\\n\u00fc\U0001F600 tab\t"},
        {"v": [1.5e-3, -2, True, False, None, -0.25e2, 10]}]},
    {"n": 12345, "t": True, "u": "\u4e2d\u6587"},
    {"f": False, "z": None, "e": [], "o": {}},
]


@pytest.mark.parametrize("chunk_size", [1, 5, 1 << 20])
def test_reader_yields_records_and_their_byte_offsets(tmp_path, chunk_size):
    raw = json.dumps(RECORDS, indent=2, ensure_ascii=False).encode()
    path = tmp_path / "a.json"
    path.write_bytes(raw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a complete file must not warn
        got = list(iter_json_array(path, chunk_size=chunk_size))
    assert [r for _, r in got] == RECORDS
    for offset, record in got:  # offsets are bytes, not characters, and point at the '{'
        assert json.JSONDecoder().raw_decode(raw[offset:].decode())[0] == record
        assert wl.read_record_at(path, offset) == record


@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_every_cut_of_a_valid_file_stops_cleanly_with_one_warning(tmp_path, ensure_ascii):
    raw = json.dumps(RECORDS, indent=1, ensure_ascii=ensure_ascii).encode()
    path = tmp_path / "cut.json"
    for cut in range(1, len(raw)):
        path.write_bytes(raw[:cut])
        for chunk_size in (3, 1 << 16):
            with pytest.warns(RuntimeWarning, match=r"cut\.json is cut short: the file ends ") \
                    as w:
                got = [r for _, r in iter_json_array(path, chunk_size=chunk_size)]
            assert len(w) == 1
            assert got == RECORDS[:len(got)], (cut, chunk_size)
            assert str(len(got)) in str(w[0].message)


def test_cut_tail_warning_counts_records(tmp_path):
    path = tmp_path / "cut.json"
    path.write_bytes(b'[{"a": 1}, {"b": 2}, {"c": "unfinished')
    with pytest.warns(RuntimeWarning, match=r"cut\.json is cut short: the file ends partway "
                      r"through record 3; using the 2 complete records before it and dropping "
                      r"the incomplete one$"):
        assert [r for _, r in iter_json_array(path)] == [{"a": 1}, {"b": 2}]
    path.write_bytes(b'[{"a": 1},\n')  # cut between records: nothing is dropped
    with pytest.warns(RuntimeWarning, match=r"cut\.json is cut short: the file ends before its "
                      r"JSON array closes; using all 1 complete record it holds$"):
        assert [r for _, r in iter_json_array(path)] == [{"a": 1}]


@pytest.mark.parametrize("content, byte, what", [
    (b'{"a": 1}', 0, "not a JSON array"),
    (b'  "text"', 2, "not a JSON array"),
    (b'[{"a": 1}, 5, {"b": 2}]', 11, "record 1 is a JSON int"),
    (b'[{"a": 1}, null]', 11, "record 1 is a JSON NoneType"),
    ('[{"a": "\u00e9\u00e9"}, {"b": 2 xx}, {"c": 3}]'.encode(), 24, "malformed JSON"),
    (b'[{"a": 1},]', 10, "malformed JSON"),
    (b'[{"a": 1} {"b": 2}]', 10, "expected ',' or ']'"),
    (b'[{"a": 1}] trailing', 11, "unexpected data after the JSON array"),
    (b'[{"a": "x\ny"}]', 9, "Invalid control character"),
    (b'[{"a": 1.}]', 8, "malformed JSON"),
    (b'[{"a": "\xff"}]', 8, "invalid UTF-8"),
])
@pytest.mark.parametrize("chunk_size", [2, 1 << 20])
def test_malformed_content_names_file_and_byte(tmp_path, content, byte, what, chunk_size):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        list(iter_json_array(path, chunk_size=chunk_size))
    msg = str(err.value)
    assert "\n" not in msg
    assert f"{path} at byte {byte}:" in msg
    assert what in msg


def test_empty_file_and_empty_array(tmp_path):
    path = tmp_path / "e.json"
    path.write_bytes(b"  \n")
    with pytest.raises(ValueError, match=r"e\.json: empty file, expected a JSON array"):
        list(iter_json_array(path))
    path.write_bytes(b"[ ]\n")
    assert list(iter_json_array(path)) == []


def test_bundled_sharegpt_file_is_read_up_to_its_cut_tail():
    with pytest.warns(RuntimeWarning, match="cut short") as w:
        n = sum(1 for _ in iter_json_array(bundled_sharegpt_path()))
    assert n > 17000
    assert f"using the {n} complete records before it" in str(w[0].message)


# --------------------------------------------------------------------------- ShareGPT sampling

def reference_sample(data, enc, num, seed, *, max_prompt=1024, max_total=2048, fixed=None):
    """benchmark_serving's sample_sharegpt_requests, written out on its own terms."""
    random.seed(seed)
    pairs = [(d["conversations"][0]["value"], d["conversations"][1]["value"])
             for d in data if len(d["conversations"]) >= 2]
    random.shuffle(pairs)

    def tokenize(text):  # the HF Llama-3 tokenizer prepends <|begin_of_text|>
        return [LLAMA3_BOS] + enc.encode_ordinary(text)

    out = []
    for prompt, completion in pairs:
        if len(out) == num:
            break
        p, c = tokenize(prompt), tokenize(completion)
        olen = len(c) if fixed is None else fixed
        if len(p) < 4 or (fixed is None and olen < 4):
            continue
        if len(p) > max_prompt or len(p) + olen > max_total:
            continue
        out.append((len(p), olen, p))
    return out


def words(n):
    return " ".join(["alpha"] * n)


def small_sharegpt(path: Path) -> list[dict]:
    """A ShareGPT-format file whose conversations exercise every filter."""
    rng = random.Random(7)
    data = []
    for i in range(120):
        kind = i % 6
        if kind == 0:  # a single turn: dropped before the shuffle
            conv = [{"from": "human", "value": words(10)}]
        elif kind == 1:  # prompt too short (BOS + 1 token < 4)
            conv = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": words(20)}]
        elif kind == 2:  # completion too short
            conv = [{"from": "human", "value": words(20)}, {"from": "gpt", "value": "ok"}]
        elif kind == 3:  # prompt over max_prompt_len = 60
            conv = [{"from": "human", "value": words(80)}, {"from": "gpt", "value": words(5)}]
        elif kind == 4:  # total over max_total_len = 100
            conv = [{"from": "human", "value": words(50)}, {"from": "gpt", "value": words(60)}]
        else:
            conv = [{"from": "human", "value": words(rng.randint(3, 55))},
                    {"from": "gpt", "value": words(rng.randint(3, 40))},
                    {"from": "human", "value": "third turn is ignored"}]
        data.append({"id": f"c{i}", "conversations": conv})
    path.write_text(json.dumps(data, indent=1))
    return data


def test_sampling_matches_benchmark_serving_on_a_small_file(tmp_path, enc):
    path = tmp_path / "sg.json"
    data = small_sharegpt(path)
    for seed, fixed in [(0, None), (5, None), (1, 30)]:
        ref = reference_sample(data, enc, 15, seed, max_prompt=60, max_total=100, fixed=fixed)
        cfg = {"kind": "sharegpt", "num_prompts": 15, "seed": seed, "dataset_path": str(path),
               "max_prompt_len": 60, "max_total_len": 100, "fixed_output_len": fixed}
        specs = build_workload(cfg, vocab_size=128256)
        assert [(s.prompt_len, s.output_len, list(s.prompt_token_ids)) for s in specs] == ref
    # Every filter bit: only the "else" conversations (1 in 6) can be taken.
    taken = {s.prompt_len for s in build_workload({**cfg, "num_prompts": 20, "seed": 0})}
    assert all(4 <= p <= 60 for p in taken)
    with pytest.raises(ValueError, match=r"workload\.num_prompts = 21, but only 20 conv"):
        build_workload({"kind": "sharegpt", "num_prompts": 21, "dataset_path": str(path),
                        "max_prompt_len": 60, "max_total_len": 100})


def test_sampling_matches_benchmark_serving_on_the_bundled_file(enc):
    raw = bundled_sharegpt_path().read_text(encoding="utf-8")
    data, pos, dec = [], raw.index("[") + 1, json.JSONDecoder()
    while True:  # an independent reader of the cut file
        while raw[pos] in " \r\n\t,":
            pos += 1
        try:
            record, pos = dec.raw_decode(raw, pos)
        except json.JSONDecodeError:
            break
        data.append(record)
    ref = reference_sample(data, enc, 300, 0)
    specs = build_workload({"kind": "sharegpt", "num_prompts": 300}, vocab_size=128256)
    assert [(s.prompt_len, s.output_len, list(s.prompt_token_ids)) for s in specs] == ref
    assert all(s.arrival_time == 0.0 for s in specs)  # request_rate defaults to inf


def test_token_ids_fold_into_a_small_vocabulary():
    specs = build_workload({"kind": "sharegpt", "num_prompts": 50}, vocab_size=512)
    full = build_workload({"kind": "sharegpt", "num_prompts": 50}, vocab_size=128256)
    for s, f in zip(specs, full, strict=True):
        assert s.prompt_token_ids == tuple(t % 512 for t in f.prompt_token_ids)
        assert max(s.prompt_token_ids) < 512
    no_ids = build_workload({"kind": "sharegpt", "num_prompts": 50})
    assert [s.prompt_token_ids for s in no_ids] == [None] * 50
    assert [(s.prompt_len, s.output_len) for s in no_ids] == \
        [(s.prompt_len, s.output_len) for s in specs]


def test_count_cache_is_reused_and_invalidated(tmp_path, monkeypatch, enc):
    monkeypatch.setenv("SCHEDLAB_CACHE_DIR", str(tmp_path / "c"))
    path = tmp_path / "sg.json"
    small_sharegpt(path)
    cfg = {"kind": "sharegpt", "num_prompts": 10, "dataset_path": str(path),
           "max_prompt_len": 60, "max_total_len": 100}
    first = build_workload(cfg)
    assert len(list((tmp_path / "c").glob("sharegpt-counts-*.npy"))) == 1
    assert not list((tmp_path / "c").glob("*.tmp"))

    def no_tokenizing(*_):
        raise AssertionError("tokenized although the cache is fresh")

    monkeypatch.setattr(sharegpt, "_count_tokens", no_tokenizing)
    assert build_workload(cfg) == first
    assert build_workload({**cfg, "seed": 3}) != first  # sampling reads the cached counts
    # A changed file (size and mtime) is counted again.
    path.write_text(path.read_text().replace("alpha", "beta"))
    os.utime(path, ns=(1, 1))
    with pytest.raises(AssertionError, match="tokenized although"):
        build_workload(cfg)


def test_unreadable_cache_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("SCHEDLAB_CACHE_DIR", str(tmp_path / "c"))
    path = tmp_path / "sg.json"
    small_sharegpt(path)
    cfg = {"kind": "sharegpt", "num_prompts": 10, "dataset_path": str(path),
           "max_prompt_len": 60, "max_total_len": 100}
    first = build_workload(cfg)
    (cache,) = (tmp_path / "c").glob("sharegpt-counts-*.npy")
    cache.write_bytes(b"garbage")
    with pytest.warns(RuntimeWarning, match="unreadable token-count cache"):
        assert build_workload(cfg) == first
    assert build_workload(cfg) == first


def test_sharegpt_record_without_conversations_is_named(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text('[{"conversations": [{"value": "a"}, {"value": "b"}]}, {"id": 1}]')
    with pytest.raises(ValueError, match=r"sg\.json: record 1 at byte 54 has no 'conversations'"):
        build_workload({"kind": "sharegpt", "num_prompts": 1, "dataset_path": str(path)})


# --------------------------------------------------------------------------- arrivals

def test_infinite_rate_sends_everything_at_zero():
    assert arrival_times(5, float("inf"), 1.0, 0).tolist() == [0.0] * 5


def test_poisson_arrivals_reproduce_benchmark_serving_stream():
    # benchmark_serving: np.random.seed(seed), then one np.random.exponential(1/rate) gap after
    # each request is sent; the first request goes at t=0.
    rate, n = 4.0, 200
    np.random.seed(3)
    gaps = [np.random.exponential(1.0 / rate) for _ in range(n - 1)]
    expected = np.concatenate([[0.0], np.cumsum(gaps)])
    np.testing.assert_allclose(arrival_times(n, rate, 1.0, 3), expected, rtol=1e-12)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_gaps_have_the_requested_mean_and_variance(burstiness):
    rate, n = 10.0, 40_000
    t = arrival_times(n, rate, burstiness, 1)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # gamma(shape b, scale 1/(rate b)): variance 1/(b rate^2), i.e. squared CV = 1/b.
    assert gaps.var() == pytest.approx(1 / (burstiness * rate**2), rel=0.08)


def test_workload_is_deterministic_per_seed():
    for cfg in ({"kind": "sharegpt", "num_prompts": 100, "request_rate": 5},
                {"kind": "synthetic", "num_prompts": 100, "request_rate": 5, "burstiness": 0.5,
                 "lengths": {"dist": "lognormal", "prompt_mean": 300, "prompt_sigma": 1,
                             "output_mean": 50, "output_sigma": 0.5}}):
        a = build_workload(cfg, vocab_size=1000)
        assert a == build_workload(cfg, vocab_size=1000)
        assert a != build_workload({**cfg, "seed": 1}, vocab_size=1000)
        times = [s.arrival_time for s in a]
        assert times == sorted(times) and times[0] == 0.0


# --------------------------------------------------------------------------- synthetic

def synth(lengths, n=2000, **kw):
    return build_workload({"kind": "synthetic", "num_prompts": n, "lengths": lengths, **kw})


def test_synthetic_fixed_and_uniform():
    specs = synth({"dist": "fixed", "prompt_len": 100, "output_len": 7})
    assert {(s.prompt_len, s.output_len) for s in specs} == {(100, 7)}
    specs = synth({"dist": "uniform", "prompt_min": 32, "prompt_max": 40, "output_min": 1,
                   "output_max": 3})
    assert {s.prompt_len for s in specs} == set(range(32, 41))  # both ends inclusive
    assert {s.output_len for s in specs} == {1, 2, 3}


def test_synthetic_lognormal_mean_and_clipping():
    specs = synth({"dist": "lognormal", "prompt_mean": 400, "prompt_sigma": 0.5,
                   "output_mean": 100, "output_sigma": 1.0, "output_min": 20,
                   "output_max": 300}, n=20_000)
    prompts = np.array([s.prompt_len for s in specs])
    outputs = np.array([s.output_len for s in specs])
    assert prompts.mean() == pytest.approx(400, rel=0.03)  # unclipped: the mean asked for
    assert outputs.min() == 20 and outputs.max() == 300


def test_synthetic_settings_of_other_dists_are_tolerated_but_typos_are_not():
    base = {"dist": "fixed", "prompt_len": 10, "output_len": 5, "prompt_min": 1,
            "prompt_mean": 3.0}
    assert len(synth(base, n=3)) == 3
    with pytest.raises(ValueError, match=r"workload\.lengths\.prompt_lenn is not a length"):
        synth({**base, "prompt_lenn": 3}, n=3)


def test_synthetic_token_ids_are_seeded_and_in_range():
    cfg = {"kind": "synthetic", "num_prompts": 50,
           "lengths": {"dist": "uniform", "prompt_min": 5, "prompt_max": 50, "output_min": 1,
                       "output_max": 9}}
    a = build_workload(cfg, vocab_size=97)
    assert a == build_workload(cfg, vocab_size=97)
    assert all(len(s.prompt_token_ids) == s.prompt_len for s in a)
    assert all(0 <= t < 97 for s in a for t in s.prompt_token_ids)
    assert len({t for s in a for t in s.prompt_token_ids}) > 90  # not a constant
    # Asking for ids leaves the lengths and arrivals alone.
    assert [(s.arrival_time, s.prompt_len, s.output_len) for s in build_workload(cfg)] == \
        [(s.arrival_time, s.prompt_len, s.output_len) for s in a]


# --------------------------------------------------------------------------- trace replay

def test_trace_replay_sorts_by_arrival_and_keeps_ties_in_file_order():
    specs = build_workload({"kind": "trace", "trace_path": str(DATA / "trace_small.csv")})
    assert [(s.arrival_time, s.prompt_len, s.output_len) for s in specs] == [
        (0.0, 64, 16), (0.5, 128, 32), (0.5, 256, 8), (1.25, 512, 128)]
    two = build_workload({"kind": "trace", "trace_path": str(DATA / "trace_small.csv"),
                          "num_prompts": 2}, vocab_size=50)
    assert [s.prompt_len for s in two] == [64, 128]
    assert all(len(s.prompt_token_ids) == s.prompt_len for s in two)


@pytest.mark.parametrize("text, match", [
    ("", r"empty trace"),
    ("arrival_time,prompt_len,output_len\n", r"header but no requests"),
    ("arrival,prompt_len,output_len\n0,1,1\n", r":1: trace header lacks column 'arrival_time'"),
    ("arrival_time,prompt_len,output_len\n0,10,5\n1.5,20\n", r":3: expected 3 fields, got 2"),
    ("arrival_time,prompt_len,output_len\n0,10,5\n1,x,5\n", r":3: prompt_len is not a number"),
    ("arrival_time,prompt_len,output_len\n-1,10,5\n", r":2: arrival_time must be >= 0"),
    ("arrival_time,prompt_len,output_len\n0,10,0\n", r":2: output_len must be >= 1"),
    ("arrival_time,prompt_len,output_len\n0,10.5,3\n", r":2: prompt_len must be an integer"),
    ("arrival_time,prompt_len,output_len\nnan,10,3\n", r":2: arrival_time must be finite"),
])
def test_malformed_trace_names_file_and_line(tmp_path, text, match):
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        read_trace(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_trace_shorter_than_num_prompts():
    with pytest.raises(ValueError, match=r"workload\.num_prompts = 9, but .* has only 4"):
        build_workload({"kind": "trace", "trace_path": str(DATA / "trace_small.csv"),
                        "num_prompts": 9})


# --------------------------------------------------------------------------- settings

SYN = {"kind": "synthetic", "num_prompts": 4,
       "lengths": {"dist": "fixed", "prompt_len": 8, "output_len": 4}}


@pytest.mark.parametrize("cfg, match", [
    ({"kind": "poisson"}, r"workload\.kind must be one of sharegpt, synthetic, trace"),
    ({**SYN, "num_prompts": 0}, r"workload\.num_prompts must be >= 1, got 0"),
    ({**SYN, "num_prompts": 2.5}, r"workload\.num_prompts must be an integer"),
    ({**SYN, "request_rate": -1}, r"workload\.request_rate must be > 0 \(or inf\), got -1"),
    ({**SYN, "request_rate": 0}, r"workload\.request_rate must be > 0"),
    ({**SYN, "request_rate": "fast"}, r"workload\.request_rate must be a number"),
    ({**SYN, "burstiness": 0}, r"workload\.burstiness must be > 0, got 0"),
    ({**SYN, "seed": -1}, r"workload\.seed must be >= 0"),
    ({**SYN, "request_rat": 3}, r"workload\.request_rat is not a setting of kind=synthetic"),
    ({**SYN, "tokenizer": "x"}, r"workload\.tokenizer is not a setting of kind=synthetic"),
    ({**SYN, "lengths": None}, r"workload\.lengths must be a mapping"),
    ({**SYN, "lengths": {"dist": "zipf"}}, r"workload\.lengths\.dist must be fixed, uniform"),
    ({**SYN, "lengths": {"dist": "fixed", "prompt_len": 3}},
     r"workload\.lengths\.output_len must be set"),
    ({**SYN, "lengths": {"dist": "uniform", "prompt_min": 9, "prompt_max": 3,
                         "output_min": 1, "output_max": 2}},
     r"workload\.lengths\.prompt_max must be >= 9, got 3"),
    ({**SYN, "lengths": {"dist": "lognormal", "prompt_mean": -5, "prompt_sigma": 1,
                         "output_mean": 5, "output_sigma": 1}},
     r"workload\.lengths\.prompt_mean must be > 0"),
    ({"kind": "sharegpt", "dataset_path": "/nonexistent/sg.json"},
     r"workload\.dataset_path: no such file /nonexistent/sg\.json"),
    ({"kind": "sharegpt", "tokenizer": "no-such-model"},
     r"workload\.tokenizer: quicktok knows no model or encoding 'no-such-model'"),
    ({"kind": "sharegpt", "max_prompt_len": 2}, r"workload\.max_prompt_len must be >= 4"),
    ({"kind": "sharegpt", "fixed_output_len": 0}, r"workload\.fixed_output_len must be >= 1"),
    ({"kind": "sharegpt", "lengths": {}}, r"workload\.lengths is not a setting of kind=sharegpt"),
    ({"kind": "trace"}, r"workload\.trace_path must be set"),
    ({"kind": "trace", "trace_path": "???"}, r"workload\.trace_path must be set to a file path"),
    ({"kind": "trace", "trace_path": "/nonexistent.csv"}, r"workload\.trace_path: no such file"),
    ({"kind": "trace", "trace_path": str(DATA / "trace_small.csv"), "request_rate": 2},
     r"workload\.request_rate is not a setting of kind=trace"),
])
def test_bad_settings_give_one_line_errors(cfg, match):
    with pytest.raises(ValueError, match=match) as err:
        build_workload(cfg)
    assert "\n" not in str(err.value)


def test_rate_accepts_inf_spellings():
    for rate in (float("inf"), "inf", "Infinity"):
        assert all(s.arrival_time == 0 for s in build_workload({**SYN, "request_rate": rate}))


def test_requests_longer_than_the_model_are_refused():
    cfg = {**SYN, "lengths": {"dist": "fixed", "prompt_len": 100, "output_len": 30}}
    assert len(build_workload(cfg, max_model_len=130)) == 4
    with pytest.raises(ValueError, match=r"request 0 needs prompt_len \+ output_len = 130 "
                                         r"tokens > model\.max_model_len = 129"):
        build_workload(cfg, max_model_len=129)


def test_to_request():
    spec = RequestSpec(1.5, 3, 7, (5, 6, 7))
    r = to_request(spec, 9, with_token_ids=True)
    assert (r.request_id, r.arrival_time, r.prompt_len, r.max_tokens, r.prompt_token_ids) == \
        (9, 1.5, 3, 7, [5, 6, 7])
    assert to_request(spec, 9, with_token_ids=False).prompt_token_ids is None
    with pytest.raises(ValueError, match="request 2 carries no prompt token ids"):
        to_request(RequestSpec(0.0, 3, 7), 2, with_token_ids=True)
    with pytest.raises(ValueError, match="3 prompt token ids but prompt_len 4"):
        RequestSpec(0.0, 4, 1, (1, 2, 3))


def test_plain_requests_are_the_requests_of_their_specs():
    """The fast path for a workload of lengths and send times alone makes the requests
    ``to_request`` makes of each spec, field for field, each with lists of its own."""
    import dataclasses

    from experiments.workload.spec import RequestSpec, plain_requests, to_request

    arrivals, prompts, outputs = [0.0, 0.25, 3.0], [7, 1, 300], [1, 9, 2]
    fast = plain_requests(arrivals, prompts, outputs)
    slow = [to_request(RequestSpec(a, p, o), i, with_token_ids=False)
            for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs, strict=True))]
    assert [dataclasses.astuple(r) for r in fast] == [dataclasses.astuple(r) for r in slow]
    assert len({id(r.token_times) for r in fast} | {id(r.block_table) for r in fast}) == 6
    with pytest.raises(ValueError, match="3 arrival times for 2 prompt lengths"):
        plain_requests(arrivals, prompts[:2], outputs)
