"""``pread_into``: fill a writable buffer from a file range with ``os.preadv``, large ranges split
over a few threads.

Why preadv in threads (measured by tests/bench/checkpoint_bench.py, issue 22, on a 2-core machine,
tmpfs): ``preadv`` copies page-cache pages straight into the target (one copy, no intermediate
tensor) and releases the GIL, so threads overlap their kernel copies. 256 MiB at load average 4:
1 thread 2.2-2.9 GB/s, 2-4 threads 2.3-3.3 GB/s, against 1.4-2.5 GB/s for ``mmap`` + ``copy_``
(``MAP_POPULATE`` or not: a page fault, or a page-table fill, per 4 KiB page before the copy).
Quiet machine, 16 MiB tensors: 2.96 GB/s with 16 MiB pieces (read inline), 2.6-3.7 GB/s with
4 MiB pieces. Small ranges stay on the calling thread: handing a piece to a thread costs ~20 us.

Many small tensors (:func:`pread_run`): tensors adjacent in a file are read by one ``preadv``
into all their targets (up to ``IOV_MAX`` buffers): 20,000 tensors of 8 KiB took 20,000 calls,
now ~20 (issue 22: per-tensor Python and syscall overhead dominated such loads).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from ..errors import CorruptCheckpointError, LoadError

PIECE = 4 << 20  # bytes per thread task; ranges under 2 pieces are read inline
_MAX_THREADS = 4
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # buffers per preadv (Linux: 1024)

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(_MAX_THREADS, n))


_THREADS = _threads()


def _shared_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="fqnckpt-read")
        return _pool


def _read_exact(fd: int, view: memoryview, offset: int, root: str, name: str, key: str) -> int:
    done, size = 0, len(view)
    while done < size:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CorruptCheckpointError(os.path.join(root, name), f"tensor {key!r}: file ends early")
        done += n
    return done


def pread_into(fd: int, view: memoryview, offset: int, root: str, name: str, key: str) -> int:
    """Read ``len(view)`` bytes of ``fd`` (file ``name`` under ``root``) at ``offset`` into
    ``view`` (a flat byte view) for tensor ``key``; returns the bytes read.

    Raises:
        CorruptCheckpointError: the file ends before the range does (names file and ``key``).
        OSError: the read fails.
    """
    size = len(view)
    if size < 2 * PIECE or _THREADS == 1:
        return _read_exact(fd, view, offset, root, name, key)
    pool = _shared_pool()
    futures = [
        pool.submit(_read_exact, fd, view[a : a + PIECE], offset + a, root, name, key)
        for a in range(0, size, PIECE)
    ]
    # Every piece is waited for before any error leaves: no thread writes into the target afterwards.
    errors = [f.exception() for f in futures]
    err = next((e for e in errors if e is not None), None)
    if err is not None:
        raise err
    return size


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
            views = [*views[:i], views[i][n:], *views[i + 1 :]]
    return total
