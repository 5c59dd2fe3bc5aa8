"""A policy that forms no batch for the requests it holds (a user's ``admit`` that refuses a
long prompt for ever): the simulator and an offline run stop with one line naming it
(``Scheduler.stalled``, a ValueError: a run's one-line error); the HTTP server (the tiny CPU
model) fails those requests with OpenAI's error object, in JSON or as an SSE event, and /health
says why, while it goes on serving the requests the policy does admit."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml
from test_serve import BLOCKS, ROOT, pipe_inbox, received, sse, start, stop, wait_for

from policies import ModelSpec, Request, SchedulerConfig, make_scheduler
from real_backend import run_real
from simulator import OverheadSpec, simulate
from simulator.hardware import HardwareSpec

USER_POLICY = '''
    """long_prompts_never: admits a prompt shorter than max_prompt tokens, never a longer one."""

    from dataclasses import dataclass

    from policies import Policy, register


    @register
    @dataclass(frozen=True)
    class LongPromptsNever(Policy):
        name = "long_prompts_never"
        max_prompt: int = 10

        def admit(self, req, sched):
            return req.prompt_len < self.max_prompt
'''
STALLED = ("policy long_prompts_never (LongPromptsNever) formed no batch with 1 waiting and 0 "
           "running requests, and none in flight: they would wait forever")
CONF = ROOT / "conf"
TINY = ModelSpec.from_dict(yaml.safe_load((CONF / "model" / "tiny.yaml").read_text()))


@pytest.fixture
def policy_file(tmp_path) -> Path:
    path = tmp_path / "long_prompts_never.py"
    path.write_text(textwrap.dedent(USER_POLICY))
    return path


def requests() -> list[Request]:
    """A short prompt the policy admits, and a long one it never does."""
    return [Request(0, 0.0, 4, 3, prompt_token_ids=[1, 2, 3, 4]),
            Request(1, 0.0, 20, 3, prompt_token_ids=[5] * 20)]


def test_the_simulator_and_an_offline_run_stop_naming_the_policy(policy_file):
    def new(num_blocks: int):
        return make_scheduler("long_prompts_never", {"module": str(policy_file)},
                              SchedulerConfig(), num_blocks, TINY.max_model_len)

    hw = HardwareSpec.from_dict(yaml.safe_load((CONF / "hardware" / "h100_sxm.yaml").read_text()))
    with pytest.raises(ValueError) as sim:
        simulate(requests(), new, TINY, hw, OverheadSpec(), num_blocks=BLOCKS, progress=False)
    assert str(sim.value) == f"virtual engine 0: {STALLED}"
    with pytest.raises(ValueError) as offline:
        run_real(requests(), new, TINY, {"device": "cpu", "num_blocks": BLOCKS}, progress=False)
    assert str(offline.value) == STALLED


def test_the_inbox_says_the_policy_stalled_then_fails_its_requests(policy_file):
    """The engine's side: ``wait()`` with a request no batch takes fails it (its blocks freed),
    "stalled" sent first, so that /health says why before its client hears of it; once."""
    sched = make_scheduler("long_prompts_never", {"module": str(policy_file)},
                           SchedulerConfig(), BLOCKS, TINY.max_model_len)
    inbox, front, clock = pipe_inbox(sched)
    long = requests()[1]
    front.send(("add", long))
    inbox.release(sched, 0.0)
    assert sched.schedule(0.0) is None
    front.send(("abort", 7))  # something in the pipe: wait() returns at once after the stall
    inbox.wait(sched, clock)
    assert received(front)[1:] == [("events", [(1, (), None, None, True)]),
                                   ("stalled", STALLED),
                                   ("events", [(1, (), None, STALLED, False)])]
    assert not sched.has_unfinished and sched.stalled() is None
    front.send(("add", Request(2, 0.0, 20, 3, prompt_token_ids=[5] * 20)))
    inbox.release(sched, 0.0)
    front.send(("abort", 7))
    inbox.wait(sched, clock)
    assert received(front) == [("events", [(2, (), None, None, True)]),  # no second "stalled"
                               ("events", [(2, (), None, STALLED, False)])]


def test_the_server_fails_the_requests_a_policy_never_admits_and_health_says_why(tmp_path,
                                                                               policy_file):
    conf = tmp_path / "my_conf" / "policy"
    conf.mkdir(parents=True)
    (conf / "long_prompts_never.yaml").write_text(
        f"name: long_prompts_never\nmodule: {policy_file}\nmax_prompt: 10\n")
    server = start(tmp_path, f"hydra.searchpath=[file://{conf.parent}]",
                   "policy=long_prompts_never")
    short = {"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True}
    long = {"prompt": [5] * 20, "max_tokens": 4, "ignore_eos": True}
    try:
        assert server.http.post("/v1/completions", json=short).status_code == 200
        assert server.http.get("/health").json() == {"status": "ok"}
        r = server.http.post("/v1/completions", json=long, timeout=20)
        assert r.status_code == 500, r.text
        assert r.json() == {"error": {"message": STALLED, "type": "server_error", "param": None,
                                      "code": 500}}
        health = server.http.get("/health")
        assert health.status_code == 503
        assert health.json() == {"status": "error", "error": STALLED}
        with server.http.stream("POST", "/v1/completions", json={**long, "stream": True},
                                timeout=20) as resp:
            assert resp.status_code == 200
            assert sse(resp) == [r.json()]  # OpenAI's error object, and no [DONE]
        # the engine goes on: what the policy admits is served, the failed requests are gone
        ok = server.http.post("/v1/completions", json=short)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        m = wait_for(server, lambda m: m["schedlab_num_requests_waiting"] == 0
                     and m["schedlab_num_requests_running"] == 0)
        assert m["schedlab_kv_cache_free_blocks"] == BLOCKS
        assert server.http.get("/health").status_code == 503
        assert server.output().count(f"error: {STALLED}") == 1
    finally:
        stop(server)
