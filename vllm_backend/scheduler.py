"""VllmPolicyScheduler: vLLM V1's scheduler with a schedlab policy deciding each step.

vLLM loads it by name (``LLM(scheduler_cls=...)``, ``vllm serve --scheduler-cls
vllm_backend.scheduler.VllmPolicyScheduler``) and reads the policy from
``additional_config={"schedlab": {...}}`` (``SETTINGS``). vLLM's ``schedule()`` is one method
without hooks; the policy's decisions reach it through what that method reads:

1. waiting order: ``self.waiting`` sorted by ``queue_key`` before each step;
2. the step's budget: ``window_budget`` sets ``max_num_scheduled_tokens`` and
   ``max_num_active_reqs``;
3. admission: ``admit`` answers in ``_handle_blocked_waiting_request`` (False: passed over
   this step, as a request vLLM itself defers);
4. chunk sizes: ``chunk_size`` answers for each prefill in ``_reserve_prefill_lookahead``,
   which vLLM asks for every request it schedules, after the budget and before the blocks
   (0 stops the running queue's prefills, or admission, as in schedlab);
5. decodes first: ``self.running`` is put in the policy's order, decodes before prefills;
6. the victim: vLLM's priority mode preempts the running request of the largest
   ``priority``, which is set to each request's place in the policy's running order (its
   tail first, as schedlab preempts); a preemptive policy's ``preempt_for_waiting`` victims
   are preempted before the step and held out of it, as schedlab holds them.

It runs the policy's mixed-batch form (vllm_backend/mapping.py refuses the rest). What stays
vLLM's own (its KV blocks, its skipping of admission in a step that preempted) is in
docs/vllm.md. Synchronous scheduling only (vLLM's CPU platform); an AsyncScheduler variant is
not written.
"""

from __future__ import annotations

import importlib
import time
import warnings
from typing import Any, NamedTuple

from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request as VllmRequest
from vllm.v1.request import RequestStatus

from policies.base import Policy, check_number, check_settings, make_policy
from policies.batch import ScheduledSeq
from policies.hooks import PolicyHooks
from policies.request import Request, RequestState
from policies.scheduler import SchedulerConfig
from vllm_backend.mapping import vllm_policy
from vllm_backend.policy_view import PolicyView, VllmBlocks

# additional_config["schedlab"]'s keys: the policy section (name, its settings, module), the
# scheduler section (schedlab's limits; default: vLLM's), the cost model a policy that sizes
# windows by time needs ({"factory": "module:function", "kwargs": {...}}, called once), and a
# clock of engine steps (seconds per step) in place of the wall clock, for step-exact tests.
SETTINGS = ("policy", "scheduler", "step_time", "step_clock_s")
# extra_args["schedlab"] of a request's SamplingParams: what a workload says of it that vLLM's
# request does not carry (its id in the workload, SLO class and targets)
REQUEST_FIELDS = ("request_id", "slo_class", "ttft_slo_ms", "tpot_slo_ms")


class StepLog(NamedTuple):
    """One schedule() call: its step, the clock's time, each request's scheduled tokens and the
    requests preempted (schedlab ids), its prefill chunks and the KV tokens it attends over."""

    step: int
    now: float
    tokens: dict[int, int]
    preempted: list[int]
    num_prefill_seqs: int
    kv_tokens: int


def _build_step_time(spec: dict[str, Any] | None) -> Any:
    if spec is None:
        return None
    check_settings("schedlab.step_time", spec, ("factory", "kwargs"))
    module, _, name = str(spec.get("factory", "")).partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        raise ValueError(f"schedlab.step_time.factory {spec.get('factory')!r}: no such "
                         "function (module:function)") from None
    return factory(**spec.get("kwargs", {}))


class VllmPolicyScheduler(Scheduler):
    """vLLM's scheduler under a schedlab policy (the module's docstring says how)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # vLLM's priority mode picks the victim by Request.priority, which schedule() sets to
        # each running request's place in the policy's order; the waiting queue is a plain
        # one, which schedule() sorts by the policy's key.
        self.policy = SchedulingPolicy.PRIORITY
        self.waiting = create_request_queue(SchedulingPolicy.FCFS)
        self.kv_holding_waiting = create_request_queue(SchedulingPolicy.FCFS)
        self.configure((self.vllm_config.additional_config or {}).get("schedlab") or {})

    def configure(self, settings: dict[str, Any]) -> None:
        """Run under ``settings`` (additional_config's ``schedlab`` section, ``SETTINGS``) from
        now on, with the step log, the clock and the prefix cache started anew (as a run of
        schedlab's starts): between runs of one engine, while the scheduler holds no request."""
        if self.requests:
            raise RuntimeError("VllmPolicyScheduler.configure: requests are in the scheduler")
        self.reset_prefix_cache()
        settings = dict(settings)
        check_settings("additional_config's schedlab", settings, SETTINGS)
        policy_settings = dict(settings.get("policy") or {"name": "chunked_prefill"})
        name = policy_settings.pop("name", None)
        module = policy_settings.pop("module", None)
        self.schedlab_policy: Policy = vllm_policy(make_policy(name, module, **policy_settings))
        # its hooks as schedlab's scheduler calls them (a user's policy's answers checked)
        self.hooks = PolicyHooks(self.schedlab_policy)
        sc = self.scheduler_config
        config = SchedulerConfig.from_dict(settings.get("scheduler") or {
            "max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens,
            "block_size": self.block_size, "watermark": 0.0,
            "enable_prefix_caching": bool(self.cache_config.enable_prefix_caching)})
        self.step_clock_s = settings.get("step_clock_s")
        if self.step_clock_s is not None:
            check_number("schedlab.step_clock_s", self.step_clock_s, positive=True)
        self._vllm_of: dict[int, VllmRequest] = {}  # schedlab id -> vLLM request
        self._mirror: dict[str, Request] = {}  # vLLM id -> schedlab request
        self.view = PolicyView(self.schedlab_policy, config, self.max_model_len,
                               VllmBlocks(self.kv_cache_manager, self.block_size, self._vllm_of),
                               _build_step_time(settings.get("step_time")))
        self._order: list[str] = []  # running requests (vLLM ids) in the policy's order
        self._held: set[str] = set()  # preempted for a waiting request: out of this step
        self._stepping = False
        self._num_running_before = 0
        self._running_prefills_stopped = False
        self._budget_left = 0
        self._t0 = time.time()
        self._capped = False
        self.num_steps = 0
        self.num_preemptions = 0
        self.step_log: list[StepLog] = []  # one per schedule()

    # ------------------------------------------------------------------ requests
    def add_request(self, request: VllmRequest) -> None:
        super().add_request(request)
        extra = (request.sampling_params.extra_args or {}).get("schedlab", {}) \
            if request.sampling_params is not None else {}
        check_settings(f"request {request.request_id}'s extra_args schedlab", extra,
                       REQUEST_FIELDS)
        rid = extra.get("request_id")
        if rid is None:
            rid = int(request.request_id) if request.request_id.isdigit() else len(self._vllm_of)
            while rid in self._vllm_of:
                rid += 1
        now = self.now()
        mirror = Request(rid, now if self.step_clock_s is not None
                         else max(request.arrival_time - self._t0, 0.0),
                         request.num_prompt_tokens, request.max_tokens,
                         priority=request.priority, slo_class=extra.get("slo_class"),
                         ttft_slo_ms=extra.get("ttft_slo_ms"), tpot_slo_ms=extra.get("tpot_slo_ms"))
        mirror.waiting_since = mirror.arrival_time
        self._vllm_of[rid] = request
        self._mirror[request.request_id] = mirror
        self.view.recent_arrivals.append(mirror.arrival_time)

    def now(self) -> float:
        """The policy's clock: seconds since configure() (or engine steps times
        ``step_clock_s``); a run's request times are on it too."""
        if self.step_clock_s is not None:
            return self.num_steps * self.step_clock_s
        return time.time() - self._t0

    def mirror(self, request_id: int) -> Request:
        """The schedlab request that mirrors vLLM's (until the next step after it finished):
        when it was first scheduled, its longest wait, its preemptions."""
        return self._mirror[self._vllm_of[request_id].request_id]

    # ------------------------------------------------------------------ one step
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        policy, hooks, view = self.schedlab_policy, self.hooks, self.view
        now = view.now = self.now()
        self._sync()
        tokens, seqs = hooks.window_budget(view)
        limits = (self.scheduler_config.max_num_batched_tokens, self.max_num_running_reqs)
        if (tokens > limits[0] or seqs > limits[1]) and not self._capped:
            self._capped = True  # vLLM's own limits bound every step's; said once
            warnings.warn(f"policy {policy.name} asks {tokens} tokens and {seqs} sequences for "
                          f"a step; vLLM's max_num_batched_tokens {limits[0]} and max_num_seqs "
                          f"{limits[1]} cap it", stacklevel=2)
        self.max_num_scheduled_tokens = min(tokens, limits[0])
        self.max_num_active_reqs = min(seqs, limits[1])
        running = {r.request_id: r for r in self.running}
        self._order = [rid for rid in self._order if rid in running]
        if policy.orders_queue:
            key, m = hooks.queue_key, self._mirror
            try:
                waiting = sorted(self.waiting, key=lambda r: key(m[r.request_id], view))
                if policy.preemptive:
                    self._order.sort(key=lambda rid: key(m[rid], view))
            except TypeError as err:  # keys that do not compare: a user's policy's
                if not hooks.checked:
                    raise
                raise hooks.incomparable(err) from err
            self.waiting.clear()
            self.waiting.extend(waiting)
        self._publish()
        self._held = set()
        if policy.preemptive and self.waiting:
            for victim in hooks.preempt_for_waiting(view):
                req = self._vllm_of[victim.request_id]
                self.running.remove(req)
                self._order.remove(req.request_id)
                self._preempt_request(req, time.monotonic())
                self._held.add(req.request_id)
            running = {r.request_id: r for r in self.running}
            self._publish()
        # decodes first, then prefills, each in the policy's order; the victim is the request
        # of the largest priority: the tail of that order
        order = [running[rid] for rid in self._order]
        for rank, req in enumerate(order):
            req.priority = rank
        self.running = [r for r in order if _decoding(r)] + [r for r in order if not _decoding(r)]
        self._num_running_before = len(self.running)
        view.forming = []
        self._budget_left = self.max_num_scheduled_tokens
        self._running_prefills_stopped = False
        self._stepping = True
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self._stepping = False
        # admitted this step: appended to the policy's order, as schedlab's running queue
        known = set(self._order)
        self._order += [r.request_id for r in self.running if r.request_id not in known]
        self._after_step(out, now)
        return out

    def _sync(self) -> None:
        """The mirrors catch up with vLLM's requests (outputs, computed tokens, queues)."""
        for vid in [vid for vid in self._mirror if vid not in self.requests]:  # finished
            mirror = self._mirror.pop(vid)
            self._vllm_of.pop(mirror.request_id, None)
            mirror.state = RequestState.FINISHED
        for vid, req in self.requests.items():
            mirror = self._mirror[vid]
            mirror.num_output_tokens = req.num_output_tokens
            mirror.num_computed_tokens = req.num_computed_tokens

    def _publish(self) -> None:
        """The view's queues: vLLM's waiting queue and the running requests in policy order."""
        m = self._mirror
        self.view.waiting = [m[r.request_id] for r in self.waiting]
        self.view.running = [m[rid] for rid in self._order]

    def _after_step(self, out: Any, now: float) -> None:
        m = self._mirror
        preempted = []
        for vid in out.preempted_req_ids:
            mirror = m[vid]
            mirror.state = RequestState.PREEMPTED
            mirror.waiting_since = now
            mirror.num_preemptions += 1
            preempted.append(mirror.request_id)
        for vid in out.num_scheduled_tokens:
            mirror = m[vid]
            if mirror.state is not RequestState.RUNNING:  # admitted: its wait ends
                mirror.state = RequestState.RUNNING
                if mirror.first_scheduled_time is None:
                    mirror.first_scheduled_time = now
                if mirror.waiting_since is not None:
                    mirror.max_wait = max(mirror.max_wait, now - mirror.waiting_since)
                    mirror.waiting_since = None
        prefills = kv = 0
        for vid, n in out.num_scheduled_tokens.items():
            req = self.requests[vid]
            kv += req.num_computed_tokens  # advanced by this step's tokens already
            prefills += not (req.num_output_tokens > 0
                             and req.num_computed_tokens - n >= req.num_tokens - 1)
        self.step_log.append(StepLog(self.num_steps, now, {m[vid].request_id: n for vid, n in
                                                           out.num_scheduled_tokens.items()},
                                     preempted, prefills, kv))
        self.num_preemptions += len(preempted)
        self.num_steps += 1

    # ------------------------------------------------------------------ vLLM's questions
    def _handle_blocked_waiting_request(self, request: VllmRequest) -> bool:
        """Admission: a request preempted for a waiting one sits this step out, and one the
        policy does not admit is passed over (vLLM defers it to the next step)."""
        if not super()._handle_blocked_waiting_request(request):
            return False
        if request.request_id in self._held:
            return False
        if type(self.schedlab_policy).admit is Policy.admit:
            return True
        # admitted so far this step join the view's running queue (no preemption: vLLM
        # admits only in a step that preempted none)
        view, m = self.view, self._mirror
        view.running = [m[rid] for rid in self._order] + \
            [m[r.request_id] for r in self.running[self._num_running_before:]]
        return self.hooks.admit(m[request.request_id], view)

    def _reserve_prefill_lookahead(self, request: VllmRequest, num_computed_tokens: int,
                                   num_new_tokens: int) -> int:
        """The policy's chunk for each prefill vLLM schedules (``num_new_tokens``: what vLLM's
        budget allows), and the step formed so far, for policies that price it."""
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        if not self._stepping or n <= 0:
            return n
        mirror = self._mirror[request.request_id]
        running = request.status == RequestStatus.RUNNING
        if running and _decoding(request):
            chunk = n
        elif running and self._running_prefills_stopped:
            chunk = 0
        else:
            left = request.num_tokens - num_computed_tokens
            chunk = min(self.hooks.chunk_size(mirror, left, self._budget_left, self.view), n)
            if chunk <= 0 and running:  # schedlab's running prefills stop here
                self._running_prefills_stopped = True
        if chunk > 0:  # a decode's tokens (vLLM's: 1, or 1 + its draft) are its decode step's
            decoding = _decoding(request)
            self.view.forming.append(ScheduledSeq(mirror, chunk, num_computed_tokens, 1,
                                                  not decoding, 0, chunk if decoding else 1))
            self._budget_left -= chunk
        return max(chunk, 0)


def _decoding(req: VllmRequest) -> bool:
    """Whether a running request decodes (its prompt, and any recompute, done)."""
    return req.num_output_tokens > 0 and req.num_computed_tokens >= req.num_tokens - 1
