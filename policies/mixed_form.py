"""A policy's mixed-batch form: its own decisions over chunked-prefill batches, decodes first.

vLLM V1 has one batch form: every step holds the running decodes and then prefill chunks up to
the token budget. A policy of separate batches (priority, sjf, edf, mlfq, lpm, or a user's)
runs there with the same hooks (queue order, admission, budget, chunk size, preemption) and
``mixed_batches`` and ``chunk_prefills`` on, which is what ``chunked_prefill`` is to FCFS. The
simulator and the real engine run the same form, so the three backends decide alike
(vllm_backend/, docs/vllm.md).
"""

from __future__ import annotations

from dataclasses import fields

from policies.base import Policy

_FORMS: dict[type[Policy], type[Policy]] = {}


def mixed_form(policy: Policy) -> Policy:
    """``policy`` with prefills chunked into mixed batches, its settings and hooks kept; a
    policy that mixes already is returned as it is (cp_promote keeps its whole prompts)."""
    cls = type(policy)
    if cls.mixed_batches:
        return policy
    form = _FORMS.get(cls)
    if form is None:
        # a subclass that only turns the two flags on: every hook and setting is the policy's
        form = type(cls.__name__ + "Mixed", (cls,), {
            "mixed_batches": True, "chunk_prefills": True, "__module__": cls.__module__,
            "__doc__": f"{cls.__name__} in chunked-prefill batches, decodes first.",
            "reads_running": vars(cls).get("reads_running", True)})
        _FORMS[cls] = form
    return form(**{f.name: getattr(policy, f.name) for f in fields(policy) if f.init})
