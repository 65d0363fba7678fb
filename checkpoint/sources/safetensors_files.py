"""safetensors as a migration :class:`~checkpoint.sources.base.Source`: one file, or shards with or
without a ``*.index.json`` (HF layout: ``{"metadata": ..., "weight_map": {key: file}}``).

Read by the package's one safetensors reader, :class:`~checkpoint.storage.reader.CheckpointReader`
(the reader ``load`` uses): every header validated by safetensors once on open, the index's
header digests and ``total_size`` checked where an fqnckpt index records them, tensor bytes read
with ``preadv`` (a file cut short is a named error, never a SIGBUS) and checked against the
index's tensor digests where it records them. This module only decides which files and keys a
source holds (an index of any name, or every ``*.safetensors`` file of a directory, each tensor in
exactly one), by the walk ``fqnckpt inspect``'s torch-free headers take
(:func:`~checkpoint.sources.st_headers.safetensors_layout`).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CorruptCheckpointError
from ..storage.local_commit import read_view
from ..storage.reader import CheckpointReader, check_total_size
from ..storage.st_header import read_index
from .base import Source, SourceSpec
from .sniffing import st_files
from .st_headers import HFIndex, check_named_files, safetensors_layout


def _files_reader(root: Path, names: list[str]) -> CheckpointReader:
    """A reader over safetensors files ``names`` of ``root`` without an index: every tensor of
    their headers, each in exactly one file (the reader refuses one stored twice)."""
    reader = CheckpointReader(str(root), None, None, {})
    reader.files = names
    return reader


def _reader_of(path: Path) -> tuple[CheckpointReader, str, Path, list[str]]:
    """``(reader, format, root, notes)`` of the safetensors source at ``path`` (see
    :func:`open_safetensors_source`); the reader's headers are not read yet."""
    fmt, root, index_file = safetensors_layout(path)
    if fmt == "safetensors":
        return _files_reader(root, [path.name]), fmt, root, []
    if index_file is None:  # shards without an index: every *.safetensors file, each key in exactly one
        return _files_reader(root, [f.name for f in st_files(root)]), fmt, root, []
    index = read_index(str(index_file))
    files = index.files()
    check_named_files(root, files, index_file)
    meta = index.metadata.fqnckpt
    if meta is not None and set(meta.files) != set(files):
        raise CorruptCheckpointError(
            str(index_file), f"metadata.fqnckpt.files {sorted(meta.files)} differ from the weight_map's files {files}"
        )
    reader = CheckpointReader(str(root), index, str(index_file), dict(index.weight_map))
    return reader, fmt, root, [f"read the files named by {index_file.name} only"]


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
        reader, fmt, root, notes = _reader_of(path)
        try:
            reader._load_headers()  # every header validated once, the index checked against them
            check_total_size(reader)
            # Key -> file in the source's order: the index's, else each header's (files by name).
            file_of = dict(reader._key_file)
            specs = {k: SourceSpec(k, tuple(s.shape), s.dtype) for k in file_of for s in (reader.spec(k),)}
        except BaseException:
            reader.close()
            raise
    src = Source(path if fmt == "safetensors" else root, fmt, list(reader.files), specs, file_of, reader)
    src.notes.extend(notes)
    return src


__all__ = ["HFIndex", "open_safetensors_source"]
