"""Read a checkpoint: an index directory, a directory with one ``model.safetensors``, or one file.

The index is authoritative: only files it names are opened (a stray ``.safetensors`` is ignored
with a warning), and everything is validated before any tensor is returned — a named file that is
missing, an entry leading outside the directory, a tensor missing from its file or stored in two
files, a corrupt header. Headers and data go through ``safetensors.safe_open`` (which also rejects
overlapping / out-of-range offsets, size-vs-shape mismatches and truncated files), reading whole
tensors or only the slices a rank needs.
"""

from __future__ import annotations

import json
import math
import os
import struct
import warnings
from collections.abc import Sequence

import torch
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open

from .. import atomic
from ..errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DuplicateTensorError,
    MissingShardError,
    TensorNotInShardError,
)
from . import paths
from .format import MODEL_PREFIX, OPTIMIZER_PREFIX, FqnckptMeta, IndexFile, index_name
from .layout import ST_TO_DTYPE, TensorSpec
from .writer import sha256_file, stats

_LFS_MAGIC = b"version https://git-lfs"


class StrayFileWarning(UserWarning):
    """A ``.safetensors`` file in the checkpoint directory is not named by the index (not read)."""


def _lfs_hint(path: str) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return ""
    if head.startswith(_LFS_MAGIC):
        return " - this is a git-lfs pointer file, not the data: run `git lfs pull` (or download the file)"
    return ""


def _safe_member(root: str, entry: str) -> str:
    """Absolute path of index entry ``entry`` inside ``root``, under the one symlink rule of
    :mod:`checkpoint.storage.paths` (plain file names; symlinks only into the checkpoint directory
    or, for a hub-cache snapshot, into its cached repository)."""
    return paths.member(root, entry)


def _header_problem(path: str) -> str:
    """The tensor at fault in a header safetensors rejected, for the message (safetensors' own
    errors often do not name it): the spec's rules checked in order; '' if none is found."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            head = json.loads(f.read(n)) if n <= size - 8 else None
    except (OSError, struct.error, ValueError, RecursionError):  # deeply nested JSON
        return ""
    if not isinstance(head, dict):
        return ""
    spans, data_len = [], size - 8 - n
    for key, v in head.items():
        if key == "__metadata__":
            continue
        try:
            st, shape, (b, e) = v["dtype"], [int(d) for d in v["shape"]], v["data_offsets"]
        except (TypeError, KeyError, ValueError):
            return f"; tensor {key!r} has a malformed entry"
        if st not in ST_TO_DTYPE:
            return f"; tensor {key!r} has dtype {st!r} unknown to fqnckpt"
        nbytes = math.prod(shape) * torch.empty((), dtype=ST_TO_DTYPE[st]).element_size()
        if any(d < 0 for d in shape) or nbytes >= 2**64:
            return f"; tensor {key!r}: shape {shape} overflows"
        if not (isinstance(b, int) and isinstance(e, int) and 0 <= b <= e <= data_len):
            return f"; tensor {key!r}: data_offsets {[b, e]} out of range (data is {data_len} bytes)"
        if e - b != nbytes:
            return f"; tensor {key!r}: data_offsets span {e - b} bytes, shape {shape} {st} needs {nbytes}"
        spans.append((b, e, key))
    pos = 0
    for b, e, key in sorted(spans):
        if b != pos:
            return f"; tensor {key!r}: data_offsets {[b, e]} {'overlap' if b < pos else 'leave a hole before'} byte {pos}"
        pos = e
    return ""


def open_safetensors(path: str):
    """``safetensors.safe_open(path, framework="pt")`` plus the one check it lacks: a tensor name
    appearing twice in the JSON header (safetensors keeps the last entry silently).

    Raises:
        CorruptCheckpointError: safetensors rejects the file (message names the tensor at fault
            where it can, and Git LFS pointers), or the header repeats a tensor name.
    """
    try:
        handle = safe_open(path, framework="pt")
    except (SafetensorError, OSError, ValueError) as e:
        raise CorruptCheckpointError(
            path,
            f"not a valid safetensors file (bad or truncated header or offsets): {e}"
            f"{_header_problem(path)}{_lfs_hint(path)}",
        ) from e
    _check_unique_header_keys(path)
    return handle


def _check_unique_header_keys(path: str) -> None:
    def pairs(items):
        seen = set()
        for k, _ in items:
            if k in seen:
                raise CorruptCheckpointError(path, f"header names tensor {k!r} twice")
            seen.add(k)
        return dict(items)

    with open(path, "rb") as f:  # safe_open has validated the length already
        (n,) = struct.unpack("<Q", f.read(8))
        json.loads(f.read(n), object_pairs_hook=pairs)


def read_index(path: str) -> IndexFile:
    """Parse and validate an index file.

    Raises:
        CorruptCheckpointError: not JSON, a git-lfs pointer, or not the HF index schema.
    """
    with open(path, "rb") as f:
        raw = f.read()
    if raw.startswith(_LFS_MAGIC):
        raise CorruptCheckpointError(path, "is a git-lfs pointer file, not the index: run `git lfs pull`")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # RecursionError: nesting
        raise CorruptCheckpointError(path, f"index is not JSON: {e}") from e
    try:
        return IndexFile.model_validate(data)
    except ValidationError as e:
        raise CorruptCheckpointError(path, f"index does not follow the schema: {e}") from e


class CheckpointReader:
    """A validated, open checkpoint. Use :func:`open_checkpoint`; close with :meth:`close` or ``with``.

    ``files`` are the shard file names read (relative to ``root``), ``index`` the parsed
    :class:`~checkpoint.storage.format.IndexFile` (``None`` without an index).
    """

    def __init__(self, root: str, index: IndexFile | None, index_path: str | None, key_file: dict[str, str]):
        self.root = root
        self.index = index
        self.index_path = index_path
        self._key_file = key_file
        self.files: list[str] = sorted(set(key_file.values()))
        self._handles: dict[str, object] = {}
        self._specs: dict[str, tuple[tuple[int, ...], str]] = {}

    # -- lookups ------------------------------------------------------------------------------
    @property
    def meta(self) -> FqnckptMeta | None:
        """fqnckpt's own index metadata, if this checkpoint was written by fqnckpt."""
        return self.index.metadata.fqnckpt if self.index is not None else None

    @property
    def alias_groups(self) -> list[list[str]]:
        return [list(g) for g in self.meta.alias_groups] if self.meta else []

    def keys(self) -> list[str]:
        """Stored tensor names, sorted."""
        return sorted(self._key_file)

    def __contains__(self, key: object) -> bool:
        return key in self._key_file

    def file_of(self, key: str) -> str:
        return self._key_file[self._known(key)]

    def spec(self, key: str) -> TensorSpec:
        """Shape and dtype of ``key`` from its file header (no data read)."""
        shape, st = self._specs[self._known(key)]
        if st not in ST_TO_DTYPE:
            raise CorruptCheckpointError(self.file_of(key), f"tensor {key!r} has unsupported dtype {st!r}")
        return TensorSpec(key, shape, ST_TO_DTYPE[st])

    def get(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` (CPU)."""
        t = self._handle(key).get_tensor(key)
        stats.bytes_read += t.numel() * t.element_size()
        return t

    def get_slice(self, key: str, slices: Sequence[slice]) -> torch.Tensor:
        """Only the block ``tensor[slices]`` of ``key`` (one ``slice`` per dim), read from disk."""
        if not self._specs[self._known(key)][0]:
            return self.get(key)
        t = self._handle(key).get_slice(key)[tuple(slices)]
        stats.bytes_read += t.numel() * t.element_size()
        return t

    def verify_file(self, name: str) -> str:
        """Re-hash shard ``name``; returns its sha256.

        Raises:
            ChecksumMismatchError: size or sha256 differ from the index's record.
            KeyError: ``name`` is not a file of this checkpoint.
        """
        if name not in self.files:
            raise KeyError(f"{name!r} is not a file of {self.root}; files: {self.files}")
        path = os.path.join(self.root, name)
        rec = self.meta.files.get(name) if self.meta else None
        if rec is not None:
            size = os.path.getsize(path)
            if size != rec.size:
                raise ChecksumMismatchError(path, f"size {rec.size}", f"size {size}")
        digest = sha256_file(path)
        if rec is not None and digest != rec.sha256:
            raise ChecksumMismatchError(path, rec.sha256, digest)
        return digest

    # -- plumbing -----------------------------------------------------------------------------
    def _known(self, key: str) -> str:
        if key not in self._key_file:
            from fqn.errors import UnknownNameError

            raise UnknownNameError(key, self._key_file, f"tensor of checkpoint {self.root}:")
        return key

    def _handle(self, key: str):
        name = self._key_file[self._known(key)]
        h = self._handles.get(name)
        if h is None:
            h = self._handles[name] = open_safetensors(os.path.join(self.root, name))
        return h

    def _load_headers(self) -> None:
        """Open every named file, check the index against the headers (before any data is read)."""
        in_file: dict[str, list[str]] = {}
        for name in self.files:
            h = self._handles[name] = open_safetensors(os.path.join(self.root, name))
            for k in h.keys():
                in_file.setdefault(k, []).append(name)
                sl = h.get_slice(k)
                self._specs.setdefault(k, (tuple(sl.get_shape()), sl.get_dtype()))
        for k, names in in_file.items():
            if len(names) > 1:
                raise DuplicateTensorError(k, names)
        for k, name in self._key_file.items():
            if name not in in_file.get(k, ()):
                other = in_file.get(k, [None])[0]
                raise TensorNotInShardError(k, name, other)
        extra = sorted(set(in_file) - set(self._key_file))
        if extra:
            warnings.warn(
                f"{self.root}: tensors {extra[:10]} are in shard headers but not in the index; ignored",
                StrayFileWarning,
                stacklevel=3,
            )
            for k in extra:
                self._specs.pop(k, None)

    def close(self) -> None:
        self._handles.clear()  # safe_open handles release their mmap when dropped

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({self.root!r}, {len(self._key_file)} tensors in {len(self.files)} files)"


def open_checkpoint(path: str | os.PathLike, prefix: str = MODEL_PREFIX) -> CheckpointReader:
    """Open and validate a checkpoint.

    ``path`` is a directory with ``<prefix>.safetensors.index.json`` (authoritative), a directory
    with a single ``<prefix>.safetensors`` and no index (HF's layout for small models), or one
    ``.safetensors`` file. ``prefix`` is ``"model"`` or ``"optimizer"``.

    Raises:
        CheckpointNotFoundError: nothing loadable at ``path``.
        MissingShardError: files named by the index are missing (all of them are listed).
        UnsafePathError: an index entry is not a plain file name, or a file is a symlink leading
            outside the checkpoint directory (see :mod:`checkpoint.storage.paths`).
        TensorNotInShardError: the index maps a tensor to a file whose header lacks it.
        DuplicateTensorError: a tensor is stored in two files.
        CorruptCheckpointError: the index or a header is invalid (git-lfs pointers are named), or
            an fqnckpt index's ``metadata.total_size`` differs from the indexed tensors' bytes.
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.lexists(path):
        atomic.recover_locked(path)
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise CheckpointNotFoundError(path, "expected a directory or a .safetensors file")
        root, name = os.path.dirname(path), os.path.basename(path)
        h = open_safetensors(path)
        reader = CheckpointReader(root, None, None, {k: name for k in h.keys()})
        reader._load_headers()
        return reader
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(path)
    idx_path = _safe_member(path, index_name(prefix))
    single = _safe_member(path, f"{prefix}.safetensors")
    if os.path.isfile(idx_path):
        index = read_index(idx_path)
        files = index.files()
        full = {f: _safe_member(path, f) for f in files}
        missing = [f for f, p in full.items() if not os.path.isfile(p)]
        if missing:
            raise MissingShardError(path, missing, index_name(prefix))
        meta = index.metadata.fqnckpt
        if meta is not None and set(meta.files) != set(files):
            raise CorruptCheckpointError(
                idx_path,
                f"metadata.fqnckpt.files {sorted(meta.files)} differ from the weight_map's files {files}",
            )
        reader = CheckpointReader(path, index, idx_path, dict(index.weight_map))
        _warn_strays(path, prefix, set(files))
    elif os.path.isfile(single):
        h = open_safetensors(single)
        reader = CheckpointReader(path, None, None, {k: f"{prefix}.safetensors" for k in h.keys()})
    else:
        raise CheckpointNotFoundError(path, f"no {index_name(prefix)} and no {prefix}.safetensors")
    reader._load_headers()
    _check_total_size(reader)
    return reader


def _check_total_size(reader: CheckpointReader) -> None:
    """An fqnckpt index's ``metadata.total_size`` must equal the indexed tensors' data bytes (a
    mismatch means index and files do not belong together). Foreign (e.g. HF) indexes may count
    whole storages, so they are not held to it."""
    if reader.meta is None or reader.index.metadata.total_size is None:
        return
    declared = reader.index.metadata.total_size
    actual = sum(reader.spec(k).nbytes for k in reader.keys())
    if actual != declared:
        raise CorruptCheckpointError(
            reader.index_path,
            f"metadata.total_size is {declared} bytes but the indexed tensors hold {actual} bytes "
            "(index and shard files do not belong together)",
        )


def _warn_strays(root: str, prefix: str, named: set[str]) -> None:
    other = OPTIMIZER_PREFIX if prefix == MODEL_PREFIX else MODEL_PREFIX
    strays = sorted(
        f
        for f in os.listdir(root)
        if f.endswith(".safetensors")
        and f not in named
        and not f.startswith(f"{other}-")
        and not f.startswith(".")
    )
    if strays:
        warnings.warn(
            f"{root}: {strays} not named by {index_name(prefix)}; not read (the index is authoritative)",
            StrayFileWarning,
            stacklevel=3,
        )
