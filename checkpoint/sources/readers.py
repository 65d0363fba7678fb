"""Open any checkpoint fqnckpt migrates from, behind one small interface (:class:`Source`).

``open_source(path)`` sniffs the format from the first bytes (not the extension) and returns a
:class:`Source` with ``keys()`` / ``spec(key)`` / ``get(key)``, the interface of
``checkpoint.storage.reader.open_checkpoint``, so a migration streams one tensor at a time from any
format. One module per format:

* :mod:`.pickle_files`: ``torch.save`` pickles (zip ``PK\\x03\\x04``; legacy non-zip, pickle
  protocol byte ``\\x80``), only ever ``weights_only=True``.
* :mod:`.safetensors_files`: one file (8-byte little-endian header length + ``{``), or shards with
  or without a ``*.index.json`` (HF layout).
* :mod:`.dcp`: DCP directories (``.metadata`` + ``*.distcp``) and DCP's per-rank safetensors shards
  (``HuggingFaceStorageWriter(save_distributed=True)``), read through ``torch.distributed.checkpoint``.
* Git LFS pointer files are refused with a hint to run ``git lfs pull``.

Files found inside a directory follow the one symlink rule of :mod:`checkpoint.storage.paths`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path
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
        from .remote import open_remote_source

        if key is not None:
            raise AmbiguousSourceError(str(path), [], f"key={key!r} applies to pickles and DCP only")
        return open_remote_source(path)  # a part index URL names that part
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


@contextlib.contextmanager
def opened(path: str | os.PathLike, **kwargs: Any):
    """``with opened(path) as src:`` form of :func:`open_source`."""
    src = open_source(path, **kwargs)
    try:
        yield src
    finally:
        src.close()


__all__ = [
    "FORMATS",
    "HFIndex",
    "OptimizerInfo",
    "Source",
    "SourceSpec",
    "open_source",
    "opened",
    "sniff",
    "sniff_file",
    "unsafe_globals",
    "resolve_globals",
]
