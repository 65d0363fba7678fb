"""The commit point of a local checkpoint directory (:class:`~checkpoint.storage.bytestore.LocalStore`:
plain local paths and ``file://``): a rename. Everything else of the commit protocol is the code
every byte store shares (:mod:`checkpoint.storage.commit`): what a checkpoint owns (only what a
record fqnckpt wrote names, and only while the entry still matches that record), what killed saves
left and its removal, retention. A checkpoint directory may hold files fqnckpt did not write
(``config.json``, tokenizer files, subfolders: Hugging Face's layout keeps them beside the shards);
they stay, byte for byte, whatever their names.

Protocol (one writer at a time: an ``fcntl.flock`` on ``.<name>.fqnckpt-lock`` beside ``path``,
held for the whole save):

1. Everything is written and fsynced in a staging directory made by this save:
   ``.<name>.fqnckpt-staging-<token>`` beside ``path`` when ``path`` does not exist, else
   ``path/.fqnckpt-staging-<token>``; ``<token>`` is 32 hex digits only this save knows, and the
   directory's first entry is its marker (:class:`StagingMarker`, naming the token). Only a
   directory with that exact name form and a marker naming its token is a staging area of ours:
   the next writer removes it with what it holds (all of it that save's). A directory of that
   name form that is empty, or holds only an empty marker (a save killed before writing its
   marker), is removed too: nothing in it is anyone's.
2. New path: the staging directory is renamed to ``path`` (atomic; the commit point). Done.
3. Existing directory: a manifest (:class:`CommitManifest`: the token, the files to move in, the
   files of the previous checkpoint to remove with the size the record gave each) is written into
   the staging directory, then under an exclusive flock on the checkpoint directory the staging
   directory is renamed to ``path/.fqnckpt-commit-<token>`` (atomic; the commit point) and rolled
   forward: each file renamed into place (shards first, indexes last), stale files removed when
   they still match the manifest, the manifest removed, the commit directory removed.

Recovery: only the next writer (a save, a removal, the manager's retention, :func:`recover`)
completes an interrupted commit, and only from a commit directory that is ours (the exact name
form, a directory, a manifest that validates and names the directory's token). An entry named
like ours that is not one (a file, a directory without our manifest) is ignored and stays.

Readers (:func:`read_view`) never write. While opening a checkpoint's files (the indexes and every
shard they name) a reader holds a shared flock on the checkpoint directory; the roll-forward takes
it exclusively, so a reader's opens never straddle a commit, and once open a file keeps its inode
(commits replace files by rename, never write into them): the reader reads one checkpoint, old or
new, whole. A reader that finds an interrupted commit of ours raises
:class:`~checkpoint.errors.InterruptedCommitError` (the files in place are a mix of two saves) and
leaves it to the next writer. Readers that do not use the lock (``transformers``) can see a mix
only while a commit runs, as with any in-place overwrite; indexes are moved last to keep that
window short.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import stat
import threading
import uuid
from collections.abc import Iterable, Iterator

from pydantic import BaseModel, ConfigDict, Field

from ..testing import faults
from ..errors import CheckpointExistsError, CheckpointNotFoundError, InterruptedCommitError
from .bytestore import (
    COMMIT_TAG, LOCK_TAG, MARKER, STAGING_TAG, LocalStore, StagingMarker, checkpoint_lock, read_record, remove_staging_area,
    sibling,
)  # fmt: skip
from .commit import (
    MODEL_INDEX, carried_side_files, check_clashes, clean_dead, holds_checkpoint, owned_objects, parse_index, removable,
)  # fmt: skip
from .format import MODEL_PREFIX, index_name

MANIFEST = ".fqnckpt-manifest.json"  # hidden: extra_files names cannot start with "."
_TOKEN = r"[0-9a-f]{32}"
_COMMIT = re.compile(r"^" + re.escape(COMMIT_TAG) + r"(" + _TOKEN + r")$")
__all__ = [
    "StagedCheckpoint", "read_view", "checkpoint_lock", "sibling", "owned_files", "fsync_path", "recover",
    "LOCK_TAG", "COMMIT_TAG",
]  # fmt: skip


def is_checkpoint_dir(path: str) -> bool:
    """A directory holding a checkpoint (:func:`checkpoint.storage.commit.holds_checkpoint`)."""
    return os.path.isdir(path) and holds_checkpoint(LocalStore(path))


def enclosing_checkpoint(path: str) -> str | None:
    """The nearest directory above ``path`` that is a checkpoint (an index or one
    ``model.safetensors``: what readers and ``overwrite`` treat as one), else None. A checkpoint
    saved there would sit inside another one's folder, whose overwrite and retention manage only
    their own files."""
    cur = os.path.dirname(os.path.abspath(path))
    while True:
        if any(os.path.isfile(os.path.join(cur, n)) for n in (index_name(MODEL_PREFIX), f"{MODEL_PREFIX}.safetensors")):
            return cur
        up = os.path.dirname(cur)
        if up == cur:
            return None
        cur = up


def fsync_path(path: str) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CommitManifest(BaseModel):
    """The manifest (:data:`MANIFEST`) in a commit directory: the save's ``token`` (the commit
    directory's name carries it), ``files`` to rename into the checkpoint directory (in this
    order), ``remove``: files of the previous checkpoint to remove, each with the byte size its
    record gave (None: no size recorded; removed while it is a regular file or a symlink). Plain
    file names only."""

    model_config = ConfigDict(extra="forbid")

    token: str = Field(pattern="^" + _TOKEN + "$")
    files: list[str]
    remove: dict[str, int | None]


# -- locks ------------------------------------------------------------------------------------------


_NO_LOCKS = (errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL, errno.EBADF)


def _open_dir(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except (FileNotFoundError, NotADirectoryError):
        return None


def _flock(fd: int, op: int) -> None:
    try:
        fcntl.flock(fd, op)
    except OSError as e:  # a filesystem without flock on directories: no reader exclusion there
        if e.errno not in _NO_LOCKS:
            raise


@contextlib.contextmanager
def _dir_lock(path: str, op: int) -> Iterator[int | None]:
    fd = _open_dir(path)
    if fd is None:
        yield None
        return
    try:
        _flock(fd, op)
        yield fd
    finally:
        os.close(fd)


# -- what a checkpoint owns -------------------------------------------------------------------------


def _plain(name: object) -> bool:
    return isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


def owned_files(path: str, listing: dict | None = None) -> set[str]:
    """Names of the regular files (or symlinks) in checkpoint directory ``path`` that an
    overwrite of its checkpoint removes (:func:`checkpoint.storage.commit.removable` on its
    :class:`~checkpoint.storage.bytestore.LocalStore`); never a directory, never anything outside
    ``path``, never a file that no longer matches its record."""
    return set(removable(LocalStore(path), listing=listing))


# -- recovery (writers only) ------------------------------------------------------------------------


def _commit_manifest(commit_dir: str) -> CommitManifest | None:
    """The manifest of ``commit_dir`` when the directory is a commit of ours (see module
    docstring), else None."""
    m = _COMMIT.match(os.path.basename(commit_dir))
    manifest = read_record(commit_dir, MANIFEST, CommitManifest, 1 << 24) if m is not None else None
    return manifest if manifest is not None and manifest.token == m.group(1) else None


def _names(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def pending_commits(path: str) -> list[str]:
    """Commit directories of ours inside ``path`` (an interrupted, decided commit each); entries
    named like one that are not ours are not listed."""
    return sorted(os.path.join(path, n) for n in _names(path) if _COMMIT.match(n) and _commit_manifest(os.path.join(path, n)))


def _matches(full: str, size: int | None) -> bool:
    """``full`` is still the file a record named: a regular file (of ``size`` bytes when recorded)
    or a symlink (removed, never followed)."""
    try:
        st = os.lstat(full)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode):
        return True
    return stat.S_ISREG(st.st_mode) and (size is None or st.st_size == size)


def _roll_forward(path: str, commit_dir: str, manifest: CommitManifest) -> None:
    """Finish a decided commit; idempotent (a crash in here is finished by the next writer).

    Raises:
        CheckpointExistsError: a directory stands where a file of the commit goes (made after the
            commit was interrupted); nothing is moved, the commit stays to be completed once it
            is moved away."""
    for name in manifest.files:
        dst = os.path.join(path, name)
        if _plain(name) and os.path.lexists(os.path.join(commit_dir, name)) and os.path.isdir(dst) and not os.path.islink(dst):
            raise CheckpointExistsError(
                dst, "a directory has the name of a file of an interrupted commit; move it away, then run `fqnckpt recover`"
            )
    moved = 0
    for name in manifest.files:
        if not _plain(name):
            continue
        src = os.path.join(commit_dir, name)
        if os.path.lexists(src):
            os.replace(src, os.path.join(path, name))
            moved += 1
            if moved == 1:
                faults.fault_point("after_first_move")
    for name, size in manifest.remove.items():
        full = os.path.join(path, name)
        if _plain(name) and name not in manifest.files and _matches(full, size):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(full)
    fsync_path(path)
    faults.fault_point("before_cleanup")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(commit_dir, MARKER))
    os.unlink(os.path.join(commit_dir, MANIFEST))  # from here on the directory is no commit
    with contextlib.suppress(OSError):
        os.rmdir(commit_dir)  # empty: every file it named was moved
    fsync_path(path)


def complete_interrupted(path: str) -> None:
    """Roll forward every interrupted commit of ours inside ``path``. Writers only: call with
    the writer lock held."""
    for name in _names(path):  # a roll-forward killed after removing its manifest: an empty directory
        if _COMMIT.match(name):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(path, name))  # fails unless empty: nothing is lost
    if not pending_commits(path):
        return
    with _dir_lock(path, fcntl.LOCK_EX):
        for c in pending_commits(path):
            manifest = _commit_manifest(c)
            if manifest is not None:
                _roll_forward(path, c, manifest)


def _remove_marker(path: str) -> None:
    """Remove a staging marker of ours left in committed directory ``path`` by a save killed
    right after its commit rename (a file of that name whose content is not one stays)."""
    if read_record(path, MARKER, StagingMarker, 4096) is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, MARKER))


def recover(path: str | os.PathLike) -> list[str]:
    """Complete an interrupted commit of ours in checkpoint directory ``path`` and remove the
    staging areas of dead saves there (what the next save would do first), under the writer lock.
    Nothing that is not ours is touched, and nothing is created where no save could have been.
    Returns the names of the commit directories completed.

    Raises:
        CheckpointNotFoundError: the directory ``path`` would be in does not exist (or is a file):
            no save can have left anything there (a mistyped path), and none is created.
    """
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise CheckpointNotFoundError(path, f"{parent} is not a directory: no save can have left anything there")
    with checkpoint_lock(path):
        completed = [os.path.basename(c) for c in pending_commits(path)]
        complete_interrupted(path)
        clean_dead(LocalStore(path), set())
        _remove_marker(path)
    return completed


# -- readers ----------------------------------------------------------------------------------------

_views = threading.local()


def _names_inode(path: str, fd: int) -> bool:
    """Whether ``path`` still leads to the directory open as ``fd`` (a lock on a directory that
    was removed meanwhile excludes no commit or removal of the one at ``path`` now)."""
    try:
        now, held = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


@contextlib.contextmanager
def read_view(path: str | os.PathLike) -> Iterator[None]:
    """Open a checkpoint's files inside this block to get one consistent checkpoint (see module
    docstring): a shared flock on directory ``path`` excludes commits while it is held. Re-entrant
    in one thread (nested blocks on the same path join the outer one), so a caller opening several
    parts (model and optimizer) wraps all the opens in one block. Nothing is written. Hold it
    only while opening: a save's commit waits for it.

    A path that is a file (a ``.safetensors`` file) is opened without a lock. Nothing at ``path``
    is no checkpoint: the view ends there, so that a reader never reads a checkpoint committed
    (or removed, unlocked) after its view began.

    Raises:
        CheckpointNotFoundError: nothing is at ``path``, or the directory there was removed
            while the view was being taken.
        InterruptedCommitError: a commit of ours inside ``path`` was interrupted (its files are
            partly in place); the next save there, or :func:`recover`, completes it.
    """
    path = os.path.abspath(os.fspath(path))
    held: dict[str, int] = _views.__dict__.setdefault("held", {})
    if path in held:
        yield
        return
    fd = _open_dir(path)
    if fd is None:
        if not os.path.lexists(path):  # a checkpoint committed there later is not this view's
            raise CheckpointNotFoundError(path)
        yield
        return
    try:
        _flock(fd, fcntl.LOCK_SH)
        if not _names_inode(path, fd):  # removed (a retention) and made anew since it was opened
            raise CheckpointNotFoundError(path, "it was removed while it was being opened")
        if pending_commits(path):
            raise InterruptedCommitError(path, "its files are partly those of the interrupted save")
        held[path] = fd
        try:
            yield
        finally:
            del held[path]
    finally:
        os.close(fd)  # releases the shared lock


# -- writers ----------------------------------------------------------------------------------------


def _commit_order(names: Iterable[str]) -> list[str]:
    """Shards and other files first, indexes last (a lock-free reader sees a new index only once
    its shards are in place)."""
    return sorted(names, key=lambda n: (n.endswith(".index.json"), n))


class StagedCheckpoint:
    """Build a checkpoint in a staging dir and commit it (see module docstring).

    Use as ``with StagedCheckpoint(path, overwrite) as st: ...write into st.dir...; st.commit()``;
    leaving the block without ``commit()`` removes the staging dir. Holds the writer lock throughout.

    Raises:
        CheckpointExistsError: ``path`` exists and ``overwrite`` is False, ``path`` is a file, a
            symlink or a non-empty directory that is not a checkpoint, or a file the new checkpoint
            writes exists there as a directory (never replaced).
    """

    def __init__(self, path: str, overwrite: bool = False):
        self.path = os.path.abspath(os.fspath(path))
        self.overwrite = overwrite
        self.dir = ""
        self.token = uuid.uuid4().hex
        self._lock: contextlib.AbstractContextManager | None = None
        self.committed = False

    def __enter__(self) -> StagedCheckpoint:
        if self.path in getattr(_views, "held", {}):  # the commit would wait for this thread forever
            raise RuntimeError(f"saving {self.path} inside read_view({self.path!r}) of the same thread")
        self._lock = checkpoint_lock(self.path)
        self._lock.__enter__()
        try:
            complete_interrupted(self.path)
            clean_dead(LocalStore(self.path), set())
            _remove_marker(self.path)
            faults.fault_point("after_lock")
            check_target(self.path, self.overwrite)
            tag = STAGING_TAG + self.token
            self.dir = os.path.join(self.path, tag) if os.path.isdir(self.path) else sibling(self.path, tag)
            os.mkdir(self.dir)
            self._write(MARKER, StagingMarker(token=self.token).model_dump_json().encode())
            faults.fault_point("after_staging_created")
        except BaseException:
            try:
                if self.dir and os.path.isdir(self.dir):  # made by this save: ours
                    remove_staging_area(self.dir)
            finally:
                self._lock.__exit__(None, None, None)
            raise
        return self

    def _write(self, name: str, data: bytes) -> None:
        fd = os.open(os.path.join(self.dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view, done = memoryview(data), 0
            while done < len(view):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_file(self, name: str, data: bytes) -> None:
        """Write ``data`` to ``name`` inside the staging dir and fsync it (``written`` records it:
        the model index names these files, the record an overwrite goes by; ``digests`` their
        sha256, which the record keeps for side files)."""
        self.__dict__.setdefault("written", set()).add(name)
        self.__dict__.setdefault("digests", {})[name] = hashlib.sha256(data).hexdigest()
        self._write(name, data)

    def carried(self, writing) -> tuple[dict[str, str], dict[str, str]]:
        """The side files of the checkpoint this save replaces that stay its own
        (:func:`checkpoint.storage.commit.carried_side_files`); nothing for a new path."""
        store = LocalStore(self.path)
        raw = store.get(MODEL_INDEX) if os.path.isdir(self.path) else None
        return carried_side_files(store, parse_index(raw), writing)

    def commit(self) -> None:
        """fsync the staging dir and commit it (see module docstring)."""
        fsync_path(self.dir)
        faults.fault_point("after_staging_fsync")
        parent = os.path.dirname(self.path)
        if not os.path.lexists(self.path):
            faults.fault_point("before_commit_rename")
            os.rename(self.dir, self.path)
            fsync_path(parent)
            self.committed = True
            faults.fault_point("after_commit_rename")
            # Killed before this, the next writer there removes the marker (_remove_marker).
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.path, MARKER))
            return
        check_target(self.path, self.overwrite)
        files = _commit_order(n for n in os.listdir(self.dir) if n != MARKER)
        for name in files:  # a directory in the way would stop the roll-forward after the commit point
            dst = os.path.join(self.path, name)
            if os.path.isdir(dst) and not os.path.islink(dst):
                raise CheckpointExistsError(
                    dst, "a directory has the name of a checkpoint file; refusing to replace it"
                )
        store = LocalStore(self.path)
        listing = store.listing()
        old = removable(store, listing=listing)
        check_clashes(store, files, owned_objects(store, listing=listing), listing, overwrite=self.overwrite)
        manifest = CommitManifest(token=self.token, files=files, remove={n: s for n, s in sorted(old.items()) if n not in files})
        self.write_file(MANIFEST, manifest.model_dump_json().encode())
        fsync_path(self.dir)
        commit_dir = os.path.join(self.path, COMMIT_TAG + self.token)
        with _dir_lock(self.path, fcntl.LOCK_EX):
            faults.fault_point("before_commit_rename")
            os.rename(self.dir, commit_dir)  # the commit point
            fsync_path(self.path)
            self.committed = True
            faults.fault_point("after_commit_rename")
            _roll_forward(self.path, commit_dir, manifest)
        # What saves left that could commit only onto the index just replaced (the same rule as
        # an object store's commit; under the writer lock no other save runs).
        clean_dead(store, set(files))

    def __exit__(self, *exc) -> None:
        try:
            if not self.committed and self.dir:  # made by this save: ours
                remove_staging_area(self.dir)
        finally:
            assert self._lock is not None
            self._lock.__exit__(None, None, None)


def check_target(path: str, overwrite: bool) -> None:
    """Raise :class:`CheckpointExistsError` unless ``path`` may be (re)placed by a checkpoint: a
    checkpoint there (:func:`checkpoint.storage.commit.holds_checkpoint`, the rule of every byte
    store) without ``overwrite``, or a file or symlink at ``path``. A directory of other files
    is no checkpoint: a save goes in beside them (each file it would replace is checked at the
    commit, :func:`checkpoint.storage.commit.check_clashes`)."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        raise CheckpointExistsError(path, "it is not a checkpoint directory; refusing to replace it") if overwrite else CheckpointExistsError(path)
    if not overwrite and holds_checkpoint(LocalStore(path)):
        raise CheckpointExistsError(path)
