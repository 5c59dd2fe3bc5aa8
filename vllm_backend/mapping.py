"""Which policies run inside vLLM's scheduler, in which form, and a one-line refusal for those
whose decisions vLLM cannot take (docs/vllm.md)."""

from __future__ import annotations

from policies.base import Policy
from policies.mixed_form import mixed_form

# Hooks through which a policy decides more than the form of its batches: a separate-batch
# policy with one of these runs in vLLM in its mixed-batch form (policies/mixed_form.py).
_DECISIONS = ("queue_key", "window_budget", "admit", "chunk_size", "preempt_for_waiting")


def _overrides(cls: type[Policy], hook: str) -> bool:
    return getattr(cls, hook) is not getattr(Policy, hook)


def vllm_policy(policy: Policy) -> Policy:
    """The form of ``policy`` that VllmPolicyScheduler runs: the policy itself where it mixes
    prefills and decodes, else its mixed-batch form; a ValueError of one line naming the
    policy and the decision where vLLM V1 cannot take it."""
    cls, name = type(policy), policy.name
    why = None
    if policy.max_steps > 1:
        why = (f"multi-step windows (policy.num_steps = {policy.max_steps}): vLLM V1 runs one "
               "step per schedule(); policy.num_steps=1 runs it in one-step windows")
    elif not cls.mixed_batches and not cls.orders_queue and not cls.preemptive and \
            not any(_overrides(cls, hook) for hook in _DECISIONS):
        why = ("prefill-only batches: vLLM V1 mixes prefills and decodes in every step "
               "(chunked_prefill is this batching there)")
    elif _overrides(cls, "preemption_victim"):
        why = ("its own preemption_victim: vLLM preempts in one order per step, the running "
               "queue's from its tail (queue_key sets it for a preemptive policy)")
    if why is not None:
        raise ValueError(f"policy {name} cannot run in vLLM's scheduler: {why}")
    return mixed_form(policy)
