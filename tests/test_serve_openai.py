"""The server's logprobs, n, echo and penalties through the ``openai`` client (the tiny CPU
model, multi_step k=4, one server for the module): logprobs consistent with greedy sampling,
alike streamed or not and on both endpoints; n=3 seeded choices sharing the prompt's blocks,
streamed interleaved; echo's prompt and its logprobs (and, with max_tokens 0, the prompt
alone); penalties that change greedy output as
the reference computes it."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
import yaml
from reference_sampling import dense_logits, penalized_greedy
from test_serve import K, Server, start, stop, wait_for

from common.model_spec import ModelSpec
from policies.sampling_params import SamplingParams
from real_backend.serving.tokenizer import Tokenizer
from real_backend.weights import random_model

TOKENIZER = Tokenizer(None, 512)
CONF = Path(__file__).resolve().parent.parent / "conf"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    s = start(tmp_path_factory.mktemp("serve_openai"), "policy=multi_step",
              f"policy.num_steps={K}")
    yield s
    stop(s)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model():
    """The server's model: the tiny one's seeded random weights (backend.seed 0), fp32 on the
    CPU, for the references."""
    spec = ModelSpec.from_dict(yaml.safe_load((CONF / "model" / "tiny.yaml").read_text()))
    return random_model(spec, torch.device("cpu"), torch.float32, 0)


GREEDY = {"model": "tiny", "max_tokens": 9, "temperature": 0.0, "extra_body": {"ignore_eos": True}}


def check_top(token_logprob: float, top: dict[str, float], n: int) -> None:
    """A greedy token's logprobs: its own is the most likely one's, and the top ones are at
    most a probability of 1 together."""
    # the token's own and the N most likely (keyed by their text, which tokens may share)
    assert 1 <= len(top) <= n + 1
    assert token_logprob == pytest.approx(max(top.values()))
    assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-6


def test_completions_logprobs_follow_greedy_sampling_alike_streamed(client):
    prompt = "The logprobs of a tiny model"
    r = client.completions.create(prompt=prompt, logprobs=5, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 9
    for token, own, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        check_top(own, top, 5)
        assert list(top)[0] == token and top[token] == own  # the sampled token is the argmax
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(9)]
    chunks = list(client.completions.create(prompt=prompt, logprobs=5, stream=True, **GREEDY))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [v for s in streamed for v in s.token_logprobs] == pytest.approx(lp.token_logprobs)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_chat_logprobs_agree_with_completions_of_the_same_tokens(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    chat = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=4,
                                          **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 9
    ids = TOKENIZER.encode_chat([("user", "Name three colours.")])
    same = client.completions.create(prompt=ids, logprobs=4, **GREEDY).choices[0].logprobs
    assert [c.token for c in content] == same.tokens
    assert [c.logprob for c in content] == pytest.approx(same.token_logprobs, abs=1e-5)
    for c, top in zip(content, same.top_logprobs, strict=True):
        assert len(c.top_logprobs) == 4 and c.top_logprobs[0].token == c.token
        listed = [t.logprob for t in c.top_logprobs]
        assert c.logprob == pytest.approx(max(listed)) and listed == sorted(listed, reverse=True)
        assert sum(math.exp(v) for v in listed) <= 1 + 1e-6
        for token, value in top.items():  # completions' dict: the same tokens, by their text
            assert any(t.token == token and t.logprob == pytest.approx(value, abs=1e-5)
                       for t in c.top_logprobs)
        assert bytes(c.bytes).decode("utf-8", errors="replace") == c.token
    assert "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        messages=messages, logprobs=True, stream=True, **GREEDY)) == chat.choices[0].message.content


def test_n_3_with_a_seed_gives_3_choices_sharing_the_prompt_s_blocks(client, server):
    prompt = "Three seeded choices of one prompt, long enough to fill two blocks: " * 2
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 11,
            "extra_body": {"ignore_eos": True}}
    hits = server.metrics()["schedlab_prefix_cache_hits_total"]
    r = client.completions.create(n=3, **body)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 3 and r.usage.completion_tokens == 18
    assert r.usage.prompt_tokens == len(TOKENIZER.encode_prompt(prompt))
    # choices 1 and 2 found choice 0's full prompt blocks (admitted with it)
    full = (r.usage.prompt_tokens - 1) // 16 * 16
    m = wait_for(server, lambda m: m["schedlab_prefix_cache_hits_total"] >= hits + 2 * full)
    assert m["schedlab_prefix_cache_hits_total"] == hits + 2 * full
    # choice i samples as a request of seed 11 + i (vLLM's rule), alone or streamed
    assert client.completions.create(**{**body, "seed": 12}).choices[0].text == r.choices[1].text
    chunks = list(client.completions.create(n=3, stream=True, **body))
    texts, finished = ["", "", ""], []
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished.append(choice.index)
    assert texts == [c.text for c in r.choices] and sorted(finished) == [0, 1, 2]
    indices = [c.choices[0].index for c in chunks if c.choices]
    assert indices != sorted(indices)  # interleaved as the windows deliver them
    chat = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], n=3,
                                          **{k: v for k, v in body.items() if k != "prompt"})
    assert [c.index for c in chat.choices] == [0, 1, 2] and chat.usage.completion_tokens == 18


def test_echo_returns_the_prompt_and_its_logprobs(client, model):
    prompt = "Echo me back"
    r = client.completions.create(prompt=prompt, echo=True, logprobs=2, **GREEDY)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    ids = TOKENIZER.encode_prompt(prompt)
    n = r.usage.prompt_tokens
    assert n == len(ids) and len(lp.tokens) == n + 9
    assert text == prompt + client.completions.create(prompt=prompt, **GREEDY).choices[0].text
    assert lp.tokens[:n] == [TOKENIZER.token_text(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # as vLLM: no context
    # every token's logprob, the prompt's and the reply's, is the model's (log_softmax of its
    # logits after the tokens before it)
    out = penalized_greedy(model, ids, 9, SamplingParams())
    every = ids + out
    want = dense_logits(model, every).log_softmax(-1)
    assert lp.token_logprobs[1:] == pytest.approx(
        [float(want[p - 1, every[p]]) for p in range(1, len(every))], abs=1e-4)
    chunks = list(client.completions.create(prompt=prompt, echo=True, stream=True, **GREEDY))
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, model):
    """As vLLM: the prompt and its logprobs, nothing of the one token the engine sampled
    (which the usage counts, as vLLM's does); alike streamed."""
    prompt = "Score this prompt alone"
    ids = TOKENIZER.encode_prompt(prompt)
    body = {**GREEDY, "prompt": prompt, "echo": True, "logprobs": 3, "max_tokens": 0}
    r = client.completions.create(**body)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt and r.choices[0].finish_reason == "length"
    assert lp.tokens == [TOKENIZER.token_text(t) for t in ids] and lp.token_logprobs[0] is None
    want = dense_logits(model, ids).log_softmax(-1)
    assert lp.token_logprobs[1:] == pytest.approx(
        [float(want[p - 1, ids[p]]) for p in range(1, len(ids))], abs=1e-4)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1
    chunks = [c for c in client.completions.create(stream=True, **body) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == prompt
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens


def test_penalties_change_greedy_output_as_the_reference_computes_it(client, model):
    prompt = [432, 300, 41, 7, 7, 260, 99, 41]  # its greedy output repeats the first token
    for params in (SamplingParams(repetition_penalty=1.8),
                   SamplingParams(frequency_penalty=0.5, presence_penalty=-2.0),
                   SamplingParams()):
        r = client.completions.create(prompt=prompt, presence_penalty=params.presence_penalty,
                                      frequency_penalty=params.frequency_penalty, **{
                                          **GREEDY, "max_tokens": 12, "extra_body": {
                                              "ignore_eos": True,
                                              "repetition_penalty": params.repetition_penalty}})
        want = penalized_greedy(model, prompt, 12, params)
        assert r.choices[0].text == TOKENIZER.decode(want), params
        if params.penalized:
            assert want != penalized_greedy(model, prompt, 12, SamplingParams())
