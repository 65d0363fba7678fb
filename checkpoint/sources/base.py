"""The migration source of every format: :class:`Source`, one implementation of
:class:`checkpoint.sources.protocol.TensorReader` (``keys`` / ``spec`` / ``get`` / ``get_slice`` /
``read_into`` / ``check_first``) over a per-format backend, plus what was found (containers,
optimizer state, notes). It is also ``load``'s reader of pickles and DCP checkpoints (the
attributes planning reads: ``root``, ``optimizer_info``, ...), so a migration and a load read a
checkpoint through the same object."""

from __future__ import annotations

import contextlib

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import UnsupportedFormatError, external_errors

if TYPE_CHECKING:  # no torch import at run time: inspect of safetensors builds Sources without it
    import torch

FORMATS = ("torch-zip", "torch-legacy", "safetensors", "safetensors-sharded", "dcp", "dcp-hf-sharded")


class SourceSpec(NamedTuple):
    """Shape (elements) and dtype of one source tensor; ``fqn`` is the source key. ``dtype`` is a
    ``torch.dtype``, or a :class:`checkpoint.sources.st_headers.HeaderDType` in a source opened
    for headers only (same ``str`` and ``itemsize``)."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


@dataclass
class OptimizerInfo:
    """An optimizer ``state_dict`` found in the source (``{"state": {id: {...}}, "param_groups"}``).

    ``param_ids`` are the ids in ``param_groups`` order (ints for ``torch.optim`` state_dicts, FQN
    strings for DCP's ``get_optimizer_state_dict``); ``param_names`` the names the source carries
    (torch's ``param_names`` in each group, or DCP's FQN keys), else ``None``; ``groups`` are the
    hyper-parameters without ids. ``state`` maps each optimizer source key to ``(param id, slot)``;
    ``scalars`` are state entries that were Python numbers (read back as 0-dim tensors, float64 /
    int64). ``separate`` is True when the optimizer sits beside a model container (``{"model": ...,
    "optim": ...}``): its keys are then not among :meth:`Source.keys` but written to the optimizer
    files of the migrated checkpoint.
    """

    param_ids: list[Any]
    param_names: list[str] | None
    groups: list[dict[str, Any]]
    group_ids: list[list[Any]]
    state: dict[str, tuple[Any, str]] = field(default_factory=dict)
    scalars: set[str] = field(default_factory=set)
    separate: bool = False
    container: str | None = None


@dataclass
class Source:
    """A readable checkpoint: ``keys()`` / ``spec(key)`` / ``get(key)`` plus what was found.

    ``format`` is one of :data:`FORMATS`; ``files`` the files read (relative to ``path`` when it
    is a directory); ``skipped`` maps non-tensor entries to their type name (never a tensor);
    ``notes`` are facts a user should know (e.g. "legacy pickle: loaded fully"); ``container`` the
    key chosen inside a pickle / DCP state_dict; ``optimizer`` is set when an optimizer state_dict
    was found (the chosen container, or one beside it: see :class:`OptimizerInfo`);
    ``extra_state`` names the entries that are extra state, never model tensors or skipped
    (DCP's non-model, non-optimizer entries, by kind: :func:`checkpoint.sources.dcp.classify_entries`).
    ``spec`` / ``get`` / ``file_of`` also answer for the optimizer's state keys. ``url`` is set
    for a checkpoint on object storage (messages name its objects).

    The backend ``_reader`` reads tensors by key (``get``), and where it can also ``get_slice``,
    ``read_into``, ``check_first``, ``read_ahead``: a
    :class:`~checkpoint.storage.reader.CheckpointReader` for safetensors (one reader of
    safetensors files in the package), a pickle's or DCP's own reader, or None for a source
    opened for its headers only (``get`` then raises ``TypeError``).
    """

    path: Path
    format: str
    files: list[str]
    _specs: dict[str, SourceSpec]
    _file_of: dict[str, str]
    _reader: Any
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    container: str | None = None
    optimizer: OptimizerInfo | None = None
    # Specs of optimizer state keys kept beside a model container (not among keys()).
    _extra_specs: dict[str, SourceSpec] = field(default_factory=dict)
    # True per-file figures when one tensor spans several files (DCP): file -> (tensors, bytes).
    _per_file: dict[str, dict[str, int]] | None = None
    # Top-level entries that are extra state (DCP: torchtitan's lr_scheduler, ...) -> their kind.
    extra_state: dict[str, str] = field(default_factory=dict)
    # Key -> the key as the checkpoint stores it, where they differ (DCP: "layers.0.weight" of
    # container "model" is stored as "model.layers.0.weight"); errors name the stored one.
    _stored: dict[str, str] = field(default_factory=dict)
    url: str | None = None
    # File -> its path or URL for messages, computed once per file (not a stat per tensor read).
    _shown_files: dict[str, str] = field(default_factory=dict, repr=False)

    # What load's planning reads of a reader besides the protocol (checkpoint.plan.model.plan_load):
    # these formats store no index, checksums or alias groups, and their names were written by
    # another tool (resolved against the model).
    index_path = None
    meta = None
    resolve_names = True
    kind = "checkpoint"

    @property
    def alias_groups(self) -> list[list[str]]:
        return []

    @property
    def root(self) -> str:
        """The directory ``file_of`` names files in (a single file's directory), or the URL."""
        if self.url is not None:
            return self.url
        return str(self.path if self.path.is_dir() else self.path.parent)

    @property
    def where(self) -> str:
        """The checkpoint, for messages."""
        return self.url if self.url is not None else str(self.path)

    @property
    def optimizer_info(self) -> OptimizerInfo | None:
        """The optimizer state found beside the model (:class:`OptimizerInfo`), or None."""
        return self.optimizer

    def __contains__(self, key: object) -> bool:
        return key in self._specs or key in self._extra_specs

    def confirm_unchanged(self) -> None:
        """The backend's check that no file was rewritten since its digests were checked
        (:meth:`~checkpoint.storage.reader.CheckpointReader.confirm_unchanged`); nothing for a
        backend without one."""
        confirm = getattr(self._reader, "confirm_unchanged", None)
        if confirm is not None:
            confirm()

    def confirm_copied(self) -> None:
        """The same after the copies (:meth:`~checkpoint.storage.reader.CheckpointReader.confirm_copied`)."""
        confirm = getattr(self._reader, "confirm_copied", None)
        if confirm is not None:
            confirm()

    def reading(self):
        """A span of reads (one load's check and copies): the backend's
        (:meth:`~checkpoint.storage.reader.CheckpointReader.reading`: its files mapped under a
        read lease), or nothing for a backend without one."""
        span = getattr(self._reader, "reading", None)
        return span() if span is not None else contextlib.nullcontext(self)

    def keys(self) -> list[str]:
        """Model tensor keys in source order (optimizer state kept apart is in ``optimizer.state``)."""
        return list(self._specs)

    def _lookup(self, key: str) -> SourceSpec:
        s = self._specs.get(key)
        if s is None:
            s = self._extra_specs.get(key)
        if s is None:
            raise KeyError(f"{key!r} is not a tensor of {self.path}")
        return s

    def spec(self, key: str) -> SourceSpec:
        """Shape and dtype of ``key`` from headers / metadata only (no tensor data read).

        Raises:
            KeyError: ``key`` is not a tensor of the source.
        """
        return self._lookup(key)

    def stored_key(self, key: str) -> str:
        """``key`` as the checkpoint stores it (DCP: with its container, ``model.layers.0.weight``),
        the name every error about it gives."""
        return self._stored.get(key, key)

    def file_of(self, key: str) -> str:
        """The file holding ``key`` (the first of several for a DCP tensor split over files)."""
        return self._file_of[key]

    def check_first(
        self, keys: Iterable[str] = (), rows: Mapping[str, Sequence[tuple[int, int]]] | None = None
    ) -> dict[str, dict[int, bytes]]:
        """Check tensors ``keys`` against the checkpoint's digests before anything is written
        (:meth:`checkpoint.storage.reader.CheckpointReader.check_first`); ``rows``' tensors are
        checked whole (no chunk digests are returned: ``{}``). Nothing for a format without
        digests. Raises what that raises."""
        check = getattr(self._reader, "check_first", None)
        if check is not None:
            check(list(dict.fromkeys(self.stored_key(k) for k in (*keys, *(rows or {})))))
        return {}

    def _shown(self, key: str) -> str:
        """The file (or object) holding ``key``, for messages."""
        name = self._file_of[key]
        shown = self._shown_files.get(name)
        if shown is None:
            if self.url is not None:
                shown = f"{self.url}/{name}"
            else:
                shown = str(self.path / name if self.path.is_dir() else self.path)
            self._shown_files[name] = shown
        return shown

    def _backend(self, key: str):
        self._lookup(key)
        if self._reader is None:
            raise TypeError(f"{key!r}: this source was opened for its headers only (open_source reads data)")
        return self._reader

    def get(self, key: str) -> torch.Tensor:
        """The tensor ``key``, a new contiguous CPU tensor (its stored shape and dtype)."""
        reader = self._backend(key)
        with external_errors(self._shown(key), self.stored_key(key), "reading"):  # torch / safetensors / OS errors named
            return reader.get(key)

    def read_into(self, key: str, out: torch.Tensor) -> bool:
        """Tensor ``key`` read straight into ``out`` where the backend can (safetensors:
        :meth:`~checkpoint.storage.reader.CheckpointReader.read_into`, checked against a
        recorded digest); False otherwise (then :meth:`get`)."""
        reader = self._backend(key)
        into = getattr(reader, "read_into", None)
        if into is None:
            return False
        with external_errors(self._shown(key), self.stored_key(key), "reading"):
            return into(key, out)

    def get_slice(self, key: str, slices: Sequence[slice]) -> torch.Tensor:
        """The block ``tensor[slices]`` of ``key`` (one ``slice`` per leading dim): read alone
        where the format allows it (safetensors: only the block's bytes), else cut from the
        whole tensor."""
        reader = self._backend(key)
        block = getattr(reader, "get_slice", None)
        with external_errors(self._shown(key), self.stored_key(key), "reading"):
            if block is not None:
                return block(key, tuple(slices))
            return reader.get(key)[tuple(slices)]

    def read_ahead(self, keys: Sequence[str]) -> None:
        """Hint: ``get`` will be called for ``keys`` in this order (lets DCP read them in batches)."""
        hint = getattr(self._reader, "read_ahead", None)
        if hint is not None:
            hint(list(keys))

    def nbytes(self, key: str) -> int:
        """Size of ``key`` in bytes."""
        s = self._lookup(key)
        return _numel(s.shape) * s.dtype.itemsize

    def total_bytes(self) -> int:
        """Bytes of the model tensors (``keys()``)."""
        return sum(self.nbytes(k) for k in self._specs)

    def optimizer_bytes(self) -> int:
        """Bytes of the optimizer state kept beside the model container (0 if none)."""
        return sum(self.nbytes(k) for k in self._extra_specs)

    def per_file(self) -> dict[str, dict[str, int]]:
        """``{file: {"tensors": n, "bytes": b}}`` over every tensor (model and optimizer): true
        figures, a tensor split over several files counts in each with the bytes stored there."""
        if self._per_file is not None:
            return {f: dict(v) for f, v in self._per_file.items()}
        out: dict[str, dict[str, int]] = {}
        for k in (*self._specs, *self._extra_specs):
            f = out.setdefault(self._file_of[k], {"tensors": 0, "bytes": 0})
            f["tensors"] += 1
            f["bytes"] += self.nbytes(k)
        return out

    def check_index_digest(self) -> None:
        """``load(verify=True)``'s check: refused, these formats record no checksums.

        Raises:
            UnsupportedFormatError: always (the checkpoint named)."""
        raise UnsupportedFormatError(
            self.where, f"a {self.format} checkpoint stores no checksums, so verify=True cannot check it"
        )

    def verify_file(self, name: str) -> str:
        """Refused as :meth:`check_index_digest` is (no file digests to compare ``name`` with)."""
        self.check_index_digest()
        return ""

    def close(self) -> None:
        close = getattr(self._reader, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


__all__ = ["FORMATS", "OptimizerInfo", "Source", "SourceSpec"]
