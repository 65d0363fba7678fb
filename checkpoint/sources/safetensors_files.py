"""safetensors as a migration :class:`~checkpoint.sources.base.Source`: one file, or shards with or
without a ``*.index.json`` (HF layout: ``{"metadata": ..., "weight_map": {key: file}}``).

Each file's header is parsed once (``safetensors.safe_open`` validates header and offsets, the
scan keeps each tensor's byte range): reading every tensor is linear in the tensor count. Tensor
bytes are read with ``preadv`` (:mod:`checkpoint.storage.tensor_read`), never copied from a
mapping: a file cut short while read is a named error, not a SIGBUS, and no mapped pages stay
resident (the window of the former mapped reads is gone with them; ``window`` is accepted and
unused).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..storage.layout import ST_TO_DTYPE
from ..storage.read_check import Whole, check_tensor_digest, check_whole
from ..storage.reader import block_slices, is_whole_block
from ..storage.tensor_read import Where, read_block, read_hashed, read_tensor
from .base import Source
from .st_headers import HFIndex, scan_safetensors

DEFAULT_WINDOW = 16 << 20


class _FileReader:
    """Per-key reads with ``preadv`` (:mod:`checkpoint.storage.tensor_read`) from one descriptor
    per file, at the byte ranges the scan took from the validated headers: a file cut short or an
    I/O error is a :class:`~checkpoint.errors.CorruptCheckpointError` / ``LoadError`` naming file
    and tensor (a copy from ``safe_open``'s mapping would die by SIGBUS)."""

    def __init__(self, root: Path, files: dict[str, str], handles: dict[str, Any], spans: dict[str, tuple[int, int]], specs,
                 digests: dict[str, str] | None = None, digest_chunk: int | None = None):  # fmt: skip
        self.root, self.files, self.spans, self.specs = root, files, spans, specs
        self.digests = digests or {}  # an fqnckpt index's: whole reads are checked, as load's are
        self.digest_chunk = digest_chunk
        self.checked: set[str] = set()  # tensors check_first found intact
        self.handles = handles  # file -> safe_open handle, opened while reading the headers
        self.fds = {f: os.open(root / f, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)) for f in handles}

    def _at(self, key: str) -> tuple[Where, int]:
        name = self.files[key]
        if name not in self.fds:
            raise ValueError(f"{self.root / name}: the source is closed")
        return Where(self.fds[name], str(self.root), name), self.spans[key][0]

    def check_first(self, keys) -> None:
        """Check tensors ``keys`` against the index's digests before anything is written
        (:func:`~checkpoint.storage.read_check.check_whole`); a tensor found intact is not hashed
        again by :meth:`get`. Raises what that raises."""
        todo = [k for k in dict.fromkeys(keys) if self.digests.get(k) is not None and k not in self.checked]
        wholes = []
        for k in todo:
            at, begin = self._at(k)
            wholes.append(Whole(k, at.fd, str(self.root / self.files[k]), begin, self.spans[k][1], self.digests[k]))
        check_whole(wholes, self.digest_chunk)
        self.checked.update(todo)

    def get(self, key: str) -> torch.Tensor:
        at, begin = self._at(key)
        spec = self.specs[key]
        want = self.digests.get(key)
        if want is None or key in self.checked:
            return read_tensor(at, key, begin, spec.shape, spec.dtype)
        # A migration must not copy flipped bytes into a checkpoint it digests anew: hashed as the
        # pieces land, on the read threads (no second pass), then checked.
        t, got = read_hashed(at, key, begin, spec.shape, spec.dtype, self.digest_chunk)
        check_tensor_digest(str(self.root / self.files[key]), key, got, want, self.digest_chunk)
        return t

    def get_slice(self, key: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """Only the bytes of ``tensor[slices]`` (:func:`~checkpoint.storage.tensor_read.read_block`);
        the whole tensor through :meth:`get` (checked)."""
        slices = block_slices(key, self.specs[key].shape, slices)
        if is_whole_block(self.specs[key].shape, slices):
            return self.get(key)
        at, begin = self._at(key)
        spec = self.specs[key]
        return read_block(at, key, begin, spec.shape, spec.dtype, slices)

    def close(self) -> None:
        self.handles.clear()
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def open_safetensors_source(path: Path, window: int = DEFAULT_WINDOW) -> Source:
    """A :class:`Source` over one safetensors file, an index file, or a directory of shards.

    Raises what :func:`~checkpoint.sources.st_headers.scan_safetensors` raises (the one walk over
    index and headers, shared with ``fqnckpt inspect``'s torch-free path).
    """
    s = scan_safetensors(path, ST_TO_DTYPE, "pt")
    reader = _FileReader(s.root, s.file_of, s.handles, s.spans, s.specs, s.digests, s.digest_chunk)
    src = Source(path if s.format == "safetensors" else s.root, s.format, s.files, s.specs, s.file_of, reader)
    src.notes.extend(s.notes)
    return src


__all__ = ["HFIndex", "open_safetensors_source"]
