"""Training checkpoints: :func:`async_save`, the whole training state (``extra_state``) and
:class:`CheckpointManager` (numbered checkpoints with retention); :class:`ResumableSampler`
(data order that resumes on any world size)."""

from .async_save import AsyncSaver, SaveFuture, async_save, prepare_async_save
from ..storage.extra_state import PerRank
from .manager import CheckpointManager, ForeignEntryWarning
from .rng_state import RNGState
from .sampler import ResumableSampler

__all__ = [
    "async_save", "prepare_async_save", "AsyncSaver", "SaveFuture", "CheckpointManager", "ForeignEntryWarning",
    "ResumableSampler", "PerRank", "RNGState",
]
