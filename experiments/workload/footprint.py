"""The memory a run's requests (and a cluster's replicas) take, and the guards that refuse a run
that would not fit."""

from __future__ import annotations

import os
from collections.abc import Sequence

# Bytes a request costs over a whole run, measured and rounded up. A simulator run of synthetic
# requests (peak RSS of experiments.run at 20k and 80k requests, outputs of 4 and 256 tokens)
# takes ~1.7 KiB per request (its RequestSpec, Request, lists and metrics rows) and ~18 B per
# output token (each token's delivery time). The real backend also keeps prompt token ids (a
# tuple in the spec and a list in the Request: ~49 B a token measured with tracemalloc) and the
# ids it samples (an int object and a pointer each).
BYTES_PER_REQUEST = 2048
BYTES_PER_OUTPUT_TOKEN = 24
BYTES_PER_PROMPT_TOKEN_ID = 56
BYTES_PER_OUTPUT_TOKEN_ID = 48
# A trace row while the file is read and sorted (a 4-tuple, its float and ints, a list slot).
BYTES_PER_TRACE_ROW = 256
# A prompt segment (RequestSpec.segments, for prefix caching): a (content key, tokens) pair,
# its 63-bit key and length ints and a tuple slot, ~100 B measured with tracemalloc. A
# conversation's later turns share their earlier turns' pairs, so this overcounts them.
BYTES_PER_SEGMENT = 128
# A Mooncake block hash, from reading the trace to the run's end: an int object and a tuple
# slot (the RequestSpec's tuple is the Request's, not a copy), and the prompt segment made of it.
BYTES_PER_HASH_ID = 40 + BYTES_PER_SEGMENT
# A simulated replica's virtual engine over a run (its scheduler, block manager and policy, its
# state and processes in the simulation, its summary in result.json), measured and rounded up:
# peak RSS of experiments.run at 2,000 and 12,000 replicas of 20 requests, with one and two
# pipeline stages, ~7 KiB a virtual engine.
BYTES_PER_ENGINE = 8192

GIB = 1 << 30


def available_memory() -> int | None:
    """Bytes the system can still give a process without swapping (Linux MemAvailable, else
    free physical pages); None where neither is known, and then nothing is refused."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def run_bytes(num_requests: int, prompt_tokens: int, output_tokens: int, *,
              with_token_ids: bool, hash_ids: int = 0, segments: int = 0) -> int:
    """Estimated bytes the requests of one run take from building the workload to its results
    (``hash_ids``: the trace's block hashes over all requests, their segments included;
    ``segments``: the requests' other prompt segments)."""
    need = (num_requests * BYTES_PER_REQUEST + output_tokens * BYTES_PER_OUTPUT_TOKEN
            + hash_ids * BYTES_PER_HASH_ID + segments * BYTES_PER_SEGMENT)
    if with_token_ids:
        need += (prompt_tokens * BYTES_PER_PROMPT_TOKEN_ID
                 + output_tokens * BYTES_PER_OUTPUT_TOKEN_ID)
    return need


def check_run_fits(num_requests: int, prompt_tokens: int | None, output_tokens: int | None, *,
                   with_token_ids: bool, hash_ids: int = 0, segments: int = 0,
                   setting: str = "num_prompts") -> None:
    """Refuse, naming ``workload.<setting>`` (what sets the number of requests) and the memory
    available, a run whose requests would not fit in memory: it would swap or be killed rather
    than finish.

    Token counts of None are not known yet (the lengths are not drawn): one token each is the
    least the requests can take, and the check is made before anything is allocated.
    """
    available = available_memory()
    if available is None:
        return
    at_least = prompt_tokens is None or output_tokens is None
    need = run_bytes(num_requests, num_requests if prompt_tokens is None else prompt_tokens,
                     num_requests if output_tokens is None else output_tokens,
                     with_token_ids=with_token_ids, hash_ids=hash_ids, segments=segments)
    if need > available:
        tokens = "" if at_least else (f", {output_tokens} output tokens and {hash_ids} block "
                                      "hashes" if hash_ids else f" and {output_tokens} output tokens")
        ids = " with prompt token ids" if with_token_ids else ""
        size = f"{'at least' if at_least else 'about'} {need / GIB:.1f} GiB{ids}"
        raise ValueError(
            f"workload.{setting}: {num_requests} requests{tokens} would take {size}, more "
            f"than the {available / GIB:.1f} GiB of memory available; lower "
            f"workload.{setting}")


def trace_row_bytes(prompt_len: int, output_len: int, hash_ids: int, *,
                    with_token_ids: bool) -> int:
    """Bytes one trace row takes while the file is read, plus what its request takes in the
    run: the whole trace fits only if the sum over its rows fits, so a reader can refuse it
    at the first row past the memory available rather than after the whole file."""
    return BYTES_PER_TRACE_ROW + run_bytes(1, prompt_len, output_len,
                                           with_token_ids=with_token_ids, hash_ids=hash_ids)


def check_replicas_fit(groups: Sequence[tuple[int, int]], setting: str) -> None:
    """Refuse, naming ``setting`` (what sets the number of replicas) and the memory available,
    a cluster whose replicas would not fit in memory; made before any replica's state is.
    ``groups``: per replica group, its replicas and their pipeline stages (a virtual engine
    each; a group may have its own ``parallel``)."""
    available = available_memory()
    num_replicas = sum(n for n, _ in groups)
    engines = sum(n * stages for n, stages in groups)
    need = engines * BYTES_PER_ENGINE
    if available is not None and need > available:
        each = (f" of {groups[0][1]} pipeline stages" if len({s for _, s in groups}) == 1
                else f" ({engines} pipeline stages in all)") if engines > num_replicas else ""
        raise ValueError(
            f"{setting}: {num_replicas} replicas{each} would take about {_size(need)}, more "
            f"than the {_size(available)} of memory available; lower {setting}")


def _size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GiB" if num_bytes >= GIB else f"{num_bytes >> 20} MiB"
