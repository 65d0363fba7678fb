"""``open_checkpoint`` and ``recover`` for any location: a local path (:mod:`checkpoint.storage.reader`,
:mod:`checkpoint.storage.local_commit`) or a URL through fsspec (:mod:`checkpoint.storage.remote_reader`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from . import reader
from .format import MODEL_PREFIX
from .bytestore import LocalStore
from .commit import clean_dead, leftovers
from .local_commit import recover as local_recover
from .location import is_remote, resolve, store_of
from .remote_reader import open_remote_checkpoint
from .views import checkpoint_view


def open_checkpoint(
    path: str | os.PathLike | Any, prefix: str = MODEL_PREFIX, storage_options: Mapping[str, Any] | None = None,
    *, check_headers: bool = True,
) -> reader.CheckpointReader:
    """Open and validate a checkpoint (see :func:`checkpoint.storage.reader.open_local_checkpoint`).
    A URL (``s3://...``, ``memory://...``) is read through fsspec with ranged reads, every part
    from the one model index fetched (``storage_options`` go to the fsspec filesystem).
    ``check_headers``: compare each shard's header with the index's digest of it on open (see
    :func:`checkpoint.storage.st_header.header_of_bytes`); ``verify`` alone turns it off.

    Raises what :func:`checkpoint.storage.reader.open_local_checkpoint` and
    :func:`checkpoint.storage.remote_reader.open_remote_checkpoint` raise;
    :class:`~checkpoint.errors.UnsupportedStorageError` for a scheme without a backend.
    """
    where = resolve(path, storage_options)
    if is_remote(where):
        with checkpoint_view(where) as view:
            return open_remote_checkpoint(view, prefix, check_headers=check_headers)
    return reader.open_local_checkpoint(where, prefix, check_headers=check_headers)


__all__ = ["open_checkpoint", "recover"]


def recover(path: str | os.PathLike | Any, storage_options: Mapping[str, Any] | None = None) -> dict[str, list[str]]:
    """Do what the next save at ``path`` does first, and nothing else: complete a commit of ours
    that was interrupted after its commit point (a local directory:
    :func:`checkpoint.storage.local_commit.recover`), and remove what saves that can no longer
    commit there left (their staging areas, or on object storage the objects their staging
    manifests name and their unfinished uploads: :func:`checkpoint.storage.commit.clean_dead`).
    Only what a marker or manifest of ours names is touched; a checkpoint with nothing to recover is
    left as it is. Readers never do this (they raise
    :class:`~checkpoint.errors.InterruptedCommitError` instead).

    Returns ``{"completed": [commit directories completed], "removed": [staging areas, manifests,
    objects and uploads removed]}`` (names relative to ``path``; both empty when nothing was left).

    Raises:
        UnsupportedStorageError: a URL whose scheme has no installed fsspec backend.
        CheckpointNotFoundError: a local ``path`` whose parent is not a directory (nothing is
            created).
    """
    where = resolve(path, storage_options)
    store = store_of(where)
    before = leftovers(store)
    if isinstance(store, LocalStore):
        completed = local_recover(store.root)
    else:
        completed = []
        with store.writer_lock():
            clean_dead(store, set())
    after = leftovers(store)
    removed = sorted(n for k in ("staging", "objects", "uploads") for n in set(before[k]) - set(after[k]))
    return {"completed": completed, "removed": removed}
