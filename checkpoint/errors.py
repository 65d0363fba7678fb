"""Exceptions of the ``checkpoint`` package. Every message names the offending file, key or rank.

Other engineers add their own types here with small edits; keep each one specific.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any


class CheckpointError(Exception):
    """Base class of every error raised by :mod:`checkpoint`."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint (index, ``model.safetensors`` or ``.safetensors`` file) at ``path``."""

    def __init__(self, path: str, why: str = ""):
        self.path = str(path)
        extra = f" ({why})" if why else ""
        super().__init__(f"no checkpoint at {self.path}{extra}")

    def __str__(self) -> str:  # OSError would format (errno, strerror)
        return self.args[0]


class CheckpointExistsError(CheckpointError, FileExistsError):
    """``path`` exists and ``overwrite=True`` was not given (or it is not a checkpoint directory)."""

    def __init__(self, path: str, why: str = "pass overwrite=True to replace it"):
        self.path = str(path)
        super().__init__(f"{self.path} already exists; {why}")

    def __str__(self) -> str:
        return self.args[0]


class MissingShardError(CheckpointError, FileNotFoundError):
    """The index names shard file(s) that are not on disk. ``shards`` lists them."""

    def __init__(self, checkpoint: str, shards: Iterable[str], index: str):
        self.path = str(checkpoint)
        self.shards = sorted(shards)
        super().__init__(
            f"index {index} in {self.path} names shard file(s) missing on disk: {self.shards} "
            "(interrupted copy or download?)"
        )

    def __str__(self) -> str:
        return self.args[0]


class TensorNotInShardError(CheckpointError, ValueError):
    """The index maps ``key`` to ``shard`` but that shard's header does not hold it."""

    def __init__(self, key: str, shard: str, found_in: str | None = None):
        self.key, self.shard, self.found_in = key, shard, found_in
        where = f"; it is in {found_in!r} instead" if found_in else ""
        super().__init__(f"index maps tensor {key!r} to shard {shard!r}, whose header lacks it{where}")


class DuplicateTensorError(CheckpointError, ValueError):
    """Tensor ``key`` is stored in more than one file of the checkpoint."""

    def __init__(self, key: str, files: Iterable[str]):
        self.key, self.files = key, sorted(files)
        super().__init__(f"tensor {key!r} is stored in several files: {self.files}")


class UnsafePathError(CheckpointError, ValueError):
    """An index entry leads outside the checkpoint directory (``..``, absolute path or symlink)."""

    def __init__(self, entry: str, checkpoint: str, why: str):
        self.entry, self.path = entry, str(checkpoint)
        super().__init__(f"index entry {entry!r} of {self.path} is refused: {why}")


class CorruptCheckpointError(CheckpointError, ValueError):
    """A file is not a valid safetensors file / index (bad header, offsets, JSON, LFS pointer)."""

    def __init__(self, file: str, why: str):
        self.file = str(file)
        super().__init__(f"{self.file}: {why}")


class ChecksumMismatchError(CheckpointError, ValueError):
    """A file's sha256 or byte size differs from the one the index recorded."""

    def __init__(self, file: str, expected: str, actual: str):
        self.file, self.expected, self.actual = str(file), expected, actual
        super().__init__(f"{self.file}: checksum mismatch (index says {expected}, file has {actual})")


class CheckpointMismatchError(CheckpointError):
    """A strict load found missing / unexpected / shape-mismatched keys. ``report`` is the LoadReport."""

    def __init__(self, report: Any, path: str = ""):
        self.report = report
        parts = []
        for label, keys in (
            ("missing", report.missing_keys),
            ("unexpected", report.unexpected_keys),
            ("shape-mismatched", [m.key for m in report.shape_mismatched]),
        ):
            if keys:
                parts.append(f"{label} keys {_head(keys)}")
        where = f" loading {path}" if path else ""
        super().__init__(f"checkpoint does not match the target{where}: " + "; ".join(parts))


class TiedValuesMismatchError(CheckpointError, ValueError):
    """Names the target ties to one tensor are stored as separate tensors with different values;
    loading would let one silently overwrite the other, so nothing is loaded."""

    def __init__(self, keys: Iterable[str], files: Iterable[str], path: str):
        self.keys, self.files, self.path = list(keys), sorted(set(files)), str(path)
        super().__init__(
            f"{self.path}: tied names {self.keys} (one tensor in the target) are stored separately in "
            f"{self.files} with different values; refusing to pick one"
        )


class MetaTargetError(CheckpointError, ValueError):
    """Target tensors are on the meta device: copying into them is a no-op (they hold no data).
    ``keys`` lists them. Pass ``assign=True`` to replace them with the checkpoint's tensors."""

    def __init__(self, keys: Iterable[str], path: str):
        self.keys, self.path = sorted(keys), str(path)
        super().__init__(
            f"loading {self.path}: target tensors {_head(self.keys)} are on the meta device (no data to "
            "copy into); pass assign=True to replace them with the checkpoint's tensors"
        )


class UnwritableTargetError(CheckpointError, ValueError):
    """Target tensor ``key`` cannot take an in-place copy (``why``: expanded / overlapping memory,
    inference tensor, non-strided layout, ...). Nothing was loaded."""

    def __init__(self, key: str, path: str, why: str):
        self.key, self.path, self.why = key, str(path), why
        super().__init__(f"loading {self.path}: target tensor {key!r} cannot be written in place: {why}")


class OverlappingTargetsError(CheckpointError, ValueError):
    """Distinct target tensors ``keys`` share memory and the checkpoint holds different values for
    the shared elements: whichever is copied last would win silently. Nothing was loaded."""

    def __init__(self, keys: Iterable[str], path: str):
        self.keys, self.path = list(keys), str(path)
        super().__init__(
            f"loading {self.path}: target tensors {self.keys} share memory and the checkpoint holds "
            "different values for the shared elements; refusing to pick one"
        )


class LossyConversionError(CheckpointError, ValueError):
    """Stored ``key`` (dtype ``src``) cannot be converted to the target's dtype ``dst`` without
    losing values (``why``). Pass ``allow_lossy=True`` to convert anyway. Nothing was loaded."""

    def __init__(self, key: str, file: str, src: str, dst: str, why: str):
        self.key, self.file, self.src, self.dst = key, str(file), src, dst
        super().__init__(
            f"{self.file}: tensor {key!r} is {src}, the target is {dst}: {why} "
            "(pass allow_lossy=True to convert anyway)"
        )


class LoadError(CheckpointError):
    """torch (or the OS) failed while reading or writing ``key`` of ``file``; ``__cause__`` holds
    the original error."""

    def __init__(self, key: str, file: str, why: str):
        self.key, self.file = key, str(file)
        super().__init__(f"{self.file}: loading {key!r} failed: {why}")


class CheckpointWriteError(CheckpointError, OSError):
    """Writing the checkpoint failed (e.g. disk full) on some rank; the previous checkpoint is intact."""

    def __init__(self, path: str, why: str, rank: int | None = None):
        self.path, self.rank = str(path), rank
        on = f" on rank {rank}" if rank is not None else ""
        super().__init__(f"saving {self.path} failed{on}: {why}; any previous checkpoint there is intact")

    def __str__(self) -> str:
        return self.args[0]


class UnsavableError(CheckpointError, ValueError):
    """``save`` refused, before writing anything, a name or value the safetensors format cannot
    hold (``key``: the tensor name, or the shard file whose header is too large). Any previous
    checkpoint at ``path`` is untouched."""

    def __init__(self, key: Any, why: str, path: str = ""):
        self.key, self.path = key, str(path)
        where = f"saving {self.path}: " if path else ""
        super().__init__(f"{where}{key!r}: {why}; nothing was written")


class UnsavableTypeError(UnsavableError, TypeError):
    """:class:`UnsavableError` for a value of a type safetensors cannot store (dtype, layout)."""


class InterruptedCommitError(CheckpointError, OSError):
    """A save into ``path`` was killed mid-commit and this process may not complete it (no write
    permission): the checkpoint cannot be read until a process that may write there opens it."""

    def __init__(self, path: str, why: str):
        self.path = str(path)
        super().__init__(
            f"{self.path}: a save was interrupted while committing and could not be completed here ({why}); "
            "open it once with write permission (load, verify or save) to complete it"
        )

    def __str__(self) -> str:
        return self.args[0]


class RankAgreementError(CheckpointError):
    """Another rank failed during a collective save / load; ``failures`` maps rank -> message."""

    def __init__(self, what: str, failures: dict[int, str]):
        self.failures = dict(failures)
        lines = "; ".join(f"rank {r}: {m}" for r, m in sorted(self.failures.items()))
        super().__init__(f"{what} failed on rank(s) {sorted(self.failures)}: {lines}")


class UnsupportedFormatError(CheckpointError, ValueError):
    """A source file's content matches no format fqnckpt reads (sniffed from its first bytes)."""

    def __init__(self, file: str, why: str):
        self.file = str(file)
        super().__init__(f"{self.file}: {why}")


class UnsafePickleError(CheckpointError, pickle.UnpicklingError):
    """A pickle references globals outside the ``weights_only`` safe set; ``globals`` lists them.
    Nothing was unpickled. Pass the ones you trust by name in ``trusted_globals=[...]``."""

    def __init__(self, file: str, globals: Iterable[str], why: str = ""):
        self.file, self.globals = str(file), sorted(globals)
        what = f"unsafe globals {self.globals}" if self.globals else why
        hint = " (pass trusted_globals=[...] / --trust NAME for the ones you trust)" if self.globals else ""
        super().__init__(f"{self.file}: refused to unpickle: {what}{hint}")


class AmbiguousSourceError(CheckpointError, ValueError):
    """The source holds several candidate containers (or ``key`` is wrong); ``choices`` lists them."""

    def __init__(self, file: str, choices: Iterable[str], why: str = ""):
        self.file, self.choices = str(file), list(choices)
        super().__init__(f"{self.file}: {why}; choices for key: {self.choices}")


class MigrationError(CheckpointError):
    """A migration stopped (unresolved / ambiguous / colliding / missing keys); ``report`` is the
    :class:`checkpoint.migrate.MigrationReport` explaining every decision. Nothing was written."""

    def __init__(self, report: Any, why: str):
        self.report = report
        super().__init__(f"migration of {report.source} stopped: {why}")


def _head(keys: list[str], n: int = 10) -> str:
    more = f" (+{len(keys) - n} more)" if len(keys) > n else ""
    return f"{keys[:n]}{more}"
