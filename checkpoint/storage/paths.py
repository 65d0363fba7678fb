"""The one rule for files a checkpoint directory leads a reader to (index entries, shards found
in the directory, DCP's ``.metadata`` / ``*.distcp``), used by every reader: ``load``, ``verify``,
``migrate``, ``inspect``, ``diff``.

* A name is a plain file name: not empty, no ``/``, ``\\`` or NUL, not ``.`` / ``..``, not
  absolute, not starting with ``~``, at most 255 bytes (``NAME_MAX`` of Linux, macOS and
  Windows file systems; no shard name fqnckpt or Hugging Face writes comes near it).
* A symlink is followed only when its final target lies inside the checkpoint directory or, for
  the Hugging Face hub-cache layout (``<cache>/models--org--name/snapshots/<rev>/<file>`` ->
  ``../../blobs/<sha256>``, as ``huggingface_hub`` writes it; see its ``file_download.py``
  ``_create_symlink``), inside that cached repository (``models--org--name/``, also
  ``datasets--`` / ``spaces--``).

The path a caller passes (the checkpoint directory or a single file) is the caller's own choice
and is taken as given; the rule applies to what is found inside it.
"""

from __future__ import annotations

import os

from ..errors import UnsafePathError

# Repository folder prefixes of the hub cache (huggingface_hub ``REPO_TYPES``).
_HUB_REPO_PREFIXES = ("models--", "datasets--", "spaces--")
NAME_MAX = 255


def trust_root(root: str) -> str:
    """Real path of the directory symlinks inside ``root`` may lead into: the cached repository
    (``.../models--org--name``) when ``root`` is a hub-cache snapshot or a folder inside one,
    else ``root`` itself."""
    real = os.path.realpath(root)
    cur = real
    while True:
        parent = os.path.dirname(cur)
        if parent == cur:
            return real
        if os.path.basename(parent) == "snapshots":
            repo = os.path.dirname(parent)
            if os.path.basename(repo).startswith(_HUB_REPO_PREFIXES) and os.path.isdir(
                os.path.join(repo, "blobs")
            ):
                return repo
        cur = parent


def check_name(root: str, name: str) -> None:
    """Raise :class:`UnsafePathError` unless ``name`` is a plain file name (see module docstring)."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or name.startswith("~"):
        raise UnsafePathError(str(name), root, "absolute or not a plain file name")
    if "/" in name or "\\" in name or "\x00" in name or name in (".", ".."):
        raise UnsafePathError(
            name, root, "not a plain file name (contains '/', '\\' or a NUL, or is '.' / '..')"
        )
    if len(name.encode("utf-8", "surrogatepass")) > NAME_MAX:  # stat() raises ENAMETOOLONG on it
        raise UnsafePathError(name[:60] + "...", root, f"not a plain file name (longer than {NAME_MAX} bytes, the file name limit)")


def member(root: str | os.PathLike, name: str) -> str:
    """Path of file ``name`` inside checkpoint directory ``root`` under the one rule.

    Returns ``root/name`` (unresolved: callers open it, the OS follows an allowed symlink).
    A name that does not exist is returned as is (callers report it missing).

    Raises:
        UnsafePathError: ``name`` is not a plain file name, or it is a symlink whose target lies
            outside ``root`` (outside the cached repository for a hub-cache snapshot); the
            message names the file and where it leads.
    """
    root = os.fspath(root)
    check_name(root, name)
    full = os.path.join(root, name)
    if not os.path.islink(full):
        return full
    target = os.path.realpath(full)
    allowed = trust_root(root)
    if os.path.commonpath([allowed, target]) != allowed:
        where = (
            "the checkpoint directory"
            if allowed == os.path.realpath(root)
            else f"the cached repository {allowed}"
        )
        raise UnsafePathError(name, root, f"is a symlink to {target}, outside {where}")
    return full


__all__ = ["member", "check_name", "trust_root"]
