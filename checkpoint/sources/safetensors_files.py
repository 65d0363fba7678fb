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
from safetensors import safe_open

from ..errors import CorruptCheckpointError
from ..storage.layout import ST_TO_DTYPE
from .base import Source
from .st_headers import HFIndex, scan_safetensors

DEFAULT_WINDOW = 16 << 20
# Bytes read through one handle per header byte before it is re-opened (re-parse <= 1/64 of reads).
_WINDOW_PER_HEADER_BYTE = 64


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


def open_safetensors_source(path: Path, window: int = DEFAULT_WINDOW) -> Source:
    """A :class:`Source` over one safetensors file, an index file, or a directory of shards.

    Raises what :func:`~checkpoint.sources.st_headers.scan_safetensors` raises (the one walk over
    index and headers, shared with ``fqnckpt inspect``'s torch-free path).
    """
    s = scan_safetensors(path, ST_TO_DTYPE, "pt")
    reader = _FileReader(s.root, s.file_of, s.handles, window)
    src = Source(path if s.format == "safetensors" else s.root, s.format, s.files, s.specs, s.file_of, reader)
    src.notes.extend(s.notes)
    return src


__all__ = ["HFIndex", "open_safetensors_source"]
