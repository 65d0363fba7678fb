"""A checkpoint on object storage (``s3://``, ``memory://``, ...) as a migration
:class:`~checkpoint.sources.base.Source`: the fqnckpt / Hugging Face layout read through
:mod:`checkpoint.storage.remote_reader` (ranged reads; one model index read once). Other formats
(pickles, DCP) are read from local paths only."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from ..storage.format import MODEL_PREFIX, OPTIMIZER_PREFIX, index_name
from ..storage.location import resolve
from ..storage.remote_reader import open_remote_checkpoint
from ..storage.views import checkpoint_view
from .base import Source, SourceSpec


def open_remote_source(url: Any, storage_options: Mapping | None = None) -> Source:
    """The model part of the checkpoint at URL ``url`` as a :class:`Source` (``url`` set: messages
    name its objects), read by its :class:`~checkpoint.storage.remote_reader.RemoteCheckpointReader`; a URL ending in one
    of its index names (``.../optimizer.safetensors.index.json``) is that part, as a local index
    path is (the index read is the object the model index names for it).

    Raises what :func:`checkpoint.storage.remote_reader.open_remote_checkpoint` raises, and
    :class:`~checkpoint.errors.UnsupportedStorageError` for a scheme without a backend."""
    prefix = MODEL_PREFIX
    if isinstance(url, str):
        head, _, last = url.rstrip("/").rpartition("/")
        part = next((p for p in (MODEL_PREFIX, OPTIMIZER_PREFIX) if last == index_name(p)), None)
        if part is not None and "://" in head:
            url, prefix = head, part
    store = resolve(url, storage_options)
    with checkpoint_view(store) as view:
        reader = open_remote_checkpoint(view, prefix)
    specs = {k: SourceSpec(k, tuple(reader.spec(k).shape), reader.spec(k).dtype) for k in reader.keys()}
    file_of = {k: reader.file_of(k) for k in reader.keys()}
    src = Source(PurePosixPath(store.url), "safetensors-sharded",  # as a local index opens
                 list(reader.files), specs, file_of, reader, url=store.url)  # fmt: skip
    src.notes.append(f"read the objects named by {store.url}/{index_name(MODEL_PREFIX)} only")
    return src


__all__ = ["open_remote_source"]
