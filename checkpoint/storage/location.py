"""Where a checkpoint lives: a local path (a plain path or ``file://``; fsspec is not imported)
or an :class:`~checkpoint.storage.objstore.ObjectStore` for any other URL. Entry points call
:func:`resolve` once and branch on :func:`is_remote`; :func:`store_of` gives the byte store of
either (:class:`~checkpoint.storage.bytestore.LocalStore` for a local path), the one the commit
layer (:mod:`checkpoint.storage.commit`) works on."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .urls import check_url, is_url, normalize_url, redact_url, url_scheme


def is_remote(where: Any) -> bool:
    """True for a byte store (:mod:`checkpoint.storage.bytestore`: a resolved URL)."""
    return not isinstance(where, (str, bytes, os.PathLike))


def resolve(path: Any, storage_options: Mapping | None = None, transfer: Any = None) -> Any:
    """``path`` as the local path string it is (``~`` expanded), or the byte store of a URL: a
    :class:`~checkpoint.storage.bytestore.LocalStore` for ``file://`` (saved through the same
    commit as a plain path: :func:`local_target`), an fsspec
    :class:`~checkpoint.storage.objstore.ObjectStore` for ``s3://``, ``memory://``, ...
    (``storage_options`` / ``transfer`` apply to it only), its path normalised
    (:func:`~checkpoint.storage.urls.normalize_url`: the same keys on every backend). A byte
    store is returned as is.

    Raises:
        UnsupportedStorageError: a URL whose scheme has no installed fsspec backend;
            :class:`~checkpoint.errors.UnsupportedURLError` (a subclass) for a URL with a query
            or fragment (:func:`checkpoint.storage.urls.check_url`).
        TypeError: ``storage_options`` / ``transfer`` given with a local path.
    """
    if is_remote(path):
        return path
    p = os.fspath(path)
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    if not is_url(p):
        if storage_options or transfer is not None:
            raise TypeError(f"storage_options / transfer apply to URLs (s3://...), not to the local path {p!r}")
        return os.path.expanduser(p)  # "~/run" as typed in Python, where no shell expands it
    check_url(p)  # a query (?versionId=...) or fragment: refused for every entry point
    p = normalize_url(p)  # "s3://b//ck" is "s3://b/ck", as "/b//ck" is "/b/ck" on disk
    if url_scheme(p) == "file" and not storage_options:  # the local byte store: no fsspec
        from .bytestore import LocalStore

        return LocalStore(p[len("file://") :] or "/", p)
    from .objstore import open_store

    return open_store(p, storage_options, transfer)


def local_path(where: Any) -> str | None:
    """The file-system path of ``where`` (a result of :func:`resolve`) when a stage may read it
    with the OS's file calls: a plain local path. None for a byte store (``s3://``, ``memory://``,
    ``file://``), which is read and written through its methods only. Formats that only exist as
    local files (a DCP directory, a ``torch.save`` pickle, a PEFT adapter folder, a hub cache)
    ask this, instead of asking which backend a store is."""
    return None if is_remote(where) else os.fspath(where)


def options_for(path: Any, storage_options: Mapping | None) -> Mapping | None:
    """``storage_options`` when ``path`` is a URL (they configure its filesystem), else None: one
    call taking a source and a destination passes each its own."""
    return storage_options if isinstance(path, (str, os.PathLike)) and is_url(os.fspath(path)) else None


def shown(where: Any) -> str:
    """How messages and rank comparisons name ``where`` (a path, a URL or a byte store): a URL
    with its secrets redacted, a local path absolute."""
    if is_remote(where):
        return str(where)  # a byte store's url is redacted when it is made
    p = os.fspath(where)
    return redact_url(normalize_url(p)) if is_url(p) else os.path.abspath(p)


def local_target(where: Any) -> Any:
    """What a save writes to: a :class:`~checkpoint.storage.bytestore.LocalStore` (``file://``)
    as its directory path, committed by rename like any local path (one commit per byte store
    kind, :mod:`checkpoint.storage.commit`); anything else as it is."""
    from .bytestore import LocalStore

    return where.root if isinstance(where, LocalStore) else where


def store_of(where: Any) -> Any:
    """The byte store of :func:`resolve`'s result: itself for a URL's, a
    :class:`~checkpoint.storage.bytestore.LocalStore` for a local path."""
    if is_remote(where):
        return where
    from .bytestore import LocalStore

    return LocalStore(os.fspath(where), os.fspath(where))


__all__ = ["resolve", "is_remote", "store_of", "local_target", "local_path", "shown", "options_for"]
