"""The byte store: the bottom layer every storage stage above is written against, as DCP writes one
``FileSystemWriter`` over ``FileSystem`` and ``FsspecFileSystem``.

:class:`ByteStore` is the interface: objects under one prefix, by plain name (no ``/``):

==========================  ============================================================
``listing()``               ``{name: (kind, size)}`` directly under the prefix
``get`` / ``get_tagged``    a whole object (and the tag a conditional write compares)
``get_range`` / ``get_many``  byte ranges ``[start, end)``
``put``                     one whole object, optionally ``if_match=tag`` / ``if_absent``
``open_writer``             a streaming writer (multipart on S3; ``close`` makes it appear)
``uploads`` / ``abort_upload``  writers that never finished (S3 multipart uploads, partial files)
``delete`` / ``delete_if``  removal, optionally only if the tag still matches
``child`` / ``url_of``      a sub-prefix, an object's URL for messages
==========================  ============================================================

Implementations: :class:`FsspecStore` (``s3://`` through s3fs with S3's conditional requests,
``memory://``, any fsspec backend; :mod:`checkpoint.storage.objstore`) and :class:`LocalStore`
(a local directory, ``file://``: ``pread``, a temporary file renamed into place, and an ``flock``
making the conditional writes atomic between processes). The stages above (commit:
:mod:`~checkpoint.storage.remote_commit`, save: :mod:`~checkpoint.storage.remote_save`, read:
:mod:`~checkpoint.storage.remote_reader`, the manager's retention, every CLI command) call only
these methods, so they are written once and do not know the backend. No fsspec import here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import uuid
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

from .secrets import scrub, scrub_url

__all__ = ["ByteStore", "ByteWriter", "LocalStore", "FsspecStore", "PreconditionFailed"]


@runtime_checkable
class ByteWriter(Protocol):
    size: int

    def write(self, data) -> None: ...
    def close(self) -> None: ...
    def abort(self) -> None: ...


@runtime_checkable
class ByteStore(Protocol):
    url: str
    conditional: bool

    def child(self, name: str) -> ByteStore: ...
    def url_of(self, name: str) -> str: ...
    def scrub(self, text: str) -> str: ...
    def listing(self) -> dict[str, tuple[str, int]]: ...
    def get(self, name: str) -> bytes | None: ...
    def get_tagged(self, name: str) -> tuple[bytes | None, str | None]: ...
    def get_range(self, name: str, start: int, end: int) -> bytes: ...
    def get_ranges(self, name: str, spans: Sequence[tuple[int, int]]) -> list[bytes]: ...
    def get_many(self, spans: Sequence[tuple[str, int, int]]) -> list[bytes]: ...
    def put(self, name: str, data: bytes, if_match: str | None = None, if_absent: bool = False) -> None: ...
    def open_writer(self, name: str, size: int | None = None) -> ByteWriter: ...
    def uploads(self) -> list[tuple[str, str]]: ...
    def abort_upload(self, name: str, upload_id: str) -> None: ...
    def delete(self, names: Sequence[str]) -> None: ...
    def delete_if(self, name: str, tag: str | None) -> None: ...
    def remove_dir_if_empty(self) -> None: ...


def __getattr__(name: str):  # FsspecStore / PreconditionFailed without importing objstore up front
    if name in ("FsspecStore", "PreconditionFailed"):
        from . import objstore

        return objstore.ObjectStore if name == "FsspecStore" else objstore.PreconditionFailed
    raise AttributeError(name)


def _tag(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


_PART = ".fqnckpt-part."  # a LocalStore writer's file until close: ".fqnckpt-part.<id>.<name>"


class LocalStore:
    """A :class:`ByteStore` over local directory ``root`` (``file://`` URLs). Whole writes go to a
    temporary file that is fsynced and renamed into place (readers see old or new bytes); the
    conditional ones run under an exclusive ``flock`` on the directory, so between processes
    using this store they are atomic (:attr:`conditional`)."""

    conditional = True

    def __init__(self, root: str, url: str | None = None):
        self.root = os.path.abspath(root)
        self.url = (scrub_url(url) if url is not None else self.root).rstrip("/")

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"LocalStore({self.url!r})"

    def scrub(self, text: str) -> str:
        return scrub(text)

    def child(self, name: str) -> LocalStore:
        return LocalStore(os.path.join(self.root, name), f"{self.url}/{name}")

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _p(self, name: str) -> str:
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"{self.url}: {name!r} is not a plain object name")
        return os.path.join(self.root, name)

    # -- reads ----------------------------------------------------------------------------------
    def listing(self) -> dict[str, tuple[str, int]]:
        try:
            entries = list(os.scandir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return {}
        out = {}
        for e in entries:
            if e.name.startswith(_PART):
                continue  # an unfinished writer's file is no object (see uploads)
            try:
                if e.is_dir(follow_symlinks=False):
                    out[e.name] = ("directory", 0)
                elif e.is_file(follow_symlinks=False):
                    out[e.name] = ("file", e.stat(follow_symlinks=False).st_size)
            except FileNotFoundError:
                continue  # removed since the scan (another writer's cleanup)
        return out

    def get(self, name: str) -> bytes | None:
        try:
            fd = os.open(self._p(name), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EISDIR):
                return None  # a symlink or a directory is no object of ours
            raise
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def get_tagged(self, name: str) -> tuple[bytes | None, str | None]:
        data = self.get(name)
        return data, _tag(data)

    def get_range(self, name: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        fd = os.open(self._p(name), os.O_RDONLY | os.O_NOFOLLOW)
        try:
            out = bytearray()
            while len(out) < end - start:
                piece = os.pread(fd, end - start - len(out), start + len(out))
                if not piece:
                    break  # short: the caller checks lengths (a truncated object)
                out += piece
            return bytes(out)
        finally:
            os.close(fd)

    def get_ranges(self, name: str, spans: Sequence[tuple[int, int]]) -> list[bytes]:
        return [self.get_range(name, s, e) for s, e in spans]

    def get_many(self, spans: Sequence[tuple[str, int, int]]) -> list[bytes]:
        return [self.get_range(n, s, e) for n, s, e in spans]

    # -- writes ---------------------------------------------------------------------------------
    def ensure_dir(self) -> None:
        os.makedirs(self.root, exist_ok=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.ensure_dir()
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _fsync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def put(self, name: str, data: bytes, if_match: str | None = None, if_absent: bool = False) -> None:
        """See :class:`ByteStore`. Raises PreconditionFailed when a condition does not hold."""
        w = self.open_writer(name)
        try:
            w.write(data)
            w.close(if_match=if_match, if_absent=if_absent)
        except BaseException:
            w.abort()
            raise

    def open_writer(self, name: str, size: int | None = None) -> LocalWriter:
        self._p(name)
        self.ensure_dir()
        return LocalWriter(self, name)

    def uploads(self) -> list[tuple[str, str]]:
        """Files of writers that never closed (a killed save): ``(name, file)``."""
        try:
            names = os.listdir(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for n in names:
            if n.startswith(_PART):
                _id, _, target = n[len(_PART) :].partition(".")
                if target:
                    out.append((target, n))
        return out

    def abort_upload(self, name: str, upload_id: str) -> None:
        if upload_id.startswith(_PART) and upload_id.endswith(f".{name}"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.root, upload_id))

    def delete(self, names: Sequence[str]) -> None:
        for n in names:
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(self._p(n))

    def delete_if(self, name: str, tag: str | None) -> None:
        from .objstore import PreconditionFailed

        with self._locked():
            if tag is not None and _tag(self.get(name)) not in (tag, None):
                raise PreconditionFailed(f"removing {self.url_of(name)}: the object changed")
            self.delete([name])

    def remove_dir_if_empty(self) -> None:
        with contextlib.suppress(OSError):
            if not os.listdir(self.root):
                os.rmdir(self.root)


class LocalWriter:
    """A :class:`ByteWriter` of :class:`LocalStore`: a hidden file written front to back, fsynced
    and renamed to its name by :meth:`close` (the object appears whole)."""

    def __init__(self, store: LocalStore, name: str):
        self.store, self.name, self.size = store, name, 0
        self.tmp = os.path.join(store.root, f"{_PART}{uuid.uuid4().hex[:12]}.{name}")
        self._f = open(self.tmp, "xb")  # noqa: SIM115 - closed by close / abort

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self._f.write(view)
        self.size += len(view)

    def close(self, if_match: str | None = None, if_absent: bool = False) -> None:
        from .objstore import PreconditionFailed

        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        target = self.store._p(self.name)
        cond = if_match is not None or if_absent
        with self.store._locked() if cond else contextlib.nullcontext():
            if cond and _tag(self.store.get(self.name)) != (None if if_absent else if_match):
                raise PreconditionFailed(f"writing {self.store.url_of(self.name)}: the object changed")
            os.replace(self.tmp, target)
        self.store._fsync_dir()

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)
