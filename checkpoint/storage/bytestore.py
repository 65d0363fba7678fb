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
``staging_areas``           where unfinished saves of the rename commit staged (local only)
``writer_lock``             held by a save or removal for its whole run (local only)
``child`` / ``url_of``      a sub-prefix, an object's URL for messages
==========================  ============================================================

Implementations: :class:`FsspecStore` (``s3://`` through s3fs with S3's conditional requests,
``memory://``, any fsspec backend; :mod:`checkpoint.storage.objstore`) and :class:`LocalStore`
(a local directory, ``file://``: ``pread``, a temporary file renamed into place, and an ``flock``
making the conditional writes atomic between processes). The stages above (commit:
:mod:`~checkpoint.storage.commit`, save: :mod:`~checkpoint.write.upload`, read:
:mod:`~checkpoint.storage.remote_reader`, the manager's retention, every CLI command) call only
these methods, so they are written once and do not know the backend. No fsspec import here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .secrets import scrub, scrub_url

__all__ = [
    "ByteStore", "ByteWriter", "LocalStore", "FsspecStore", "PreconditionFailed", "checkpoint_lock", "sibling",
    "StagingMarker", "staging_token", "is_staging_area", "remove_staging_area", "read_record", "MARKER",
]  # fmt: skip


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
    def staging_areas(self) -> list[str]: ...
    def remove_staging_area(self, name: str) -> None: ...
    def writer_lock(self) -> contextlib.AbstractContextManager: ...


def __getattr__(name: str):  # FsspecStore / PreconditionFailed without importing objstore up front
    if name in ("FsspecStore", "PreconditionFailed"):
        from . import objstore

        return objstore.ObjectStore if name == "FsspecStore" else objstore.PreconditionFailed
    raise AttributeError(name)


def _tag(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


_PART = ".fqnckpt-part."  # a LocalStore writer's file until close: ".fqnckpt-part.<id>.<name>"
# The rename commit's entries (checkpoint.storage.local_commit): a save's staging directory (inside
# the checkpoint directory, or beside a new one as ".<name>.fqnckpt-staging-<token>"), a decided
# commit being rolled forward, the writer lock file beside.
STAGING_TAG = ".fqnckpt-staging-"
COMMIT_TAG = ".fqnckpt-commit-"
LOCK_TAG = ".fqnckpt-lock"


MARKER = ".fqnckpt-staging.json"  # the first entry of a local save's staging directory
_TOKEN32 = r"[0-9a-f]{32}"


def staging_token(name: str, beside: str | None = None) -> str | None:
    """The token in ``name`` when it has the exact form of a local save's staging directory:
    inside a checkpoint directory ``.fqnckpt-staging-<token>``, beside checkpoint ``beside`` (its
    base name) ``.<beside>.fqnckpt-staging-<token>``; else None."""
    head = STAGING_TAG if beside is None else f".{beside}{STAGING_TAG}"
    m = re.fullmatch(re.escape(head) + "(" + _TOKEN32 + ")", name)
    return m.group(1) if m else None


class StagingMarker(BaseModel):
    """:data:`MARKER`, the first entry of a local save's staging directory: the save's token."""

    model_config = ConfigDict(extra="forbid")
    format: str = Field("fqnckpt-local-staging-1", pattern=r"^fqnckpt-local-staging-1$")
    token: str = Field(pattern="^" + _TOKEN32 + "$")


def read_record(dir_path: str, name: str, model: type[BaseModel], limit: int = 1 << 20) -> Any:
    """Record ``name`` in directory ``dir_path`` (a marker, a manifest) parsed by pydantic model
    ``model``, or None: unless ``dir_path`` is a real directory (not a symlink) and ``name`` a
    regular file of at most ``limit`` bytes that validates, nothing there is a record of ours. Never
    follows a symlink and never blocks (a FIFO with that name is no record)."""
    full = os.path.join(dir_path, name)
    try:  # never opened unless a regular file (a FIFO is not even opened), and checked again once open
        if not stat.S_ISDIR(os.lstat(dir_path).st_mode) or not stat.S_ISREG(os.lstat(full).st_mode):
            return None
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
                return None
            return model.model_validate_json(f.read(limit + 1))
    except (ValidationError, ValueError, OSError):
        return None


def is_staging_area(path: str, token: str) -> bool:
    """Whether directory ``path`` is a staging area a save of ours made with ``token`` (a real
    directory, not a symlink, holding a marker that validates and names ``token``)."""
    marker = read_record(path, MARKER, StagingMarker, 4096)
    return marker.token == token if marker is not None else _unborn(path)


def _unborn(path: str) -> bool:
    """A staging directory whose save was killed before its marker was written: a real directory,
    empty or holding only an empty marker file. Nothing in it is anyone's data, so the exact name
    form is enough to remove it."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        entries = list(os.scandir(path))
        return all(e.name == MARKER and e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_size == 0 for e in entries)
    except OSError:
        return False


def remove_staging_area(path: str) -> None:
    """Remove staging area ``path`` (a directory this save made, or one :func:`is_staging_area`
    accepts: made by a save of ours, so everything in it is that save's), its marker last, then
    the directory. Symlinks in it are removed, never followed."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return
    for e in entries:
        if e.name == MARKER:
            continue
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(e.path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(path, MARKER))  # last: until here the area is recognisably ours
    with contextlib.suppress(OSError):
        os.rmdir(path)


def split_path(path: str) -> tuple[str, str]:
    path = os.path.abspath(path)
    return os.path.dirname(path), os.path.basename(path)


def sibling(path: str, tag: str, suffix: str = "") -> str:
    """``/a/ckpt`` + tag -> ``/a/.ckpt<tag><suffix>``."""
    parent, name = split_path(path)
    return os.path.join(parent, f".{name}{tag}{suffix}")


@contextlib.contextmanager
def checkpoint_lock(path: str) -> Iterator[None]:
    """Exclusive ``fcntl.flock`` on ``.<name>.fqnckpt-lock`` beside ``path`` (blocks until free):
    one save (or removal) of a local checkpoint at a time. The lock file exists only while a save holds it (nothing is left beside a
    checkpoint): it is unlinked before the lock is released, and a waiter that then wins the lock
    on the unlinked inode sees that the name no longer leads to its inode and locks afresh (the
    usual lock-file-with-unlink protocol; flock alone would let two savers lock different inodes)."""
    parent, _ = split_path(path)
    os.makedirs(parent, exist_ok=True)
    lock = sibling(path, LOCK_TAG)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = os.fstat(fd)
            now = os.stat(lock)
        except FileNotFoundError:
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            raise
        if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            break
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)  # releases the lock


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
                elif e.is_symlink():  # a name of the checkpoint all the same (removed, never followed, by removals)
                    out[e.name] = ("link", e.stat().st_size if e.is_file() else 0)
            except FileNotFoundError:
                continue  # removed since the scan (another writer's cleanup)
        return out

    def get(self, name: str) -> bytes | None:
        try:  # O_NONBLOCK: a FIFO of that name must not block the open
            fd = os.open(self._p(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                return None  # a symlink, a directory or a socket is no object of ours
            raise
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None  # a FIFO or a device is no object of ours
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

    def writer_lock(self) -> contextlib.AbstractContextManager:
        """The checkpoint's writer lock (:func:`checkpoint_lock`): saves and removals one at a time."""
        return checkpoint_lock(self.root)

    def staging_areas(self) -> list[str]:
        """Staging directories of rename commits that never committed (a killed save; under the
        writer lock every one is dead): inside the directory (``.fqnckpt-staging-<token>``) and
        beside it (``.<name>.fqnckpt-staging-<token>``), each only when its marker names its
        token (:func:`is_staging_area`): a directory merely named like one is not ours."""
        parent, base = split_path(self.root)
        inner = [n for n in _names(self.root) if (t := staging_token(n)) and is_staging_area(os.path.join(self.root, n), t)]
        beside = [n for n in _names(parent) if (t := staging_token(n, base)) and is_staging_area(os.path.join(parent, n), t)]
        return sorted(inner + beside)

    def remove_staging_area(self, name: str) -> None:
        """Remove staging area ``name`` (as :meth:`staging_areas` lists it) when it is still ours."""
        parent, base = split_path(self.root)
        for where, beside in ((self.root, None), (parent, base)):
            token = staging_token(name, beside)
            if token is not None and is_staging_area(os.path.join(where, name), token):
                remove_staging_area(os.path.join(where, name))
                return


def _names(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []


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
