"""The HTTP server's limits under load: oversized bodies and half-sent connections.

Scenario: `python -m experiments.serve` with the tiny model on the CPU (docs/serving.md's
example), then, one case at a time:
1. BODIES at once of 100 MB each (Content-Length declared, the body streamed as fast as the
   socket takes it): each should be refused with 413 before it is read, the front end's RSS
   should not grow, and /health should keep answering.
2. HALF_OPEN connections that send a request's headers and no body: /health should answer
   promptly while they are held, and each should get 408 and be closed once
   server.request_timeout_s has passed.
3. More half-open connections than server.max_connections: the ones over the cap get 503 at
   once, and their file descriptors are freed.
Prints one row per case (and one for the idle server): replies by status, the front end's RSS
before and at its peak, and /health's latency over the case (a new connection per probe, every
50 ms; median and max).

Run: python benchmarks/server_limits.py [--half-open 2000] [--timeout-s 5] [--cap 1000]
"""

from __future__ import annotations

import argparse
import http.client
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
BODY_BYTES = 100 * 10**6
CHUNK = b" " * 2**20
HEADERS = ("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
           "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, *overrides: str) -> tuple[subprocess.Popen, int]:
    """The server and its front-end process's pid, once /health answers."""
    run_dir = ROOT / "outputs" / "server_limits"
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "experiments.serve", "model=tiny", "backend.device=cpu",
           "backend.num_blocks=64", f"server.port={port}", f"hydra.run.dir={run_dir}",
           *overrides]
    log = run_dir / "server.log"  # a file, not a pipe nobody reads: a full pipe stalls logging
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT),
                                     "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, front_end_pid(proc.pid)
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not come up in 120 s")


def front_end_pid(pid: int) -> int:
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise SystemExit("no front-end process")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Probe:
    """Samples /health's latency and the front end's RSS on a thread while a case runs."""

    def __init__(self, port: int, pid: int) -> None:
        self.port, self.pid = port, pid
        self.latencies_ms: list[float] = []
        self.statuses: Counter[str] = Counter()
        self.rss_before = self.rss_peak = rss_mb(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            try:  # a new connection each time, as a client that comes along would make
                conn.request("GET", "/health")
                status = str(conn.getresponse().status)
            except OSError as err:
                status = type(err).__name__
            finally:
                conn.close()
            self.latencies_ms.append(1000 * (time.perf_counter() - t0))
            self.statuses[status] += 1
            self.rss_peak = max(self.rss_peak, rss_mb(self.pid))
            self._stop.wait(0.05)

    def stop(self) -> str:
        self._stop.set()
        self._thread.join()
        lat = self.latencies_ms or [float("nan")]
        return (f"RSS {self.rss_before:.0f} -> peak {self.rss_peak:.0f} MB; /health "
                f"{dict(self.statuses)} median {statistics.median(lat):.1f} ms, "
                f"max {max(lat):.1f} ms")


def status_of(sock: socket.socket, timeout: float) -> str:
    """The status of the reply on ``sock`` (or how the connection ended without one)."""
    sock.settimeout(timeout)
    try:
        head = sock.recv(64)
    except TimeoutError:
        return "no reply"
    except OSError as err:
        return type(err).__name__
    return head.split()[1].decode() if head.startswith(b"HTTP/") else "closed"


def big_body(port: int) -> str:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(HEADERS.format(BODY_BYTES).encode())
    sent = 0
    try:
        while sent < BODY_BYTES:
            sent += sock.send(CHUNK)
    except OSError:
        pass
    result = status_of(sock, 30)
    sock.close()
    return result


def case_bodies(port: int, pid: int, bodies: int) -> None:
    probe = Probe(port, pid)
    replies: list[str] = []
    threads = [threading.Thread(target=lambda: replies.append(big_body(port)))
               for _ in range(bodies)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    print(f"{bodies} x 100 MB body: replies {dict(Counter(replies))} in {took:.2f} s; "
          f"{probe.stop()}")


def open_half(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(HEADERS.format(100).encode())
        socks.append(s)
    return socks


def case_idle(port: int, pid: int) -> None:
    probe = Probe(port, pid)
    time.sleep(1.0)
    print(f"idle: {probe.stop()}")


def case_half_open(port: int, pid: int, n: int, timeout_s: float) -> None:
    t0 = time.perf_counter()
    socks = open_half(port, n)
    opened = time.perf_counter() - t0
    time.sleep(0.5)  # the server has taken them all
    probe = Probe(port, pid)
    time.sleep(1.0)  # held: /health is probed meanwhile
    held = probe.stop()
    t1 = time.perf_counter()
    replies = Counter(status_of(s, timeout_s + 10) for s in socks)
    waited = time.perf_counter() - t1
    for s in socks:
        s.close()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "/health")
    after = conn.getresponse().status
    conn.close()
    print(f"{n} half-open connections (opened in {opened:.2f} s): while held, {held}; then "
          f"{dict(replies)} within {waited:.1f} s more; /health after: {after}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--half-open", type=int, default=2000)
    ap.add_argument("--timeout-s", type=float, default=5.0, help="server.request_timeout_s")
    ap.add_argument("--cap", type=int, default=1000,
                    help="server.max_connections for case 3 (below --half-open)")
    args = ap.parse_args()
    port = free_port()
    proc, pid = start_server(port, f"server.request_timeout_s={args.timeout_s}")
    try:
        case_idle(port, pid)
        case_bodies(port, pid, 1)
        case_bodies(port, pid, 4)
        case_half_open(port, pid, args.half_open, args.timeout_s)
    finally:
        proc.terminate()
        proc.wait(30)
    port = free_port()
    proc, pid = start_server(port, f"server.request_timeout_s={args.timeout_s}",
                             f"server.max_connections={args.cap}")
    try:
        print(f"server.max_connections={args.cap}:", end=" ")
        case_half_open(port, pid, args.half_open, args.timeout_s)
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
