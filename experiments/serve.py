"""The Hydra app `python -m experiments.serve`: the real engine under one policy behind the
OpenAI-compatible HTTP server (real_backend/serving), until SIGINT or SIGTERM."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from omegaconf import DictConfig

from experiments.backends import real_settings
from experiments.choices import PolicyChoice, known_settings, max_request_tokens, plain
from experiments.cli_checks import suggest_keys
from experiments.run import CONF_DIR, refuse_moved_settings
from policies import ModelSpec
from policies.base import check_int, check_settings

if TYPE_CHECKING:
    from real_backend.serving.front_end import HTTPSettings

SERVER_KEYS = ("host", "port", "allowed_hosts", "api_key", "max_body_bytes",
               "request_timeout_s", "keep_alive_timeout_s", "max_connections", "access_log")
STEP_ROWS_KEPT = 100_000  # the newest windows' rows, written to steps.csv at shutdown


def check_server(cfg: Mapping[str, Any]) -> tuple[int, HTTPSettings]:
    """The top-level keys (config.yaml's and ``server``) and the ``server`` section: the port,
    and the front end's settings."""
    from real_backend.serving.front_end import HTTPSettings

    check_settings("the config's top level", cfg, [*known_settings()[0], "server"])
    server = plain(cfg["server"])
    check_settings("server", server, SERVER_KEYS)
    host = server.get("host")
    if not isinstance(host, str) or not host:
        raise ValueError(f"server.host must be a host name or address, got {host!r}")
    port = check_int("server.port", server.get("port"), 0)
    if port > 65535:
        raise ValueError(f"server.port must be in [0, 65535], got {port}")
    hosts = server.get("allowed_hosts") or []
    if not isinstance(hosts, list) or not all(isinstance(h, str) and h for h in hosts):
        raise ValueError(f"server.allowed_hosts must be a list of host names, got {hosts!r}")
    key = server.get("api_key")
    if key is not None and (not isinstance(key, str) or not key or not key.isprintable()
                            or not key.isascii()):
        raise ValueError("server.api_key must be printable ASCII text, or null for none")
    timeouts = {}
    for name in ("request_timeout_s", "keep_alive_timeout_s"):
        value = server.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"server.{name} must be a number of seconds > 0, got {value!r}")
        timeouts[name] = float(value)
    access_log = server.get("access_log", True)
    if not isinstance(access_log, bool):
        raise ValueError(f"server.access_log must be true or false, got {access_log!r}")
    settings = HTTPSettings(
        host=host, allowed_hosts=tuple(hosts), api_key=key, access_log=access_log,
        max_body_bytes=check_int("server.max_body_bytes", server.get("max_body_bytes"), 1),
        max_connections=check_int("server.max_connections", server.get("max_connections"), 1),
        **timeouts)
    backend = plain(cfg["backend"])
    if backend.get("name") != "real":
        raise ValueError(f"experiments.serve serves the real engine: backend must be real, got "
                         f"{backend.get('name')!r}")
    return port, settings


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (IPv4 or IPv6, as the host resolves), bound
    before the engine is built so that a busy port or a bad host fails at once, in one line."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        return socket.create_server(address, family=family)
    except OSError as err:  # the system's reason alone (a resolver's errno is negative)
        reason = os.strerror(err.errno) if (err.errno or 0) > 0 else err.strerror or str(err)
        raise ValueError(f"cannot listen on server.host={host} server.port={port}: "
                         f"{reason}") from None


class Server:
    """The engine (weights, KV cache, scheduler) and its HTTP front end, built from a config.

    The engine loop runs in a thread of this process over the Inbox; the front end (uvicorn)
    runs in a process of its own, started by ``run()``, and the two talk over a pipe
    (real_backend/serving/inbox.py, engine_client.py). The front end's Python work never
    holds the engine's interpreter lock.
    """

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        import torch

        from real_backend.config import BackendConfig
        from real_backend.engine import Clock, build_runner, check_overlap_backend
        from real_backend.serving.front_end import ServedModel
        from real_backend.serving.inbox import Inbox
        from real_backend.serving.metrics import EngineMetrics
        from real_backend.serving.tokenizer import Tokenizer

        self.port, self.http = check_server(cfg)
        self.host = self.http.host
        parallel = plain(cfg.get("parallel") or {})
        if any(parallel.get(k, 1) != 1 for k in ("tensor_parallel_size",
                                                 "pipeline_parallel_size")):
            raise ValueError("experiments.serve runs the engine in one process: "
                             "parallel.tensor_parallel_size and pipeline_parallel_size must be 1")
        model = ModelSpec.from_dict(plain(cfg["model"]))
        choice = PolicyChoice(cfg, model)
        policy, policy_name, new_scheduler = choice.policy, choice.name, choice.new_scheduler
        backend = BackendConfig.from_mapping(real_settings(
            {k: v for k, v in plain(cfg["backend"]).items() if k != "name"}, choice.speculation))
        Tokenizer(model.tokenizer, model.vocab_size)  # a bad model.tokenizer fails here, at once

        probe = new_scheduler(1)
        check_overlap_backend(probe, backend)
        self.socket = listen(self.host, self.port)
        try:
            self.clock = Clock()  # delivery times and arrival times on one clock
            self.runner = build_runner(model, backend, probe, self.clock)
            self.sched = new_scheduler(self.runner.kv_cache.num_blocks)
            self.served = ServedModel(model.name, model.max_model_len, model.vocab_size,
                                      backend.sampling, model.tokenizer,
                                      max_request_tokens(self.sched))
            self.metrics = EngineMetrics({
                "model": model.name, "policy": policy_name,
                "k": str(getattr(policy, "num_steps", 1)), "overlap": str(probe.overlap).lower(),
                "enable_prefix_caching": str(probe.config.enable_prefix_caching).lower(),
                "num_blocks": str(self.runner.kv_cache.num_blocks),
                "block_size": str(self.runner.block_size), "device": str(self.runner.device),
                "device_name": (torch.cuda.get_device_name(self.runner.device)
                                if self.runner.cuda else "cpu")})
            self.conn, self.front_end_conn = multiprocessing.get_context("spawn").Pipe()
            self.inbox = Inbox(self.conn, self.sched, self.metrics, self.clock)
        except BaseException:
            self.socket.close()
            raise
        self.engine_error: str | None = None
        # per window: its shape and CPU phases, as an offline run's steps.csv (the engine thread
        # appends, the run directory gets them at shutdown)
        self.steps: deque[dict[str, Any]] = deque(maxlen=STEP_ROWS_KEPT)
        settings = ", ".join(f"{k}={v}" for k, v in policy.describe().items() if k != "name")
        host, port = self.socket.getsockname()[:2]  # the port chosen, for server.port=0
        host = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
        self.banner = (f"{model.name} under {policy_name} ({settings}) with "
                       f"{self.runner.kv_cache.num_blocks} KV blocks on {self.runner.device}, "
                       f"at http://{host}:{port}")

    def _engine(self) -> None:
        import torch

        from real_backend.engine import serve_source

        self.metrics.watch_engine_thread(threading.get_ident())
        if self.runner.cuda:
            torch.cuda.set_device(self.runner.device)  # per thread
        try:
            serve_source(self.inbox, self.sched, self.runner, self.clock, self.steps)
        except BaseException as err:  # the loop is gone: say why, fail every request, stop
            self.engine_error = f"{type(err).__name__}: {err}"
            traceback.print_exc()
            self.inbox.fail(f"the engine stopped: {self.engine_error}")

    def run(self) -> int:
        """Serve until SIGINT or SIGTERM; 0 after a clean shutdown, 1 if the engine or the
        front end failed."""
        from real_backend.serving.front_end import run_front_end

        front_end = multiprocessing.get_context("spawn").Process(
            target=run_front_end, name="schedlab-front-end", daemon=True,
            args=(self.served, self.http, self.banner, self.front_end_conn, self.socket))
        signals = {"seen": 0, "passed": 0}  # stop signals received, and passed on

        def stop(sig: int | None = None, frame: Any = None) -> None:
            """The first signal: a clean shutdown, led by the front end; the next one (a front
            end that does not stop): kill it, and the engine closes as its pipe ends."""
            if sig is not None:
                signals["seen"] += 1
            if front_end.pid is None or not front_end.is_alive():
                return  # not started yet: passed on once it is
            if signals["passed"] == 0:
                os.kill(front_end.pid, signal.SIGTERM)
            else:
                front_end.kill()
            signals["passed"] += 1

        # The front end starts with SIGINT ignored, inherited before its Python starts: a
        # terminal's Ctrl-C reaches both processes, and this one passes it on as SIGTERM.
        old = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
               signal.SIGTERM: signal.signal(signal.SIGTERM, stop)}
        try:
            front_end.start()
        finally:
            signal.signal(signal.SIGINT, stop)
        if signals["seen"] and not signals["passed"]:  # it came while the process started
            stop()
        self.front_end_conn.close()  # the front end's copies are its own now
        self.socket.close()
        engine = threading.Thread(target=self._engine, name="engine", daemon=True)
        started = time.monotonic()
        try:
            engine.start()
            while engine.is_alive():  # ends once the front end has closed the inbox or gone
                engine.join(0.5)
            front_end.join(timeout=30)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
            self.conn.close()
        code = 0
        if front_end.is_alive():
            print("error: the front end did not stop within 30 s", file=sys.stderr)
            front_end.kill()
            code = 1
        # stopped by the signal passed on before it could take it (still starting): clean
        clean = signals["passed"] == 1 and front_end.exitcode == -signal.SIGTERM
        if code == 0 and front_end.exitcode and not clean and not self.engine_error:
            print(f"error: the front end exited with code {front_end.exitcode}",
                  file=sys.stderr)
            code = 1
        code = code or (1 if self.engine_error else 0)
        m = self.metrics
        print(f"shut down after {time.monotonic() - started:.1f} s: "
              f"{m.count('finished')} requests finished, {m.count('aborted')} aborted, "
              f"{m.count('windows')} windows; exit {code}", flush=True)
        return code


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="serve")
def _app(cfg: DictConfig) -> None:
    try:
        server = Server(cfg)
    except (ValueError, OSError) as err:  # bad settings or input: one line, no traceback
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except TypeError as err:
        print(f"error: a setting has the wrong type: {err}", file=sys.stderr)
        sys.exit(2)
    code = server.run()
    from hydra.core.hydra_config import HydraConfig

    from experiments.files import write_text_atomic
    from experiments.result_files import steps_csv

    steps = Path(HydraConfig.get().runtime.output_dir) / "steps.csv"
    if len(server.steps) == STEP_ROWS_KEPT:
        print(f"note: {steps} keeps the newest {STEP_ROWS_KEPT:,} windows only",
              file=sys.stderr)
    try:
        write_text_atomic(steps, steps_csv(list(server.steps)))
    except OSError as err:
        print(f"error: {steps}: {err.strerror or err}", file=sys.stderr)
        code = code or 1
    sys.exit(code)


def main() -> None:
    refuse_moved_settings(sys.argv[1:])
    with suggest_keys("serve", sys.argv[1:]):  # "did you mean ...?" after Hydra's error
        _app()


if __name__ == "__main__":
    main()
