"""Where checkpoint bytes are written: shard files are created with their header, then tensor
bytes are ``os.pwrite``-n at planned offsets straight from tensor memory (no serialization copy).

Written with ``os`` calls rather than safetensors because several ranks fill byte ranges of the
same preallocated file (see :mod:`checkpoint.storage.layout`). ``stats`` counts bytes written in this
process (tests and the benchmark use it to prove each byte is written once).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..testing import faults
from . import digest, fskind, ownership, threads, writeback
from .format import FileRecordV2
from .layout import FilePlan, TensorSlot

_HASH_CHUNK = 16 << 20  # bytes per read when hashing a finished file


# dtypes whose tensors numpy can view directly (not bfloat16 / float8).
NUMPY_DTYPES = frozenset(
    {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
     torch.uint8, torch.bool, torch.complex64}
)  # fmt: skip


@dataclass
class IOStats:
    """Bytes written / read by this process since the last ``reset()`` (data and headers): test
    and benchmark support (see :mod:`checkpoint.testing`), not part of the API."""

    bytes_written: int = 0
    bytes_read: int = 0  # into targets or new tensors
    bytes_checked: int = 0  # read to check digests before any target is written (check_first)
    tensors_checked: int = 0  # tensors whose whole digest check_first compared

    def reset(self) -> None:
        self.bytes_written = 0
        self.bytes_read = 0
        self.bytes_checked = 0
        self.tensors_checked = 0


stats = IOStats()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t`` in row-major order, without copying when ``t`` is contiguous in host
    memory (a tensor on an accelerator is moved to host first)."""
    # Few torch calls on the common path (a CPU contiguous tensor): each costs microseconds and
    # MoE checkpoints hold 10^5 tensors.
    if t.requires_grad:
        t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj() or t.is_neg() or not t.is_contiguous():
        t = t.resolve_conj().resolve_neg().contiguous()
    if t.dtype in NUMPY_DTYPES and t.numel() and t.dim() <= 32:  # numpy 1 holds 32 dims, 2 holds 64
        return memoryview(t.numpy()).cast("B")  # one call instead of two views (~2x faster)
    flat = t.view(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy())


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """``os.pwrite`` until every byte of ``data`` is at ``offset`` (pwrite may write less)."""
    done, n = 0, len(data)
    while done < n:
        w = os.pwrite(fd, data[done:], offset + done)
        if w <= 0:
            raise OSError(f"pwrite wrote {w} bytes at offset {offset + done}")
        done += w
    stats.bytes_written += n


def create_shard_file(path: str, plan: FilePlan) -> int:
    """Create ``path`` with ``plan.size`` bytes reserved (``posix_fallocate``, so a full disk fails
    here rather than midway) and the header written. Returns an open fd (read/write).

    On tmpfs the file is only sized (``ftruncate``): there fallocate zero-fills every page that the
    writes then overwrite (a fifth of a 64 MiB save's time), and "disk full" is memory anyway.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        try:
            if fskind.in_memory_dir(os.path.dirname(os.path.abspath(path))):
                os.ftruncate(fd, plan.size)
            else:
                os.posix_fallocate(fd, 0, plan.size)
        except (AttributeError, OSError) as e:  # filesystems without fallocate
            if isinstance(e, OSError) and e.errno not in (95, 22):  # EOPNOTSUPP, EINVAL
                raise
            os.ftruncate(fd, plan.size)
        pwrite_all(fd, memoryview(plan.header), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_shard_file(path: str) -> int:
    """Open an existing (preallocated) shard file for writing byte ranges."""
    return os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))


def write_tensor(fd: int, slot: TensorSlot, tensor: torch.Tensor) -> None:
    """Write the whole ``tensor`` into its ``slot``.

    Raises:
        ValueError: shape / dtype differ from the slot's spec (would corrupt the file).
    """
    check_matches(slot, tensor)
    pwrite_all(fd, tensor_bytes(tensor), slot.begin)


def check_matches(slot: TensorSlot, tensor: torch.Tensor) -> None:
    spec = slot.spec
    if tensor.dtype != spec.dtype or tensor.shape != spec.shape:
        raise ValueError(
            f"tensor {spec.fqn!r} is {tuple(tensor.shape)} {tensor.dtype}, the plan says {spec.shape} {spec.dtype}"
        )


def block_runs(
    global_shape: Sequence[int], local_shape: Sequence[int], offset: Sequence[int]
) -> Iterator[tuple[int, int, int]]:
    """Contiguous runs of a row-major block: ``(global element offset, local element offset, length)``.

    The block of shape ``local_shape`` sits at ``offset`` inside a tensor of ``global_shape``; the
    trailing dims where the block spans the whole tensor form one run per index of the leading dims.
    """
    nd = len(global_shape)
    if nd == 0:
        yield 0, 0, 1
        return
    if any(d == 0 for d in local_shape):
        return
    k = nd - 1
    while k > 0 and local_shape[k] == global_shape[k]:
        k -= 1
    gstride = [1] * nd
    for d in range(nd - 2, -1, -1):
        gstride[d] = gstride[d + 1] * global_shape[d + 1]
    run = local_shape[k] * gstride[k]
    lead = list(local_shape[:k])
    base = sum(offset[d] * gstride[d] for d in range(k + 1))
    if not lead:
        yield base, 0, run
        return
    idx = np.indices(lead).reshape(k, -1).T  # every index tuple of the leading dims, row-major
    starts = base + idx @ np.asarray(gstride[:k], dtype=np.int64)
    for i, g in enumerate(starts.tolist()):
        yield g, i * run, run


def write_block(fd: int, slot: TensorSlot, local: torch.Tensor, offset: Sequence[int], wrote=None) -> None:
    """Write ``local`` (a shard of the slot's tensor at element ``offset``) into its byte ranges;
    ``wrote(begin, end)``, when given, is told each file byte range once it is written (large runs
    go in :attr:`BlockWriter.PIECE` pieces so writeback can start while later pieces are copied)."""
    spec = slot.spec
    if local.dtype != spec.dtype or len(local.shape) != len(spec.shape):
        raise ValueError(f"shard of {spec.fqn!r} is {local.dtype} {tuple(local.shape)}, plan says {spec}")
    data = tensor_bytes(local)
    item = spec.itemsize
    piece = BlockWriter.PIECE
    for g, lo, n in block_runs(spec.shape, tuple(local.shape), tuple(offset)):
        run, at = data[lo * item : (lo + n) * item], slot.begin + g * item
        if wrote is None:
            pwrite_all(fd, run, at)
            continue
        for p in range(0, len(run), piece):
            chunk = run[p : p + piece]
            pwrite_all(fd, chunk, at + p)
            wrote(at + p, at + p + len(chunk))


class BlockWriter:
    """This rank's writes into one preallocated shard file of a distributed save (each rank writes
    the byte ranges it owns, see :func:`write_block`). On a real disk the kernel is told to start
    writing back every :attr:`WRITEBACK` bytes this rank wrote (:mod:`checkpoint.storage.writeback`),
    over the span of file offsets they cover, so the device works while the ranks still copy and the
    closing ``fsync`` (one rank's, after every rank wrote) finds little left to flush.

    Why: without it the ranks finish their writes and the one ``fsync`` after them then flushes
    the whole file alone, longer than the writes took; with writeback started by each writer the
    flush runs during the writes, as in :class:`SequentialFileWriter`.

    Ranks writing one file take turns: Linux holds the file's inode lock across each write's copy
    (``shmem_file_write_iter`` on tmpfs, buffered ext4 alike), so two processes writing one file
    take about twice as long as each writing a file of its own (the waiting one sleeps); writing
    through a shared mapping avoids the lock but pays a fault and a zero-fill per 4 KiB page, and
    is no faster. So a save of whole-tensor files is bound by one file's
    write rate there, about 1/ranks of per-rank files (tests/bench/dist_save.py ``raw_shared``),
    unless there are several files: then ranks start at different ones
    (:func:`checkpoint.write.plan.write_orders`; tests/bench/shared_writes.py).
    """

    PIECE = 8 << 20  # bytes per pwrite of a large run
    WRITEBACK = 8 << 20

    def __init__(self, path: str, writeback_on: bool):
        self.fd = open_shard_file(path)
        self._on = writeback_on and writeback.available()
        self._lo, self._hi, self._pending = -1, -1, 0  # span and byte count written since the last start

    def write(self, slot: TensorSlot, local: torch.Tensor, offset: Sequence[int]) -> None:
        write_block(self.fd, slot, local, offset, self._wrote if self._on else None)

    def _wrote(self, begin: int, end: int) -> None:
        self._lo = begin if self._lo < 0 else min(self._lo, begin)
        self._hi = max(self._hi, end)
        self._pending += end - begin
        if self._pending >= self.WRITEBACK:
            self._start()

    def _start(self) -> None:
        if self._pending:
            writeback.start_writeback(self.fd, self._lo, self._hi - self._lo)
        self._lo, self._hi, self._pending = -1, -1, 0

    def close(self) -> None:
        """Start writeback of what is left and close (never waits for the device)."""
        if self.fd >= 0:
            try:
                if self._on:
                    self._start()
            finally:
                os.close(self.fd)
                self.fd = -1


def fsync_fd(fd: int) -> None:
    os.fsync(fd)


def sha256_file(path: str) -> str:
    """sha256 hex digest of a whole file, read in 16 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_HASH_CHUNK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def _hasher() -> ThreadPoolExecutor | None:
    """The one thread that hashes large tensors beside the writing thread; None on one CPU."""
    return threads.pool("hash", 1) if threads.cpus() >= 2 else None


def _spare_core() -> bool:
    """Whether a CPU is idle right now besides the calling thread: Linux's count of running tasks
    (``procs_running`` in /proc/stat, the caller included) below the CPU count. True where unknown.
    One read (~40 us), once per shard file."""
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"procs_running "):
                    return int(line.split()[1]) < (os.cpu_count() or 1)
    except (OSError, ValueError, IndexError):
        pass
    return True


class SequentialFileWriter:
    """Writes one shard file front to back from a single process, computing the format-version-3
    digests on the way (see :mod:`checkpoint.storage.digest`); the file is never read back.

    A large tensor is hashed beside its ``pwrite`` on a second thread when a CPU is idle, else
    one digest chunk at a time right after the chunk's ``pwrite``, while it is in cache (see
    :attr:`HASH_INLINE`), and on a real disk the kernel is told
    to start writing back every :attr:`WRITEBACK` bytes (:mod:`checkpoint.storage.writeback`), so
    the device works while later bytes are copied. Small tensors are copied into one staging
    buffer and written with one ``pwrite`` per buffer instead of one syscall each (a checkpoint
    with 10^5 small tensors would otherwise spend its time in syscalls); a tensor of one digest
    chunk at most that is not small is written straight from its memory and hashed right after,
    from cache (a syscall costs less than copying it through the buffer, and less than a handoff
    to the hash thread). Call :meth:`write` for each slot in byte order, then :meth:`finish`.
    """

    # Tensors below this many bytes go through the staging buffer (copying 64 KiB costs about
    # what one more pwrite does).
    SMALL = 64 << 10
    BUFFER = 8 << 20
    # Large tensors: hashed on the hash thread beside the pwrite when a CPU is idle as the file is
    # started (_spare_core), else each 1 MiB digest chunk on the writing thread right after its
    # pwrite, from cache. HASH_INLINE = True / False forces either (the bench's sides). Why:
    # with no idle core the hash thread takes the cores the writes need (more wall time than
    # hashing inline, from cache, for about the same CPU); with an idle core it hides the hash
    # beside the writes (tests/bench/save_phases.py compares the sides).
    PIECE = 8 << 20  # bytes per pwrite of a large tensor hashed on the hash thread
    HASH_INLINE: bool | None = None
    WRITEBACK = 8 << 20  # bytes written between two writeback starts (real disks only)

    def __init__(self, path: str, plan: FilePlan):
        self.path, self.plan = path, plan
        self.header_digest = digest.hexdigest(plan.header)
        self.tensor_digests: dict[str, str] = {}
        self._next = 0
        # Sized to the plan's small tensors: zero-filling 8 MiB costs ~1 ms a file when none are small.
        small = sum(x.end - x.begin for x in plan.slots if x.end - x.begin < self.SMALL)
        self._buf_view = memoryview(bytearray(min(self.BUFFER, small)))
        self._buf_len = 0
        self._buf_at = plan.data_start  # file offset of the staging buffer's first byte
        self.fd = create_shard_file(path, plan)
        self._writeback = writeback.available() and not fskind.in_memory_dir(os.path.dirname(os.path.abspath(path)))
        inline = self.HASH_INLINE
        self._inline = _hasher() is None or (inline if inline is not None else not _spare_core())
        self._started = 0  # writeback started for bytes [0, _started)

    def write(self, slot: TensorSlot, tensor: torch.Tensor) -> None:
        if slot is not self.plan.slots[self._next]:
            raise RuntimeError(f"{slot.spec.fqn!r} written out of order in {self.plan.name}")
        check_matches(slot, tensor)
        data = tensor_bytes(tensor)
        n = len(data)
        if n < self.SMALL:
            if self._buf_len + n > len(self._buf_view):
                self._flush()
            if self._buf_len == 0:
                self._buf_at = slot.begin
            staged = self._buf_view[self._buf_len : self._buf_len + n]
            staged[:] = data
            self.tensor_digests[slot.spec.fqn] = digest.tensor_hexdigest(staged)  # hashed from cache
            self._buf_len += n
        else:
            self._flush()
            if self._inline or n <= digest.TENSOR_CHUNK:
                self.tensor_digests[slot.spec.fqn] = self._write_hashing(data, slot.begin)
            else:
                self.tensor_digests[slot.spec.fqn] = self._write_beside_hash(data, slot.begin)
        self._next += 1

    def _write_hashing(self, data: memoryview, at: int) -> str:
        """Write ``data`` at file offset ``at`` one digest chunk (:data:`digest.TENSOR_CHUNK`) at a
        time, each chunk hashed right after its ``pwrite`` while it is still in cache (the copy
        into the file reads it from memory, the hash from cache: ~35 GB/s against ~7 from memory).
        Returns the tensor's format-version-3 digest."""
        c, n = digest.TENSOR_CHUNK, len(data)
        top = digest.new()
        one = digest.xxh3_128_digest
        fd, d = self.fd, b""
        for lo in range(0, n, c):
            piece = data[lo : lo + c]
            pwrite_all(fd, piece, at + lo)
            d = one(piece)
            top.update(d)
            self._wrote(at + lo + len(piece))
        return d.hex() if n <= c else top.hexdigest()

    def _write_beside_hash(self, data: memoryview, at: int) -> str:
        """Write ``data`` at file offset ``at`` while the hash thread reads the same memory (both
        from memory; neither waits for the other until the tensor's end); the tensor's digest."""
        n = len(data)
        # xxhash releases the GIL: the hash runs beside the pwrite of `data`.
        hashed = _hasher().submit(digest.tensor_hexdigest, data)
        try:
            for lo in range(0, n, self.PIECE):
                pwrite_all(self.fd, data[lo : lo + self.PIECE], at + lo)
                self._wrote(at + min(n, lo + self.PIECE))
        finally:
            # Waited for on every exit path, Ctrl-C included: the hash reads the caller's tensor.
            ownership.settle([hashed])
        return hashed.result()

    def _wrote(self, end: int) -> None:
        """Bytes up to file offset ``end`` are written: start their writeback every WRITEBACK bytes."""
        if self._writeback and end - self._started >= self.WRITEBACK:
            writeback.start_writeback(self.fd, self._started, end - self._started)
            self._started = end

    def _flush(self) -> None:
        if self._buf_len:
            pwrite_all(self.fd, self._buf_view[: self._buf_len], self._buf_at)
            self._wrote(self._buf_at + self._buf_len)
            self._buf_len = 0

    def finish(self) -> FileRecordV2:
        """Write what is staged, fsync and close; returns the file's index record."""
        if self._next != len(self.plan.slots):
            raise RuntimeError(f"{self.plan.name}: {len(self.plan.slots) - self._next} tensors not written")
        self._flush()
        faults.fault_point("before_file_fsync")
        os.fsync(self.fd)
        self.close()
        faults.fault_point("after_file_fsync")
        return FileRecordV2(
            size=self.plan.size,
            digest=digest.combine(self.header_digest, self.tensor_digests.values()),
            header=self.header_digest,
            tensors=self.tensor_digests,
        )

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def distributed_record(plan: FilePlan, tensor_digests: dict[str, str]) -> FileRecordV2:
    """Format-version-2 record of a shard file of a distributed save: the header digest from the
    plan's header bytes (the ones written), tensor digests (any order) put in byte order."""
    header = digest.hexdigest(plan.header)
    tensors = {s.spec.fqn: tensor_digests[s.spec.fqn] for s in plan.slots}
    return FileRecordV2(
        size=plan.size, digest=digest.combine(header, tensors.values()), header=header, tensors=tensors
    )

