"""Reads of file ranges straight into writable buffers with ``os.preadv``: one call per run of
adjacent targets, large ranges cut into pieces, every piece of a load spread over a few threads.

Why preadv in threads (measured by tests/bench/checkpoint_bench.py and a side-by-side script,
issue 22, 2-core machine, kernel 6.18, 128 MiB in 8 tensors, quiet machine, median of 9):
``preadv`` copies page-cache pages straight into the target (one copy, no intermediate tensor)
and releases the GIL, so threads overlap their kernel copies. On ext4 (large folios) 4 MiB pieces
of all tensors shared by the calling thread and one pool thread read 9.3 GB/s [7.6-9.5] against
8.0 GB/s for a 2-thread in-memory copy; the same pieces waited for tensor by tensor, with the
calling thread idle, 5.3 GB/s; 1, 2 or 16 MiB pieces 8.3-8.8 GB/s; a third thread on 2 cores
8.7 GB/s. On tmpfs (4 KiB pages) the same read 5.7 GB/s [5.0-6.3], the kernel's per-page copy
path: ``mmap`` + ``copy_`` 3.9 GB/s there (a fault per page; ``MAP_POPULATE`` 2.7 GB/s).
Small loads stay on the calling thread: handing a piece to a thread costs ~20 us.

Cold cache (side-by-side script, ext4 on a virtio disk, 128 MiB, page cache evicted before each
step): pieces shared by 2 threads on one file read 0.54x [0.40-1.48] of one sequential
``readinto`` stream (the interleaved offsets defeat the kernel's readahead; ``POSIX_FADV_WILLNEED``
first: 0.59x), one thread in file order 1.0-1.26x. So one byte at up to 8 places of the load is
first read with ``RWF_NOWAIT`` (page cache only): when one would wait for the device, the load is
read by the calling thread in file order (``checkpoint_bench.py --cold``: 0.99x [0.91-1.34] of the
raw sequential read at 512 MiB).

Mapped copies on disks (issue 22, ``checkpoint_bench.py --full``, 512 MiB in 8 tensors, ext4 on
virtio, warm cache, another 2-core machine, session of 2026-12-02): ``preadv`` in 4 MiB pieces on 2
threads read 11.6 GB/s [11.3-12.1], 0.81x of ``safe_open`` + ``copy_`` (14.1 GB/s; memcpy 13.8).
The same pieces copied from a shared read-only mapping of the file by ``np.copyto`` (glibc's
memmove, GIL released) read 13.1 GB/s [12.1-13.8]: user-space memmove outruns the kernel's
``copy_to_user`` there, and ext4's large folios are mapped a few faults per 2 MiB. ``torch``'s
``copy_`` in the same threads read 12.0 GB/s (it splits each copy over its own threads again).
Each piece is first populated with ``MADV_POPULATE_READ``, so an I/O error or a file cut short
since it was opened raises (named, as from ``preadv``) instead of killing the process with
SIGBUS; that cost nothing measurable (12.5 GB/s against 13.1, inside the range). tmpfs keeps
``preadv``: mapped there 6.1 GB/s against 8.5 (a fault per 4 KiB page). Bytes not cached keep
the sequential ``preadv`` (readahead), and files that cannot be mapped fall back to ``preadv``.

Many small tensors: tensors adjacent in a file are read by one ``preadv`` into all their targets
(up to ``IOV_MAX`` buffers): 20,000 tensors of 8 KiB took 20,000 calls, now ~20 (issue 22:
per-tensor Python and syscall overhead dominated such loads).
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import CorruptCheckpointError, LoadError
from . import fskind, threads

PIECE = 4 << 20  # bytes per thread task; loads under 2 pieces are read inline
_MAX_THREADS = 4  # threads reading, the calling one included
MAP_MIN = 1 << 20  # single-target jobs of this many bytes or more are copied from a mapping (disks)
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14; Python 3.11 lacks the name
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # buffers per preadv (Linux: 1024)

_THREADS = max(1, min(_MAX_THREADS, threads.cpus()))


@dataclass(frozen=True)
class Run:
    """Targets ``views`` (flat byte views of tensors ``keys``) filled from consecutive bytes of
    ``fd`` (file ``name`` under ``root``) from ``offset`` on, in file order."""

    fd: int
    views: list[memoryview]
    keys: list[str]
    offset: int
    root: str
    name: str

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self.views)

    def read(self) -> int:
        """:func:`pread_run` of this run; returns the bytes read."""
        return pread_run(self.fd, self.views, self.keys, self.offset, self.root, self.name)


@dataclass(frozen=True)
class _MappedRun:
    """A one-target :class:`Run` copied from ``mapping`` (a shared read-only mapping of its whole
    file, from when it was opened) instead of ``preadv`` (see the module docstring)."""

    run: Run
    mapping: mmap.mmap

    def read(self) -> int:
        """Copy the run's bytes into its target; returns the bytes copied.

        Raises:
            CorruptCheckpointError: the file ends before the run does (names file and tensor).
            LoadError: populating the pages fails (an I/O error; names tensor and file).
        """
        r, m = self.run, self.mapping
        (view,) = r.views
        n, path = len(view), os.path.join(r.root, r.name)
        if r.offset + n > len(m):
            raise CorruptCheckpointError(path, f"tensor {r.keys[0]!r}: file ends early")
        start = r.offset - r.offset % mmap.PAGESIZE
        try:
            m.madvise(_POPULATE_READ, start, r.offset + n - start)
        except OSError as e:
            if e.errno == errno.EINVAL:  # a kernel without MADV_POPULATE_READ: no safe mapped copy
                return r.read()
            if e.errno == errno.EFAULT:  # the file was cut short since it was mapped
                raise CorruptCheckpointError(path, f"tensor {r.keys[0]!r}: file ends early") from e
            raise LoadError(r.keys[0], path, f"{type(e).__name__}: {e}") from e
        np.copyto(np.frombuffer(view, np.uint8), np.frombuffer(m, np.uint8, n, r.offset))
        return n


def _mapped(jobs: Sequence[Run]) -> tuple[list[Run | _MappedRun], list[mmap.mmap]]:
    """``jobs`` with each one-target job of :data:`MAP_MIN` bytes or more in a file not on tmpfs
    as a :class:`_MappedRun`, and the mappings made (close them when done). A file that cannot be
    mapped (its filesystem refuses, or it is empty) keeps ``preadv``."""
    maps: dict[int, mmap.mmap | None] = {}
    out: list[Run | _MappedRun] = []
    for r in jobs:
        if len(r.views) != 1 or len(r.views[0]) < MAP_MIN:
            out.append(r)
            continue
        if r.fd not in maps:
            maps[r.fd] = None
            if not fskind.in_memory_fd(r.fd, r.root):
                try:
                    size = os.fstat(r.fd).st_size
                    maps[r.fd] = mmap.mmap(r.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if size else None
                except (OSError, ValueError):
                    pass
        m = maps[r.fd]
        out.append(r if m is None else _MappedRun(r, m))
    return out, [m for m in maps.values() if m is not None]


def _close(maps: Sequence[mmap.mmap]) -> None:
    for m in maps:
        try:
            m.close()
        except BufferError:  # a view still held (a failed copy's traceback): unmapped when freed
            pass


def _pieces(runs: Sequence[Run]) -> list[Run]:
    """``runs`` with every target of :data:`PIECE` * 2 bytes or more cut into ``PIECE`` runs."""
    out: list[Run] = []
    for r in runs:
        if len(r.views) == 1 and len(r.views[0]) >= 2 * PIECE:
            v = memoryview(r.views[0])  # (a ctypes array slices to a list)
            out.extend(Run(r.fd, [v[a : a + PIECE]], r.keys, r.offset + a, r.root, r.name) for a in range(0, len(v), PIECE))
        else:
            out.append(r)
    return out


_PROBES = 8  # pages tested per load


def _in_cache(jobs: Sequence[Run]) -> bool:
    """Whether the bytes of ``jobs`` look cached: one byte at the start of up to :data:`_PROBES`
    jobs spread over the load is read with ``RWF_NOWAIT`` (served from the page cache or not at
    all; ~2 us each). True where the filesystem has no ``RWF_NOWAIT`` (tmpfs: always memory)."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return True
    byte = [bytearray(1)]
    for j in sorted({i * (len(jobs) - 1) // max(1, _PROBES - 1) for i in range(_PROBES)}):
        r = jobs[j]
        try:
            if os.preadv(r.fd, byte, r.offset, flag) < 1:
                return False  # at or past the end: the sequential read names the problem
        except BlockingIOError:
            return False
        except OSError:  # EOPNOTSUPP and the like: no way to tell, and tmpfs is memory
            return True
    return True


def read_runs(runs: Sequence[Run]) -> int:
    """Fill every run's targets (:meth:`Run.read` each); returns the bytes read. Large targets
    are cut into :data:`PIECE` pieces, and when the runs hold 2 pieces or more and their bytes
    are in the page cache (:func:`_in_cache`) they are shared by the calling thread and up to
    ``_THREADS - 1`` pool threads, each taking the next piece from one queue (no wait per
    tensor), pieces in files not on tmpfs copied from a mapping (:class:`_MappedRun`); bytes
    still on the device are read by the calling thread in file order. Every
    thread has stopped before this returns or raises, so nothing writes into a target afterwards.

    Raises:
        CorruptCheckpointError: a file ends early (the first error met; names file and tensor).
        LoadError: a read fails (names tensor and file).
    """
    total = sum(r.nbytes for r in runs)
    if total < 2 * PIECE or _THREADS == 1:
        return sum(r.read() for r in runs)
    jobs = _pieces(runs)
    if not _in_cache(jobs):  # from the device: one sequential stream (see the module docstring)
        for r in sorted(jobs, key=lambda r: (r.fd, r.offset)):
            r.read()
        return total
    jobs, maps = _mapped(jobs)
    try:
        _share(jobs)
    finally:
        _close(maps)
    return total


def _share(jobs: Sequence[Run | _MappedRun]) -> None:
    """Run every job's ``read`` on the calling thread and up to ``_THREADS - 1`` pool threads,
    each taking the next job from one queue; re-raises the first error once every thread stopped."""
    counter = itertools.count()  # next() on a count is atomic under the GIL: one queue, no lock
    errors: list[BaseException] = []

    def work() -> None:
        while not errors:
            j = next(counter)
            if j >= len(jobs):
                return
            try:
                jobs[j].read()
            except BaseException as e:  # noqa: BLE001 - re-raised below, after every thread stopped
                errors.append(e)

    helpers = [threads.pool("read", _THREADS).submit(work) for _ in range(min(_THREADS, len(jobs)) - 1)]
    work()
    for f in helpers:
        f.result()
    if errors:
        raise errors[0]


def pread_run(fd: int, views: list[memoryview], keys: list[str], offset: int, root: str, name: str) -> int:
    """Fill ``views`` (flat byte views of tensors ``keys``, adjacent in file ``name`` from
    ``offset`` on, in file order) with ``preadv`` calls of up to :data:`IOV_MAX` buffers;
    returns the bytes read.

    Raises:
        CorruptCheckpointError: the file ends early (names the first tensor not read in full).
        LoadError: the read fails (names that tensor too; ``__cause__`` is the OSError).
    """
    i, total = 0, 0
    while i < len(views):
        try:
            n = os.preadv(fd, views[i : i + IOV_MAX], offset + total)
        except OSError as e:
            raise LoadError(keys[i], os.path.join(root, name), f"{type(e).__name__}: {e}") from e
        if n <= 0:
            raise CorruptCheckpointError(os.path.join(root, name), f"tensor {keys[i]!r}: file ends early")
        total += n
        while i < len(views) and n >= len(views[i]):  # buffers filled whole
            n -= len(views[i])
            i += 1
        if n:  # a short read inside one buffer: the rest of it next
            views = [*views[:i], memoryview(views[i])[n:], *views[i + 1 :]]  # (a ctypes array slices to a list)
    return total
