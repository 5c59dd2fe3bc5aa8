"""Per-request sampling and stop sequences on the HTTP server (the tiny CPU model, multi_step
k=4): two seeded streams of different temperatures in one batch, each reproducible on its own; a
temperature or top_p below float32's range is greedy; stop sequences cut the text and end the
request in the engine; bad settings are 400s naming the field; each request's access-log line."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_serve import BLOCKS, K, pipe_inbox, received, start, stop, stream, wait_for

from policies import Request, SchedulerConfig, make_scheduler


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start(tmp_path_factory.mktemp("serve_sampling"), "policy=multi_step",
              f"policy.num_steps={K}")
    yield s
    stop(s)


PROMPT = "Once upon a time"
A = {"prompt": PROMPT, "max_tokens": 14, "ignore_eos": True, "temperature": 0.8, "seed": 1}
B = {"prompt": "In a galaxy far away", "max_tokens": 11, "ignore_eos": True,
     "temperature": 1.4, "top_k": 50, "top_p": 0.95, "seed": -7}
HOT = {"prompt": "Other company", "max_tokens": 9, "ignore_eos": True, "temperature": 1.0}
GREEDY = {"prompt": "More company", "max_tokens": 13, "ignore_eos": True}


def text_of(events: list) -> str:
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    return "".join(c["choices"][0]["text"] for c in chunks)


def together(server, *bodies: dict) -> list[str]:
    """The bodies' streams sent at once: each text."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        return [text_of(e) for e in pool.map(lambda b: stream(server, b), bodies)]


def test_two_seeded_streams_in_one_batch_are_each_reproducible(server):
    """A and B (different temperatures and seeds) streamed at once share windows; each gives
    the text it gives alone, and again among other company (unseeded and greedy requests)."""
    def windows() -> float:
        return server.metrics()["schedlab_windows_total"]

    w0 = windows()
    a_alone = text_of(stream(server, A))
    b_alone = text_of(stream(server, B))
    alone = windows() - w0
    # sent at once they share windows, unless a loaded machine's threads send them a window
    # apart: then again (each time each text is its own)
    for _ in range(3):
        w0 = windows()
        assert together(server, A, B) == [a_alone, b_alone]
        if windows() - w0 < alone:
            break
    else:
        pytest.fail(f"A and B never shared a window in 3 tries ({alone} windows alone)")
    assert together(server, HOT, B, GREEDY, A)[3::-2] == [a_alone, b_alone]
    assert a_alone != b_alone and a_alone != text_of(stream(server, {**A, "seed": 2}))
    assert a_alone != text_of(stream(server, {**A, "temperature": 0.0}))


def test_seeded_non_streaming_equals_streaming_and_unseeded_varies(server):
    r = server.http.post("/v1/completions", json=A)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text_of(stream(server, A))
    hot = {**HOT, "max_tokens": 24}
    assert len({text_of(stream(server, hot)) for _ in range(3)}) > 1


def test_top_k_1_and_temperature_0_are_greedy(server):
    greedy = text_of(stream(server, GREEDY))
    assert text_of(stream(server, {**GREEDY, "temperature": 1.7, "top_k": 1, "seed": 3})) == greedy
    assert text_of(stream(server, {**GREEDY, "temperature": 0.0, "seed": 5})) == greedy


def test_a_temperature_or_top_p_below_float32s_range_is_greedy(server):
    """temperature=1e-40 (greedy below vLLM's epsilon) and top_p=1e-300 (the most likely token
    always stays) give the greedy text, streamed or not, not token 0 repeated."""
    greedy = text_of(stream(server, GREEDY))
    for extra in ({"temperature": 1e-40}, {"temperature": 1e-40, "seed": 2},
                  {"temperature": 1.0, "top_p": 1e-300}, {"temperature": 1.3, "top_p": 1e-300,
                                                          "top_k": 2**63 - 1, "seed": 9}):
        body = {**GREEDY, **extra}
        assert text_of(stream(server, body)) == greedy, extra
        r = server.http.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy, extra


def test_a_stop_sequence_cuts_the_text_and_ends_the_request(server):
    body = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True}
    full = server.http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    s = full[12:15]
    assert s and s.strip("\ufffd")  # a piece of real text
    want = full[:full.index(s)]
    before = server.metrics()
    r = server.http.post("/v1/completions", json={**body, "stop": [s, "never seen"]})
    choice, use = r.json()["choices"][0], r.json()["usage"]
    assert (choice["text"], choice["finish_reason"]) == (want, "stop")
    assert use["completion_tokens"] < 40
    events = stream(server, {**body, "stop": s, "stream_options": {"include_usage": True}})
    assert text_of(events) == want
    assert events[-2]["usage"]["completion_tokens"] == use["completion_tokens"]
    assert [e["choices"][0]["finish_reason"] for e in events[:-2]][-1] == "stop"
    # the engine ended both as finished, not aborted, and freed their blocks
    m = wait_for(server, lambda m: m["schedlab_num_requests_running"] == 0)
    assert m["schedlab_kv_cache_free_blocks"] == BLOCKS
    assert m["schedlab_requests_aborted_total"] == before["schedlab_requests_aborted_total"]
    assert m["schedlab_requests_finished_total"] >= before["schedlab_requests_finished_total"] + 2


@pytest.mark.parametrize("body, param", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "3"}, "seed"),
    ({"seed": True}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": [1]}, "stop"),
])
def test_bad_sampling_settings_are_400s_naming_the_field(server, body, param):
    r = server.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"].split(".")[0] == param, err
    assert "\n" not in err["message"] and param in err["message"]


@pytest.mark.parametrize("field, value", [("temperature", "NaN"), ("temperature", "Infinity"),
                                          ("temperature", "1e400"), ("top_p", "NaN")])
def test_sampling_settings_that_are_no_finite_number_are_400s(server, field, value):
    r = server.http.post("/v1/completions", headers={"content-type": "application/json"},
                         content=f'{{"prompt": "hi", "max_tokens": 2, "{field}": {value}}}')
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "finite" in err["message"], err


def test_each_request_has_an_access_log_line(server):
    r = server.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 5,
                                                  "ignore_eos": True})
    rid = r.json()["id"]
    line = wait_for_line(server, rid)
    m = re.fullmatch(rf"{rid}: prompt 3 tokens, output 5 tokens, TTFT ([\d.]+) s, "
                     r"E2EL ([\d.]+) s, finish length", line)
    assert m and 0 <= float(m[1]) <= float(m[2]), line


def wait_for_line(server, rid: str, timeout: float = 10) -> str:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in server.output().splitlines():
            if line.startswith(f"{rid}: "):
                return line
        time.sleep(0.05)
    raise AssertionError(f"no access-log line for {rid}: {server.output()[-2000:]}")


def test_a_stop_sequence_ends_the_request_in_the_engine_as_finished():
    """("stop", id) from the front end, with overlap and the request in the window in flight:
    it leaves the scheduler, its blocks are free, that window's update() counts its slots as
    wasted and sends nothing more for it, and the metrics count it finished, not aborted."""
    sched = make_scheduler("multi_step", {"num_steps": 4},
                           SchedulerConfig(block_size=4, overlap=True), 16, 4096)
    inbox, front, clock = pipe_inbox(sched)
    front.send(("add", Request(0, 0.0, 3, 50, [1, 2, 3])))
    front.send(("add", Request(1, 0.0, 3, 50, [1, 2, 3])))
    inbox.release(sched, clock())
    first = sched.schedule(clock())
    sched.update(first, [1.0], [[7]] * 2)
    inbox.delivered(first, [])
    in_flight = sched.schedule(clock())  # both decode 4 steps
    received(front)
    front.send(("stop", 0))
    inbox.release(sched, clock())
    assert sched.block_manager.num_free_blocks == 16 - len(in_flight.seqs[1].request.block_table)
    assert [r.request_id for r in sched.running] == [1]
    sched.update(in_flight, [2.0, 3.0, 4.0, 5.0], [[8] * 4] * 2)
    inbox.delivered(in_flight, [])
    ((kind, events),) = received(front)
    assert kind == "events" and [e[0] for e in events] == [1]
    assert in_flight.num_wasted_steps == 4
    assert inbox.metrics.count("finished") == 1 and inbox.metrics.count("aborted") == 0
