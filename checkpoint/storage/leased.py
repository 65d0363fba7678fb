"""A checkpoint file read from a memory mapping held under a read lease: the check before the
copies (:mod:`~.read_check`) hashes the mapped pages, and the copies into the targets
(:func:`~.pread.pread_run`, the block reads of :mod:`~.tensor_read`) copy from them, so a load
passes over the page cache twice without a kernel copy (about what ``preadv`` alone costs,
where the check through a buffer and then ``preadv`` cost two kernel copies).

Why a lease: a plain mapping of a file that another process truncates (or that meets an I/O error)
kills the reader with SIGBUS, which nothing in Python can catch. A read lease (``fcntl(fd,
F_SETLEASE, F_RDLCK)``, Linux, ``fcntl(2)``) makes every open of the file for writing and every
truncation, by any process, this one included, wait until the lease is given back (or until the
kernel's ``/proc/sys/fs/lease-break-time``, 45 s by default, has passed). While a writer waits,
``F_GETLEASE`` already reports the lease as broken. So a piece (at most a few MiB) is read from the
mapping only after ``F_GETLEASE`` shows the lease intact, and the mapping is never touched after a
writer could have changed the file: a broken lease sends every later read to ``preadv``
(:meth:`LeasedMap.intact` is False), which reports a short or failed read as an error naming the
file and tensor. The lease also keeps the bytes copied equal to the bytes checked: no writer can
open the file between the check and the copies while it holds. A device's I/O error, the other
cause of SIGBUS, is met before any page is touched: each range is read in first with
``madvise(MADV_POPULATE_READ)`` (Linux 5.14), which returns the error instead, and the range is
then read with ``preadv``, which names file and tensor.

The break notice: the kernel signals the lease holder (``SIGIO`` by default, whose default action
ends the process). ``F_SETSIG`` names ``SIGURG`` instead, whose default action is to ignore it, so
the notice costs nothing; leases are only taken while ``SIGURG`` has its default (or ignored)
disposition, and once a lease is set the file's owner is cleared (``F_SETOWN`` 0: a break then
signals no process), so a program with its own ``SIGURG`` handler, even one installed while a load
runs, never sees a notice of ours. The notice carries nothing the reader needs: it polls
``F_GETLEASE`` before each piece instead.

No lease (the file open for writing somewhere, not the caller's and no ``CAP_LEASE``, a filesystem
without leases such as NFS or FUSE, another OS, ``lease-break-time`` under a second): no mapping,
and every read goes through ``preadv`` as before. Leases are taken only inside a
:meth:`~.reader.CheckpointReader.reading` span (one load: the check and the copies) and given back
when it ends.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import signal
import sys
import threading

import numpy as np

from .libc import libc_function

# <fcntl.h> on Linux (F_LINUX_SPECIFIC_BASE = 1024); the fcntl module names F_SETLEASE only on
# recent Pythons.
F_SETSIG, F_GETSIG = 10, 11
F_SETLEASE, F_GETLEASE = 1024, 1025
_NOTICE = getattr(signal, "SIGURG", 0)  # default action: ignore (signal(7))
_MIN_BREAK_TIME = 1  # seconds: below this a waiting writer gets the file before a piece is read

# False: every read through ``preadv`` (environment ``FQNCKPT_LEASES=0``: for a program whose
# other processes must never wait to open a checkpoint file for writing; the benchmark's reference).
enabled = os.environ.get("FQNCKPT_LEASES", "1") != "0"

_lock = threading.Lock()
_by_fd: dict[int, LeasedMap] = {}

_MADV_POPULATE_READ = 22  # <linux/mman.h>, Linux 5.14
_BLOCK = 1 << 20  # bytes read in per madvise bookkeeping unit (LeasedMap._fault_in)
_populate = libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))


def usable() -> bool:
    """Whether this process can hold a lease's break notice harmlessly right now: Linux, leases
    enabled with a break time of at least a second, and ``SIGURG`` at its default (ignore) or
    ignored disposition."""
    if not enabled or not sys.platform.startswith("linux") or not _NOTICE:
        return False
    if signal.getsignal(_NOTICE) not in (signal.SIG_DFL, signal.SIG_IGN):
        return False
    return _break_time() >= _MIN_BREAK_TIME


def _break_time() -> int:
    try:
        with open("/proc/sys/fs/leases-enable") as f:
            if f.read().strip() != "1":
                return 0
        with open("/proc/sys/fs/lease-break-time") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


class LeasedMap:
    """File descriptor ``fd`` (opened read-only) mapped whole, under a read lease: see the module
    docstring. Made by :func:`take`; given back by :meth:`release`."""

    __slots__ = ("fd", "size", "_map", "_base", "_released", "_faulted")

    def __init__(self, fd: int, size: int, mapping: mmap.mmap, base: int):
        self.fd, self.size, self._map, self._base = fd, size, mapping, base
        self._released = False
        self._faulted = bytearray(-(-size // _BLOCK))  # blocks whose pages were read in

    def _fault_in(self, lo: int, hi: int) -> bool:
        """Read in the pages of file bytes ``[lo, hi)`` with ``madvise(MADV_POPULATE_READ)``
        (Linux 5.14) before they are touched: a device's I/O error is then this call's error
        (False: the caller reads with ``preadv``, which names it) instead of a SIGBUS inside a
        hash or a copy. Each :data:`_BLOCK` once per mapping; where the kernel lacks the call,
        nothing (the pages are read by the touch itself, as by any mapping)."""
        if not _populate:
            return True
        done = self._faulted
        b0, b1 = lo // _BLOCK, -(-hi // _BLOCK)
        b = b0
        while b < b1:
            if done[b]:
                b += 1
                continue
            e = b
            while e < b1 and not done[e]:
                e += 1
            start, stop = b * _BLOCK, min(e * _BLOCK, self.size)
            if _populate(self._base + start, stop - start, _MADV_POPULATE_READ) != 0:
                err = ctypes.get_errno()
                if err in (errno.EINVAL, errno.ENOSYS):  # an older kernel: touched as usual
                    return True
                return False  # EIO, EFAULT, EHWPOISON: preadv reports it by name
            done[b:e] = b"\x01" * (e - b)
            b = e
        return True

    def intact(self) -> bool:
        """Whether the lease still holds (no writer waits for the file): one ``fcntl`` call."""
        import fcntl

        if self._released:
            return False
        try:
            return fcntl.fcntl(self.fd, F_GETLEASE) == fcntl.F_RDLCK
        except OSError:
            return False

    def view(self, lo: int, hi: int) -> memoryview | None:
        """File bytes ``[lo, hi)`` as a read-only view of the mapping, or None when the lease is
        broken or the range ends past the file (the caller then reads with ``preadv``, which names
        a short file). The caller releases the view before :meth:`release`."""
        if hi > self.size or not self.intact() or not self._fault_in(lo, hi):
            return None
        return memoryview(self._map)[lo:hi]

    def copy_views(self, views: list[memoryview], pos: int) -> int:
        """Fill ``views`` (writable byte buffers, in file order) from file bytes ``pos`` on, one
        ``memmove`` each (ctypes gives up the GIL during the call); returns the bytes copied, or
        -1 (nothing copied) when the lease is broken or the bytes end past the file."""
        total = sum(len(v) for v in views)
        if pos + total > self.size or not self.intact() or not self._fault_in(pos, pos + total):
            return -1
        src = self._base + pos
        for v in views:
            n = len(v)
            if n:
                ctypes.memmove(_address(v), src, n)
                src += n
        return total

    def tensor(self, pos: int, nbytes: int):
        """File bytes ``[pos, pos + nbytes)`` as a ``uint8`` CPU tensor over the mapped pages
        (no copy; never written: the pages are mapped read-only), or None when the bytes end
        past the file. Valid until :meth:`release`: the caller drops it before the span ends and
        reads it only after :meth:`intact`."""
        if pos + nbytes > self.size or not self._fault_in(pos, pos + nbytes):
            return None
        import torch

        arr = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self._base + pos))
        return torch.from_numpy(arr)

    def release(self) -> None:
        """Unmap the file and give the lease back (a waiting writer goes on). Only once no read
        of this mapping runs (the reader's span has ended)."""
        import fcntl

        if self._released:
            return
        self._released = True
        with _lock:
            if _by_fd.get(self.fd) is self:
                del _by_fd[self.fd]
        try:
            self._map.close()
        except BufferError:  # a view still alive (a traceback's frame): unmapped when it goes
            pass
        finally:
            try:
                fcntl.fcntl(self.fd, F_SETLEASE, fcntl.F_UNLCK)
            except OSError:
                pass


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def take(fd: int) -> LeasedMap | None:
    """A read lease on ``fd`` (open read-only) and a mapping of the whole file, registered for
    :func:`mapping`; None (no lease held) where none can be had: see the module docstring."""
    if not usable():
        return None
    import fcntl

    try:
        size = os.fstat(fd).st_size
        if size <= 0 or not resident(fd, size):
            return None
        fcntl.fcntl(fd, F_SETSIG, _NOTICE)  # before each lease: a break may have reset it
        fcntl.fcntl(fd, F_SETLEASE, fcntl.F_RDLCK)
    except OSError:  # EAGAIN: open for writing; EACCES: not ours; EINVAL: no leases here
        return None
    try:
        if fcntl.fcntl(fd, F_GETSIG) != _NOTICE:
            raise OSError("break notice not set")
        fcntl.fcntl(fd, fcntl.F_SETOWN, 0)  # no owner: a later break signals no process at all
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        arr = np.frombuffer(m, dtype=np.uint8)
        base = arr.ctypes.data
        del arr  # (an exported buffer would keep the mapping from closing)
        lm = LeasedMap(fd, size, m, base)
        with _lock:
            _by_fd[fd] = lm
    except BaseException as e:  # Ctrl-C included: no lease stays held without a record to give it back
        try:
            fcntl.fcntl(fd, F_SETLEASE, fcntl.F_UNLCK)
        except OSError:
            pass
        if isinstance(e, (OSError, ValueError)):
            return None
        raise
    return lm


_PROBES = 8  # pages tested per file (resident)


def resident(fd: int, size: int) -> bool:
    """Whether the file's bytes look cached: one byte at up to :data:`_PROBES` places spread over
    it is read with ``RWF_NOWAIT`` (page cache only; ~2 us each). A file still on the device is
    not mapped: two threads faulting its pages in defeat the kernel's readahead, and ``preadv``
    in file order reads it faster (its rewrite in place is then found by its modification time:
    :meth:`~.reader.CheckpointReader.confirm_unchanged`). True where ``RWF_NOWAIT`` is missing."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return True
    byte = [bytearray(1)]
    for i in range(_PROBES):
        try:
            if os.preadv(fd, byte, i * (size - 1) // max(1, _PROBES - 1), flag) < 1:
                return False
        except BlockingIOError:
            return False
        except OSError:  # EOPNOTSUPP and the like: tmpfs is memory
            return True
    return True


def mapping(fd: int) -> LeasedMap | None:
    """The leased mapping of ``fd`` taken by :func:`take` and not released, if any."""
    return _by_fd.get(fd)
