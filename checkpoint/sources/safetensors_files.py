"""safetensors as a migration :class:`~checkpoint.sources.base.Source`: one file, or shards with or
without a ``*.index.json`` (HF layout: ``{"metadata": ..., "weight_map": {key: file}}``).

Each file's header is parsed once (``safetensors.safe_open`` validates header and offsets) and its
handle kept: reading every tensor is linear in the tensor count. Why the handle is re-opened
after a window of bytes: a mapped file's touched pages stay resident until unmapped; the window
grows with the header size so re-parsing stays a small fraction of the work.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors import safe_open

from ..errors import (
    AmbiguousSourceError,
    CorruptCheckpointError,
    DuplicateTensorError,
    MissingShardError,
    TensorNotInShardError,
)
from ..storage import paths
from ..storage.layout import ST_TO_DTYPE
from ..storage.reader import open_safetensors
from .base import Source, SourceSpec
from .sniffing import index_files, sniff_file, st_files

DEFAULT_WINDOW = 16 << 20
# Bytes read through one handle per header byte before it is re-opened (re-parse <= 1/64 of reads).
_WINDOW_PER_HEADER_BYTE = 64


class HFIndex(BaseModel):
    """HF sharded-checkpoint index (``model.safetensors.index.json``): ``weight_map`` key -> file."""

    model_config = ConfigDict(extra="allow")

    metadata: dict[str, Any] = {}
    weight_map: dict[str, str]


def _st_dtype(name: str, path: Path, key: str) -> torch.dtype:
    # The writer's own table, so every dtype fqnckpt saves (C64, FNUZ float8s too) reads back.
    try:
        return ST_TO_DTYPE[name]
    except KeyError:
        raise CorruptCheckpointError(
            str(path), f"tensor {key!r} has dtype {name} torch cannot hold"
        ) from None


def _open(path: Path):
    try:
        return open_safetensors(str(path))
    except CorruptCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors / OS errors become ours, naming the file
        raise CorruptCheckpointError(str(path), f"not a valid safetensors file: {e}") from None


def _header_len(path: Path) -> int:
    with open(path, "rb") as f:
        return int.from_bytes(f.read(8), "little")


class _FileReader:
    """Per-key reads through one open ``safe_open`` handle per file (one header parse per file).

    A re-open (after the window) goes through ``/proc/self/fd/<fd>`` of a descriptor held since
    the header was read, so it maps the same file even if the path was replaced meanwhile (a
    concurrent ``save(overwrite=True)``), and skips the duplicate-name check already done."""

    def __init__(self, root: Path, files: dict[str, str], handles: dict[str, Any], window: int):
        self.root, self.files, self.window = root, files, window
        self.handles = handles  # file -> handle, opened while reading the headers
        self.fds = {f: os.open(root / f, os.O_RDONLY) for f in handles}
        self.touched: dict[str, int] = {}
        self.limit = {f: max(window, _WINDOW_PER_HEADER_BYTE * _header_len(root / f)) for f in handles}

    def _reopen(self, name: str) -> Any:
        proc = f"/proc/self/fd/{self.fds[name]}"
        path = proc if os.path.exists(proc) else str(self.root / name)
        try:
            return safe_open(path, framework="pt")
        except Exception as e:  # noqa: BLE001 - validated before; a changed file is named
            raise CorruptCheckpointError(str(self.root / name), f"cannot re-open: {e}") from None

    def _handle(self, key: str) -> tuple[str, Any]:
        name = self.files[key]
        h = self.handles.get(name)
        if h is None or self.touched.get(name, 0) > self.limit[name]:
            self.handles[name] = None  # drop the old mapping before mapping again
            h = self.handles[name] = self._reopen(name)
            self.touched[name] = 0
        return name, h

    def get(self, key: str) -> torch.Tensor:
        name, h = self._handle(key)
        t = h.get_tensor(key).contiguous()
        self.touched[name] = self.touched.get(name, 0) + t.nbytes
        return t

    def get_slice(self, key: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """Only the bytes of ``tensor[slices]`` (safetensors' ``get_slice``)."""
        name, h = self._handle(key)
        t = h.get_slice(key)[slices].contiguous() if slices else h.get_tensor(key).contiguous()
        self.touched[name] = self.touched.get(name, 0) + t.nbytes
        return t

    def close(self) -> None:
        self.handles.clear()  # safe_open handles release their mapping when dropped
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def _header(path: Path) -> tuple[dict[str, SourceSpec], Any]:
    h = _open(path)
    out = {}
    for k in h.keys():
        sl = h.get_slice(k)
        out[k] = SourceSpec(k, tuple(sl.get_shape()), _st_dtype(sl.get_dtype(), path, k))
    return out, h


def open_safetensors_source(path: Path, window: int = DEFAULT_WINDOW) -> Source:
    """A :class:`Source` over one safetensors file, an index file, or a directory of shards.

    Raises:
        AmbiguousSourceError: several ``*.index.json`` files in the directory.
        CorruptCheckpointError: an invalid index or header (file named).
        MissingShardError: the index names files missing on disk.
        UnsafePathError: an index entry is not a plain file name, or a symlink leads outside.
        TensorNotInShardError: the index maps a tensor to a file whose header lacks it.
        DuplicateTensorError: without an index, one tensor in two files.
    """
    if path.is_file() and sniff_file(path) == "safetensors":
        specs, h = _header(path)
        files = dict.fromkeys(specs, path.name)
        return Source(path, "safetensors", [path.name], specs, files,
                      _FileReader(path.parent, files, {path.name: h}, window))  # fmt: skip
    root, index_file = (path.parent, path) if path.is_file() else (path, None)
    if index_file is None:
        idx = index_files(root)
        if len(idx) > 1:
            raise AmbiguousSourceError(str(root), [i.name for i in idx], "several index files")
        index_file = idx[0] if idx else None
    specs: dict[str, SourceSpec] = {}
    file_of: dict[str, str] = {}
    handles: dict[str, Any] = {}
    if index_file is not None:
        try:
            index = HFIndex.model_validate_json(index_file.read_bytes())
        except ValidationError as e:
            raise CorruptCheckpointError(str(index_file), f"invalid index: {e.errors()[0]['msg']}") from None
        files = sorted(set(index.weight_map.values()))
        missing = [f for f in files if not Path(paths.member(root, f)).is_file()]
        if missing:
            raise MissingShardError(str(root), missing, index_file.name)
        headers = {}
        for f in files:
            headers[f], handles[f] = _header(root / f)
        for key, f in index.weight_map.items():
            if key not in headers[f]:
                found = next((g for g, h in headers.items() if key in h), None)
                raise TensorNotInShardError(key, f, found)
            specs[key], file_of[key] = headers[f][key], f
    else:  # shards without an index: every *.safetensors file, each key in exactly one
        files = [f.name for f in st_files(root)]
        for f in files:
            header, handles[f] = _header(root / f)
            for key, s in header.items():
                if key in file_of:
                    raise DuplicateTensorError(key, [file_of[key], f])
                specs[key], file_of[key] = s, f
    src = Source(
        root, "safetensors-sharded", files, specs, file_of, _FileReader(root, file_of, handles, window)
    )
    if index_file is not None:
        src.notes.append(f"read the files named by {index_file.name} only")
    return src


__all__ = ["HFIndex", "open_safetensors_source"]
