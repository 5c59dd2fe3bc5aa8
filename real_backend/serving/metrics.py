"""The server's Prometheus metrics, in two registries: the engine process's (queue lengths, KV
usage, TTFT and TPOT histograms, windows, preemptions and aborts, speculative decoding's drafts
and acceptance, the engine thread's CPU time)
and the front-end process's (requests received, SSE chunks sent, its own CPU time). GET /metrics
shows both: the front end asks the engine for its text over the pipe between them."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from policies.request import Request
from policies.scheduler import Scheduler

# Seconds; vLLM's buckets for the same histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)


class EngineMetrics:
    """The engine's side, written by the engine thread and rendered there when the front end
    asks (``text()``)."""

    def __init__(self, info: dict[str, str]) -> None:
        self.registry = r = CollectorRegistry()
        Info("schedlab_engine", "what the server runs: model, policy, window steps, KV blocks",
             registry=r).info(info)
        self.running = Gauge("schedlab_num_requests_running", "requests running", registry=r)
        self.waiting = Gauge("schedlab_num_requests_waiting", "requests waiting", registry=r)
        self.kv_usage = Gauge("schedlab_kv_cache_usage_ratio", "fraction of KV blocks in use",
                              registry=r)
        self.free_blocks = Gauge("schedlab_kv_cache_free_blocks", "free KV blocks", registry=r)
        self.ttft = Histogram("schedlab_time_to_first_token_seconds", "TTFT of finished requests",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("schedlab_time_per_output_token_seconds",
                              "TPOT of finished requests with 2 or more tokens",
                              buckets=TPOT_BUCKETS, registry=r)
        self.windows = Counter("schedlab_windows", "scheduler windows run", registry=r)
        self.steps = Counter("schedlab_steps", "GPU steps run over all windows", registry=r)
        self.preemptions = Counter("schedlab_preemptions", "recompute preemptions", registry=r)
        self.finished = Counter("schedlab_requests_finished", "requests finished", registry=r)
        self.aborted = Counter("schedlab_requests_aborted",
                               "requests aborted (client gone, or shutdown)", registry=r)
        # vLLM's prefix_cache_queries / prefix_cache_hits: prompt tokens looked up, and found
        self.prompt_tokens = Counter("schedlab_prefix_cache_queries",
                                     "prompt tokens of finished requests (prefix cache lookups)",
                                     registry=r)
        self.cached_tokens = Counter("schedlab_prefix_cache_hits",
                                     "of those, tokens found in the prefix cache", registry=r)
        self.engine_cpu = Gauge("schedlab_engine_thread_cpu_seconds",
                                "CPU seconds used by the engine loop's thread", registry=r)
        self._preemptions_seen = 0
        # speculative decoding (vLLM's spec_decode_* names): the scheduler's counts as verified
        self.spec_drafts = Counter("schedlab_spec_decode_num_drafts",
                                   "decode steps that drafted tokens", registry=r)
        self.spec_draft_tokens = Counter("schedlab_spec_decode_draft_tokens",
                                         "tokens drafted", registry=r)
        self.spec_accepted = Counter("schedlab_spec_decode_accepted_tokens",
                                     "drafted tokens accepted", registry=r)
        self.spec_rate = Gauge("schedlab_spec_decode_acceptance_rate",
                               "accepted over drafted tokens", registry=r)
        self.spec_length = Gauge("schedlab_spec_decode_acceptance_length",
                                 "tokens a drafting step emits on average (1 + accepted)",
                                 registry=r)
        self.spec_position = Gauge("schedlab_spec_decode_per_position_acceptance_rate",
                                   "accepted over drafted tokens at each draft position",
                                   ["position"], registry=r)
        self._spec_seen = (0, 0, 0)

    def watch_engine_thread(self, ident: int) -> None:
        """Report the CPU time of the engine loop's thread, ``ident`` (threading.get_ident()),
        its last reading once it has ended; nothing where the platform has no per-thread CPU
        clock."""
        try:
            clock = time.pthread_getcpuclockid(ident)
        except (AttributeError, OSError):
            return
        last = [0.0]

        def read() -> float:
            try:
                last[0] = time.clock_gettime(clock)
            except OSError:  # the thread has ended: its last reading
                pass
            return last[0]

        self.engine_cpu.set_function(read)

    def sample(self, sched: Scheduler) -> None:
        """The scheduler's queues and cache now; its counters since the last sample."""
        bm = sched.block_manager
        self.running.set(sched.num_running + len(sched.finishing))
        self.waiting.set(sched.num_waiting)
        self.free_blocks.set(bm.num_free_blocks)
        self.kv_usage.set(1.0 - bm.num_free_blocks / bm.num_blocks)
        n = sched.stats.num_preemptions
        self.preemptions.inc(n - self._preemptions_seen)
        self._preemptions_seen = n
        spec = sched.spec_stats
        if spec.num_drafts:
            now = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
            for counter, new, seen in zip((self.spec_drafts, self.spec_draft_tokens,
                                           self.spec_accepted), now, self._spec_seen,
                                          strict=True):
                counter.inc(new - seen)
            self._spec_seen = now
            m = spec.metrics()
            self.spec_rate.set(m["spec_decode_acceptance_rate"])
            self.spec_length.set(m["spec_decode_acceptance_length"])
            for i, rate in enumerate(m["spec_decode_per_position_acceptance_rate"]):
                if rate is not None:
                    self.spec_position.labels(str(i)).set(rate)

    def window(self, num_steps: int) -> None:
        self.windows.inc()
        self.steps.inc(num_steps)

    def request_done(self, req: Request) -> None:
        times = req.token_times
        self.finished.inc()
        self.prompt_tokens.inc(req.prompt_len)
        self.cached_tokens.inc(req.num_cached_prompt_tokens)
        if times:
            self.ttft.observe(times[0] - req.arrival_time)
        if len(times) > 1:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def count(self, name: str) -> int:
        """A counter's total (``finished``, ``aborted``, ``windows``...)."""
        value = self.registry.get_sample_value(f"schedlab_{name}_total")
        if value is None:
            value = self.registry.get_sample_value(f"schedlab_requests_{name}_total")
        return int(value or 0)


class FrontEndMetrics:
    """The front end's side: what it received and streamed, and the CPU time of its whole
    process (HTTP parsing, tokenization, detokenization, SSE; what experiments.fit_api
    prices per request, per chunk and per token)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.received = Counter("schedlab_requests_received",
                                "completion requests taken by the front end", registry=r)
        self.sse_chunks = Counter("schedlab_sse_chunks",
                                  "SSE chunks streamed that carry output tokens", registry=r)
        Gauge("schedlab_front_end_cpu_seconds", "CPU seconds used by the front-end process",
              registry=r).set_function(time.process_time)

    def text(self) -> bytes:
        return generate_latest(self.registry)
