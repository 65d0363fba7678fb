"""Tensors and blocks of tensors read from a safetensors file with ``preadv`` into new tensors:
the one read of tensor bytes under :meth:`CheckpointReader.get` / ``get_slice`` and the
safetensors migration source (``migrate``, conversions, ``diff``, the CLI).

Why not ``safe_open(...).get_tensor`` / ``get_slice``: they copy from a memory mapping of the
file, and a file cut short or an I/O error while mapped kills the process with SIGBUS (nothing
in Python can catch it). ``preadv`` reports both as a short read or an ``OSError``, which become
:class:`CorruptCheckpointError` / :class:`LoadError` naming file and tensor
(:func:`~.pread.pread_run`). The byte ranges come from the header ``safe_open`` validated
(offsets inside the file, sizes matching shapes), so only the read itself can fail. Large reads
go through :func:`~.pread.read_runs` (pieces shared by the read pool, under the rules of
:mod:`~.ownership`).

Blocks (``tensor[slices]``, a rank's shard): the block's contiguous runs of the file are read
straight into the new tensor when each run is at least :data:`DIRECT_RUN` bytes; smaller runs
(e.g. a few columns of a wide matrix) are read as whole rows of the outer dimension, a window of
at most :data:`WINDOW` bytes at a time, and the block copied out of the window (one ``preadv`` per
window instead of one per tiny run). Targets that are not contiguous in the stored dtype (a
converting or strided load target: :func:`copy_into`) are filled the same way, window by window,
so no intermediate tensor of the whole size is made.

Cost (tests/bench/read_paths.py, 128 MiB in 8 tensors, 2 busy cores, load average 3-9): whole
``get`` 0.72x [0.21-0.90] of the former mapped ``get_tensor`` + ``copy_``; a converting load
(float32 -> float64) 0.5-0.95x: the mapped copy read the page cache once, here ``preadv`` copies
it into the window first (~30 ms per 128 MiB), the price of a named error instead of SIGBUS. The
load of same-dtype contiguous targets (``read_many``) never went through the mapping: unchanged.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch

from . import pread as _pread
from .writer import block_runs, tensor_bytes

DIRECT_RUN = 16 << 10  # bytes: block runs from this size on are read straight into the block
# Bytes read into the scratch window at a time (whole rows of a block of small runs; a converting
# or strided target). Large: each window costs a copy_ (an OpenMP region, ~ms on a busy machine).
WINDOW = 16 << 20


class Where:
    """An open file to read from: descriptor ``fd`` of file ``name`` under ``root`` (for errors)."""

    __slots__ = ("fd", "root", "name")

    def __init__(self, fd: int, root: str, name: str):
        self.fd, self.root, self.name = fd, root, name


_local = threading.local()


def _scratch(nbytes: int) -> torch.Tensor:
    """This thread's reused window buffer, at least ``nbytes`` (<= :data:`WINDOW`) bytes: fresh
    host memory costs a page fault per page on first touch, a reused window none."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _local.buf = torch.empty(max(nbytes, min(WINDOW, 1 << 20)), dtype=torch.uint8)
    return buf


def release_scratch() -> None:
    """Drop this thread's scratch window (a load ends: no 16 MiB kept between loads)."""
    _local.buf = None


def _read_as(at: Where, key: str, offset: int, out: torch.Tensor, dtype: torch.dtype) -> None:
    """Stored bytes (``dtype``, ``out``'s shape) at ``offset`` into ``out``, any CPU tensor of
    that shape: straight into it when it is contiguous in ``dtype``, else one window at a time
    through the scratch buffer and ``copy_`` (converting dtype, writing through strides)."""
    if not out.numel():
        return
    if out.dtype == dtype and out.is_contiguous() and not out.is_conj() and not out.is_neg() and out.is_cpu:
        _pread.read_runs([_pread.Run(at.fd, [tensor_bytes(out)], [key], offset, at.root, at.name, (out,))])
        return
    shape = tuple(out.shape)
    _rows(at, key, offset, shape if shape else (1,), dtype, [(0, n) for n in (shape if shape else (1,))],
          out if shape else out.view(1))  # fmt: skip


def read_tensor(at: Where, key: str, begin: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The whole tensor ``key`` (``shape``, ``dtype``; its bytes at absolute file offset ``begin``)
    as a new contiguous CPU tensor.

    Raises:
        CorruptCheckpointError: the file ends before the tensor does (file and tensor named).
        LoadError: the read fails (tensor and file named).
    """
    out = torch.empty(tuple(shape), dtype=dtype)
    _read_as(at, key, begin, out, dtype)
    return out


def copy_into(
    at: Where, key: str, begin: int, shape: Sequence[int], dtype: torch.dtype, out: torch.Tensor,
    slices: Sequence[slice] | None = None,
) -> None:
    """Tensor ``key`` (or its block ``tensor[slices]``, step-1 slices) into ``out``, any CPU
    tensor of that shape (another dtype, non-contiguous: ``copy_``'s rules), through a reused
    window: no intermediate tensor of the whole size. Raises what :func:`read_tensor` raises."""
    shape = tuple(shape)
    if not shape:
        _read_as(at, key, begin, out, dtype)
        return
    slices = tuple(slices or ()) + (slice(None),) * (len(shape) - len(slices or ()))
    bounds = []
    for s, n in zip(slices, shape):
        lo, hi, step = s.indices(n)
        if step != 1:
            raise ValueError(f"tensor {key!r}: copy_into takes step-1 slices, got step {step}")
        bounds.append((lo, max(lo, hi)))
    if tuple(out.shape) != tuple(hi - lo for lo, hi in bounds):
        raise ValueError(f"tensor {key!r}: block {tuple(hi - lo for lo, hi in bounds)} into a target of shape {tuple(out.shape)}")
    if out.numel():
        _rows(at, key, begin, shape, dtype, bounds, out)


def read_block(
    at: Where, key: str, begin: int, shape: Sequence[int], dtype: torch.dtype, slices: Sequence[slice]
) -> torch.Tensor:
    """Block ``tensor[slices]`` of tensor ``key`` (stored ``shape`` / ``dtype`` at ``begin``; one
    slice per leading dim, missing ones whole; any step) as a new contiguous CPU tensor, reading
    only the rows the block needs (see the module docstring). Raises what :func:`read_tensor` raises."""
    shape = tuple(shape)
    slices = tuple(slices) + (slice(None),) * (len(shape) - len(slices))
    if len(slices) != len(shape):
        raise IndexError(f"tensor {key!r} has {len(shape)} dims, got {len(slices)} slices")
    if not shape:
        return read_tensor(at, key, begin, shape, dtype)
    bounds, steps = [], []
    for s, n in zip(slices, shape):
        lo, hi, step = s.indices(n)
        if step < 1:
            raise ValueError(f"tensor {key!r}: slice step must be positive, got {step}")
        bounds.append((lo, max(lo, hi)))
        steps.append(step)
    if any(st != 1 for st in steps):  # the step-1 cover, then the stepped view of it
        cover = read_block(at, key, begin, shape, dtype, [slice(lo, hi) for lo, hi in bounds])
        return cover[tuple(slice(None, None, st) for st in steps)].contiguous()
    lens = tuple(hi - lo for lo, hi in bounds)
    out = torch.empty(lens, dtype=dtype)
    if out.numel() == 0:
        return out
    item = out.element_size()
    runs = list(block_runs(shape, lens, [lo for lo, _ in bounds])) if _few_runs(shape, lens, item) else None
    if runs is not None:
        view = tensor_bytes(out)
        _pread.read_runs(
            [
                _pread.Run(at.fd, [view[lo * item : (lo + n) * item]], [key], begin + g * item, at.root, at.name, (out,))
                for g, lo, n in runs
            ]
        )
        return out
    _rows(at, key, begin, shape, dtype, bounds, out)
    return out


def _few_runs(shape: tuple[int, ...], lens: tuple[int, ...], item: int) -> bool:
    """Whether the block's contiguous runs are at least :data:`DIRECT_RUN` bytes (or at most 16)."""
    k = len(shape) - 1
    while k > 0 and lens[k] == shape[k]:
        k -= 1
    run = lens[k] * math.prod(shape[k + 1 :]) * item
    return run >= DIRECT_RUN or math.prod(lens[:k]) <= 16


def _rows(
    at: Where, key: str, begin: int, shape: tuple[int, ...], dtype: torch.dtype, bounds: list[tuple[int, int]],
    out: torch.Tensor,
) -> None:
    """Fill ``out`` (the block ``bounds`` of a tensor of ``shape`` / ``dtype`` at ``begin``; any
    CPU tensor of the block's shape) from windows of whole rows of dim 0 read into the scratch
    buffer; a row over :data:`WINDOW` bytes is filled row by row of its own dim 0. A 1-D block is
    one contiguous range: read straight into ``out`` when it can be (:func:`_read_as`)."""
    item = dtype.itemsize
    lo, hi = bounds[0]
    if len(shape) == 1:
        n = (hi - lo) * item
        if out.dtype == dtype and out.is_contiguous() and not out.is_conj() and not out.is_neg() and out.is_cpu:
            _read_as(at, key, begin + lo * item, out, dtype)
            return
        per = max(1, WINDOW // item)
        for a in range(lo, hi, per):
            b = min(hi, a + per)
            window = _scratch((b - a) * item)[: (b - a) * item].view(dtype)
            _read_as(at, key, begin + a * item, window, dtype)
            out[a - lo : b - lo].copy_(window)
        return
    row = math.prod(shape[1:]) * item
    if row > WINDOW:
        for r in range(lo, hi):
            _rows(at, key, begin + r * row, shape[1:], dtype, bounds[1:], out[r - lo])
        return
    inner = tuple(slice(a, b) for a, b in bounds[1:])
    per = max(1, WINDOW // max(1, row))
    for r0 in range(lo, hi, per):
        r1 = min(hi, r0 + per)
        window = _scratch((r1 - r0) * row)[: (r1 - r0) * row].view(dtype).view(r1 - r0, *shape[1:])
        _read_as(at, key, begin + r0 * row, window, dtype)
        out[r0 - lo : r1 - lo].copy_(window[(slice(None), *inner)])
