"""How a checkpoint directory is committed, and how readers see exactly one checkpoint.

This is the commit point of :class:`~checkpoint.storage.bytestore.LocalStore` (plain local paths
and ``file://``): everything else, what a checkpoint owns (only what a record of fqnckpt's names:
the model index's ``metadata.fqnckpt.objects``, the shards its indexes name; see
:func:`checkpoint.storage.commit.owned_objects`), the removal of what killed saves left
(:func:`checkpoint.storage.commit.clean_dead`), the manager's retention and completeness, is the
code every byte store shares. A checkpoint directory may hold files fqnckpt did not write
(``config.json``, tokenizer files, subfolders: Hugging Face's layout keeps them beside the
shards); ``overwrite=True`` replaces only what the previous checkpoint owns. Everything else
stays, byte for byte.

Commit protocol (one writer at a time: an ``fcntl.flock`` on ``.<name>.fqnckpt-lock`` beside
``path``, held for the whole save; never deleted, so two savers always lock the same inode):

1. Everything is written and fsynced in a staging directory: ``.<name>.fqnckpt-staging-<uuid>``
   beside ``path`` when ``path`` does not exist, else ``path/.fqnckpt-staging-<uuid>``.
2. New path: the staging directory is renamed to ``path`` (atomic; the commit point). Done.
3. Existing directory: a manifest (:class:`CommitManifest`: the files to move in, the stale owned
   files to remove) is written into the staging directory, then under an exclusive flock on the
   checkpoint directory itself the staging directory is renamed to ``path/.fqnckpt-commit-<uuid>``
   (atomic; the commit point) and rolled forward: each file renamed into place (shards first,
   indexes last), stale files removed, the commit directory removed.

Crash recovery rolls a commit forward only from a ``.fqnckpt-commit-*`` directory INSIDE the
checkpoint directory: it exists only from the commit point on, so its presence proves a commit was
decided and interrupted; deleting or moving the checkpoint directory takes it along. Staging
directories (inside or beside) are never committed by anyone but their writer: they are only
removed, by the next save. Leftovers of fqnckpt's earlier rename-aside protocol
(``.<name>.fqnckpt-old-*``) are only removed, never renamed back (a checkpoint the user deleted must
not come back).

Readers (:func:`read_view`): while opening a checkpoint's files (the indexes and every shard they
name), a reader holds a shared flock on the checkpoint directory; the commit's renames take it
exclusively. So a reader's opens never straddle a commit, and once open a file keeps its inode
(commits replace files by rename, never write into them), so the reader keeps reading the one
checkpoint it opened: old or new, whole. Chosen over unique per-save shard names (which would
break Hugging Face's ``model-0000k-of-0000n`` names) and over detect-and-retry (which needs a
second read of every header). A reader that finds an interrupted commit completes it first (it
takes the writer lock), or raises :class:`~checkpoint.errors.InterruptedCommitError` when it may not
write there. Readers that do not use the lock (e.g. ``transformers``) can see a mix only while a
commit runs, as with any in-place overwrite; indexes are moved last to keep that window short.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import threading
import uuid
from collections.abc import Iterable, Iterator

from pydantic import BaseModel, ConfigDict

from . import _faults
from .errors import CheckpointExistsError, InterruptedCommitError
from .storage.bytestore import COMMIT_TAG, LOCK_TAG, OLD_TAG, STAGING_TAG, LocalStore, checkpoint_lock, sibling
from .storage.commit import check_clashes, clean_dead, holds_checkpoint, owned_objects
from .storage.format import MODEL_PREFIX, index_name

MANIFEST = ".fqnckpt-manifest.json"  # hidden: extra_files names cannot start with "."
__all__ = ["StagedCheckpoint", "read_view", "checkpoint_lock", "sibling", "owned_files", "fsync_path", "LOCK_TAG", "COMMIT_TAG"]
def is_leftover_name(name: str) -> bool:
    """True for names fqnckpt uses for staging / commit / lock entries (never checkpoint files)."""
    return name.startswith(".") and any(t in name for t in (STAGING_TAG, COMMIT_TAG, OLD_TAG, LOCK_TAG))


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
    """The manifest (:data:`MANIFEST`) in a commit directory: ``files`` to rename into the checkpoint directory (in
    this order), ``remove``: stale files of the previous checkpoint. Plain file names only."""

    model_config = ConfigDict(extra="forbid")

    files: list[str]
    remove: list[str]


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
    return (
        isinstance(name, str)
        and bool(name)
        and "/" not in name
        and "\\" not in name
        and name not in (".", "..")
    )


def owned_files(path: str, listing: dict | None = None) -> set[str]:
    """Names of the regular files (or symlinks) in checkpoint directory ``path`` that its checkpoint
    owns (:func:`checkpoint.storage.commit.owned_objects` on its
    :class:`~checkpoint.storage.bytestore.LocalStore`); never a directory, never anything outside ``path``."""
    store = LocalStore(path)
    listing = store.listing() if listing is None else listing
    return {n for n in owned_objects(store, listing=listing) if n in listing and listing[n][0] != "directory"}


# -- recovery ---------------------------------------------------------------------------------------


def _inner(path: str, tag: str) -> list[str]:
    try:
        entries = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(os.path.join(path, e) for e in entries if e.startswith(tag))


def pending_commits(path: str) -> list[str]:
    """Commit directories inside ``path`` (an interrupted, decided commit each)."""
    return _inner(path, COMMIT_TAG)


def _roll_forward(path: str, commit_dir: str) -> None:
    """Finish a decided commit; idempotent (a crash in here is finished by the next call)."""
    try:
        with open(os.path.join(commit_dir, MANIFEST), "rb") as f:
            manifest = CommitManifest.model_validate_json(f.read())
    except FileNotFoundError:
        manifest = None  # removed last before the directory itself: the roll-forward was done
    if manifest is not None:
        moved = 0
        for name in manifest.files:
            if not _plain(name):
                continue
            src = os.path.join(commit_dir, name)
            if os.path.lexists(src):
                os.replace(src, os.path.join(path, name))
                moved += 1
                if moved == 1:
                    _faults.fault_point("after_first_move")
        for name in manifest.remove:
            if _plain(name) and name not in manifest.files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(path, name))
        fsync_path(path)
        _faults.fault_point("before_cleanup")
        os.unlink(os.path.join(commit_dir, MANIFEST))
    shutil.rmtree(commit_dir, ignore_errors=True)
    fsync_path(path)


def complete_interrupted(path: str) -> None:
    """Roll forward every interrupted commit inside ``path``. Call with the writer lock held."""
    commits = pending_commits(path)
    if not commits:
        return
    with _dir_lock(path, fcntl.LOCK_EX):
        for c in pending_commits(path):
            _roll_forward(path, c)


def cleanup_leftovers(path: str) -> None:
    """Remove what earlier interrupted saves left (staging directories beside and inside ``path``,
    old-protocol rename-aside copies, dead object-store staging manifests and what they name):
    :func:`checkpoint.storage.commit.clean_dead`. Call with the writer lock held; nothing is restored."""
    clean_dead(LocalStore(path), set())


# -- readers ----------------------------------------------------------------------------------------

_views = threading.local()


@contextlib.contextmanager
def read_view(path: str | os.PathLike) -> Iterator[None]:
    """Open a checkpoint's files inside this block to get one consistent checkpoint (see module
    docstring): a shared flock on directory ``path`` excludes commits while it is held. Re-entrant
    in one thread (nested blocks on the same path join the outer one), so a caller opening several
    parts (model and optimizer) wraps all the opens in one block. An interrupted commit found
    inside ``path`` is completed first. Hold it only while opening: a save's commit waits for it.

    A path that is not a directory (a ``.safetensors`` file, nothing) is opened without a lock.

    Raises:
        InterruptedCommitError: an interrupted commit is pending and this process cannot take the
            writer lock to complete it (no write permission).
    """
    path = os.path.abspath(os.fspath(path))
    held: dict[str, int] = _views.__dict__.setdefault("held", {})
    if path in held:
        yield
        return
    fd = _open_dir(path)
    if fd is None:
        yield
        return
    try:
        while True:
            _flock(fd, fcntl.LOCK_SH)
            if not pending_commits(path):
                break
            _flock(fd, fcntl.LOCK_UN)
            try:
                with checkpoint_lock(path):
                    complete_interrupted(path)
            except PermissionError as e:
                raise InterruptedCommitError(path, str(e)) from e
            except OSError as e:
                if e.errno != errno.EROFS:
                    raise
                raise InterruptedCommitError(path, str(e)) from e
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
        self._lock: contextlib.AbstractContextManager | None = None
        self.committed = False

    def __enter__(self) -> StagedCheckpoint:
        if self.path in getattr(_views, "held", {}):  # the commit would wait for this thread forever
            raise RuntimeError(f"saving {self.path} inside read_view({self.path!r}) of the same thread")
        self._lock = checkpoint_lock(self.path)
        self._lock.__enter__()
        try:
            complete_interrupted(self.path)
            cleanup_leftovers(self.path)
            _faults.fault_point("after_lock")
            check_target(self.path, self.overwrite)
            tag = STAGING_TAG + uuid.uuid4().hex
            self.dir = os.path.join(self.path, tag) if os.path.isdir(self.path) else sibling(self.path, tag)
            os.mkdir(self.dir)
            _faults.fault_point("after_staging_created")
        except BaseException:
            self._lock.__exit__(None, None, None)
            raise
        return self

    def write_file(self, name: str, data: bytes) -> None:
        """Write ``data`` to ``name`` inside the staging dir and fsync it (``written`` records it:
        the model index names these files, the record :func:`owned_files` goes by)."""
        self.__dict__.setdefault("written", set()).add(name)
        fd = os.open(os.path.join(self.dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view, done = memoryview(data), 0
            while done < len(view):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)

    def commit(self) -> None:
        """fsync the staging dir and commit it (see module docstring)."""
        fsync_path(self.dir)
        _faults.fault_point("after_staging_fsync")
        parent = os.path.dirname(self.path)
        if not os.path.lexists(self.path):
            _faults.fault_point("before_commit_rename")
            os.rename(self.dir, self.path)
            fsync_path(parent)
            self.committed = True
            _faults.fault_point("after_commit_rename")
            return
        check_target(self.path, self.overwrite)
        files = _commit_order(os.listdir(self.dir))
        for name in files:  # a directory in the way would stop the roll-forward after the commit point
            dst = os.path.join(self.path, name)
            if os.path.isdir(dst) and not os.path.islink(dst):
                raise CheckpointExistsError(
                    dst, "a directory has the name of a checkpoint file; refusing to replace it"
                )
        listing = LocalStore(self.path).listing()
        owned = owned_files(self.path, listing)
        check_clashes(LocalStore(self.path), files, owned, listing)
        manifest = CommitManifest(files=files, remove=sorted(owned - set(files)))
        self.write_file(MANIFEST, manifest.model_dump_json().encode())
        fsync_path(self.dir)
        commit_dir = os.path.join(self.path, COMMIT_TAG + uuid.uuid4().hex)
        with _dir_lock(self.path, fcntl.LOCK_EX):
            _faults.fault_point("before_commit_rename")
            os.rename(self.dir, commit_dir)  # the commit point
            fsync_path(self.path)
            self.committed = True
            _faults.fault_point("after_commit_rename")
            _roll_forward(self.path, commit_dir)
        # What saves left that could commit only onto the index just replaced (the same rule as
        # an object store's commit; under the writer lock no other save runs).
        clean_dead(LocalStore(self.path), set(files))

    def __exit__(self, *exc) -> None:
        try:
            if not self.committed and self.dir:
                shutil.rmtree(self.dir, ignore_errors=True)
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
