"""A DCP checkpoint as the reader of :func:`checkpoint.plan.model.plan_load` (the interface of
:class:`checkpoint.storage.reader.CheckpointReader` that planning and applying use).

Where bytes are read: :meth:`DCPTargetReader.prefetch` runs one ``dcp.load`` into fresh tensors
shaped like the targets, in the stored dtype (``torch.empty_like``: a DTensor keeps its mesh and
placements, so DCP's own planner reads only this rank's slices, resharding onto any mesh). The
value checks then look at these buffers, and :mod:`checkpoint.apply` copies them into the targets.
Collective (every rank calls it) when a process group is active and a target is a DTensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..ranks import dist
from .base import Source
from .dcp import dcp_load_planner, dcp_errors, read_entries
from .target_reader import SourceTargetReader


class DCPTargetReader(SourceTargetReader):
    """:class:`~.target_reader.SourceTargetReader` over a DCP :class:`Source`, plus :meth:`prefetch`
    / :meth:`read_block` (see module docstring). No checksums, no alias groups (DCP stores
    neither)."""

    kind = "DCP checkpoint"

    def __init__(self, source: Source):
        super().__init__(source)
        self.root = str(source.path)
        self._bufs: dict[str, torch.Tensor] = {}

    def prefetch(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """Read every ``(key, target)`` in one ``dcp.load`` (see module docstring).

        Raises:
            CorruptCheckpointError / UnsafePickleError: DCP failed (names DCP, file, keys, rank).
        """
        import torch.distributed.checkpoint as dcp

        flat = self.source._reader.flat
        bufs = {}
        for k, t in pairs:
            s = self.spec(k)
            # Shaped like the target (a DTensor keeps mesh and placements: DCP reshards), in the
            # stored dtype; a state tensor of another shape (an optimizer's step) is read whole.
            like = tuple(t.shape) == tuple(s.shape) and not t.is_meta
            bufs[flat[k]] = torch.empty_like(t, dtype=s.dtype) if like else torch.empty(s.shape, dtype=s.dtype)
        if not bufs:
            return
        collective = dist.active() and any(isinstance(b, DTensor) for b in bufs.values())
        path = Path(self.root)
        with dcp_errors(path, list(bufs), self.source._reader.files_of(list(bufs))):
            dcp.load(bufs, storage_reader=self.source._reader.reader, planner=dcp_load_planner(path),
                     no_dist=not collective, process_group=dist.current_group())  # (the load's mesh ranks)
        self._bufs.update({k: bufs[flat[k]] for k, _ in pairs})

    def entry_kinds(self) -> dict[str, str]:
        """Kind of every top-level entry (see :func:`~.dcp.classify_entries`)."""
        return dict(self.source._reader.kinds)

    def extra_entries(self) -> dict[str, Any]:
        """Every top-level entry that is neither model nor optimizer (torchtitan's
        ``lr_scheduler``, ``dataloader``, ``train_state``; anything else), rebuilt as saved:
        nested dicts / lists of values and tensors (non-tensors unpickled ``weights_only``)."""
        return read_entries(self.source, self.source._reader.extra_keys)

    def read_block(self, key: str, t: torch.Tensor) -> torch.Tensor | None:
        """This rank's block of ``key`` as prefetched for target ``t`` (None if not prefetched)."""
        b = self._bufs.get(key)
        if b is None:
            return None
        return b.to_local() if isinstance(b, DTensor) else b

    def close(self) -> None:
        self._bufs = {}
        super().close()


__all__ = ["DCPTargetReader"]
