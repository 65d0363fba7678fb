"""checkpoint: sharded safetensors checkpoints in eager FQNs, from one process or many ranks.

Public API: :func:`save`, :func:`save_streaming`, :func:`load`, :func:`verify`,
:func:`open_checkpoint`, the reports and the errors; for training, :func:`async_save` and
:class:`CheckpointManager` (see :mod:`checkpoint.training`).
"""

from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DuplicateTensorError,
    ExternalError,
    InterruptedCommitError,
    LoadError,
    LossyConversionError,
    MetaTargetError,
    MissingShardError,
    OverlappingTargetsError,
    RankAgreementError,
    SnapshotChangedError,
    TensorNotInShardError,
    TiedValuesMismatchError,
    UnsafePathError,
    UnsavableError,
    UnsavableTypeError,
    UnsupportedTensorError,
    UnwritableTargetError,
)
from .load import load
from .migrate import MigrationReport, migrate  # rebinds checkpoint.migrate to the function
from .reports import LoadReport, VerifyReport
from .save import save, save_streaming
from .storage.format import IndexFile, parse_size
from .storage.layout import TensorSpec
from .storage.reader import CheckpointReader, StrayFileWarning, open_checkpoint
from .training import CheckpointManager, ForeignEntryWarning, PerRank, ResumableSampler, RNGState, SaveFuture, async_save
from .verify import verify

__all__ = [
    "save",
    "save_streaming",
    "async_save",
    "SaveFuture",
    "CheckpointManager",
    "PerRank",
    "RNGState",
    "ResumableSampler",
    "load",
    "verify",
    "migrate",
    "MigrationReport",
    "open_checkpoint",
    "CheckpointReader",
    "TensorSpec",
    "IndexFile",
    "parse_size",
    "LoadReport",
    "VerifyReport",
    "StrayFileWarning",
    "ForeignEntryWarning",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointExistsError",
    "MissingShardError",
    "TensorNotInShardError",
    "DuplicateTensorError",
    "UnsafePathError",
    "CorruptCheckpointError",
    "ChecksumMismatchError",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "RankAgreementError",
    "SnapshotChangedError",
    "TiedValuesMismatchError",
    "UnsavableError",
    "UnsavableTypeError",
    "InterruptedCommitError",
    "MetaTargetError",
    "UnwritableTargetError",
    "OverlappingTargetsError",
    "LossyConversionError",
    "LoadError",
    "UnsupportedTensorError",
    "ExternalError",
]
