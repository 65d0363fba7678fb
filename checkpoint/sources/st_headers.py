"""The headers of a safetensors source (one file, or shards with or without a ``*.index.json``):
keys, shapes, dtypes and which file holds each key, parsed and validated once, without torch.

:func:`scan_safetensors` is the walk over files, index and headers of ``fqnckpt inspect``
(:func:`open_safetensors_headers`: ``framework="numpy"`` and :class:`HeaderDType`, as ``import
torch`` costs seconds), with the checks of the source that reads data
(:mod:`checkpoint.sources.safetensors_files`, through ``CheckpointReader``): both give the same
keys, specs, files and notes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import (
    AmbiguousSourceError,
    CorruptCheckpointError,
    DuplicateTensorError,
    MissingShardError,
    TensorNotInShardError,
)
from ..storage import paths
from ..storage.st_header import ST_DTYPES, open_safetensors_with_header, torch_shape
from .base import Source, SourceSpec
from .sniffing import index_files, sniff_file, st_files


class HFIndex(BaseModel):
    """HF sharded-checkpoint index (``model.safetensors.index.json``): ``weight_map`` key -> file."""

    model_config = ConfigDict(extra="allow")

    metadata: dict[str, Any] = {}
    weight_map: dict[str, str]


class HeaderDType(NamedTuple):
    """A safetensors dtype under torch's name, without torch: ``str()`` is ``"torch.<name>"`` and
    ``itemsize`` the bytes per element, as for the ``torch.dtype`` it stands for."""

    name: str
    itemsize: int

    def __str__(self) -> str:
        return f"torch.{self.name}"


HEADER_DTYPES = {st: HeaderDType(name, size) for st, (name, size) in ST_DTYPES.items()}


def _open(path: Path, framework: str, header_digest: str | None = None):
    try:
        return open_safetensors_with_header(str(path), framework, header_digest=header_digest)
    except CorruptCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors / OS errors become ours, naming the file
        raise CorruptCheckpointError(str(path), f"not a valid safetensors file: {e}") from None


def _header(path: Path, dtypes: dict[str, Any], framework: str, header_digest: str | None = None) -> dict[str, SourceSpec]:
    """Specs of file ``path``'s tensors, from its header as safetensors validates it;
    ``header_digest``: the index's digest of the header bytes, checked
    (:func:`~checkpoint.storage.st_header.header_of_bytes`)."""
    _, head = _open(path, framework, header_digest)
    out = {}
    for k, v in head.items():
        if k == "__metadata__":
            continue
        st = v["dtype"]
        if st not in dtypes:  # the writer's own table: every dtype fqnckpt saves reads back
            raise CorruptCheckpointError(str(path), f"tensor {k!r} has dtype {st} torch cannot hold")
        try:
            shape = torch_shape(st, v["shape"])  # F4: two values per byte (st_header.PACKED)
        except ValueError as e:
            raise CorruptCheckpointError(str(path), f"tensor {k!r}: {e}") from None
        out[k] = SourceSpec(k, shape, dtypes[st])
    return out


@dataclass
class SafetensorsScan:
    """What :func:`scan_safetensors` found."""

    root: Path
    format: str
    files: list[str]
    specs: dict[str, SourceSpec]
    file_of: dict[str, str]
    notes: list[str] = field(default_factory=list)


def safetensors_layout(path: Path) -> tuple[str, Path, Path | None]:
    """``(format, root, index file or None)`` of the safetensors source at ``path``: one file
    (``"safetensors"``; its directory is the root), an index file, or a directory with its one
    ``*.index.json`` or none (``"safetensors-sharded"``). The one walk every safetensors source
    takes (reading, and ``fqnckpt inspect``'s headers).

    Raises:
        AmbiguousSourceError: several ``*.index.json`` files in the directory.
        CorruptCheckpointError, UnsupportedFormatError: a file that is no safetensors file or index
            (:func:`~.sniffing.sniff_file`).
    """
    if path.is_file() and sniff_file(path) == "safetensors":
        return "safetensors", path.parent, None
    root, index_file = (path.parent, path) if path.is_file() else (path, None)
    if index_file is None:
        idx = index_files(root)
        if len(idx) > 1:
            raise AmbiguousSourceError(str(root), [i.name for i in idx], "several index files")
        index_file = idx[0] if idx else None
    return "safetensors-sharded", root, index_file


def check_named_files(root: Path, files: list[str], index_file: Path) -> None:
    """Every file ``files`` the index ``index_file`` names is a file of ``root`` under the one
    symlink rule (:mod:`checkpoint.storage.paths`).

    Raises:
        UnsafePathError: a name is not a plain file name, or a symlink leads outside.
        MissingShardError: named files are missing (all of them listed).
    """
    missing = [f for f in files if not Path(paths.member(root, f)).is_file()]
    if missing:
        raise MissingShardError(str(root), missing, index_file.name)


def scan_safetensors(path: Path, dtypes: dict[str, Any], framework: str) -> SafetensorsScan:
    """Headers of one safetensors file, an index file, or a directory of shards; ``dtypes`` maps
    safetensors dtype names to the dtype objects of the specs.

    Raises:
        AmbiguousSourceError: several ``*.index.json`` files in the directory.
        CorruptCheckpointError: an invalid index or header (file named).
        MissingShardError: the index names files missing on disk.
        UnsafePathError: an index entry is not a plain file name, or a symlink leads outside.
        TensorNotInShardError: the index maps a tensor to a file whose header lacks it.
        DuplicateTensorError: without an index, one tensor in two files.
    """
    fmt, root, index_file = safetensors_layout(path)
    if fmt == "safetensors":
        specs = _header(path, dtypes, framework)
        return SafetensorsScan(path.parent, "safetensors", [path.name], specs, dict.fromkeys(specs, path.name))
    specs: dict[str, SourceSpec] = {}
    file_of: dict[str, str] = {}
    if index_file is not None:
        try:
            index = HFIndex.model_validate_json(index_file.read_bytes())
        except ValidationError as e:
            raise CorruptCheckpointError(str(index_file), f"invalid index: {e.errors()[0]['msg']}") from None
        files = sorted(set(index.weight_map.values()))
        check_named_files(root, files, index_file)
        recorded = _recorded_headers(index.metadata)  # each file's header digest, checked on open
        headers = {f: _header(root / f, dtypes, framework, recorded.get(f)) for f in files}
        for key, f in index.weight_map.items():
            if key not in headers[f]:
                found = next((g for g, h in headers.items() if key in h), None)
                raise TensorNotInShardError(key, f, found)
            specs[key], file_of[key] = headers[f][key], f
    else:  # shards without an index: every *.safetensors file, each key in exactly one
        files = [f.name for f in st_files(root)]
        for f in files:
            for key, s in _header(root / f, dtypes, framework).items():
                if key in file_of:
                    raise DuplicateTensorError(key, [file_of[key], f])
                specs[key], file_of[key] = s, f
    notes = [f"read the files named by {index_file.name} only"] if index_file is not None else []
    return SafetensorsScan(root, "safetensors-sharded", files, specs, file_of, notes)


def _fqnckpt_block(metadata: dict[str, Any]):
    """An fqnckpt index's own metadata block, parsed through its schema; None for other indexes
    (a block that does not parse is reported by ``verify``, which reads it with the checkpoint
    reader)."""
    from ..storage.format import FqnckptMeta

    block = metadata.get("fqnckpt") if isinstance(metadata, dict) else None
    if block is None:
        return None
    try:
        return FqnckptMeta.model_validate(block)
    except ValidationError:
        return None


def _recorded_headers(metadata: dict[str, Any]) -> dict[str, str]:
    """{file: xxh3-128 digest of its header bytes} of an fqnckpt index's ``metadata`` (format
    versions 2 and 3); {} for other indexes."""
    meta = _fqnckpt_block(metadata)
    if meta is None:
        return {}
    return {name: rec.header for name, rec in meta.files.items() if getattr(rec, "header", None) is not None}


def open_safetensors_headers(path: Path) -> Source:
    """A :class:`Source` over the headers of a safetensors checkpoint, without importing torch:
    keys, specs (dtypes as :class:`HeaderDType`), files and notes exactly as
    ``open_source(path)`` gives them; a source without a backend, whose reads raise
    ``TypeError``. Raises what :func:`scan_safetensors` raises."""
    s = scan_safetensors(path, HEADER_DTYPES, "numpy")
    src = Source(s.root if s.format != "safetensors" else path, s.format, s.files, s.specs, s.file_of, None)
    src.notes.extend(s.notes)
    return src


__all__ = ["HFIndex", "HeaderDType", "HEADER_DTYPES", "SafetensorsScan", "check_named_files", "safetensors_layout",
           "scan_safetensors", "open_safetensors_headers"]
