"""Made-up prompt content: synthetic lengths from a seeded distribution, seeded random prompt
token ids, and the content keys of prompt segments (prefix caching)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from experiments.workload.settings import get_float, get_int

# The settings kind=synthetic reads besides the common ones and the arrival process's.
SYNTHETIC_KEYS = frozenset({"lengths"})


def synthetic_lengths(lengths: Mapping[str, Any], num_prompts: int, seed: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths drawn from ``workload.lengths`` with a seeded Generator.

    dist=fixed: prompt_len, output_len. dist=uniform: integers in [prompt_min, prompt_max] and
    [output_min, output_max]. dist=lognormal: prompt_mean/prompt_sigma and
    output_mean/output_sigma (mean in tokens of the unclipped distribution, sigma of the
    underlying normal), rounded and clipped to [X_min, X_max] (defaults 1 and unbounded).
    The section may hold the settings of every dist (synthetic.yaml lists them all, so one
    command-line override switches dist); only those of the chosen dist are read.
    """
    if not isinstance(lengths, Mapping):
        raise ValueError(f"workload.lengths must be a mapping with a 'dist' key, got {lengths!r}")
    dist = lengths.get("dist")
    if dist not in ("fixed", "uniform", "lognormal"):
        raise ValueError(f"workload.lengths.dist must be fixed, uniform or lognormal, "
                         f"got {dist!r}")
    known = {"dist"} | {f"{side}_{k}" for side in ("prompt", "output")
                        for k in ("len", "min", "max", "mean", "sigma")}
    unknown = sorted(set(lengths) - known)
    if unknown:
        raise ValueError(f"workload.lengths.{unknown[0]} is not a length setting "
                         f"(settings: {', '.join(sorted(known))})")
    rng = np.random.default_rng(seed)
    pre = "workload.lengths"
    out = []
    for side in ("prompt", "output"):
        if dist == "fixed":
            v = get_int(lengths, f"{side}_len", None, 1, prefix=pre)
            out.append(np.full(num_prompts, v, dtype=np.int64))
        elif dist == "uniform":
            lo = get_int(lengths, f"{side}_min", None, 1, prefix=pre)
            hi = get_int(lengths, f"{side}_max", None, lo, prefix=pre)
            out.append(rng.integers(lo, hi, endpoint=True, size=num_prompts))
        else:
            mean = get_float(lengths, f"{side}_mean", None, prefix=pre)
            sigma = get_float(lengths, f"{side}_sigma", None, prefix=pre)
            if not (mean > 0 and math.isfinite(mean)):
                raise ValueError(f"{pre}.{side}_mean must be > 0, got {mean}")
            if not (sigma >= 0 and math.isfinite(sigma)):
                raise ValueError(f"{pre}.{side}_sigma must be >= 0, got {sigma}")
            lo = get_int(lengths, f"{side}_min", 1, 1, prefix=pre)
            hi = lengths.get(f"{side}_max")
            hi = math.inf if hi is None else get_int(lengths, f"{side}_max", None, lo, prefix=pre)
            # numpy's mean is the underlying normal's; shift it so the lengths average `mean`.
            mu = math.log(mean) - sigma * sigma / 2
            x = np.clip(np.rint(rng.lognormal(mu, sigma, size=num_prompts)), lo, hi)
            out.append(x.astype(np.int64))
    return out[0], out[1]


def random_token_ids(lens: Sequence[int], vocab_size: int, seed: int) -> list[tuple[int, ...]]:
    """Seeded prompt token ids below ``vocab_size`` for requests that have no text (synthetic,
    trace): the real backend needs ids, and only their count matters to it."""
    # A stream of its own, so asking for token ids never changes lengths or arrivals.
    rng = np.random.default_rng((seed, 0x70C))
    return [tuple(int(t) for t in rng.integers(0, vocab_size, size=n)) for n in lens]


def segment_token_ids(segments: Sequence[tuple[tuple[int, int], ...]], vocab_size: int
                      ) -> list[tuple[int, ...]]:
    """Prompt token ids that follow each prompt's segments (a trace's block hashes): a content
    key's tokens are drawn from a stream seeded by the key, so equal keys give equal tokens and
    the real engine's cached KV is that of the tokens it stands for."""
    drawn: dict[int, np.ndarray] = {}

    def tokens(key: int, n: int) -> np.ndarray:
        got = drawn.get(key)
        if got is None or len(got) < n:
            got = drawn[key] = np.random.default_rng(key).integers(0, vocab_size, size=n)
        return got[:n]

    return [tuple(int(t) for key, n in segs for t in tokens(key, n)) for segs in segments]


def content_key(kind: str, *which: int) -> int:
    """A prompt segment's content key (RequestSpec.segments): 63 bits of blake2b over ``kind``,
    a tag naming the kind of content (so keys of two kinds never meet), and the ints saying
    which content of that kind. Stable across processes, unlike Python's salted str hash."""
    text = repr((kind, *(int(w) for w in which))).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


# workload.shared_prefix_len's system prompt: the same tokens at the start of every prompt.
SYSTEM_PROMPT_KEY = content_key("system prompt")


def request_prompt_key(index: int) -> int:
    """The key of a prompt that shares nothing (the ``index``-th request's own tokens)."""
    return content_key("request prompt", index)


def system_prompt_ids(length: int, vocab_size: int, seed: int) -> tuple[int, ...]:
    """workload.shared_prefix_len's system prompt as token ids: seeded, below ``vocab_size``."""
    rng = np.random.default_rng((seed, 0x5157))  # its own stream: nothing else changes
    return tuple(int(t) for t in rng.integers(0, vocab_size, size=length))
