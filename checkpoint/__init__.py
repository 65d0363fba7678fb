"""checkpoint: sharded safetensors checkpoints in eager FQNs, from one process or many ranks.

Public API: :func:`save`, :func:`save_streaming`, :func:`load`, :func:`verify`,
:func:`open_checkpoint`, the reports and the errors.
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
    MissingShardError,
    RankAgreementError,
    TensorNotInShardError,
    TiedValuesMismatchError,
    UnsafePathError,
    UnsupportedTensorError,
)
from .load import load
from .migrate import MigrationReport, migrate  # rebinds checkpoint.migrate to the function
from .reports import LoadReport, VerifyReport
from .save import save, save_streaming
from .storage.format import IndexFile, parse_size
from .storage.layout import TensorSpec
from .storage.reader import CheckpointReader, StrayFileWarning, open_checkpoint
from .verify import verify

__all__ = [
    "save",
    "save_streaming",
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
    "TiedValuesMismatchError",
    "UnsupportedTensorError",
    "ExternalError",
]
