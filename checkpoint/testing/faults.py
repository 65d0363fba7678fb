"""Fault injection for crash tests: ``fault_point(name)`` SIGKILLs this process when the env var
``FQNCKPT_FAULT_POINT`` equals ``name`` (and, if ``FQNCKPT_FAULT_RANK`` is set, only on that rank,
read from env ``RANK``). A no-op otherwise (one dict lookup).

Point names, in the order a save reaches them:

- ``after_lock``: lock taken, interrupted commits completed, leftovers of earlier saves removed,
  staging dir not yet made.
- ``after_staging_created``: empty staging directory exists (inside the target directory, or
  beside a new path).
- ``after_file_create``: a shard file was created and preallocated (header written, no data).
- ``after_tensor_write``: one tensor (or a rank's shard of it) was written.
- ``before_file_fsync`` / ``after_file_fsync``: around the fsync of one shard file.
- ``after_data_written``: every shard file of the checkpoint is written and fsynced.
- ``before_index_write`` / ``after_index_write``: around writing the index file(s) (written last).
- ``after_staging_fsync``: staging directory fsynced, ready to move into place.
- ``before_commit_rename``: just before the commit point (see :mod:`checkpoint.storage.local_commit`): the rename
  of the staging dir to ``path`` (new path) or to ``path/.fqnckpt-commit-*`` (existing directory).
- ``after_commit_rename``: the commit is decided; over an existing directory no file moved yet
  (readers refuse it; the next save, or ``recover``, rolls it forward).
- ``after_first_move``: existing directory only: one new file renamed into place, the rest not.
- ``before_cleanup``: existing directory only: every file moved, stale files removed; the commit
  directory not yet removed.
- ``after_part_upload``: object storage (:mod:`checkpoint.storage.objstore`): one part of an
  object (or a whole small object) was sent; the model index (the commit) not yet written.
"""

from __future__ import annotations

import os
import signal

POINTS = (
    "after_lock",
    "after_staging_created",
    "after_file_create",
    "after_tensor_write",
    "before_file_fsync",
    "after_file_fsync",
    "after_data_written",
    "before_index_write",
    "after_index_write",
    "after_staging_fsync",
    "before_commit_rename",
    "after_commit_rename",
    "after_first_move",
    "before_cleanup",
)
REMOTE_POINTS = ("after_part_upload",)  # saves to object storage only (tests/test_storage_s3.py)


def armed(name: str) -> bool:
    """Whether :func:`fault_point` ``name`` would kill this process now. Asked once per file by
    loops over tensors: ``os.environ.get`` costs ~1.5 us, 30 ms of a 20,000-tensor save."""
    if os.environ.get("FQNCKPT_FAULT_POINT") != name:
        return False
    rank = os.environ.get("FQNCKPT_FAULT_RANK")
    return rank is None or rank == os.environ.get("RANK", "0")


def fault_point(name: str) -> None:
    """SIGKILL this process if ``FQNCKPT_FAULT_POINT == name`` (and the rank matches, if set)."""
    if armed(name):
        os.kill(os.getpid(), signal.SIGKILL)
