"""The one rule for a directory holding two checkpoint layouts at once.

DCP's ``.metadata`` beside a safetensors checkpoint's ``model.safetensors.index.json`` (or its
single ``model.safetensors``) makes the directory two checkpoints: torch's ``FileSystemReader``
reads the first, ``transformers.from_pretrained`` the second, and nothing in the directory says
which one is current (``checkpoint.save`` removes a stale ``.metadata`` when it writes, see
``checkpoint.storage.commit.SHADOWING``, so fqnckpt never leaves this itself). Every local
reading entry point (``load``, ``inspect``, ``verify``, ``migrate``, ``diff``, the DCP
``StorageReader``, format sniffing) calls :func:`check_one_layout` and refuses such a directory
instead of picking one by its own precedence.
"""

from __future__ import annotations

import os

from ..errors import AmbiguousSourceError
from .paths import member

DCP_METADATA = ".metadata"
# What a safetensors reader opens in a directory (transformers opens model.safetensors first).
SAFETENSORS_ENTRIES = ("model.safetensors.index.json", "model.safetensors")
# What transformers opens when there is no safetensors file (fqnckpt reads a lone pickle too).
PICKLE_ENTRIES = ("pytorch_model.bin.index.json", "pytorch_model.bin")


def check_one_layout(root: str | os.PathLike) -> None:
    """Refuse the directory ``root`` when it holds DCP's ``.metadata`` and a Hugging Face model
    checkpoint (``model.safetensors.index.json`` / ``model.safetensors``, else
    ``pytorch_model.bin.index.json`` / ``pytorch_model.bin``); a file or a missing path passes
    (other checks name those).

    Raises:
        AmbiguousSourceError: ``.file`` is ``root``, ``.choices`` the clashing file names
            (``.metadata`` first); nothing was read.
        UnsafePathError: ``.metadata`` is a symlink leading outside ``root`` (dangling or not).
    """
    root = os.fspath(root)
    if not os.path.lexists(os.path.join(root, DCP_METADATA)):
        return
    # A .metadata symlink leading outside the directory is refused by every reader, as format
    # sniffing refuses it (checkpoint.storage.paths.member), dangling or not; verify and
    # open_checkpoint used to pass it while load raised.
    if os.path.isdir(root):
        member(root, DCP_METADATA)
    if not os.path.isfile(os.path.join(root, DCP_METADATA)):  # isfile: False for a file root too
        return
    others = [n for n in SAFETENSORS_ENTRIES + PICKLE_ENTRIES if os.path.lexists(os.path.join(root, n))]
    if others:
        kind = "pickle" if others[0] in PICKLE_ENTRIES else "safetensors"
        raise AmbiguousSourceError(
            root, [DCP_METADATA, *others],
            f"holds both a DCP checkpoint ({DCP_METADATA}) and a {kind} checkpoint ({others[0]}); "
            "DCP and Hugging Face readers would read different checkpoints from it: remove one of "
            "them or move it to a directory of its own", "the path",
        )  # fmt: skip


__all__ = ["check_one_layout", "DCP_METADATA", "SAFETENSORS_ENTRIES", "PICKLE_ENTRIES"]
