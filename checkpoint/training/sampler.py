"""A data-parallel sampler that resumes on any world size.

:class:`ResumableSampler` puts one global permutation per epoch (``torch.randperm`` seeded with
``seed + epoch``, as ``torch.utils.data.DistributedSampler`` seeds its own) in order and gives
global position ``p`` of what is left of the epoch to rank ``p % world_size``. Its state is where
the epoch stands in that global order (``consumed``: samples handed to all ranks together), which
is the same number on every rank, so it is saved once like any ``extra_state`` entry and a resume
on 1, 2 or 4 ranks continues with exactly the samples of the epoch not yet seen.

The ragged tail follows ``DistributedSampler``: when ``world_size`` does not divide what is left,
``drop_last=False`` (default) pads with samples from the start of the permutation so that every
rank yields as many samples (the collectives of a step need every rank), and ``drop_last=True``
drops the last ``len % world_size`` of the epoch instead.

With a ``DataLoader`` that has workers, the loader pulls indices ahead of the training loop
(``prefetch_factor * num_workers`` batches), so the sampler cannot know on its own what the loop
has consumed: iterate through :meth:`ResumableSampler.track` (``for batch in
sampler.track(loader)``), which counts the batches the loop has received. With ``num_workers=0``
plain iteration is exact too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler


def _dist_rank_world() -> tuple[int, int]:
    import torch.distributed as dist  # only when the caller gave neither rank nor world size

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ResumableSampler(Sampler[int]):
    """Per-rank indices of a seeded global permutation per epoch, resumable on any world size.

    Args:
        data_source: a sized dataset, or its length (``int``, samples).
        seed: the permutation of epoch ``e`` is ``torch.randperm(n, generator=manual_seed(seed + e))``.
        shuffle: ``False`` keeps ``range(n)`` order every epoch.
        drop_last: how the epoch's tail is split when ``world_size`` does not divide it (module doc).
        rank: defaults to ``torch.distributed``'s when a process group is initialized, else 0.
        world_size: defaults to ``torch.distributed``'s when a process group is initialized, else 1.

    ``state_dict()`` is ``{"seed", "num_samples", "shuffle", "drop_last", "epoch", "consumed",
    "world_size"}`` (ints and bools; ``consumed`` counts global positions of the epoch, all ranks
    together, padding included);
    ``load_state_dict`` raises ``ValueError`` naming the field when the seed, the dataset length,
    ``shuffle`` or ``drop_last`` differ from this sampler's (another run's order cannot continue
    this one's), and when ``consumed`` lies outside the epoch.
    """

    def __init__(
        self,
        data_source: Sized | int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        n = data_source if isinstance(data_source, int) else len(data_source)
        if n < 0:
            raise ValueError(f"ResumableSampler: dataset length {n} < 0")
        if rank is None or world_size is None:
            r, w = _dist_rank_world()
            rank = r if rank is None else rank
            world_size = w if world_size is None else world_size
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"ResumableSampler: rank {rank} is not in a world of size {world_size}")
        self.num_samples, self.seed, self.shuffle, self.drop_last = n, int(seed), shuffle, drop_last
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.consumed = 0  # global positions of the current epoch handed to the loop
        self._tracking = False

    # -- the order --------------------------------------------------------------------------
    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def _epoch_len(self, consumed: int) -> int:
        """Global positions this epoch will have, given ``consumed`` already (padded / dropped)."""
        left = self.num_samples - consumed
        if self.drop_last:
            left -= left % self.world_size
        else:
            left += -left % self.world_size
        return consumed + left

    def _local_indices(self) -> list[int]:
        order = self._order(self.epoch)
        end = self._epoch_len(self.consumed)
        rest = order[self.consumed :]
        pad = end - self.num_samples
        if pad > 0:  # DistributedSampler's padding: repeat from the start of the permutation
            reps = -(-pad // max(self.num_samples, 1))
            rest = torch.cat([rest, order.repeat(reps)[:pad]])
        rest = rest[: end - self.consumed]
        return rest[self.rank :: self.world_size].tolist()

    def __len__(self) -> int:
        """Samples this rank yields from the current position to the end of the epoch."""
        return (self._epoch_len(self.consumed) - self.consumed) // self.world_size

    def __iter__(self) -> Iterator[int]:
        local = self._local_indices()
        start = self.consumed
        for k, i in enumerate(local):
            if not self._tracking:
                self.consumed = start + (k + 1) * self.world_size
            yield i
        if not self._tracking:
            self._next_epoch()

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.consumed = 0

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (as ``DistributedSampler.set_epoch``); a
        call with the current epoch keeps the position, so a resumed loop may call it."""
        if epoch != self.epoch:
            self.epoch, self.consumed = int(epoch), 0

    def track(self, loader: Iterable[Any], batch_size: int | None = None) -> Iterator[Any]:
        """Iterate ``loader`` (a ``DataLoader`` over this sampler) and advance the saved position
        by the batches the loop has received, not those the loader prefetched.

        ``batch_size`` (samples a batch) defaults to ``loader.batch_size``; the last batch may be
        shorter. Raises ``ValueError`` when neither gives a batch size."""
        bs = batch_size if batch_size is not None else getattr(loader, "batch_size", None)
        if not bs:
            raise ValueError("ResumableSampler.track: pass batch_size (the loader has none)")
        start, end = self.consumed, self._epoch_len(self.consumed)
        self._tracking = True
        try:
            for k, batch in enumerate(loader, start=1):
                self.consumed = min(start + k * bs * self.world_size, end)
                yield batch
        finally:
            self._tracking = False
        self._next_epoch()

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "world_size": self.world_size,  # informational: bounds consumed (the padded tail)
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "num_samples", "shuffle", "drop_last"):
            # type too: True == 1 in Python, but a bool seed or an int shuffle is another run's state
            if type(state.get(key)) is not type(getattr(self, key)) or state.get(key) != getattr(self, key):
                raise ValueError(
                    f"ResumableSampler.load_state_dict: {key} is {state.get(key)!r} in the saved state, "
                    f"{getattr(self, key)!r} here; another run's order cannot be continued"
                )
        epoch, consumed = state.get("epoch"), state.get("consumed")
        if type(epoch) is not int or epoch < 0:
            raise ValueError(f"ResumableSampler.load_state_dict: epoch {epoch!r} is not an int >= 0")
        saved_world = state.get("world_size", 1)
        if type(saved_world) is not int or saved_world < 1:
            raise ValueError(f"ResumableSampler.load_state_dict: world_size {saved_world!r} is not an int >= 1")
        if type(consumed) is not int or not 0 <= consumed < self.num_samples + saved_world:
            raise ValueError(f"ResumableSampler.load_state_dict: consumed {consumed!r} is outside the epoch")
        self.epoch, self.consumed = epoch, min(consumed, self.num_samples)
