"""Digests of what a read will cover, taken before any target is written: the read pipeline's
one data check (:meth:`checkpoint.storage.reader.CheckpointReader.check_first` calls it for
every entry point, placement and file kind).

A load that copied each tensor into its target while hashing it would find a flipped byte only
after the target held it: a model half-overwritten by a checkpoint that is then refused. So the
bytes a load covers are hashed first, on the read threads, and only a checkpoint whose digests
all match is copied into the targets. A file mapped under a read lease for the load
(:mod:`~.leased`) is hashed straight from its mapped pages (no kernel copy; the lease keeps every
writer out until the copies are done, so they copy the bytes hashed here); any other file through
one small buffer per thread, read with ``preadv`` (the buffer stays in the CPU cache between the
read and the hash).

Units hashed (see :mod:`~.digest` for the scheme): a tensor whose digest is one xxh3-128 (format
version 2, or a tensor of at most one chunk) is hashed whole; a larger tensor of format version 3
in its chunks, by index, so that a tensor split over ranks (``Shard(0)`` rows) is checked from the
chunks each rank hashes in its own rows, combined after an exchange.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from ..errors import CorruptCheckpointError, LoadError
from . import digest as _digest
from . import leased, ownership
from .pread import PIECE, threads_for
from .writer import stats

_BUFFER = PIECE  # bytes one thread hashes per step (read into a buffer that stays in cache, or a mapped view)


class Unit(NamedTuple):
    """One digest to take: file bytes ``[lo, hi)`` of tensor ``key`` in file ``path`` (open as
    ``fd``); ``chunk`` is the chunk's index (format version 3), or None for the tensor's plain
    xxh3-128 of all its bytes."""

    fd: int
    path: str
    key: str
    chunk: int | None
    lo: int
    hi: int


def tensor_units(fd: int, path: str, key: str, begin: int, end: int, chunk: int | None,
                 first: int = 0, stop: int | None = None) -> list[Unit]:  # fmt: skip
    """The units of tensor ``key`` (file bytes ``[begin, end)``): its plain digest when ``chunk``
    is None (format version 2) or the tensor is at most one chunk, else its chunks ``first`` to
    ``stop`` (default: all) of ``chunk`` bytes, the last one shorter."""
    if chunk is None or end - begin <= chunk:
        return [Unit(fd, path, key, None, begin, end)]
    n = _digest.chunk_count(end - begin, chunk)
    stop = n if stop is None else min(stop, n)
    return [Unit(fd, path, key, i, begin + i * chunk, min(end, begin + (i + 1) * chunk)) for i in range(first, stop)]


def row_chunks(nbytes: int, chunk: int, lo: int, hi: int) -> tuple[int, int]:
    """``(first, stop)``: the chunks (of ``chunk`` bytes, of a tensor of ``nbytes``) whose first
    byte lies in the tensor's bytes ``[lo, hi)`` (a rank's rows): each chunk is hashed by exactly
    one of the ranks whose rows partition the tensor."""
    n = _digest.chunk_count(nbytes, chunk)
    return min(n, -(-lo // chunk)), min(n, -(-hi // chunk))


def _groups(units: Sequence[Unit]) -> list[list[Unit]]:
    """Units in file order cut into groups read by one ``preadv`` each: adjacent units of one
    file, at most :data:`_BUFFER` bytes together (a larger unit is a group of its own, read in
    steps through the buffer)."""
    out: list[list[Unit]] = []
    cur: list[Unit] = []
    for u in sorted(units, key=lambda u: (u.fd, u.lo, u.hi)):
        if cur and (u.fd != cur[-1].fd or u.lo != cur[-1].hi or u.hi - cur[0].lo > _BUFFER):
            out.append(cur)
            cur = []
        cur.append(u)
    if cur:
        out.append(cur)
    return out


_local = threading.local()


def _buffer() -> memoryview:
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) != _BUFFER:  # (made at another size while _BUFFER was patched)
        buf = _local.buf = memoryview(bytearray(_BUFFER))
    return buf


def _read(fd: int, view: memoryview, pos: int, u: Unit) -> None:
    """Fill ``view`` from file offset ``pos``; a short file is corrupt (names file and tensor)."""
    got = 0
    while got < len(view):
        try:
            n = os.preadv(fd, [view[got:]], pos + got)
        except OSError as e:
            raise LoadError(u.key, u.path, f"{type(e).__name__}: {e}") from e
        if n <= 0:
            raise CorruptCheckpointError(u.path, f"tensor {u.key!r}: file ends early", key=u.key)
        got += n


def _hash_mapped(group: list[Unit], out: dict, m: leased.LeasedMap) -> bool:
    """:func:`_hash_group` from the file's leased mapping, the lease checked before each
    :data:`_BUFFER` bytes (a group of small units in one view); False where the lease is broken
    before the group is done (the caller then hashes it through the buffer, from the start)."""
    lo, hi = group[0].lo, group[-1].hi
    if hi - lo <= _BUFFER:
        view = m.view(lo, hi)
        if view is None:
            return False
        with view:  # (released before the mapping can close)
            got = {}
            for u in group:
                h = _digest.new(view[u.lo - lo : u.hi - lo])
                got[(u.key, u.chunk)] = h.digest() if u.chunk is not None else h.hexdigest()
        out.update(got)
        return True
    (u,) = group  # one unit larger than the buffer, hashed in steps
    h = _digest.new()
    for pos in range(lo, hi, _BUFFER):
        view = m.view(pos, min(hi, pos + _BUFFER))
        if view is None:
            return False
        with view:
            h.update(view)
    out[(u.key, u.chunk)] = h.digest() if u.chunk is not None else h.hexdigest()
    return True


def _hash_group(group: list[Unit], out: dict) -> None:
    m = leased.mapping(group[0].fd)
    if m is not None and _hash_mapped(group, out, m):
        return
    buf = _buffer()
    lo, hi = group[0].lo, group[-1].hi
    if hi - lo <= len(buf):
        view = buf[: hi - lo]
        _read(group[0].fd, view, lo, group[0])
        for u in group:
            piece = view[u.lo - lo : u.hi - lo]
            # A hasher object's update gives up the GIL (the one-shot functions hold it).
            h = _digest.new(piece)
            out[(u.key, u.chunk)] = h.digest() if u.chunk is not None else h.hexdigest()
        return
    (u,) = group  # one unit larger than the buffer: a plain digest, streamed through it
    h = _digest.new()
    pos = lo
    while pos < hi:
        view = buf[: min(len(buf), hi - pos)]
        _read(u.fd, view, pos, u)
        h.update(view)
        pos += len(view)
    out[(u.key, u.chunk)] = h.digest() if u.chunk is not None else h.hexdigest()


def hash_units(units: Iterable[Unit], threads: bool = True) -> dict[tuple[str, int | None], bytes | str]:
    """``{(key, chunk): digest}`` of every unit (16 bytes for a chunk, the hex digest for a plain
    unit), read with ``preadv`` and hashed by the calling thread and the read pool's threads,
    each through its own buffer; every thread has stopped before this returns or raises.

    Raises:
        CorruptCheckpointError: a file ends before a unit (file and tensor named).
        LoadError: a read fails (tensor and file named).
    """
    groups = _groups(list(units))
    out: dict[tuple[str, int | None], bytes | str] = {}
    if not groups:
        return out
    workers = threads_for(sum(g[-1].hi - g[0].lo for g in groups), len(groups)) if threads else 1
    if workers <= 1:  # (threads=False: bytes still on the device, read in file order for readahead)
        for g in groups:
            _hash_group(g, out)
        return out
    # (distinct keys per group: the dict's stores are atomic under the GIL)
    ownership.share_queue("read", workers, groups, lambda g: _hash_group(g, out))
    return out


_ONE_SHOT = 64 << 10  # tensors under this are hashed by the one-shot call (it holds the GIL)


def check_plain(fd: int, path: str, items: list[tuple[int, int, str]], want: dict[str, str]) -> None:
    """Check tensors of one plain xxh3-128 digest each (format version 2, or at most one chunk of
    version 3): ``items`` are ``(begin, end, key)`` of file ``path`` (open as ``fd``), ``want``
    the index's digests by key. Adjacent tensors are read (or viewed in the leased mapping) in
    groups of up to :data:`_BUFFER` bytes shared by the read threads, each hashed and compared
    where it lies: no object per tensor, for loads of 10^4-10^5 small tensors.

    Raises:
        CorruptCheckpointError: the first tensor in file order whose bytes differ from its digest,
            or whose file ends early (file and tensor named; ``key`` set).
        LoadError: a read fails (tensor and file named).
    """
    items = sorted(items)
    groups: list[list[tuple[int, int, str]]] = []
    cur: list[tuple[int, int, str]] = []
    for it in items:
        if cur and (it[0] != cur[-1][1] or it[1] - cur[0][0] > _BUFFER):
            groups.append(cur)
            cur = []
        cur.append(it)
    if cur:
        groups.append(cur)
    bad: list[tuple[int, str, str]] = []  # (begin, key, digest found)

    def one(group: list[tuple[int, int, str]]) -> None:
        lo, hi = group[0][0], group[-1][1]
        if len(group) == 1 and hi - lo > _BUFFER:  # one tensor larger than the buffer
            b, e, k = group[0]
            got = hash_units([Unit(fd, path, k, None, b, e)])[(k, None)]
            if got != want[k]:
                bad.append((b, k, got))
            return
        m = leased.mapping(fd)
        view = m.view(lo, hi) if m is not None else None
        mapped = view is not None
        if not mapped:
            view = _buffer()[: hi - lo]
            try:
                _read(fd, view, lo, Unit(fd, path, group[0][2], None, lo, hi))
            except CorruptCheckpointError:  # the file ends early: name the tensor it ends in
                size = os.fstat(fd).st_size
                k = next((k for b, e, k in group if e > size), group[0][2])
                raise CorruptCheckpointError(path, f"tensor {k!r}: file ends early", key=k) from None
        one_shot, new = _digest.hexdigest, _digest.new
        try:
            for b, e, k in group:
                piece = view[b - lo : e - lo]
                got = one_shot(piece) if e - b < _ONE_SHOT else new(piece).hexdigest()
                del piece
                if got != want[k]:
                    bad.append((b, k, got))
        finally:
            if mapped:
                view.release()  # (before the mapping can close)

    nbytes = items[-1][1] - items[0][0] if items else 0
    workers = threads_for(nbytes, len(groups))
    if workers <= 1:
        for g in groups:
            one(g)
    else:
        ownership.share_queue("read", workers, groups, one)
    stats.bytes_checked += sum(e - b for b, e, _ in items)
    stats.tensors_checked += len(items)
    if bad:
        b, k, got = min(bad)
        check_tensor_digest(path, k, got, want[k])


class Whole(NamedTuple):
    """A tensor to check whole: file bytes ``[begin, end)`` of ``key`` in file ``path`` (open as
    ``fd``), whose recorded digest is ``want``."""

    key: str
    fd: int
    path: str
    begin: int
    end: int
    want: str


def check_whole(tensors: Sequence[Whole], chunk: int | None, threads: bool = True) -> None:
    """Hash every tensor of ``tensors`` (:func:`hash_units`, digest chunk ``chunk``: the index's
    ``tensor_digest_chunk``, None for format version 2) and compare it with its recorded digest,
    in file order; the first mismatch raises.

    Raises:
        CorruptCheckpointError: a tensor's bytes differ from its digest, or its file ends early
            (file and tensor named; ``key`` set).
        LoadError: a read fails (tensor and file named).
    """
    units = [u for t in tensors for u in tensor_units(t.fd, t.path, t.key, t.begin, t.end, chunk)]
    got = hash_units(units, threads)
    stats.bytes_checked += sum(u.hi - u.lo for u in units)
    stats.tensors_checked += len(tensors)
    for t in sorted(tensors, key=lambda t: (t.path, t.begin)):
        check_tensor_digest(t.path, t.key, tensor_digest(got, t.key, t.end - t.begin, chunk), t.want, chunk)


def check_tensor_digest(path: str, key: str, data: object, want: str, chunk: int | None = None) -> None:
    """Check ``data`` (all of tensor ``key``'s stored bytes: a buffer, a hasher of
    :func:`~.digest.tensor_hasher` fed every byte, or their hex digest) against ``want``, the
    index's digest of ``key`` (file ``path``; ``chunk``: the index's ``tensor_digest_chunk``,
    None for format version 2): the one check of every reader of fqnckpt checkpoints.

    Raises:
        CorruptCheckpointError: the digests differ (file and tensor named; ``key`` set).
    """
    if isinstance(data, str):  # a hex digest already taken
        got = data
    else:
        got = data.hexdigest() if hasattr(data, "hexdigest") else _digest.tensor_hexdigest(data, chunk)
    if got != want:
        raise CorruptCheckpointError(
            path,
            f"tensor {key!r}: its bytes differ from the index's xxh3-128 digest ({got} != {want}); "
            "flipped or overwritten bytes (`fqnckpt verify` lists every such tensor)",
            key=key,
        )



def tensor_digest(got: dict, key: str, nbytes: int, chunk: int | None) -> str:
    """Tensor ``key``'s digest (:func:`~.digest.tensor_hexdigest`'s value) from the units of
    :func:`tensor_units` hashed by :func:`hash_units`."""
    if chunk is None or nbytes <= chunk:
        return got[(key, None)]
    return _digest.combine_chunks([got[(key, i)] for i in range(_digest.chunk_count(nbytes, chunk))])
