"""The contracts of what a policy's hooks and a router's ``route`` return, checked in one place
for both backends, and a hook's exception in a user's code reported as one line.

A class written in schedlab (a built-in policy or router) is trusted: the scheduler calls its
hooks as they are, so checking costs the built-ins nothing. A class defined outside schedlab
(``policy.module``, ``router.module``, any other module; a subclass of a built-in too) has every
hook called through a wrapper that checks the value it returns, and turns an exception raised
in it into a ``HookError``: one line naming the class, the hook, the value and the contract, or
the exception and the last line of the user's own code it passed through.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from policies.request import Request
from policies.user_code import HookError, raised, users

if TYPE_CHECKING:
    from policies.base import Policy
    from policies.scheduler import Scheduler

POLICY_HOOKS = ("queue_key", "window_budget", "admit", "chunk_size", "window_steps",
                "prefill_steps", "preemption_victim", "preempt_for_waiting")


def _show(value: Any) -> str:
    if isinstance(value, Request):
        return f"request {value.request_id} ({value.state.value})"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: Any) -> bool:
    """An integer (numpy's too), not a bool: True is no replica and no token count."""
    return type(value) is int or (isinstance(value, numbers.Integral)
                                  and not isinstance(value, bool))


class PolicyHooks:
    """The hooks of ``policy`` as the Scheduler calls them: the policy's own methods for a
    policy written in schedlab, checking wrappers for one written outside (``checked``)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.checked = users(type(policy))
        self.owner = f"policy {type(policy).__name__}"
        if hasattr(policy, "decode_tokens"):  # the hook it was: one home for a decode's tokens
            raise HookError(f"{self.owner} defines decode_tokens: the tokens a decode computes "
                            "are the speculation policy's (spec.policy, its request_tokens; "
                            "docs/speculative_decoding.md)")
        for hook in POLICY_HOOKS:  # e.g. self.chunk_size: policy.chunk_size or _chunk_size
            setattr(self, hook, getattr(self, "_" + hook) if self.checked
                    else getattr(policy, hook))
        if self.checked:
            steps = self._call("max_steps")
            if not _is_int(steps) or steps < 1:
                self._refuse("max_steps", steps, "an int >= 1 (the longest window it runs)")
            if policy.chunk_prefills and not policy.mixed_batches:
                raise HookError(f"{self.owner} says chunk_prefills = True but not mixed_batches "
                                "= True: a prompt split over windows continues only in mixed "
                                "windows")

    def _call(self, hook: str, *args: Any) -> Any:
        """The policy's answer: ``hook`` called with ``args`` (a property's value without)."""
        try:
            answer = getattr(self.policy, hook)
            return answer(*args) if args else answer
        except HookError:
            raise
        except Exception as err:
            raise raised(f"{self.owner}.{hook}", err) from err

    def _refuse(self, hook: str, value: Any, contract: str, context: str = "") -> None:
        raise HookError(f"{self.owner}.{hook} returned {_show(value)}{context}; it must return "
                        f"{contract}")

    def incomparable(self, err: TypeError) -> HookError:
        """The error for queue keys that do not compare (sorting them raised ``err``)."""
        return HookError(f"{self.owner}.queue_key returned keys that do not compare ({err}); it "
                         "must return keys that sort with each other (lowest first)")

    def _queue_key(self, req: Request, sched: Scheduler) -> Any:
        return self._call("queue_key", req, sched)

    def _window_budget(self, sched: Scheduler) -> tuple[int, int]:
        budget = self._call("window_budget", sched)
        seats = sched.config.max_num_seqs
        if not (isinstance(budget, (tuple, list)) and len(budget) == 2
                and _is_int(budget[0]) and _is_int(budget[1])
                and budget[0] >= 1 and 0 <= budget[1] <= seats):
            self._refuse("window_budget", budget,
                         "(tokens, seqs): ints, tokens >= 1 (a window of no tokens forms nothing) "
                         f"and seqs from 0 to scheduler.max_num_seqs ({seats})")
        return int(budget[0]), int(budget[1])

    def _admit(self, req: Request, sched: Scheduler) -> bool:
        ok = self._call("admit", req, sched)
        if not isinstance(ok, bool):
            self._refuse("admit", ok, "True or False", f" for request {req.request_id}")
        return ok

    def _chunk_size(self, req: Request, num_new: int, budget: int, sched: Scheduler) -> int:
        q = self._call("chunk_size", req, num_new, budget, sched)
        chunks = self.policy.chunk_prefills
        if _is_int(q):  # (the message is made only for an answer refused)
            if chunks:
                if 0 <= q <= num_new and q <= budget:
                    return int(q)
            elif q == 0 or q == num_new <= budget:
                return int(q)
        context = f" for request {req.request_id} (num_new={num_new}, budget={budget})"
        if chunks:
            self._refuse("chunk_size", q, f"an int from 0 (it does not fit) to "
                         f"min(num_new, budget) = {min(num_new, budget)}", context)
        whole = f" or num_new = {num_new} (all of it)" if num_new <= budget else ""
        self._refuse("chunk_size", q, f"0 (it does not fit){whole}: the policy does not chunk "
                     "prefills (chunk_prefills = False)", context)

    def _window_steps(self, sched: Scheduler, has_prefill: bool) -> int:
        k = self._call("window_steps", sched, has_prefill)
        top = self.policy.max_steps
        if not _is_int(k) or not 1 <= k <= top:
            self._refuse("window_steps", k, f"an int from 1 to max_steps = {top} (the longest "
                         "window the policy runs: decodes reserve its slots)")
        return int(k)

    def _prefill_steps(self, k: int) -> int:
        steps = self._call("prefill_steps", k)
        if not _is_int(steps) or not 1 <= steps <= k:
            self._refuse("prefill_steps", steps, f"an int from 1 to the window's k = {k}")
        return int(steps)

    def _preemption_victim(self, sched: Scheduler, req: Request) -> Request:
        victim = self._call("preemption_victim", sched, req)
        if not any(r is victim for r in sched.running):
            self._refuse("preemption_victim", victim, "one of the running requests "
                         "(sched.running)", f" for request {req.request_id}")
        return victim

    def _preempt_for_waiting(self, sched: Scheduler) -> list[Request]:
        victims = self._call("preempt_for_waiting", sched)
        contract = "a list of distinct running requests (sched.running)"
        if not isinstance(victims, (list, tuple)):
            self._refuse("preempt_for_waiting", victims, contract)
        running = {id(r) for r in sched.running}
        seen: set[int] = set()
        for victim in victims:
            if id(victim) not in running or id(victim) in seen:
                why = " twice" if id(victim) in seen else ", which is not running"
                self._refuse("preempt_for_waiting", victim, contract, why)
            seen.add(id(victim))
        return list(victims)


class SpeculationHooks:
    """The hooks of a speculation policy (policies/speculation.py) as the Scheduler calls them:
    its own methods for one written in schedlab, checking wrappers for one written outside."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.owner = f"speculation policy {type(policy).__name__}"
        checked = users(type(policy))
        self.window_tokens = self._window_tokens if checked else policy.window_tokens
        self.request_tokens = self._request_tokens if checked else policy.request_tokens

    def _call(self, hook: str, *args: Any) -> Any:
        try:
            return getattr(self.policy, hook)(*args)
        except HookError:
            raise
        except Exception as err:
            raise raised(f"{self.owner}.{hook}", err) from err

    def _window_tokens(self, sched: Scheduler) -> int:
        k = self._call("window_tokens", sched)
        top = self.policy.num_tokens
        if not _is_int(k) or not 0 <= k <= top:
            raise HookError(f"{self.owner}.window_tokens returned {_show(k)}; it must return an "
                            f"int from 0 (no speculation) to spec.num_tokens = {top}")
        return int(k)

    def _request_tokens(self, req: Request, k: int, sched: Scheduler) -> int:
        n = self._call("request_tokens", req, k, sched)
        if not _is_int(n) or not 0 <= n <= k:
            raise HookError(f"{self.owner}.request_tokens returned {_show(n)} for request "
                            f"{req.request_id}; it must return an int from 0 to the window's "
                            f"k = {k}")
        return int(n)


class CheckedRouter:
    """A router written outside schedlab as the simulator calls it: its ``route`` answer
    checked (an int in range(len(replicas))) and its exceptions reported as one line."""

    def __init__(self, router: Any) -> None:
        self.router = router
        self.owner = f"router {type(router).__name__}.route"

    def route(self, req: Request, replicas: Sequence[Any], now: float) -> int:
        try:
            index = self.router.route(req, replicas, now)
        except Exception as err:
            raise raised(self.owner, err) from err
        if not _is_int(index) or not 0 <= index < len(replicas):
            raise HookError(f"{self.owner} returned {_show(index)} for request "
                            f"{req.request_id}; it must return a replica's index: an int in "
                            f"range({len(replicas)})")
        return int(index)


def checked_router(router: Any) -> Any:
    """``router`` itself if schedlab wrote it, else a ``CheckedRouter`` of it."""
    return CheckedRouter(router) if users(type(router)) else router
