"""Reads of file ranges straight into writable buffers with ``os.preadv``: one call per run of
adjacent targets, large ranges cut into pieces, every piece of a load spread over a few threads.

Why ``preadv`` in threads: it copies page-cache pages straight into the target (one copy, no
intermediate tensor) and releases the GIL, so threads overlap their kernel copies; pieces of all
tensors of a load are taken from one queue by the calling thread and pool threads (no wait per
tensor). Small loads stay on the calling thread: handing a piece to a thread costs more than a
small read.

Bytes still on the device are read differently: two threads interleaving offsets of one file
defeat the kernel's readahead, so one byte at up to 8 places of the load is first read with
``RWF_NOWAIT`` (page cache only), and when one would wait for the device the load is read by the
calling thread in file order.

Inside a load, a file held under a read lease is copied from its mapping instead (one ``memmove``
per target, :mod:`~.leased`: the lease makes every writer and truncation wait, so the mapping
cannot raise SIGBUS); a plain mapping is never read (a file cut short or an I/O error while mapped
kills the process with SIGBUS instead of raising an error naming the tensor and file). Many small tensors: tensors adjacent in a file are read by one ``preadv`` into all their
targets (up to ``IOV_MAX`` buffers), so per-tensor Python and syscall overhead does not dominate.
Measured throughput: the benchmarks page of the documentation and ``tests/bench/checkpoint_bench.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import CorruptCheckpointError, LoadError
from . import leased, ownership, threads
from .libc import libc_function

PIECE = 4 << 20  # bytes per thread task; loads under 2 pieces are read inline
_MAX_THREADS = 4  # threads reading, the calling one included
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # buffers per preadv (Linux: 1024)

_THREADS = max(1, min(_MAX_THREADS, threads.cpus()))
# Mean bytes per target from which a run of a leased file is copied from its mapping (one
# ``memmove`` per target) rather than read by one ``preadv`` of all its targets.
_MAPPED_VIEW = 64 << 10


@dataclass(frozen=True)
class Run:
    """Targets ``views`` (flat byte views of tensors ``keys``) filled from consecutive bytes of
    ``fd`` (file ``name`` under ``root``) from ``offset`` on, in file order. ``owners`` are the
    objects owning the views' memory (the target tensors): held while the run exists, so a view
    over a raw address never outlives its memory (rule 3 of :mod:`~.ownership`). ``after``:
    called as ``after(lo, hi)`` by the thread that read the run, right after bytes ``[lo, hi)``
    of its views (counted from the first view's start) landed, while they are in that core's
    cache (a load's digest check: :class:`~.reader.CheckpointReader.read_many`); a run cut into
    pieces calls it once per piece, in whatever order the pieces land."""

    fd: int
    views: list[memoryview]
    keys: list[str]
    offset: int
    root: str
    name: str
    owners: tuple = field(default=(), repr=False, compare=False)
    after: Callable[[int, int], None] | None = field(default=None, repr=False, compare=False)
    fresh: bool = field(default=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self.views)

    def read(self) -> int:
        """:func:`pread_run` of this run (its pages faulted in first when ``fresh``:
        :func:`populate`), then ``after``; returns the bytes read."""
        if self.fresh:
            for v in self.views:
                populate(v)
        n = pread_run(self.fd, self.views, self.keys, self.offset, self.root, self.name)
        if self.after is not None:
            self.after(0, n)
        return n


def _pieces(runs: Sequence[Run]) -> list[Run]:
    """``runs`` with every target of :data:`PIECE` * 2 bytes or more cut into ``PIECE`` runs."""
    out: list[Run] = []
    for r in runs:
        if len(r.views) == 1 and len(r.views[0]) >= 2 * PIECE:
            v = memoryview(r.views[0])  # (a ctypes array slices to a list)
            out.extend(
                Run(r.fd, [v[a : a + PIECE]], r.keys, r.offset + a, r.root, r.name, r.owners, _shifted(r.after, a), r.fresh)
                for a in range(0, len(v), PIECE)
            )
        else:
            out.append(r)
    return out


MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14
_PAGE = 4096


def populate(view: memoryview) -> None:
    """Fault in the whole pages of ``view`` (fresh memory about to be read into) with one
    ``madvise(MADV_POPULATE_WRITE)`` call: ``preadv`` into untouched anonymous memory takes a page
    fault per 4 KiB page inside its copy, the populate call maps them in one loop without the
    trap per page (less CPU than faulting inside the copy). Nothing where the kernel lacks it (the
    read faults them)."""
    import ctypes

    fn = libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
    if not fn or len(view) < 2 * _PAGE:
        return
    start = ctypes.addressof(ctypes.c_char.from_buffer(view))
    lo, hi = -(-start // _PAGE) * _PAGE, (start + len(view)) // _PAGE * _PAGE
    if hi > lo and not _resident(lo):
        fn(lo, hi - lo, MADV_POPULATE_WRITE)  # a failure leaves the pages to the read's faults


def _resident(page: int) -> bool:
    """Whether the page at address ``page`` is mapped in (``mincore``): memory the allocator
    reuses (glibc's heap) is, and populating it again costs a page-table walk per page
    (~5 ms of 128 MiB here) for nothing; a fresh ``mmap`` is not."""
    import ctypes

    fn = libc_function("mincore", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p))
    vec = ctypes.create_string_buffer(1)
    return not fn or fn(page, _PAGE, vec) != 0 or bool(vec.raw[0] & 1)


def _shifted(after: Callable[[int, int], None] | None, by: int) -> Callable[[int, int], None] | None:
    """``after`` of a whole run, for its piece starting ``by`` bytes in."""
    if after is None:
        return None
    return lambda lo, hi: after(lo + by, hi + by)


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
    tensor); bytes still on the device are read by the calling thread in file order. Every
    thread has stopped before this returns or raises, whatever the calling thread receives
    (Ctrl-C included), so nothing writes into a target afterwards (:mod:`~.ownership`).

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
    # Rule 1 of ownership: the crew returns or raises (Ctrl-C included) only once no helper reads.
    ownership.share_queue("read", _THREADS, jobs, Run.read)
    return total


def pread_run(fd: int, views: list[memoryview], keys: list[str], offset: int, root: str, name: str) -> int:
    """Fill ``views`` (flat byte views of tensors ``keys``, adjacent in file ``name`` from
    ``offset`` on, in file order) with ``preadv`` calls of up to :data:`IOV_MAX` buffers;
    returns the bytes read.

    Raises:
        CorruptCheckpointError: the file ends early (names the first tensor not read in full).
        LoadError: the read fails (names that tensor too; ``__cause__`` is the OSError).
    """
    m = leased.mapping(fd)
    if m is not None and len(views) * _MAPPED_VIEW <= sum(len(v) for v in views):
        n = m.copy_views(views, offset)  # under the lease (-1: broken, so preadv below)
        if n >= 0:
            return n
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


def threads_for(nbytes: int, jobs: int) -> int:
    """Threads (the calling one included) that share ``jobs`` tasks over ``nbytes`` bytes in
    the page cache: one below 2 :data:`PIECE` (a thread's start costs more than it saves),
    else up to the read pool's size."""
    return 1 if nbytes < 2 * PIECE else max(1, min(_THREADS, jobs))
