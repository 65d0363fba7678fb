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

Blocks (``tensor[slices]``, a rank's ``Shard(1)`` columns, a narrow column block): the block's
contiguous runs are read straight into the target (a new tensor, or a load target contiguous in
the stored dtype) by one ``preadv`` per segment of the file, the holes between runs (up to
:data:`GAP` bytes) read into a small junk buffer by the same call: no copy pass, no per-row
syscall (a call costs about what the kernel needs to copy tens of KiB). The
iovec arrays are built by numpy and passed to libc's ``preadv`` through ctypes (``os.preadv``
wants one Python buffer object per iovec). Blocks of many short runs (:data:`SHORT_RUN`: a
``Shard(1)`` block of rows of a few KiB) into a same-dtype target are read a window of whole
dim-0 rows at a time by one ``pread`` into a reused scratch buffer and the block copied out of it (:func:`_rows`: ``np.copyto`` into a same-dtype
target, 1 MiB windows that stay in cache between the read and the copy; else ``copy_``).
Targets not contiguous in the stored dtype (a converting or strided load target:
:func:`copy_into`) are filled in pieces of :data:`CHUNK` bytes (whole rows, or the block's runs
packed), each read into a thread's scratch and copied out by ``copy_`` on the same thread while
the bytes are in its core's cache, the pieces shared by the calling thread and the read pool with
each thread's ``copy_`` on that thread alone (:func:`_run_pieces`, :func:`_serial_copies`): the
read of one piece overlaps the conversion of another. No intermediate tensor of the whole size.
Digests are not taken here: a read into a caller's tensor is checked before it starts
(:mod:`~.read_check`), a read into a new tensor as it lands (:func:`read_hashed`).
This is the package's one column-block read: ``get_slice``,
``copy_into`` (``checkpoint.load`` of DTensor blocks, ``dcp.load``'s ``Shard(1)`` blocks,
migrations). One ``pread`` per run (skipping the holes) costs microseconds of Python and
syscall per run, more than reading a short hole, so holes up to :data:`GAP` are read, not skipped.

Inside a load whose file is mapped under a read lease (:mod:`~.leased`), a block is one
``copy_`` of the mapped tensor's block into the target (:func:`_mapped_fill`: strides and dtype
conversion by torch, in pieces of whole rows with the lease checked before each). Without one,
the paths that need a second pass over the bytes (a converting or strided target, a whole
``get`` into a new tensor) pay one more copy than a mapping: ``preadv`` copies every byte from
the page cache once, the price of a named error instead of SIGBUS (an unleased mapping cannot
report a file cut short or an I/O error any other way: see :mod:`~.pread`). Pieces
of :data:`CHUNK` bytes read and converted on one thread each keep that second pass in the core's
cache, and beat one thread reading and an OpenMP team converting on a busy machine (the team
waits for its slowest thread). A new tensor's first touch (a page fault per 4 KiB page) is paid by
each piece's reader in one call (:func:`~.pread.populate`; see :func:`_fresh`). The load of
same-dtype contiguous targets (``read_many``) reads straight into them. ``tests/bench/read_paths.py``
and ``tests/bench/converting_load.py`` measure these paths.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import math
import os
import threading
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import CorruptCheckpointError, LoadError
from . import leased, ownership
from . import pread as _pread
from .libc import libc_function
from .writer import tensor_bytes

# Bytes of a hole between two runs of a block read into a junk buffer by the same ``preadv``
# (one call instead of two): a call costs about what the kernel needs to copy a few KiB.
GAP = 64 << 10
# A block of runs shorter than this (over 64 of them, holes of at most GAP) is read as whole rows
# through the window (:func:`_rows`) instead of one iovec per run and hole: for runs this short
# the iovecs cost more than reading the holes (tests/bench/read_paths.py compares the two).
SHORT_RUN = 1 << 10
# Largest scratch window of whole rows (_rows; a longer row is read row by row of its own dim 0).
WINDOW = 16 << 20
# Bytes of one piece of a converting or strided read (:func:`_run_pieces`): read into the thread's
# scratch and copied into the target by the same thread while the bytes are still in its core's
# cache: under 1 MiB the per-piece calls dominate, at 4 MiB the piece leaves the cache.
CHUNK = 2 << 20
# Bytes of whole rows per read when the block is copied out by numpy (:func:`_rows`, a same-dtype
# target): smaller windows pay Python per window, larger ones leave the core's cache before the
# copy reads them back.
ROWS_WINDOW = 1 << 20

_JUNK = np.empty(GAP, dtype=np.uint8)  # holes land here (kernel writes only; never read)
_JUNK_ADDR = _JUNK.ctypes.data
_JUNK_VIEW = memoryview(_JUNK)


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


def _direct(out: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the stored bytes can be read straight into ``out`` (contiguous, same dtype, CPU)."""
    return out.dtype == dtype and out.is_cpu and out.is_contiguous() and not out.is_conj() and not out.is_neg()


def _read_as(at: Where, key: str, offset: int, out: torch.Tensor, dtype: torch.dtype, fresh: bool = False) -> None:
    """Stored bytes (``dtype``, ``out``'s shape) at ``offset`` into ``out``, any CPU tensor of
    that shape: straight into it when it is contiguous in ``dtype``, else one window at a time
    through the scratch buffer and ``copy_`` (converting dtype, writing through strides).
    ``fresh``: ``out`` is new memory (its pages faulted in by each piece's reader first)."""
    if not out.numel():
        return
    if _direct(out, dtype):
        _pread.read_runs([_pread.Run(at.fd, [tensor_bytes(out)], [key], offset, at.root, at.name, (out,), fresh=fresh)])
        return
    shape = tuple(out.shape) or (1,)
    _fill(at, key, offset, shape, dtype, [(0, n) for n in shape], out if out.dim() else out.view(1))


def _preadv():
    """libc's ``preadv`` through ctypes (False off Linux): one call over an iovec array built by
    numpy, where ``os.preadv`` wants one Python buffer object per iovec (~1 us each in Python)."""
    import ctypes

    return libc_function("preadv", (ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64), ctypes.c_ssize_t)


class _IovRun:
    """Reads of a block's runs into ``iov`` (``uint64`` rows of ``(address, length)``: the runs in
    ``owner``'s memory, short holes between them in the junk buffer), one ``preadv`` per segment
    ``(file offset, first row, end row, bytes)`` of consecutive file bytes, with the interface
    :func:`~.pread.read_runs` uses (``fd``, ``offset``, ``nbytes``, ``read``; no ``views`` to cut).
    ``owner`` keeps the memory the addresses point into alive while the run exists (rule 3 of
    :mod:`~.ownership`)."""

    __slots__ = ("fd", "offset", "iov", "segs", "nbytes", "key", "path", "owner", "views")

    def __init__(self, at: Where, key: str, iov: np.ndarray, segs: list[tuple[int, int, int, int]], owner):
        self.fd, self.iov, self.segs, self.key, self.owner = at.fd, iov, segs, key, owner
        self.offset = segs[0][0]
        self.nbytes = sum(s[3] for s in segs)
        self.path = os.path.join(at.root, at.name)
        self.views = ()

    def read(self) -> int:
        """Fill every iovec (``IOV_MAX`` per call, a short read resumed where it stopped);
        returns the bytes read. Raises what :func:`~.pread.pread_run` raises."""
        fn, iov, addr, step = _preadv(), self.iov, self.iov.ctypes.data, self.iov.strides[0]
        for pos, r0, r1, nb in self.segs:
            if r1 - r0 <= _pread.IOV_MAX and fn(self.fd, addr + r0 * step, r1 - r0, pos) == nb:
                continue  # the usual case: one call, every byte
            self._slow(fn, iov[r0:r1].copy(), pos)
        return self.nbytes

    def _slow(self, fn, iov: np.ndarray, pos: int) -> None:
        """One segment from scratch on its own copy of the iovecs: ``IOV_MAX`` per call, short
        reads resumed, errors named (file ends early: CorruptCheckpointError; else LoadError)."""
        import ctypes

        i = 0
        while i < len(iov):
            cnt = min(_pread.IOV_MAX, len(iov) - i)
            n = fn(self.fd, iov.ctypes.data + i * iov.strides[0], cnt, pos)
            if n < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                e = OSError(err, os.strerror(err))
                raise LoadError(self.key, self.path, f"{type(e).__name__}: {e}") from e
            if n == 0:
                raise CorruptCheckpointError(self.path, f"tensor {self.key!r}: file ends early")
            pos += n
            cum = np.cumsum(iov[i : i + cnt, 1])
            j = int(np.searchsorted(cum, n, side="right"))  # iovecs filled whole
            rest = n - (int(cum[j - 1]) if j else 0)
            i += j
            if rest:  # a short read inside one iovec: the rest of it next
                iov[i, 0] += rest
                iov[i, 1] -= rest


def _run_starts(shape: Sequence[int], lens: Sequence[int], lo: Sequence[int]) -> tuple[int, np.ndarray]:
    """The contiguous runs of block ``lens`` at ``lo`` in a row-major tensor of ``shape``: (run
    length in elements, file element offset of each run in row-major order of the block); the
    trailing dims the block spans whole join each run (as :func:`~.writer.block_runs`)."""
    nd = len(shape)
    k = nd - 1
    while k > 0 and lens[k] == shape[k]:
        k -= 1
    gstride = [math.prod(shape[d + 1 :]) for d in range(nd)]
    run = lens[k] * gstride[k]
    base = sum(lo[d] * gstride[d] for d in range(k + 1))
    starts = np.full(1, base, dtype=np.int64)
    for d in range(k - 1, -1, -1):  # outer dims, innermost first: broadcast sums stay row-major
        starts = (np.arange(lens[d], dtype=np.int64) * gstride[d])[:, None] + starts[None, :]
        starts = starts.reshape(-1)
    return run, starts


def _scatter(at: Where, key: str, begin: int, item: int, run: int, starts: np.ndarray, out: torch.Tensor) -> None:
    """The runs (``run`` elements at file element offsets ``starts``, file order) of a block into
    consecutive runs of ``out`` (contiguous, the stored dtype). Runs whose hole is at most
    :data:`GAP` bytes share one ``preadv`` (the hole read into a junk buffer); each read covers at
    most :data:`~.pread.PIECE` bytes of the file, so the read pool shares them
    (:func:`~.pread.read_runs`, under the rules of :mod:`~.ownership`)."""
    rb, gap = run * item, min(GAP, len(_JUNK))
    off = begin + starts * item
    if len(off) == 1:  # one range: pread's pieces share it
        _pread.read_runs([_pread.Run(at.fd, [tensor_bytes(out)], [key], int(off[0]), at.root, at.name, (out,))])
        return
    holes = off[1:] - off[:-1] - rb
    long = np.concatenate(([True], holes > gap))  # a new read after each long hole ...
    first = off[np.flatnonzero(long)][np.cumsum(long) - 1]
    piece = (off - first) // _pread.PIECE  # ... every PIECE bytes of the file ...
    cut = long | np.concatenate(([False], piece[1:] != piece[:-1]))
    cut[:: _pread.IOV_MAX // 2] = True  # ... and within IOV_MAX iovecs
    cuts = np.concatenate((np.flatnonzero(cut), [len(off)]))
    if _preadv():
        iov = np.empty((2 * len(off) - 1, 2), dtype=np.uint64)
        iov[0::2, 0] = out.data_ptr() + np.arange(len(off), dtype=np.uint64) * rb
        iov[0::2, 1] = rb
        iov[1::2, 0] = _JUNK_ADDR
        iov[1::2, 1] = holes  # read only inside a segment: there at most GAP
        owner, jobs, segs, size = (out, _JUNK), [], [], 0
        ends = (off[cuts[1:] - 1] + rb - off[cuts[:-1]]).tolist()
        for a, b, first, nb in zip(cuts[:-1].tolist(), cuts[1:].tolist(), off[cuts[:-1]].tolist(), ends):
            segs.append((first, 2 * a, 2 * b - 1, nb))
            size += nb
            if size >= _pread.PIECE:  # a job of the read pool
                jobs.append(_IovRun(at, key, iov, segs, owner))
                segs, size = [], 0
        if segs:
            jobs.append(_IovRun(at, key, iov, segs, owner))
    else:  # no ctypes preadv: a memoryview per run and hole
        view, jobs = tensor_bytes(out), []
        for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
            views: list[memoryview] = []
            for i in range(a, b):
                if i > a and holes[i - 1]:
                    views.append(_JUNK_VIEW[: int(holes[i - 1])])
                views.append(view[i * rb : (i + 1) * rb])
            jobs.append(_pread.Run(at.fd, views, [key] * len(views), int(off[a]), at.root, at.name, (out,)))
    _pread.read_runs(jobs)


def _dense(shape: Sequence[int], lens: Sequence[int], item: int) -> bool:
    """Whether a block is many short runs (under :data:`SHORT_RUN` bytes, more than 64 of them)
    with holes of at most :data:`GAP` between them: then whole dim-0 rows are read through the
    window (:func:`_rows`) and the block copied out of it, where one iovec per run and hole would
    cost more in the kernel than the second copy (see :data:`SHORT_RUN`)."""
    k = len(shape) - 1
    while k > 0 and lens[k] == shape[k]:
        k -= 1
    if k == 0 or math.prod(lens[:k]) <= 64:
        return False
    inner = math.prod(shape[k + 1 :]) * item
    run, stretch = lens[k] * inner, shape[k] * inner
    return run < SHORT_RUN and stretch - run <= GAP


def _pread_into(at: Where, key: str, addr: int, nbytes: int, pos: int, view: memoryview | None) -> None:
    """``nbytes`` file bytes at ``pos`` into memory at ``addr`` (``view``: the same bytes as a
    buffer, for ``os.preadv`` off Linux): libc ``pread`` through ctypes, no Python object per
    call; a short read resumed where it stopped. Raises :class:`CorruptCheckpointError` (file
    ends early) or :class:`LoadError` (the read fails), naming file and tensor."""
    fn = _pread_fn()
    done = 0
    while done < nbytes:
        if fn:
            n = fn(at.fd, addr + done, nbytes - done, pos + done)
            err = 0
            if n < 0:
                import ctypes

                err = ctypes.get_errno()
        else:
            try:
                n, err = os.preadv(at.fd, [view[done:nbytes]], pos + done), 0
            except OSError as e:
                n, err = -1, e.errno or errno.EIO
        if n < 0:
            if err == errno.EINTR:
                continue
            e = OSError(err, os.strerror(err))
            raise LoadError(key, os.path.join(at.root, at.name), f"{type(e).__name__}: {e}") from e
        if n == 0:
            raise CorruptCheckpointError(os.path.join(at.root, at.name), f"tensor {key!r}: file ends early")
        done += n


def _pread_fn():
    """libc's ``pread`` through ctypes (False off Linux)."""
    import ctypes

    return libc_function("pread", (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64), ctypes.c_ssize_t)


def _rows(
    at: Where, key: str, begin: int, shape: tuple[int, ...], dtype: torch.dtype, bounds: list[tuple[int, int]],
    out: torch.Tensor,
) -> None:
    """Block ``bounds`` of the tensor (``shape`` / ``dtype`` at ``begin``, at least 2 dims, a
    dim-0 row of at most :data:`WINDOW` bytes) into ``out`` through whole dim-0 rows: one
    ``pread`` of a window of rows into this thread's scratch buffer, then the block's part of it
    copied out: by ``np.copyto`` on byte views when ``out`` is contiguous in ``dtype``
    (single-threaded, no OpenMP region per window; windows of :data:`ROWS_WINDOW` bytes, which
    stay in the core's cache between the read and the copy), else by ``copy_`` (dtype
    conversion, strides; windows of :data:`WINDOW` bytes)."""
    item = dtype.itemsize
    row = math.prod(shape[1:]) * item
    lo, hi = bounds[0]
    direct = _direct(out, dtype)
    per = max(1, (ROWS_WINDOW if direct else WINDOW) // row)
    buf = _scratch(min(hi - lo, per) * row)
    raw = buf.numpy()
    addr = buf.data_ptr()
    view = memoryview(raw) if not _pread_fn() else None
    if direct:  # byte views: any dtype (bf16, fp8, complex, bool); the last dim counted in bytes
        lens = [b - a for a, b in bounds]
        dst = out.view(torch.uint8).numpy().reshape(*lens[:-1], lens[-1] * item)
        inner = tuple(slice(a, b) for a, b in bounds[1:-1]) + (slice(bounds[-1][0] * item, bounds[-1][1] * item),)
        tail = (*shape[1:-1], shape[-1] * item)
    else:
        inner = tuple(slice(a, b) for a, b in bounds[1:])
    for r0 in range(lo, hi, per):
        r1 = min(hi, r0 + per)
        nb = (r1 - r0) * row
        _pread_into(at, key, addr, nb, begin + r0 * row, view)
        if direct:
            np.copyto(dst[r0 - lo : r1 - lo], raw[:nb].reshape(r1 - r0, *tail)[(slice(None), *inner)])
        else:
            window = buf[:nb].view(dtype).view(r1 - r0, *shape[1:])
            out[r0 - lo : r1 - lo].copy_(window[(slice(None), *inner)])


def _fill(
    at: Where, key: str, begin: int, shape: tuple[int, ...], dtype: torch.dtype, bounds: list[tuple[int, int]],
    out: torch.Tensor,
) -> None:
    """Fill ``out`` (any CPU tensor of the block's shape) with the block ``bounds`` (one
    ``(lo, hi)`` per dim) of the tensor of ``shape`` / ``dtype`` stored at ``begin``: the one
    column-block read of the package (``get_slice``, ``copy_into``, ``dcp.load``'s ``Shard(1)``
    blocks, migrations).

    Straight into ``out`` when it is contiguous in ``dtype`` and the block's runs are long
    (:func:`_scatter`: no second copy); a converting or strided target in pieces of :data:`CHUNK`
    bytes, each read into a thread's scratch and copied out by that thread, shared by the calling
    thread and the read pool (:func:`_plan`, :func:`_run_pieces`); for many short runs into a
    same-dtype target (:func:`_dense`), through whole dim-0 rows (:func:`_rows`), a row over
    :data:`WINDOW` bytes row by row of its own dim 0."""
    if not out.numel():
        return
    if _mapped_fill(at, key, begin, shape, dtype, bounds, out):
        return
    item = dtype.itemsize
    lens = tuple(hi - lo for lo, hi in bounds)
    starts = [lo for lo, _ in bounds]
    dense = _dense(shape, lens, item)
    if not dense and _direct(out, dtype):
        _scatter(at, key, begin, item, *_run_starts(shape, lens, starts), out)
        return
    if not _direct(out, dtype):  # converting / strided: pieces shared by threads
        jobs: list = []
        _plan(at, key, begin, shape, dtype, bounds, out, dense, min(WINDOW, CHUNK), jobs)
        _run_pieces(at, key, dtype, jobs)
        return
    # Left: many short runs into a same-dtype target (a 1-D block is one run: never dense).
    lo, hi = bounds[0]
    row = math.prod(shape[1:]) * item
    if row > WINDOW:
        for r in range(lo, hi):
            _fill(at, key, begin + r * row, shape[1:], dtype, bounds[1:], out[r - lo])
    else:
        _rows(at, key, begin, shape, dtype, bounds, out)


def _mapped_fill(
    at: Where, key: str, begin: int, shape: tuple[int, ...], dtype: torch.dtype, bounds: list[tuple[int, int]], out: torch.Tensor
) -> bool:
    """:func:`_fill` from the file's leased mapping (:mod:`~.leased`), when the load holds one:
    ``copy_`` of the block's view of the mapped tensor into ``out`` (strides and dtype
    conversion by torch, one copy), in pieces of whole dim-0 rows of about :data:`CHUNK` stored
    bytes, the lease checked before each; the rows left when it breaks go through :func:`_fill`'s
    ``preadv`` paths. False (nothing read) without a mapping."""
    m = leased.mapping(at.fd)
    if m is None or not m.intact():
        return False
    item = dtype.itemsize
    row = math.prod(shape[1:]) * item
    src = m.tensor(begin, math.prod(shape) * item)
    if src is None:
        return False  # past the end of the file: the preadv paths name it
    try:
        src = src.view(dtype).view(shape)
        inner = tuple(slice(a, b) for a, b in bounds[1:])
        lo, hi = bounds[0]
        per = max(1, CHUNK // max(1, row))
        for r0 in range(lo, hi, per):
            r1 = min(hi, r0 + per)
            if r0 > lo and not m.intact():
                rest = out[r0 - lo :]
                _fill(at, key, begin, shape, dtype, [(r0, hi), *bounds[1:]], rest)
                return True
            out[r0 - lo : r1 - lo].copy_(src[(slice(r0, r1), *inner)])
    finally:
        del src  # (over the mapping: never kept past the span)
    return True


class _Span:
    """A piece of a converting or strided read: ``nbytes`` consecutive file bytes at ``offset``,
    seen as ``shape`` in the stored dtype (``pick`` then selects the block's part of them, or
    None), copied into ``out``. Everything but the read and the copy is computed before the
    threads start: on a busy machine each GIL hand-over between them costs a wake-up."""

    __slots__ = ("offset", "nbytes", "shape", "pick", "out")

    def __init__(self, offset: int, nbytes: int, shape: tuple[int, ...], pick, out: torch.Tensor):
        self.offset, self.nbytes, self.shape, self.pick, self.out = offset, nbytes, shape, pick, out


def _plan(
    at: Where, key: str, begin: int, shape: tuple[int, ...], dtype: torch.dtype, bounds: list[tuple[int, int]],
    out: torch.Tensor, dense: bool, size: int, jobs: list,
) -> None:
    """Append to ``jobs`` one piece per ``size`` bytes of window (whole dim-0 rows; a row over
    ``size`` bytes split along its own dims): a :class:`_Span` when the piece is one range of the
    file, else a callable reading the block's runs of its rows (see :func:`_fill`)."""
    item = dtype.itemsize
    lo, hi = bounds[0]
    if len(shape) == 1:
        per = max(1, size // item)
        for a in range(lo, hi, per):
            b = min(hi, a + per)
            jobs.append(_Span(begin + a * item, (b - a) * item, (b - a,), None, out[a - lo : b - lo]))
        return
    lens = tuple(b - a for a, b in bounds[1:])
    row = math.prod(shape[1:]) * item
    wrow = row if dense else math.prod(lens) * item  # bytes per dim-0 row in the window
    if wrow > size:
        sub_dense = _dense(shape[1:], lens, item)
        for r in range(lo, hi):
            sub = out[r - lo]
            if not sub_dense and _direct(sub, dtype):  # a row of a target strided in dim 0 only
                jobs.append(functools.partial(_fill, at, key, begin + r * row, shape[1:], dtype, bounds[1:], sub))
            else:
                _plan(at, key, begin + r * row, shape[1:], dtype, bounds[1:], sub, sub_dense, size, jobs)
        return
    whole = lens == tuple(shape[1:])  # whole rows: one range of the file per piece
    pick = None if whole or not dense else (slice(None), *(slice(a, b) for a, b in bounds[1:]))
    per = max(1, size // max(1, wrow))
    for r0 in range(lo, hi, per):
        r1 = min(hi, r0 + per)
        part = out[r0 - lo : r1 - lo]
        if whole or dense:
            jobs.append(_Span(begin + r0 * row, (r1 - r0) * row, (r1 - r0, *shape[1:]), pick, part))
        else:
            jobs.append(functools.partial(_piece_rows, at, key, begin, shape, dtype, bounds, r0, r1, wrow, part))


def _piece_rows(at, key, begin, shape, dtype, bounds, r0, r1, wrow, out) -> None:
    """Only the block's runs of rows ``r0:r1``, packed into the window, then into ``out``."""
    window = _scratch((r1 - r0) * wrow)[: (r1 - r0) * wrow].view(dtype).view(r1 - r0, *(b - a for a, b in bounds[1:]))
    starts = (r0, *(a for a, _ in bounds[1:]))
    _scatter(at, key, begin, dtype.itemsize, *_run_starts(shape, window.shape, starts), window)
    out.copy_(window)


def _run_pieces(at: Where, key: str, dtype: torch.dtype, jobs: list) -> None:
    """Run every piece of :func:`_plan`. Two or more: shared by the calling thread and pool
    threads, each taking the next piece (read and copy on one thread: the copy reads the bytes
    from that core's cache), with ``copy_`` on one thread each (:func:`_serial_copies`; an
    OpenMP team per copy would put 2 threads per core on the cores the readers use). Every
    thread has stopped before this returns or raises, Ctrl-C included (:mod:`~.ownership`)."""

    def one(job, windows: dict) -> None:
        if type(job) is not _Span:
            job()
            return
        got = windows.get((job.nbytes, job.shape))
        if got is None:
            buf = _scratch(job.nbytes)[: job.nbytes]
            win = buf.view(dtype).view(job.shape)
            got = windows[job.nbytes, job.shape] = (memoryview(buf.numpy()), win if job.pick is None else win[job.pick])
        _pread.pread_run(at.fd, [got[0]], [key], job.offset, at.root, at.name)
        job.out.copy_(got[1])

    if len(jobs) < 2 or _pread._THREADS == 1 or _omp() is None:
        windows: dict = {}
        for job in jobs:
            one(job, windows)
        return
    counter = itertools.count()  # next() on a count is atomic under the GIL: one queue, no lock
    errors: list[BaseException] = []

    def work(stop) -> None:
        windows: dict = {}  # this thread's views of its scratch
        with _serial_copies():
            while not errors and not stop.is_set():
                j = next(counter)
                if j >= len(jobs):
                    return
                try:
                    one(jobs[j], windows)
                except BaseException as e:  # noqa: BLE001 - re-raised below, after every thread stopped
                    errors.append(e)

    ownership.share("read", _pread._THREADS, work, min(_pread._THREADS, len(jobs)) - 1)
    if errors:
        raise errors[0]


def _omp():
    """``(omp_get_max_threads, omp_set_num_threads)`` of the OpenMP runtime torch's CPU kernels
    run on (found among the loaded libraries), or None (another parallel backend, none found):
    then pieces run one after another on the calling thread."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        import ctypes

        with open("/proc/self/maps") as f:
            libs = {ln.split()[-1] for ln in f if ln.rstrip().endswith((".so", ".so.1", ".so.5"))}
        for path in sorted(libs):
            if os.path.basename(path).startswith(("libgomp", "libomp", "libiomp")):
                lib = ctypes.CDLL(path)  # already loaded: the same handle
                get, put = lib.omp_get_max_threads, lib.omp_set_num_threads
                get.restype, put.argtypes = ctypes.c_int, [ctypes.c_int]
                return get, put
    except (OSError, AttributeError):
        pass
    return None


@contextlib.contextmanager
def _serial_copies():
    """While inside: torch's CPU kernels called from this thread run on this thread alone.
    OpenMP's thread count is a per-thread setting (the ``nthreads-var`` ICV of the calling
    thread's task), so other threads, and torch's own count, are untouched; restored on exit."""
    get, put = _omp()
    torch.get_num_threads()  # torch's first call on a thread sets the count: before ours
    prev = get()
    put(1)
    try:
        yield
    finally:
        put(prev)


def _fresh(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A new tensor for a whole read: plain ``torch.empty``. Not advised ``MADV_HUGEPAGE``: with
    THP's defrag in "madvise" mode the first such tensor of a process stalls in direct compaction
    (a 128 MiB ``get`` took 0.9-1.9 s against 0.11-0.15 s with 4 KiB pages, here); later ones
    were faster, but a one-off load is the common case."""
    return torch.empty(tuple(shape), dtype=dtype)


def read_tensor(at: Where, key: str, begin: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The whole tensor ``key`` (``shape``, ``dtype``; its bytes at absolute file offset ``begin``)
    as a new contiguous CPU tensor.

    Raises:
        CorruptCheckpointError: the file ends before the tensor does (file and tensor named).
        LoadError: the read fails (tensor and file named).
    """
    out = _fresh(shape, dtype)
    _read_as(at, key, begin, out, dtype, fresh=True)
    return out


def read_hashed(
    at: Where, key: str, begin: int, shape: Sequence[int], dtype: torch.dtype, chunk: int | None = None
) -> tuple[torch.Tensor, str]:
    """:func:`read_tensor` and the tensor digest (chunk size ``chunk``, see
    :func:`~.digest.tensor_hexdigest`) of the bytes read, hashed while the read
    goes on: each piece hashed right after it landed, by the thread that read it, in file order
    (:class:`~.digest.RunHashes` on :func:`~.pread.read_runs`' pieces, as ``read_many`` does), so
    no second pass over the tensor from memory. Raises what :func:`read_tensor` raises."""
    from . import digest

    out = _fresh(shape, dtype)
    if not out.numel():
        return out, digest.hexdigest(b"")
    view = tensor_bytes(out)
    hashes = digest.RunHashes([view], [True], chunk)
    _pread.read_runs([_pread.Run(at.fd, [view], [key], begin, at.root, at.name, (out,), hashes.landed, True)])
    return out, hashes.digest(0) if hashes.complete() else digest.tensor_hexdigest(view, chunk)


def copy_into(
    at: Where, key: str, begin: int, shape: Sequence[int], dtype: torch.dtype, out: torch.Tensor,
    slices: Sequence[slice] | None = None,
) -> None:
    """Tensor ``key`` (or its block ``tensor[slices]``, step-1 slices) into ``out``, any CPU
    tensor of that shape (another dtype, non-contiguous: ``copy_``'s rules): straight into it
    when it is contiguous in the stored dtype, else through a reused window (no intermediate
    tensor of the whole size). Digests are checked before, by the caller
    (:meth:`~.reader.CheckpointReader.check_first`). Raises what :func:`read_tensor` raises."""
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
    _fill(at, key, begin, shape, dtype, bounds, out)


def read_block(
    at: Where, key: str, begin: int, shape: Sequence[int], dtype: torch.dtype, slices: Sequence[slice]
) -> torch.Tensor:
    """Block ``tensor[slices]`` of tensor ``key`` (stored ``shape`` / ``dtype`` at ``begin``; one
    slice per leading dim, missing ones whole; any step) as a new contiguous CPU tensor, reading
    only the runs of the file the block needs (see the module docstring). Raises what
    :func:`read_tensor` raises."""
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
    out = _fresh(tuple(hi - lo for lo, hi in bounds), dtype)
    _fill(at, key, begin, shape, dtype, bounds, out)
    return out
