"""How a checkpoint directory is committed, and how readers see exactly one checkpoint.

What a checkpoint owns. A checkpoint directory may hold files fqnckpt did not write
(``config.json``, tokenizer files, subfolders: Hugging Face's layout keeps them beside the shards);
``overwrite=True`` replaces only what the previous checkpoint owns (:func:`owned_files`): the
files its indexes (``model`` / ``optimizer`` ``.safetensors.index.json``) name, the indexes
themselves, the per-rank extra-state files ``extra_state.json`` lists, the fixed names in
:data:`OWNED_NAMES` (``model.safetensors``, the report ``migrate`` writes, ...) and Meta's
``consolidated.NN.pth`` (a format without a file list). Nothing is owned for looking like a shard
(``model-00001-of-00003.safetensors`` that no index names stays). Everything else stays, byte for byte.

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
import re
import shutil
import threading
import uuid
from collections.abc import Iterable, Iterator

from pydantic import BaseModel, ConfigDict, ValidationError

from . import _faults
from .errors import CheckpointExistsError, InterruptedCommitError
from .storage.format import MODEL_PREFIX, OPTIMIZER_PREFIX, IndexFile, index_name

STAGING_TAG = ".fqnckpt-staging-"
COMMIT_TAG = ".fqnckpt-commit-"
OLD_TAG = ".fqnckpt-old-"  # rename-aside leftovers of the earlier protocol: removed, never restored
LOCK_TAG = ".fqnckpt-lock"
MANIFEST = ".fqnckpt-manifest.json"  # hidden: extra_files names cannot start with "."
PREFIXES = (MODEL_PREFIX, OPTIMIZER_PREFIX)
# Files a checkpoint owns by name alone (besides what its indexes name).
OWNED_NAMES = frozenset(
    [index_name(p) for p in PREFIXES]
    + [f"{p}.safetensors" for p in PREFIXES]
    + ["migration_report.json", "extra_state.json"]  # extra_state.json: checkpoint.storage.extra_state
)  # peft's adapter files, config.json, ...: owned when the model index's metadata.fqnckpt.objects names them
_FORMAT_GLOBBED = re.compile(r"^consolidated\.\d{2,}\.pth$")
# Meta's model-parallel shards (checkpoint.convert.meta_files): that format has no file list, its
# readers glob these names, so a stale one left by an overwrite would be read; the only names
# owned by form. Hugging Face shards and per-rank extra state are owned only when a record of the
# checkpoint (its indexes, extra_state.json's per_rank) names them.


def _split(path: str) -> tuple[str, str]:
    path = os.path.abspath(path)
    return os.path.dirname(path), os.path.basename(path)


def sibling(path: str, tag: str, suffix: str = "") -> str:
    """``/a/ckpt`` + tag -> ``/a/.ckpt<tag><suffix>``."""
    parent, name = _split(path)
    return os.path.join(parent, f".{name}{tag}{suffix}")


def is_leftover_name(name: str) -> bool:
    """True for names fqnckpt uses for staging / commit / lock entries (never checkpoint files)."""
    return name.startswith(".") and any(t in name for t in (STAGING_TAG, COMMIT_TAG, OLD_TAG, LOCK_TAG))


def is_checkpoint_dir(path: str) -> bool:
    """A directory holding an index, a single ``model.safetensors`` or Meta's first shard."""
    return any(
        os.path.isfile(os.path.join(path, n))
        for n in (index_name(MODEL_PREFIX), f"{MODEL_PREFIX}.safetensors", "consolidated.00.pth")
    )


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


@contextlib.contextmanager
def checkpoint_lock(path: str) -> Iterator[None]:
    """Exclusive ``fcntl.flock`` on ``.<name>.fqnckpt-lock`` beside ``path`` (blocks until free):
    one save at a time. The lock file exists only while a save holds it (nothing is left beside a
    checkpoint): it is unlinked before the lock is released, and a waiter that then wins the lock
    on the unlinked inode sees that the name no longer leads to its inode and locks afresh (the
    usual lock-file-with-unlink protocol; flock alone would let two savers lock different inodes)."""
    parent, _ = _split(path)
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


def owned_files(path: str) -> set[str]:
    """Names of the regular files (or symlinks) in checkpoint directory ``path`` that its checkpoint
    owns (see module docstring); never a directory, never anything outside ``path``."""
    try:
        names = set(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return set()
    owned = {n for n in names if n in OWNED_NAMES or _FORMAT_GLOBBED.match(n)}
    for prefix in PREFIXES:
        try:
            with open(os.path.join(path, index_name(prefix)), "rb") as f:
                idx = IndexFile.model_validate_json(f.read())
        except (OSError, ValidationError, ValueError):
            continue  # no index, or unreadable: only the fixed names above
        owned.update(n for n in idx.weight_map.values() if _plain(n) and n in names)
        meta = idx.metadata.fqnckpt if prefix == MODEL_PREFIX else None
        if meta is not None and meta.objects:  # the other files the save wrote (its record)
            owned.update(n for n in meta.objects.values() if _plain(n) and n in names)
    owned.update(n for n in _per_rank_files(path) if n in names)
    return {
        n for n in owned if os.path.islink(os.path.join(path, n)) or os.path.isfile(os.path.join(path, n))
    }


def _per_rank_files(path: str) -> list[str]:
    """The per-rank extra-state files ``path/extra_state.json`` lists (its ``per_rank``)."""
    from .storage.extra_state import ExtraStateFile, rank_file_name

    try:
        with open(os.path.join(path, "extra_state.json"), "rb") as f:
            doc = ExtraStateFile.model_validate_json(f.read())
    except (OSError, ValidationError, ValueError):
        return []
    if doc.per_rank is None:
        return []
    return [rank_file_name(r, doc.per_rank.world_size) for r in range(doc.per_rank.world_size)]


# -- recovery ---------------------------------------------------------------------------------------


def _inner(path: str, tag: str) -> list[str]:
    try:
        entries = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(os.path.join(path, e) for e in entries if e.startswith(tag))


def _leftovers(path: str, tag: str) -> list[str]:
    parent, name = _split(path)
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        return []
    return sorted(os.path.join(parent, e) for e in entries if e.startswith(f".{name}{tag}"))


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
    """Remove staging directories of earlier interrupted saves (beside and inside ``path``) and
    old-protocol rename-aside leftovers. Call with the writer lock held; nothing is restored."""
    for d in _leftovers(path, STAGING_TAG) + _leftovers(path, OLD_TAG) + _inner(path, STAGING_TAG):
        shutil.rmtree(d, ignore_errors=True)


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
        manifest = CommitManifest(files=files, remove=sorted(owned_files(self.path) - set(files)))
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

    def __exit__(self, *exc) -> None:
        try:
            if not self.committed and self.dir:
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
    if any(not is_leftover_name(n) for n in os.listdir(path)) and not is_checkpoint_dir(path):
        raise CheckpointExistsError(
            path, "it is a non-empty directory that is not a checkpoint; refusing to replace it"
        )
