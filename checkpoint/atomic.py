"""Atomic commit of a checkpoint directory.

A save builds the checkpoint in a staging directory beside ``path``
(``.<name>.fqnckpt-staging-<uuid>``), fsyncs every file and the directory, writes the index last,
then moves it into place: ``renameat2(RENAME_EXCHANGE)`` swaps old and new atomically where the
filesystem supports it (Linux >= 3.15: ext4, xfs, btrfs, tmpfs); elsewhere the old checkpoint is
renamed aside (``.<name>.fqnckpt-old-<uuid>``) and the new one renamed in, and a crash between the
two renames is repaired by :func:`recover` on the next load or save. An ``fcntl`` lock file
(``.<name>.fqnckpt-lock``) beside ``path`` serializes concurrent saves. Leftovers carry hidden
names that never match a checkpoint path and are removed by the next save.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import shutil
import uuid
from collections.abc import Iterator

from . import _faults
from .errors import CheckpointExistsError
from .storage.format import MODEL_PREFIX, index_name

STAGING_TAG = ".fqnckpt-staging-"
OLD_TAG = ".fqnckpt-old-"
LOCK_TAG = ".fqnckpt-lock"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _split(path: str) -> tuple[str, str]:
    path = os.path.abspath(path)
    return os.path.dirname(path), os.path.basename(path)


def sibling(path: str, tag: str, suffix: str = "") -> str:
    """``/a/ckpt`` + tag -> ``/a/.ckpt<tag><suffix>``."""
    parent, name = _split(path)
    return os.path.join(parent, f".{name}{tag}{suffix}")


def is_leftover_name(name: str) -> bool:
    """True for names fqnckpt uses for staging / old / lock entries (never a checkpoint)."""
    return name.startswith(".") and any(t in name for t in (STAGING_TAG, OLD_TAG, LOCK_TAG))


def is_checkpoint_dir(path: str) -> bool:
    """A directory holding an index or a single ``model.safetensors``."""
    return os.path.isfile(os.path.join(path, index_name(MODEL_PREFIX))) or os.path.isfile(
        os.path.join(path, f"{MODEL_PREFIX}.safetensors")
    )


def fsync_path(path: str) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def checkpoint_lock(path: str) -> Iterator[None]:
    """Exclusive ``fcntl.flock`` on ``.<name>.fqnckpt-lock`` beside ``path`` (blocks until free).

    The lock file is never deleted: deleting it would let two savers lock different inodes.
    """
    parent, _ = _split(path)
    os.makedirs(parent, exist_ok=True)
    fd = os.open(sibling(path, LOCK_TAG), os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _leftovers(path: str, tag: str) -> list[str]:
    parent, name = _split(path)
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        return []
    return sorted(os.path.join(parent, e) for e in entries if e.startswith(f".{name}{tag}"))


def recover(path: str) -> bool:
    """Repair an interrupted fallback commit (old checkpoint renamed aside, new not yet in):
    if ``path`` is missing and a complete ``.<name>.fqnckpt-old-*`` exists, rename it back.
    Call with the lock held. Returns True if something was restored."""
    if os.path.lexists(path):
        return False
    for old in _leftovers(path, OLD_TAG):
        if is_checkpoint_dir(old):
            os.rename(old, path)
            fsync_path(os.path.dirname(os.path.abspath(path)))
            return True
    return False


def recover_locked(path: str) -> bool:
    """:func:`recover` under the lock (used by load when ``path`` is missing)."""
    if not _leftovers(path, OLD_TAG):
        return False
    with checkpoint_lock(path):
        return recover(path)


def cleanup_leftovers(path: str) -> None:
    """Remove staging / old directories of earlier interrupted saves. Call with the lock held."""
    for d in _leftovers(path, STAGING_TAG) + _leftovers(path, OLD_TAG):
        shutil.rmtree(d, ignore_errors=True)


def _renameat2_exchange(a: str, b: str) -> bool:
    """Atomically swap two paths; False if the kernel / filesystem / libc cannot."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), a)


class StagedCheckpoint:
    """Build a checkpoint in a staging dir beside ``path`` and commit it atomically.

    Use as ``with StagedCheckpoint(path, overwrite) as st: ...write into st.dir...; st.commit()``;
    leaving the block without ``commit()`` removes the staging dir. Holds the lock throughout.

    Raises:
        CheckpointExistsError: ``path`` exists and ``overwrite`` is False, or ``path`` is a file or
            a non-empty directory that is not a checkpoint (never replaced).
    """

    def __init__(self, path: str, overwrite: bool = False):
        self.path = os.path.abspath(os.fspath(path))
        self.overwrite = overwrite
        self.dir = sibling(self.path, STAGING_TAG, uuid.uuid4().hex)
        self._lock: contextlib.AbstractContextManager | None = None
        self.committed = False

    def __enter__(self) -> StagedCheckpoint:
        self._lock = checkpoint_lock(self.path)
        self._lock.__enter__()
        try:
            recover(self.path)
            cleanup_leftovers(self.path)
            _faults.fault_point("after_lock")
            check_target(self.path, self.overwrite)
            os.mkdir(self.dir)
            _faults.fault_point("after_staging_created")
        except BaseException:
            self._lock.__exit__(None, None, None)
            raise
        return self

    def write_file(self, name: str, data: bytes) -> None:
        """Write ``data`` to ``name`` inside the staging dir and fsync it."""
        fd = os.open(os.path.join(self.dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view, done = memoryview(data), 0
            while done < len(view):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)

    def commit(self) -> None:
        """fsync the staging dir and move it to ``path`` atomically (see module docstring)."""
        fsync_path(self.dir)
        _faults.fault_point("after_staging_fsync")
        parent = os.path.dirname(self.path)
        _faults.fault_point("before_commit_rename")
        if os.path.lexists(self.path):
            check_target(self.path, self.overwrite)
            if _renameat2_exchange(self.dir, self.path):
                old = self.dir  # now holds the previous checkpoint
            else:
                old = sibling(self.path, OLD_TAG, uuid.uuid4().hex)
                os.rename(self.path, old)
                _faults.fault_point("after_aside_rename")
                os.rename(self.dir, self.path)
        else:
            old = None
            os.rename(self.dir, self.path)
        fsync_path(parent)
        self.committed = True
        _faults.fault_point("after_commit_rename")
        if old is not None:
            _faults.fault_point("before_cleanup")
            shutil.rmtree(old, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        try:
            if not self.committed:
                shutil.rmtree(self.dir, ignore_errors=True)
        finally:
            assert self._lock is not None
            self._lock.__exit__(None, None, None)


def check_target(path: str, overwrite: bool) -> None:
    """Raise :class:`CheckpointExistsError` unless ``path`` may be (re)placed by a checkpoint."""
    if not os.path.lexists(path):
        return
    if not overwrite:
        raise CheckpointExistsError(path)
    if os.path.islink(path) or not os.path.isdir(path):
        raise CheckpointExistsError(path, "it is not a checkpoint directory; refusing to replace it")
    if os.listdir(path) and not is_checkpoint_dir(path):
        raise CheckpointExistsError(
            path, "it is a non-empty directory that is not a checkpoint; refusing to replace it"
        )
