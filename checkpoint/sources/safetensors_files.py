"""safetensors as a migration :class:`~checkpoint.sources.base.Source`: one file, or shards with or
without a ``*.index.json`` (HF layout: ``{"metadata": ..., "weight_map": {key: file}}``).

Read by the package's one safetensors reader, :class:`~checkpoint.storage.reader.CheckpointReader`
(the reader ``load`` uses): every header validated by safetensors once on open, the index's
header digests and ``total_size`` checked where an fqnckpt index records them, tensor bytes read
with ``preadv`` (a file cut short is a named error, never a SIGBUS) and checked against the
index's tensor digests where it records them. This module only decides which files and keys a
source holds (an index of any name, or every ``*.safetensors`` file of a directory, each tensor in
exactly one), with the same checks as the torch-free walk of ``fqnckpt inspect``
(:func:`~checkpoint.sources.st_headers.scan_safetensors`).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from ..errors import AmbiguousSourceError, CorruptCheckpointError, DuplicateTensorError, MissingShardError
from ..storage import paths
from ..storage.local_commit import read_view
from ..storage.reader import CheckpointReader, check_total_size
from ..storage.st_header import open_safetensors_with_header, read_header_bytes, read_index
from .base import Source, SourceSpec
from .sniffing import index_files, sniff_file, st_files
from .st_headers import HFIndex


def _header_keys(path: Path) -> list[str]:
    """The tensor names of safetensors file ``path`` in header order, from its JSON header alone
    (the reader validates the header when it opens the file: one validation per file); a header
    that does not parse is validated here, which names what is wrong.

    Raises:
        CorruptCheckpointError: the file cannot be read, or safetensors rejects its header.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CorruptCheckpointError(str(path), f"not a valid safetensors file (cannot be read): {e}") from e
    try:
        raw, _ = read_header_bytes(fd, str(path))
    finally:
        os.close(fd)
    try:
        (n,) = struct.unpack("<Q", raw[:8])
        head = json.loads(raw[8 : 8 + n])
        if not isinstance(head, dict) or len(raw) < 8 + n:
            raise ValueError("not a header")
    except (ValueError, struct.error, RecursionError):
        head = open_safetensors_with_header(str(path))[1]  # raises, naming the fault
    return [k for k in head if k != "__metadata__"]


def _reader_of(path: Path) -> tuple[CheckpointReader, str, Path, list[str], list[str]]:
    """``(reader, format, root, notes, keys in source order)`` of the safetensors source at
    ``path`` (see :func:`open_safetensors_source`)."""
    if path.is_file() and sniff_file(path) == "safetensors":
        keys = _header_keys(path)
        return CheckpointReader(str(path.parent), None, None, dict.fromkeys(keys, path.name)), "safetensors", path.parent, [], keys
    root, index_file = (path.parent, path) if path.is_file() else (path, None)
    if index_file is None:
        idx = index_files(root)
        if len(idx) > 1:
            raise AmbiguousSourceError(str(root), [i.name for i in idx], "several index files")
        index_file = idx[0] if idx else None
    if index_file is None:  # shards without an index: every *.safetensors file, each key in exactly one
        key_file: dict[str, str] = {}
        for f in st_files(root):
            for k in _header_keys(f):
                if k in key_file:
                    raise DuplicateTensorError(k, [key_file[k], f.name])
                key_file[k] = f.name
        return CheckpointReader(str(root), None, None, key_file), "safetensors-sharded", root, [], list(key_file)
    index = read_index(str(index_file))
    files = index.files()
    missing = [f for f in files if not Path(paths.member(root, f)).is_file()]
    if missing:
        raise MissingShardError(str(root), missing, index_file.name)
    meta = index.metadata.fqnckpt
    if meta is not None and set(meta.files) != set(files):
        raise CorruptCheckpointError(
            str(index_file), f"metadata.fqnckpt.files {sorted(meta.files)} differ from the weight_map's files {files}"
        )
    reader = CheckpointReader(str(root), index, str(index_file), dict(index.weight_map))
    return reader, "safetensors-sharded", root, [f"read the files named by {index_file.name} only"], list(index.weight_map)


def open_safetensors_source(path: Path) -> Source:
    """A :class:`Source` over one safetensors file, an index file (any ``*.index.json`` name), or
    a directory of shards (its one index, else every ``*.safetensors`` file), read by a
    :class:`~checkpoint.storage.reader.CheckpointReader` opened inside one read view
    (:func:`~checkpoint.storage.local_commit.read_view`). Keys keep the source's order (the
    index's, else each header's, files by name).

    Raises:
        AmbiguousSourceError: several ``*.index.json`` files in the directory.
        CorruptCheckpointError: an invalid index or header (file named), a header or the
            indexed ``total_size`` differing from what an fqnckpt index records.
        MissingShardError: the index names files missing on disk.
        UnsafePathError: an index entry is not a plain file name, or a symlink leads outside.
        TensorNotInShardError: the index maps a tensor to a file whose header lacks it.
        DuplicateTensorError: one tensor in two files.
        InterruptedCommitError: a commit of ours in the directory was interrupted.
    """
    with read_view(path):  # a file: no lock to take
        reader, fmt, root, notes, keys = _reader_of(path)
        try:
            reader._load_headers()  # every header validated, the index checked against them
            check_total_size(reader)
            specs = {k: SourceSpec(k, tuple(s.shape), s.dtype) for k in keys for s in (reader.spec(k),)}
        except BaseException:
            reader.close()
            raise
    src = Source(path if fmt == "safetensors" else root, fmt, list(reader.files), specs,
                 {k: reader.file_of(k) for k in keys}, reader)  # fmt: skip
    src.notes.extend(notes)
    return src


__all__ = ["HFIndex", "open_safetensors_source"]
