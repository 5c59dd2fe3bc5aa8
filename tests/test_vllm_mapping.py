"""Which policies run inside vLLM's scheduler and in which form (vllm_backend/mapping.py,
policies/mixed_form.py), a one-line refusal for the rest, and the one-line error where vLLM is
missing or broken (vllm_backend.require_vllm). None of these needs vLLM installed."""

from __future__ import annotations

import importlib.metadata
import sys
from dataclasses import dataclass

import pytest

import vllm_backend
from policies.base import POLICIES, Policy, make_policy, register
from policies.mixed_form import mixed_form
from vllm_backend.mapping import vllm_policy


@pytest.mark.parametrize(("name", "settings", "decision"), [
    ("single_step", {}, "prefill-only batches"),
    ("multi_step", {"num_steps": 1}, "prefill-only batches"),
    ("multi_step", {"num_steps": 8}, "multi-step windows (policy.num_steps = 8)"),
    ("cp1", {}, "multi-step windows"),
    ("cp2", {"num_steps": 4}, "multi-step windows (policy.num_steps = 4)"),
    ("cp_promote", {}, "multi-step windows"),
    ("adaptive", {}, "multi-step windows"),
    ("slo_adaptive", {}, "multi-step windows (policy.num_steps = 16)"),
    ("lpm", {"num_steps": 4}, "multi-step windows"),
])
def test_a_decision_vllm_cannot_take_is_refused_in_one_line(name, settings, decision):
    with pytest.raises(ValueError) as err:
        vllm_policy(make_policy(name, **settings))
    message = str(err.value)
    assert message.startswith(f"policy {name} cannot run in vLLM's scheduler: ")
    assert decision in message and "\n" not in message


def test_a_policy_with_its_own_preemption_victim_is_refused():
    @dataclass(frozen=True)
    class NewestFirst(Policy):
        name = "test_newest_victim"
        orders_queue = True

        def preemption_victim(self, sched, req):
            return max(sched.running, key=lambda r: r.arrival_time)

    with pytest.raises(ValueError, match="its own preemption_victim"):
        vllm_policy(NewestFirst())


@pytest.mark.parametrize("name", ["chunked_prefill", "sarathi", "cp1", "slo_adaptive"])
def test_a_mixed_policy_runs_as_it_is(name):
    settings = {"num_steps": 1} if name in ("cp1", "slo_adaptive") else {}
    policy = make_policy(name, **settings)
    assert vllm_policy(policy) is policy


@pytest.mark.parametrize(("name", "settings"), [
    ("priority", {}), ("sjf", {"predictor": "noisy", "sigma": 0.3}), ("edf", {"ttft_slo_ms": 7.0}),
    ("mlfq", {"quantum_tokens": 8}), ("lpm", {"num_steps": 1, "fcfs_above": 3}),
])
def test_an_ordering_policy_runs_in_its_mixed_form_with_its_own_settings(name, settings):
    policy = make_policy(name, **settings)
    mixed = vllm_policy(policy)
    assert type(mixed).mixed_batches and type(mixed).chunk_prefills
    assert isinstance(mixed, type(policy)) and mixed.name == name
    assert mixed.describe() == policy.describe()  # the same settings, the same hooks
    assert type(mixed_form(policy)) is type(mixed)  # one class per policy class
    assert not type(policy).mixed_batches  # the policy itself is unchanged


def test_a_users_policy_from_outside_the_package_maps():
    @register
    @dataclass(frozen=True)
    class LongestFirst(Policy):
        name = "test_longest_first"
        orders_queue = True

        def queue_key(self, req, sched):
            return -req.prompt_len

    try:
        mixed = vllm_policy(make_policy("test_longest_first"))
        assert type(mixed).mixed_batches and mixed.queue_key.__func__ is LongestFirst.queue_key
    finally:
        POLICIES.pop("test_longest_first")


def test_missing_vllm_is_one_line_naming_the_package(monkeypatch):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(ValueError) as err:
        vllm_backend.require_vllm()
    assert "the package vllm is not installed" in str(err.value)
    assert "[vllm-cpu]" in str(err.value) and "\n" not in str(err.value)


def test_a_vllm_that_fails_to_import_is_one_line(monkeypatch):
    monkeypatch.setattr(vllm_backend, "vllm_installed", lambda: "vllm-cpu")
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    with pytest.raises(ValueError, match=r"^vLLM is installed but failed to import: "
                                         r"\w*Error: [^\n]*$"):
        vllm_backend.require_vllm()
