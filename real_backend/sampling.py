"""Token sampling on the device, with no host sync: one setting for a whole batch (``sample``,
every offline run), or each row its own (``sample_rows``: the server's per-request temperature,
top-k, top-p, seed and vLLM's penalties, whose token counts ``PenaltyState`` keeps on the
device); the logprobs a served request asks for (``top_logprobs``); the device-side map of each
request's newest token that overlap scheduling reads inputs from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from policies.request import Request, RequestState
from policies.sampling_params import SamplingParams

__all__ = ["PenaltyState", "RowSampling", "SamplingParams", "StepPenalties", "TokenMap",
           "apply_penalties", "sample", "sample_rows", "seed_key", "seeded_noise",
           "top_logprobs"]


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> torch.Tensor:
    """Token ids [N] (int64, on the logits' device) from fp32 logits [N, vocab]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        drop = _top_p_drop(sorted_probs, params.top_p)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    # Gumbel-max in its exponential form: argmax(p / E), E ~ Exp(1), samples from p with no sync.
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def _top_p_drop(sorted_probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """The tokens top-p drops, in probability order: each one whose preceding mass already
    reaches top_p. The most likely token always stays: a top_p below float32's range (1e-300)
    is 0 on the device, and would drop every token (softmax of all -inf: NaN, token 0)."""
    drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    drop[:, 0] = False
    return drop


# Seeded sampling: a counter-based hash of (the request's seed, the token's position, the
# vocabulary id) gives each candidate its Exp(1) noise, so a seeded request's samples depend on
# nothing else: not on the rows beside it, the window's k, overlap, a preemption or a CUDA graph
# (no generator state to carry between steps or to capture). Plain int64 tensor ops, the same on
# the CPU and the GPU: 32-bit values multiplied in 16-bit halves never overflow int64.
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (Wellons' lowbias32), bijective on [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """A request's 64-bit seed (negative ones too) as the hash's 32-bit key (splitmix64)."""
    m = (1 << 64) - 1
    z = (seed + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return (z ^ (z >> 31)) & _M32


def seeded_noise(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [n, vocab] (fp32) of n rows, each a function of (key, position) alone."""
    row = _mix32(keys ^ _mix32(positions & _M32))
    ids = _mul32(torch.arange(vocab, dtype=torch.int64, device=keys.device), 0x9E3779B9)
    h = _mix32(row[:, None] ^ ids[None, :])
    u = ((h >> 8).to(torch.float32) + 0.5) * 2.0 ** -24  # (0, 1), 24 bits: exact in fp32
    return -torch.log(u)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties, as its sampler applies them (before temperature, and before a greedy
    row's argmax), on fp32 logits [n, vocab]: ``counts`` [n, vocab] each token's occurrences
    in the row's output so far, ``prompt`` [n, vocab] bool the tokens of its prompt;
    ``presence``, ``frequency``, ``repetition`` [n]. A token of the prompt or the output has
    its logit divided by the repetition penalty if positive, multiplied if not; then each
    output token's logit loses frequency x its count and presence once."""
    seen = counts > 0
    rep = repetition[:, None]
    x = torch.where(prompt | seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return x - frequency[:, None] * counts - presence[:, None] * seen.to(x.dtype)


class PenaltyState:
    """The inputs of vLLM's penalties, on the device, for the requests that ask for one: a row
    per request of its output tokens' counts and its prompt's tokens (a mask), kept across
    windows. A row is built from the tokens the host knows when its request first comes
    (``rows``, ``build``), then each step's samples are counted into it on the device
    (``count``), so that a window formed before the last one's tokens reach the host (overlap,
    a multi-step window's later steps) sees them all. Rows of finished requests are handed out
    again; the tensors grow (by doubling) as more rows are held at once."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(0, vocab, dtype=torch.float32, device=device)
        self.prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self._row: dict[Request, int] = {}  # the host's side: rank 0 hands rows out
        self._free: list[int] = []
        self._next = 0

    def rows(self, requests: Sequence[Request]) -> tuple[list[int], list[int]]:
        """Each request's row, and the indices (into ``requests``) of those handed out now, to
        be built; rows of finished requests are given back first."""
        row = self._row
        for req in [r for r in row if r.state is RequestState.FINISHED]:
            self._free.append(row.pop(req))
        self._free.sort(reverse=True)
        out, new = [], []
        for i, req in enumerate(requests):
            r = row.get(req)
            if r is None:
                if self._free:
                    r = self._free.pop()
                else:
                    r, self._next = self._next, self._next + 1
                row[req] = r
                new.append(i)
            out.append(r)
        return out, new

    def build(self, rows: torch.Tensor, num_rows: int, prompt: tuple[torch.Tensor, torch.Tensor],
              output: tuple[torch.Tensor, torch.Tensor]) -> None:
        """(Re)build ``rows`` from (row, token id) pairs of their prompts and known outputs;
        the tensors first grow to hold ``num_rows`` rows."""
        size = self.counts.shape[0]
        if num_rows > size:
            grow = max(num_rows, 2 * size, 8) - size
            self.counts = torch.cat([self.counts, self.counts.new_zeros(grow, self.vocab)])
            self.prompt = torch.cat([self.prompt, self.prompt.new_zeros(grow, self.vocab)])
        self.counts.index_fill_(0, rows, 0.0)
        self.prompt.index_fill_(0, rows, False)
        self.prompt.index_put_(prompt, torch.ones_like(prompt[1], dtype=torch.bool))
        self.counts.index_put_(output, torch.ones_like(output[1], dtype=torch.float32),
                               accumulate=True)


@dataclass(slots=True)
class StepPenalties:
    """The rows of a step's logits that have a penalty: their positions among the step's rows,
    their ``PenaltyState`` rows and their penalties."""

    state: PenaltyState
    where: torch.Tensor  # [q] int64
    rows: torch.Tensor  # [q] int64
    presence: torch.Tensor  # [q] fp32
    frequency: torch.Tensor
    repetition: torch.Tensor

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits with these rows penalized (a new tensor: the raw logits stay, for
        logprobs)."""
        st = self.state
        rows = self.rows
        x = apply_penalties(logits.index_select(0, self.where), st.counts.index_select(0, rows),
                            st.prompt.index_select(0, rows), self.presence, self.frequency,
                            self.repetition)
        return logits.index_copy(0, self.where, x)

    def count(self, sampled: torch.Tensor) -> None:
        """Count the step's samples into the rows' output tokens."""
        tokens = sampled.index_select(0, self.where)
        self.state.counts.index_put_((self.rows, tokens),
                                     torch.ones_like(tokens, dtype=torch.float32),
                                     accumulate=True)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw logprobs (log_softmax of the model's logits, before penalties, temperature or
    top-k/top-p: vLLM's default ``logprobs_mode``, raw_logprobs) of rows [m, vocab]: [m, 1 + k]
    fp32, each row's ``tokens`` (the one sampled, or the next prompt token) first, then its k
    most likely tokens'; and those tokens' ids [m, k]."""
    lp = logits.float().log_softmax(dim=-1)
    top = lp.topk(k, dim=-1)
    return torch.cat([lp.gather(1, tokens[:, None]), top.values], dim=1), top.indices


@dataclass(slots=True)
class RowSampling:
    """Each row's sampling settings for the steps that sample the same rows, on the device
    (built from window_inputs.SamplingRows); the flags, known on the host, skip what no row
    needs without a sync."""

    greedy: torch.Tensor  # [n] bool
    temperature: torch.Tensor  # [n] fp32 (1 on greedy rows)
    top_k: torch.Tensor  # [n] int64, -1: whole vocabulary
    top_p: torch.Tensor  # [n] fp32, 2 where there is no cut
    seeded: torch.Tensor  # [s] int64 rows with a seed
    keys: torch.Tensor  # [s] int64 their seed keys
    positions: torch.Tensor  # [s] int64 the position each samples at the rows' first step
    first_step: int  # the step ``positions`` count from
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_unseeded: bool  # a sampled row without a seed: noise from the engine's generator
    all_seeded: bool
    penalties: StepPenalties | None = None  # the rows with a penalty
    logprob_rows: torch.Tensor | None = None  # [m] int64 the rows that ask for logprobs
    num_logprobs: int = 0  # the most top logprobs one of them asks for


def sample_rows(logits: torch.Tensor, rows: RowSampling, step: int,
                generator: torch.Generator | None) -> torch.Tensor:
    """Token ids [N] from fp32 logits [N, vocab], each row with its own settings (vLLM's
    penalties first, then ``sample``'s rules per row: temperature, then top-k, then top-p over
    what top-k kept). ``logits`` are left as they are (raw, for logprobs); the samples of rows
    with a penalty are counted into their rows of the ``PenaltyState``."""
    penalties = rows.penalties
    if penalties is not None:
        logits = penalties.apply(logits)
    sampled = _sample_rows(logits, rows, step, generator)
    if penalties is not None:
        penalties.count(sampled)
    return sampled


def _sample_rows(logits: torch.Tensor, rows: RowSampling, step: int,
                 generator: torch.Generator | None) -> torch.Tensor:
    greedy_ids = logits.argmax(dim=-1)
    if rows.all_greedy:
        return greedy_ids
    vocab = logits.shape[-1]
    x = logits / rows.temperature[:, None]
    if rows.any_top_k or rows.any_top_p:
        sorted_x, order = x.sort(dim=-1, descending=True)
        if rows.any_top_k:
            k = torch.where(rows.top_k > 0, rows.top_k.clamp(max=vocab), vocab)
            kth = sorted_x.gather(1, (k - 1)[:, None])
            x = x.masked_fill(x < kth, float("-inf"))
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        if rows.any_top_p:
            p = sorted_x.softmax(dim=-1)
            drop = _top_p_drop(p, rows.top_p[:, None])
            x = torch.empty_like(x).scatter_(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = x.softmax(dim=-1)
    positions = rows.positions + (step - rows.first_step)
    if rows.all_seeded:
        noise = seeded_noise(rows.keys, positions, vocab)
    else:
        noise = (torch.empty_like(probs).exponential_(generator=generator) if rows.any_unseeded
                 else torch.ones_like(probs))
        if rows.seeded.numel():
            noise.index_copy_(0, rows.seeded, seeded_noise(rows.keys, positions, vocab))
    return torch.where(rows.greedy, greedy_ids, (probs / noise).argmax(dim=-1))


class TokenMap:
    """Each running request's newest sampled token on the device, in a row the map hands out.

    Overlap scheduling builds window n+1's inputs before window n's ids reach the host:
    sampling writes every step's ids into the map, and window n+1's input ids are gathered
    from it on the device. A request's row goes back once it is no longer running; a window
    still in flight may write the row after that, but the stream runs windows in order, so its
    next owner writes the row (its first sample) before anything reads it.
    """

    def __init__(self, num_rows: int, device: torch.device) -> None:
        self.tokens = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self._row: dict[Request, int] = {}
        self._free = list(range(num_rows - 1, -1, -1))

    def rows(self, requests: Sequence[Request]) -> list[int]:
        """Each request's row, handed out on first use (rows of finished and preempted
        requests are given back first)."""
        row = self._row
        for req in [r for r in row if r.state is not RequestState.RUNNING]:
            self._free.append(row.pop(req))
        out = []
        for req in requests:
            r = row.get(req)
            if r is None:
                if not self._free:
                    raise RuntimeError(f"the token map's {len(row)} rows are all held by "
                                       "running requests")
                r = row[req] = self._free.pop()
            out.append(r)
        return out

    def write(self, rows: torch.Tensor, sampled: torch.Tensor) -> None:
        self.tokens.index_copy_(0, rows, sampled)

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        return self.tokens.index_select(0, rows)
