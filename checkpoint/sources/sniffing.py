"""Which format a checkpoint path holds, from content (first bytes), never the extension.

Files found inside a directory pass the one symlink rule (:mod:`checkpoint.storage.paths`).
"""

from __future__ import annotations

import re

import os
from pathlib import Path


from ..errors import (
    AmbiguousSourceError,
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedFormatError,
)
from ..storage import paths
from ..storage.dir_layout import check_one_layout

ZIP_MAGIC = b"PK\x03\x04"
LFS_MAGIC = b"version https://git-lfs"
# Key under which DCP's HuggingFaceStorageWriter stores per-rank sharding info in the header.
DCP_SHARDING_KEY = "DCP_SHARDING_INFO"
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def sniff_file(path: Path) -> str:
    """Format of one file from its first bytes: ``torch-zip``, ``torch-legacy``, ``safetensors``,
    ``index`` (a JSON ``*.index.json``).

    Raises:
        CorruptCheckpointError: a Git LFS pointer (run ``git lfs pull``).
        UnsupportedFormatError: unknown content.
    """
    with open(path, "rb") as f:
        head = f.read(64)
    if head.startswith(ZIP_MAGIC):
        return "torch-zip"
    if head.startswith(LFS_MAGIC):
        raise CorruptCheckpointError(
            str(path), "this is a Git LFS pointer file, not the data; run `git lfs pull` to fetch it"
        )
    if len(head) >= 9 and head[8:9] == b"{":
        return "safetensors"
    if head[:1] == b"\x80":
        return "torch-legacy"
    if head.lstrip()[:1] == b"{":
        return "index"
    raise UnsupportedFormatError(str(path), f"unrecognised content (first bytes {head[:8]!r})")


def _members(d: Path, names: list[str]) -> list[Path]:
    """``d/name`` for each regular file (a FIFO would block a reader), under the symlink rule."""
    out = []
    for n in sorted(names):
        p = Path(paths.member(d, n))
        if p.is_file():
            out.append(p)
    return out


def index_files(d: Path) -> list[Path]:
    return _members(d, [f.name for f in d.glob("*.index.json")])


def st_files(d: Path) -> list[Path]:
    """Regular ``*.safetensors`` files of ``d`` (hidden ones are staging leftovers: not read)."""
    return _members(d, [f.name for f in d.glob("*.safetensors") if not f.name.startswith(".")])


def pickle_files(d: Path) -> list[Path]:
    return _members(d, [f.name for f in d.iterdir() if f.suffix in PICKLE_SUFFIXES])


def is_dcp_hf(d: Path) -> bool:
    """``d`` holds DCP's per-rank safetensors shards (``HuggingFaceStorageWriter(save_distributed=
    True)``): their headers carry ``DCP_SHARDING_INFO``. One header is read, not every file's."""
    files = st_files(d)
    if not files:
        return False
    from ..storage.st_header import open_safetensors_with_header

    try:  # the header only, read without mapping the file (a cut file must not SIGBUS)
        return DCP_SHARDING_KEY in (open_safetensors_with_header(str(files[0]))[0].metadata() or {})
    except Exception:  # a bad file is reported by the reader that opens it
        return False


def is_dcp(d: Path) -> bool:
    """``d`` is a DCP ``FileSystemWriter`` directory (``.metadata`` + ``*.distcp``).

    Raises:
        AmbiguousSourceError: ``.metadata`` sits beside a safetensors model checkpoint
            (:func:`checkpoint.storage.dir_layout.check_one_layout`, the rule every reader uses).
    """
    check_one_layout(d)
    return Path(paths.member(d, ".metadata")).is_file()


META_SHARD = re.compile(r"consolidated\.\d{2,}\.pth")  # Meta's model-parallel shard files


def meta_shards(path: str | os.PathLike) -> list[str]:
    """The names of Meta's model-parallel ``consolidated.NN.pth`` shards in directory ``path``
    when they are its only pickles, two or more (what ``migrate --recipe meta-llama-to-hf``
    joins; no other layout beside them); [] otherwise."""
    p = Path(path)
    if not p.is_dir() or is_dcp(p) or index_files(p) or st_files(p):
        return []
    names = sorted(f.name for f in pickle_files(p))
    return names if len(names) > 1 and all(META_SHARD.fullmatch(n) for n in names) else []


def sniff(path: str | os.PathLike) -> str:
    """Format of the checkpoint at ``path`` (a file or a directory); one of
    :data:`checkpoint.sources.FORMATS`.

    Raises:
        CheckpointNotFoundError: nothing at ``path``, a directory without a known layout
            (several pickles are listed by name), or one removed while it is being listed.
        UnsafePathError: a file in the directory is a symlink leading outside it.
        CorruptCheckpointError / UnsupportedFormatError: see :func:`sniff_file`.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(str(p))
    if p.is_file():
        kind = sniff_file(p)
        return "safetensors-sharded" if kind == "index" else kind
    if not p.is_dir():  # a FIFO / socket / device: opening it could block or never end
        raise CheckpointNotFoundError(str(p), "not a regular file or a directory")
    try:
        return _sniff_dir(p)
    except CheckpointError:
        raise
    except (FileNotFoundError, NotADirectoryError):  # removed meanwhile (a retention, rm -r)
        raise CheckpointNotFoundError(str(p), "it was removed while its files were being listed") from None


def _sniff_dir(p: Path) -> str:
    """:func:`sniff` of directory ``p``."""
    if is_dcp(p):
        return "dcp"
    # HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True) leaves DCP's
    # per-rank shards in sharded/ and the consolidated Hugging Face files beside it: the latter
    # are the checkpoint (what from_pretrained reads), chosen alike by every command; sharded/
    # alone (consolidation off or not finished) is read through DCP.
    if index_files(p):
        return "safetensors-sharded"
    if (p / "sharded").is_dir() and is_dcp_hf(p / "sharded"):
        return "dcp-hf-sharded"
    if st_files(p):
        return "dcp-hf-sharded" if is_dcp_hf(p) else "safetensors-sharded"
    pickles = pickle_files(p)
    if len(pickles) == 1:
        return sniff_file(pickles[0])
    if pickles:  # never pick one silently: list them
        meta = all(META_SHARD.fullmatch(f.name) for f in pickles)
        why = ("Meta model-parallel shards: name one of them as the path, or join them with "
               "`migrate --recipe meta-llama-to-hf`" if meta else "several pickle files, name one of them as the path")  # fmt: skip
        raise AmbiguousSourceError(str(p), [f.name for f in pickles], why, "the path")
    raise CheckpointNotFoundError(str(p), "no .metadata, *.safetensors, index or single pickle file in it")


__all__ = ["sniff", "sniff_file", "meta_shards", "META_SHARD", "DCP_SHARDING_KEY"]
