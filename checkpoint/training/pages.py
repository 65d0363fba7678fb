"""Fault in the pages of a host buffer ahead of its first use (async-save staging buffers).

Why: fresh anonymous memory costs a page fault and a zero-fill per 4 KiB page on its first write,
so a first copy into fresh staging takes several times as long as a later copy, and the first
``async_save`` blocked that much longer. Touching the buffers earlier, on the saver's writer
thread, moves that cost out of the save call.

How: ``madvise(MADV_POPULATE_WRITE)`` (Linux >= 5.14) faults the buffer's whole pages in one call
that runs without the GIL (``ctypes`` releases it; Python's ``mmap.madvise`` works only on its own
mappings and its ``os`` has no ``madvise``). Elsewhere, or when the call fails, one byte per page is
written through numpy, 8 MiB at a time. The buffer's content is garbage afterwards (it is a
staging buffer that a save overwrites); bytes outside it are never written.
"""

from __future__ import annotations


import torch

from ..storage.libc import libc_function

MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14
PAGE = 4096
_CHUNK = 8 << 20

def _load():
    import ctypes

    return libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))


def populate(buf: torch.Tensor) -> None:
    """Write-fault every page of host tensor ``buf`` (contiguous); its values become undefined.
    Never raises for a kernel without ``MADV_POPULATE_WRITE`` (falls back to writing)."""
    n = buf.numel() * buf.element_size()
    if n == 0 or buf.device.type != "cpu":
        return
    start = buf.data_ptr()
    lo, hi = -(-start // PAGE) * PAGE, (start + n) // PAGE * PAGE  # whole pages inside buf
    fn = _load()
    if fn and hi > lo and fn(lo, hi - lo, MADV_POPULATE_WRITE) == 0:
        raw = buf.reshape(-1).view(torch.uint8).numpy()
        raw[0] = 0  # the partial pages at both ends
        raw[-1] = 0
        return
    raw = buf.reshape(-1).view(torch.uint8).numpy()
    for at in range(0, n, _CHUNK):  # chunks: the GIL is given up between them
        raw[at : at + _CHUNK : PAGE] = 0
    raw[-1] = 0


__all__ = ["populate"]
