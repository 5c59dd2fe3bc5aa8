"""Tensor parallelism in the real engine: each rank's share of the model (Megatron-style), the
collectives of a forward step, and the worker ranks: one process per GPU beside the serving
process (rank 0), each running the windows rank 0 schedules and broadcasts.

Sharding (``TPGroup``, real_backend/tp_group.py): q/k/v and gate/up are split by output rows (column-parallel), o_proj
and down_proj by input columns (row-parallel) and their outputs all-reduced; the embedding
and the LM head are split by vocabulary rows: an embedding lookup is all-reduced (each rank
fills the rows of its ids), the logits gathered. KV heads are split with their query heads,
or replicated when there are fewer KV heads than ranks. Every rank keeps the whole residual
stream and gets the whole logits, so every rank samples the same ids from the same seeded
generator and runs advance_step on them itself: no sampled id crosses between ranks.
"""

from __future__ import annotations

import ctypes
import dataclasses
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from common.model_spec import ModelSpec
from real_backend.build import RunnerShape, build_rank_runner
from real_backend.tp_group import GroupBroken, TPGroup

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from real_backend.config import BackendConfig
    from real_backend.runner import ModelRunner
    from real_backend.window_inputs import HostPlan


# ---------------------------------------------------------------------- the worker ranks


@dataclass(frozen=True, slots=True)
class BuildRunner:
    """Rank 0 to the workers: build your runner for the next run (then serve its windows)."""

    spec: ModelSpec
    cfg: BackendConfig
    shape: RunnerShape


EXIT = "exit"  # rank 0 to the workers: no more runs


def rank_config(cfg: BackendConfig, rank: int) -> BackendConfig:
    """Rank r's settings: GPU r on a CUDA host."""
    if cfg.torch_device.type != "cuda":
        return cfg
    return dataclasses.replace(cfg, device=f"cuda:{rank}")


def check_devices(cfg: BackendConfig, size: int) -> None:
    """One line when ``size`` ranks cannot each get a device of ``cfg``."""
    dev = torch.device(cfg.device)
    if dev.type != "cuda":
        return
    if dev.index is not None:
        raise ValueError(f"backend.device {cfg.device}: with parallel.tensor_parallel_size "
                         f"{size} set backend.device=cuda (rank r runs on cuda:r)")
    if torch.cuda.device_count() < size:
        raise ValueError(f"parallel.tensor_parallel_size {size} needs {size} GPUs, this host "
                         f"has {torch.cuda.device_count()}")


# How long a collective of the activations' NCCL group waits for a rank before NCCL's watchdog
# aborts it: a step's collectives take milliseconds, and the longest healthy wait, one rank's
# warm-up (Triton compiles, graph capture) ahead of another's, well under a minute; a GPU rank
# that dies inside a window then ends the run after this long instead of never. The gloo groups
# keep torch's 30 minutes: a worker waits there for rank 0's next window as long as rank 0 has
# no request to run, and a dead peer shows there at once, as a closed connection.
NCCL_TIMEOUT = timedelta(minutes=5)
# After a failed collective, how long rank 0 waits for the rank that closed its connection to
# be seen dead (its sockets close as its process ends, a moment before it can be reaped).
DEATH_WAIT_S = 5.0
# How long rank 0 waits for its workers to start (spawn, imports) before it joins the group.
WORKER_START_S = 600.0
RENDEZVOUS_PREFIX = "schedlab-tp-"


def _init_group(rank: int, size: int, init_method: str, device_type: str) -> TPGroup:
    if device_type == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=size,
                                device_id=torch.device("cuda", rank), timeout=NCCL_TIMEOUT)
        return TPGroup(rank, size, dist.group.WORLD, dist.new_group(backend="gloo"))
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
    return TPGroup(rank, size, dist.group.WORLD, dist.group.WORLD)


def exit_with_parent(parent: int) -> None:
    """This worker ends when rank 0's process does, even when that one was killed (-9) and ran
    no cleanup: the kernel sends SIGKILL on Linux, a thread watching the parent elsewhere."""
    if sys.platform == "linux":
        pr_set_pdeathsig = 1  # <linux/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    else:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, name="rank0-watch", daemon=True).start()
    if os.getppid() != parent:  # rank 0 was gone before the kernel watched it
        os._exit(1)


def _worker_main(rank: int, size: int, init_method: str, device_type: str, parent: int,
                 ready: Connection) -> None:
    """A worker rank's process: build a runner for each run rank 0 announces and serve it."""
    exit_with_parent(parent)
    # Ctrl-C reaches the whole terminal's process group: rank 0 alone handles it (and ends
    # the workers), so a worker prints no traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if device_type == "cpu":
        torch.set_num_threads(1)  # the ranks share the host's cores
    ready.send(True)  # started: rank 0 joins the group only once every worker has
    ready.close()
    try:
        group = _init_group(rank, size, init_method, device_type)
        while isinstance(job := group.recv(), BuildRunner):
            try:
                runner = build_rank_runner(job.spec, rank_config(job.cfg, rank), job.shape, group)
            except ValueError:
                continue  # rank 0 raises the same one line and ends the run
            if serve_windows(runner, group) == EXIT:
                break
            del runner
    except (GroupBroken, dist.DistError):  # NCCL's errors outside a collective: DistError
        # The group broke: rank 0 went away (killed, or ending the run after a failure and
        # about to end this process too). It reports the run's end; this rank has nothing to
        # add, and the broken group needs no teardown.
        os._exit(1)
    dist.destroy_process_group()


def serve_windows(runner: ModelRunner, group: TPGroup) -> object:
    """A worker rank's loop: run every window rank 0 broadcasts, up to two in flight (their
    inputs' host copies stay alive until then), until a message that is not a window (the end
    of the run, or EXIT), which it returns."""
    from real_backend.window_inputs import HostPlan

    in_flight: deque[Callable[[], None]] = deque()
    while isinstance(plan := group.recv(), HostPlan):
        in_flight.append(runner.launch_plan(plan))
        if len(in_flight) > 2:
            in_flight.popleft()()
    while in_flight:
        in_flight.popleft()()
    return plan


def how_ended(exitcode: int | None) -> str:
    """A worker process's end in words: killed by a signal, or its exit code."""
    if exitcode is not None and exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _owner_tag() -> str:
    return f"{os.uname().nodename} {os.getpid()}"


def remove_stale_rendezvous(tmp: Path | None = None) -> None:
    """Remove the rendezvous directories that runs of this user on this host left when they were
    killed outright (kill -9 runs no cleanup): each names its owner (host and pid) in a file,
    and only those whose owner is gone go. Another user's, another host's (a shared /tmp) and a
    live run's stay."""
    for d in Path(tmp or tempfile.gettempdir()).glob(f"{RENDEZVOUS_PREFIX}*"):
        try:
            if d.stat().st_uid != os.getuid():
                continue
            host, pid = (d / "owner").read_text().split()
        except (OSError, ValueError):
            continue  # not ours, not readable, or being made
        if host == os.uname().nodename and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


class Workers:
    """Rank 0's side: the worker processes (ranks 1..size-1) and this process's group.

    ``with Workers(size, cfg) as workers``: on a clean exit the workers are told to stop and
    joined; after a failure or an interrupt (a rank may be stuck in a collective) they are
    terminated; either way the rendezvous directory goes. Runs given them
    (``run_real(..., workers=...)``) share them; a failed run closes them. A worker that dies
    is a one-line ``ChildProcessError`` naming its rank: seen before each window is sent, or
    when a collective fails because the worker's connection closed.
    """

    def __init__(self, size: int, cfg: BackendConfig) -> None:
        check_devices(cfg, size)
        if dist.is_initialized():  # a process belongs to one group of ranks
            raise ValueError("tensor-parallel ranks are running in this process already: close "
                             "those workers first")
        self.size = size
        self.device_type = cfg.torch_device.type
        self.procs: list[mp.process.BaseProcess] = []
        self.closed = False
        remove_stale_rendezvous()
        self._dir = tempfile.mkdtemp(prefix=RENDEZVOUS_PREFIX)
        try:
            (Path(self._dir) / "owner").write_text(_owner_tag())
            init_method = f"file://{self._dir}/rendezvous"
            ctx = mp.get_context("spawn")  # a CUDA context cannot cross a fork
            started = []
            for r in range(1, size):
                started_r, ready = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker_main, daemon=True,
                                args=(r, size, init_method, self.device_type, os.getpid(), ready))
                p.start()
                ready.close()
                self.procs.append(p)
                started.append(started_r)
            self._await_started(started)
            self.group = _init_group(0, size, init_method, self.device_type)
            self.group.on_failure = lambda: self.check_alive(wait=DEATH_WAIT_S)
        except BaseException:  # an interrupt too: no process or directory is left
            self.close(clean=False)
            raise

    def _await_started(self, started: list[Connection]) -> None:
        """Wait until every worker has started (imports done, about to join the group): the
        group's rendezvous waits for a rank that died before it came as long as the group's
        timeout, so a worker that ends first is a one-line ChildProcessError here instead."""
        pending = dict(zip(started, range(1, self.size), strict=True))
        deadline = time.monotonic() + WORKER_START_S
        while pending:
            ended = mp.connection.wait(
                [*pending, *(p.sentinel for p in self.procs)],
                timeout=max(0.0, deadline - time.monotonic()))
            if not ended:
                raise TimeoutError(f"tensor-parallel ranks {sorted(pending.values())} did not "
                                   f"start within {WORKER_START_S:.0f} s")
            for conn in ended:
                if conn in pending:
                    try:
                        conn.recv()
                    except EOFError:  # it ended: its sentinel says how, below
                        continue
                    del pending[conn]
            self.check_alive()
        for conn in started:
            conn.close()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.close(clean=exc_type is None)

    def check_alive(self, wait: float = 0.0) -> None:
        """A one-line ChildProcessError naming the first worker rank that has ended (waiting up
        to ``wait`` seconds for one to)."""
        ended = mp.connection.wait([p.sentinel for p in self.procs], timeout=wait)
        for rank, p in enumerate(self.procs, start=1):
            if p.sentinel in ended:
                p.join()
                raise ChildProcessError(f"tensor-parallel rank {rank} {how_ended(p.exitcode)} "
                                        "during the run")

    def publish(self, plan: HostPlan) -> None:
        # a dead worker is caught here, between windows: on NCCL the next collective would
        # only end with NCCL_TIMEOUT
        self.check_alive()
        self.group.send(plan)

    def close(self, clean: bool = True) -> None:
        """Stop the workers: told to (``clean``), or terminated (after a failure)."""
        if self.closed:
            return
        self.closed = True
        try:
            if clean:
                self.group.send(EXIT)
        except BaseException:
            clean = False
            raise
        finally:
            for p in self.procs:
                p.join(timeout=30 if clean else 0)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
                if p.is_alive():  # stuck where SIGTERM does not reach
                    p.kill()
                    p.join()
            if dist.is_initialized():
                dist.destroy_process_group()
            shutil.rmtree(self._dir, ignore_errors=True)
