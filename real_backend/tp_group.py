"""One tensor-parallel rank's share of the model and the collectives of a forward step
(``TPGroup``), apart from the worker ranks (real_backend/parallel.py) so that the model, its
weights and the runner's build can name it without importing the workers that build them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from common.model_spec import ModelSpec
from common.parallel import kv_heads_per_rank

# all_gather_into_tensor's newer name (torch >= 2.10; the old one warns there)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GroupBroken(RuntimeError):
    """A collective failed: another rank went away (its connection closed) or timed out."""


@dataclass(slots=True)
class TPGroup:
    """One rank's place among ``size`` tensor-parallel ranks and the groups it talks over:
    ``group`` for activations (NCCL on GPUs, gloo on the CPU), ``cpu_group`` (gloo) for the
    window descriptions rank 0 broadcasts. Without groups (tests of the sharding) no
    collective may run."""

    rank: int
    size: int
    group: Any = None  # torch.distributed.ProcessGroup
    cpu_group: Any = None
    # rank 0: raises the one line naming a rank that died, after a collective failed
    on_failure: Callable[[], None] | None = None

    def _failed(self, err: RuntimeError) -> NoReturn:
        """A collective failed (a peer's connection closed, a timeout): the dead rank's one line
        where rank 0 knows its workers, else ``GroupBroken`` (gloo says RuntimeError only)."""
        if self.on_failure is not None:
            self.on_failure()
        raise GroupBroken(str(err)) from err

    # ------------------------------------------------------------------ the shard
    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        """The shape of this rank's share: its query and KV heads and MLP columns (the
        vocabulary stays whole: the logits are gathered)."""
        return dataclasses.replace(spec, num_heads=spec.num_heads // self.size,
                                   num_kv_heads=kv_heads_per_rank(spec, self.size),
                                   intermediate_size=spec.intermediate_size // self.size)

    def kv_head_start(self, spec: ModelSpec) -> int:
        """The first KV head this rank holds: the one its first query head reads."""
        return self.rank * spec.num_kv_heads // self.size

    def vocab_rows(self, spec: ModelSpec) -> tuple[int, int, int]:
        """(first id, rows held, rows filled) of this rank's vocabulary shard: every rank holds
        ceil(V / size) rows, the last one's tail zero when V does not divide."""
        per = -(-spec.vocab_size // self.size)
        start = self.rank * per
        return start, per, max(0, min(per, spec.vocab_size - start))

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        try:
            dist.all_reduce(x, group=self.group)
        except RuntimeError as err:
            self._failed(err)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[N, V] from each rank's [N, V / size] columns (the LM head's shards)."""
        n, per = logits.shape
        out = logits.new_empty(self.size * n, per)
        try:
            _all_gather(out, logits.contiguous(), group=self.group)
        except RuntimeError as err:
            self._failed(err)
        return out.view(self.size, n, per).permute(1, 0, 2).reshape(n, self.size * per)[:, :vocab_size]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (e.g. the KV blocks each rank's memory fits)."""
        t = torch.tensor([value], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        except RuntimeError as err:
            self._failed(err)
        return int(t.item())

    def agree(self, error: str | None) -> None:
        """Every rank says whether its setup failed; all raise the first failure's one line,
        so that no rank waits for the others in a collective that never comes."""
        errors: list[str | None] = [None] * self.size
        try:
            dist.all_gather_object(errors, error, group=self.cpu_group)
        except RuntimeError as err:
            self._failed(err)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise ValueError(first)

    def send(self, message: object) -> None:
        """Rank 0: broadcast ``message`` (a window, a job, the end of a run) to the workers."""
        try:
            dist.broadcast_object_list([message], src=0, group=self.cpu_group)
        except RuntimeError as err:
            self._failed(err)

    def recv(self) -> object:
        box: list[object] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        except RuntimeError as err:
            self._failed(err)
        return box[0]
