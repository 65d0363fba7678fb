"""Open any checkpoint fqnckpt migrates from, behind one small interface (:class:`Source`).

``open_source(path)`` sniffs the format from the first bytes (not the extension) and returns a
:class:`Source`, a :class:`~.protocol.TensorReader` as every reader of the package is, so a
migration streams one tensor at a time from any format. One module per format:

* :mod:`.pickle_files`: ``torch.save`` pickles (zip ``PK\\x03\\x04``; legacy non-zip, pickle
  protocol byte ``\\x80``), only ever ``weights_only=True``.
* :mod:`.safetensors_files`: one file (8-byte little-endian header length + ``{``), or shards with
  or without a ``*.index.json`` (HF layout).
* :mod:`.dcp`: DCP directories (``.metadata`` + ``*.distcp``) and DCP's per-rank safetensors shards
  (``HuggingFaceStorageWriter(save_distributed=True)``), read through ``torch.distributed.checkpoint``.
* Object storage (a URL, or a resolved byte store): the fqnckpt / Hugging Face layout through
  :mod:`checkpoint.storage.remote_reader` (ranged reads).
* Git LFS pointer files are refused with a hint to run ``git lfs pull``.

Files found inside a directory follow the one symlink rule of :mod:`checkpoint.storage.paths`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import AmbiguousSourceError
from ..storage.location import local_path, resolve
from .base import FORMATS, OptimizerInfo, Source, SourceSpec
from .dcp import open_dcp
from .pickle_files import open_pickle, resolve_globals, unsafe_globals
from .safetensors_files import HFIndex, open_safetensors_source
from .sniffing import pickle_files, sniff, sniff_file

# Kept for callers: no source maps files any more (pickles and safetensors are read per tensor
# with preadv, so only the tensor asked for is resident); the window is accepted and unused.
DEFAULT_MMAP_WINDOW = 16 << 20


def open_source(
    path: str | os.PathLike,
    *,
    key: str | None = None,
    trusted_globals: Iterable[Any] = (),
    mmap_window: int = DEFAULT_MMAP_WINDOW,
) -> Source:
    """Open any supported checkpoint at ``path`` for streaming reads (format sniffed by content).

    Args:
        key: for pickles / DCP state_dicts holding several containers (``{"model": sd, "ema":
            sd}``), which one to read (``a/b`` for a nested pickle one); without it the only
            container holding model tensors is used.
        trusted_globals: classes / functions (or ``"module.name"`` strings) a pickle may
            reference beyond the ``weights_only`` safe set; nothing else is ever unpickled.
        mmap_window: accepted, unused: pickles (zip) and safetensors files are read tensor by
            tensor with ``preadv``, never mapped (a file cut while read is a named error, not a
            SIGBUS), so memory holds only the tensor asked for.

    Raises:
        CheckpointNotFoundError: nothing readable at ``path``.
        UnsafePickleError: the pickle references globals outside the safe set (``.globals`` lists them).
        AmbiguousSourceError: several containers and no ``key`` (``.choices`` lists them).
        UnsafePathError: an index entry is not a plain file name, or a symlink leads outside the
            checkpoint directory (see :mod:`checkpoint.storage.paths`).
        CorruptCheckpointError, MissingShardError, TensorNotInShardError,
        DuplicateTensorError, UnsupportedFormatError: a malformed checkpoint (file and key named).
    """
    where = resolve(path)  # "~/run" typed in Python: no shell expanded it
    if local_path(where) is None:  # a byte store (object storage): safetensors layouts through its methods
        if key is not None:
            raise AmbiguousSourceError(str(path), [], f"key={key!r} applies to pickles and DCP only")
        return _remote_source(path)  # a part index URL names that part
    p = Path(where)
    fmt = sniff(p)
    if fmt in ("torch-zip", "torch-legacy"):
        f = pickle_files(p)[0] if p.is_dir() else p
        return open_pickle(f, fmt, key, trusted_globals, mmap_window)
    if fmt in ("dcp", "dcp-hf-sharded"):
        return open_dcp(p, fmt, key)
    if key is not None:
        raise AmbiguousSourceError(str(p), [], f"key={key!r} applies to pickles and DCP only; this is {fmt}")
    return open_safetensors_source(p)


def _remote_source(url: Any) -> Source:
    """The model part of the checkpoint at URL ``url`` (or a resolved byte store) as a
    :class:`Source` with ``url`` set (messages name its objects), read by its
    :class:`~checkpoint.storage.remote_reader.RemoteCheckpointReader` (ranged reads; the one model
    index read once); a URL ending in one of its index names
    (``.../optimizer.safetensors.index.json``) is that part, as a local index path is (the index
    read is the object the model index names for it). Other formats (pickles, DCP) are read from
    local paths only.

    Raises what :func:`checkpoint.storage.remote_reader.open_remote_checkpoint` raises, and
    :class:`~checkpoint.errors.UnsupportedStorageError` for a scheme without a backend."""
    from ..storage.format import MODEL_PREFIX, OPTIMIZER_PREFIX, index_name
    from ..storage.remote_reader import open_remote_checkpoint  # fsspec is optional
    from ..storage.views import checkpoint_view

    prefix = MODEL_PREFIX
    if isinstance(url, str):
        head, _, last = url.rstrip("/").rpartition("/")
        part = next((p for p in (MODEL_PREFIX, OPTIMIZER_PREFIX) if last == index_name(p)), None)
        if part is not None and "://" in head:
            url, prefix = head, part
    store = resolve(url)
    with checkpoint_view(store) as view:
        reader = open_remote_checkpoint(view, prefix)
    specs = {k: SourceSpec(k, tuple(reader.spec(k).shape), reader.spec(k).dtype) for k in reader.keys()}
    file_of = {k: reader.file_of(k) for k in reader.keys()}
    src = Source(PurePosixPath(store.url), "safetensors-sharded",  # as a local index opens
                 list(reader.files), specs, file_of, reader, url=store.url)  # fmt: skip
    src.notes.append(f"read the objects named by {store.url}/{index_name(MODEL_PREFIX)} only")
    return src


__all__ = [
    "FORMATS",
    "HFIndex",
    "OptimizerInfo",
    "Source",
    "SourceSpec",
    "open_source",
    "sniff",
    "sniff_file",
    "unsafe_globals",
    "resolve_globals",
]
