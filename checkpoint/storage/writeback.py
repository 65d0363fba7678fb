"""Start the kernel's writeback of a file range just written, so the disk works while later
bytes are still being copied and the closing ``fsync`` has less left to flush.

Why by hand: Python's ``os`` has no ``sync_file_range`` (Linux, glibc >= 2.6), so it is called
through ``ctypes``; ``posix_fadvise(POSIX_FADV_DONTNEED)`` also starts writeback but then drops
the clean pages from the cache, which a load right after the save would miss. On a real disk,
writes with writeback started every few MiB finish their closing ``fsync`` sooner than writes
left to the page cache (``tests/bench/checkpoint_bench.py`` on disk compares the save with
``save_file`` + fsync). It only starts writeback (``SYNC_FILE_RANGE_WRITE``, no wait); the
``fsync`` at the end is still what makes the bytes durable.
"""

from __future__ import annotations


from .libc import libc_function

SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>

def _load():
    import ctypes

    return libc_function("sync_file_range", (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint))


def available() -> bool:
    """True where :func:`start_writeback` does something (Linux with glibc's ``sync_file_range``)."""
    return bool(_load())


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing bytes ``[offset, offset + nbytes)`` of ``fd`` (bytes) to
    the device, without waiting. Never raises: a failure only means the bytes are written at the
    closing ``fsync`` instead (which reports real I/O errors)."""
    fn = _load()
    if fn and nbytes > 0:
        fn(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)


__all__ = ["available", "start_writeback"]
