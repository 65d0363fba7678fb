"""checkpoint: sharded safetensors checkpoints in eager FQNs, from one process or many ranks.

Public API: :func:`save`, :func:`save_streaming`, :func:`load`, :func:`verify`,
:func:`open_checkpoint`, the reports and the errors; for training, :func:`async_save` and
:class:`CheckpointManager` (see :mod:`checkpoint.training`).
"""

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    ChecksumMismatchError,
    ConcurrentSaveError,
    CorruptCheckpointError,
    DuplicateTensorError,
    ExternalError,
    InterruptedCommitError,
    LoadError,
    LossyConversionError,
    MetaTargetError,
    MissingShardError,
    OverlappingTargetsError,
    QuantizationError,
    RankAgreementError,
    RankMismatchError,
    SnapshotChangedError,
    TensorNotInShardError,
    TiedValuesMismatchError,
    UnsafePathError,
    UnsavableError,
    UnsavableTypeError,
    UnsupportedTensorError,
    UnsupportedStorageError,
    UnsupportedURLError,
    UnwritableTargetError,
)
# Everything but the errors is imported on first use (PEP 562): ``import checkpoint`` (and the CLI's
# --version / --help) must not pay for torch, torch.distributed and pydantic. The implementing
# modules are named apart from the functions (``loading`` for ``load``, ...), so importing one never
# rebinds a public name.
_LAZY = {
    "load": "loading",
    "save": "saving",
    "save_streaming": "saving",
    "migrate": "migrating",
    "MigrationReport": "migrating",
    "LoadReport": "reports",
    "VerifyReport": "reports",
    "IndexFile": "storage.format",
    "parse_size": "storage.format",
    "TensorSpec": "storage.layout",
    "CheckpointReader": "storage.reader",
    "StrayFileWarning": "storage.reader",
    "open_checkpoint": "storage.opening",
    "recover": "storage.opening",
    "CheckpointManager": "training",
    "ForeignEntryWarning": "training",
    "PerRank": "training",
    "ResumableSampler": "training",
    "RNGState": "training",
    "SaveFuture": "training",
    "async_save": "training",
    "prepare_async_save": "training",
    "verify": "verifying",
}

if TYPE_CHECKING:  # static checkers and IDEs see the eager names
    from .loading import load
    from .migrating import MigrationReport, migrate
    from .reports import LoadReport, VerifyReport
    from .saving import save, save_streaming
    from .storage.format import IndexFile, parse_size
    from .storage.layout import TensorSpec
    from .storage.opening import open_checkpoint, recover
    from .storage.reader import CheckpointReader, StrayFileWarning
    from .training import (
        CheckpointManager,
        ForeignEntryWarning,
        PerRank,
        ResumableSampler,
        RNGState,
        SaveFuture,
        async_save,
        prepare_async_save,
    )
    from .verifying import verify


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access (PEP 562); else ``checkpoint.<submodule>``."""
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
    else:
        if name.startswith("__"):
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value  # later accesses skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "save",
    "save_streaming",
    "async_save",
    "prepare_async_save",
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
    "recover",
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
    "ConcurrentSaveError",
    "RankAgreementError",
    "RankMismatchError",
    "SnapshotChangedError",
    "TiedValuesMismatchError",
    "UnsavableError",
    "UnsavableTypeError",
    "InterruptedCommitError",
    "MetaTargetError",
    "UnwritableTargetError",
    "UnsupportedStorageError",
    "UnsupportedURLError",
    "OverlappingTargetsError",
    "QuantizationError",
    "LossyConversionError",
    "LoadError",
    "UnsupportedTensorError",
    "ExternalError",
]
