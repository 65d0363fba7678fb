"""Integrity digests of format versions 2 and 3: xxh3-128 of each tensor's bytes (version 3: in
chunks above 1 MiB, see below), of each file's header, and of the index itself.

Why xxh3-128: on one thread it hashes at about the speed of a memory copy, several times faster
than sha256, crc32 or blake2/3 (the benchmarks page of the documentation measures them side by
side), so hashing each chunk just before ``pwrite`` reads it (while it is in cache)
costs about one extra pass over cached data, and its 128 bits make accidental collisions
negligible (crc32c's 32 bits are not). It guards against corruption, not tampering: an attacker
who can rewrite files can rewrite the index too.

Scheme (a file is ``[8-byte length][JSON header][tensor bytes, no holes]``, see
:mod:`checkpoint.storage.layout`): the index records per file its byte ``size``, ``header`` =
xxh3-128 of bytes ``[0, data_start)``, ``tensors`` = {FQN: xxh3-128 of the tensor's row-major
bytes} and ``digest`` = :func:`combine` of those. The header fixes every tensor's byte range and
the ranges cover the rest of the file, so every byte is covered. A tensor's digest does not depend
on the file, offset or sharding it was saved with, so two checkpoints can be compared tensor by
tensor. The index carries ``index_xxh3_128``, the digest of its own bytes with that value zeroed.

Format version 3 (written now) changes one thing: a tensor of more than ``chunk`` bytes
(``metadata.fqnckpt.tensor_digest_chunk``, :data:`TENSOR_CHUNK` = 1 MiB) is digested as xxh3-128
of the concatenated 16-byte xxh3-128 digests of its consecutive ``chunk``-byte pieces (the last
one shorter); a tensor of at most ``chunk`` bytes keeps version 2's plain digest
(:func:`tensor_hexdigest`, :class:`ChunkedHasher`). Why: xxh3 cannot combine digests of parts, so
with version 2 a tensor split over ranks (``Shard(0)``) had to be read back from the file and
hashed by one rank after every rank wrote it, which cost a large share of a distributed save's
CPU (the hashing and the reading back).
With fixed chunks each rank hashes the chunks lying in its own bytes from its own memory while it
writes them, and reads back only the at most two chunks per tensor and rank that straddle another
rank's bytes. Still layout-independent (same digest whatever file, offset or sharding), every
byte covered, any flipped byte changes its chunk's digest and so the tensor's.
"""

from __future__ import annotations

import bisect
import json
import os
import struct
import threading
from collections.abc import Iterable, Sequence

import xxhash

ALGORITHM = "xxh3_128"
HEX_LEN = 32
ZERO = "0" * HEX_LEN
CHUNK = 8 << 20  # bytes hashed then written per step: stays in cache between the two
INDEX_FIELD = "index_xxh3_128"

hexdigest = xxhash.xxh3_128_hexdigest
xxh3_128_digest = xxhash.xxh3_128_digest  # (one chunk's 16-byte digest)
new = xxhash.xxh3_128
TENSOR_CHUNK = 1 << 20  # format version 3's tensor digest chunk (bytes)


def chunk_digest(data) -> bytes:
    """The 16-byte xxh3-128 digest of ``data`` (a chunk), computed without the GIL: python-xxhash's
    one-shot ``xxh3_128_digest`` holds it for the whole hash, a hasher object's update gives it
    up, so threads hashing chunks (read and save pools) run side by side."""
    return new(data).digest()


def _bytes_view(data) -> memoryview:
    v = data if isinstance(data, memoryview) else memoryview(data)
    return v if v.format == "B" and v.ndim == 1 else v.cast("B")


def tensor_hexdigest(data, chunk: int | None = 0) -> str:
    """Digest of a tensor's row-major bytes ``data``: format version 3's chunked digest (see the
    module docstring) with ``chunk``-byte chunks (0: :data:`TENSOR_CHUNK`, what saves write, read
    when called), or version 2's plain xxh3-128 for ``chunk=None`` (and for any tensor of at most
    ``chunk`` bytes: the two agree there)."""
    chunk = chunk or TENSOR_CHUNK if chunk is not None else None
    if chunk is None:
        return hexdigest(data)
    v = _bytes_view(data)  # (len() of a typed view counts items, not bytes)
    if len(v) <= chunk:
        return hexdigest(v)
    top = new()
    for lo in range(0, len(v), chunk):
        top.update(chunk_digest(v[lo : lo + chunk]))
    return top.hexdigest()


def combine_chunks(chunks: Sequence[bytes]) -> str:
    """A format-version-3 tensor digest from the 16-byte digests of all its chunks, in order: what
    :func:`tensor_hexdigest` returns for the tensor's bytes."""
    if len(chunks) == 1:
        return chunks[0].hex()  # at most one chunk: the plain digest
    top = new()
    for c in chunks:
        top.update(c)
    return top.hexdigest()


def chunk_count(nbytes: int, chunk: int) -> int:
    """Number of chunks of a tensor of ``nbytes`` bytes (one for an empty tensor)."""
    return max(1, -(-nbytes // chunk))


class ChunkedHasher:
    """Streaming :func:`tensor_hexdigest` with ``chunk``-byte chunks: ``update`` with the tensor's
    bytes in order (pieces of any size), then ``hexdigest``. Same interface as an ``xxhash``
    hasher, so readers feed either."""

    __slots__ = ("chunk", "top", "cur", "fill", "count", "first")

    def __init__(self, chunk: int):
        self.chunk, self.top, self.cur = chunk, new(), new()
        self.fill = self.count = 0  # bytes in the current chunk; chunks finished
        self.first = b""  # the first chunk's digest (the answer when it is the only one)

    def update(self, data) -> None:
        v = _bytes_view(data)
        pos, n = 0, len(v)
        while pos < n:
            take = min(self.chunk - self.fill, n - pos)
            if take == self.chunk:  # a whole chunk at once: no hasher state
                d = chunk_digest(v[pos : pos + take])
            else:
                self.cur.update(v[pos : pos + take])
                self.fill += take
                pos += take
                if self.fill < self.chunk:
                    continue
                d = self.cur.digest()
                self.cur.reset()
                self.fill = 0
                take = 0
            pos += take
            if not self.count:
                self.first = d
            self.top.update(d)
            self.count += 1

    def add_chunks(self, digests: Sequence[bytes]) -> None:
        """Feed the 16-byte digests of the next whole chunks (hashed elsewhere: by the threads
        of a read, each chunk from its own memory, in any order), in order; the last may be the
        tensor's shorter final chunk (then nothing may follow). Only at a chunk boundary."""
        if self.fill:
            raise ValueError("add_chunks inside a chunk")
        for d in digests:
            if not self.count:
                self.first = d
            self.top.update(d)
            self.count += 1

    def hexdigest(self) -> str:
        if self.count == 0:
            return self.cur.hexdigest()
        if self.count == 1 and self.fill == 0:
            return self.first.hex()
        if self.fill == 0:
            return self.top.hexdigest()
        top = self.top.copy()
        top.update(self.cur.digest())
        return top.hexdigest()


def tensor_hasher(chunk: int | None = 0):
    """A streaming hasher of a tensor's bytes for digests of chunk size ``chunk`` (0:
    :data:`TENSOR_CHUNK`; None: format version 2's plain xxh3-128 hasher)."""
    return new() if chunk is None else ChunkedHasher(chunk or TENSOR_CHUNK)


class RunHashes:
    """xxh3-128 of each of ``views`` (consecutive buffers of one read run) whose ``wanted`` flag
    is set, fed by byte ranges ``[lo, hi)`` of their concatenation as reads land
    (:meth:`landed`: a :class:`~.pread.Run`'s ``after``), in any order and from any thread.
    Ranges are hashed in order: by the thread whose range comes next, right after its read
    (while the bytes are in its core's cache); a range landing early is left for the thread
    hashing the one before it, so no thread waits. A run read whole in one call (small tensors
    sharing one ``preadv``) is hashed view by view in one call each (no hasher object per
    tensor). Why: a load checked after all reads hashed every byte once more from memory on the
    calling thread alone.
    ``chunk``: the index's tensor digest chunk (format version 3), None for version 2. With a
    chunk, one wanted view of more than a chunk and ranges made of whole chunks (a read's pieces
    are multiples of it), each range's chunks are hashed by the thread that read them, in any
    order, no range left for another thread (:attr:`chunks`); a range cutting a chunk leaves
    the run incomplete (the caller hashes the view whole)."""

    __slots__ = (
        "views", "wanted", "chunk", "hashers", "digests", "starts", "total", "next", "pending", "busy", "lock",
        "chunks", "cut",
    )

    def __init__(self, views: Sequence, wanted: Sequence[bool], chunk: int | None = None):
        self.views, self.wanted, self.chunk = views, wanted, chunk  # (byte views made when a first range is partial)
        self.hashers: list | None = None  # streaming hashers, made then too
        self.digests: list[str | None] = []
        self.starts: list[int] = []
        self.total, self.next, self.busy = sum(len(v) for v in views), 0, False
        self.pending: dict[int, int] = {}
        self.lock = threading.Lock()
        self.chunks: list[bytes | None] | None = None  # format 3, one view: each chunk's digest, by index
        self.cut = False  # a range cut a chunk (format 3, one view)
        if chunk and len(views) == 1 and wanted[0] and self.total > chunk:
            self.chunks = [None] * chunk_count(self.total, chunk)

    def landed(self, lo: int, hi: int) -> None:
        """Bytes ``[lo, hi)`` were read: hash them now if they come next (and every range waiting
        after them), else leave them to the thread hashing the range before (format 3, one
        view: hash the range's chunks now, whatever lands before or after)."""
        if lo == 0 and hi == self.total and self.next == 0:  # the whole run at once
            self.digests = [tensor_hexdigest(v, self.chunk) if w else None for v, w in zip(self.views, self.wanted)]
            self.next = hi
            return
        if self.chunks is not None:
            c = self.chunk
            if lo % c or (hi % c and hi != self.total):
                self.cut = True
                return
            v = _bytes_view(self.views[0])
            for a in range(lo, hi, c):  # (a hasher's update gives up the GIL; xxh3_128_digest does not)
                self.chunks[a // c] = new(v[a : min(a + c, hi)]).digest()
            return
        with self.lock:
            self.pending[lo] = hi
            if self.busy:
                return
            self.busy = True
            if self.hashers is None:
                self.views = [v if isinstance(v, memoryview) else memoryview(v).cast("B") for v in self.views]
                pos = 0
                for v in self.views:
                    self.starts.append(pos)
                    pos += len(v)
                self.hashers = [tensor_hasher(self.chunk) if w else None for w in self.wanted]
        done = None
        try:
            while True:
                with self.lock:
                    if done is not None:
                        self.next = done
                    end = self.pending.pop(self.next, None)
                    if end is None:
                        self.busy = False
                        return
                    start = self.next
                self._feed(start, end)
                done = end
        except BaseException:
            with self.lock:
                self.busy = False
            raise

    def _feed(self, lo: int, hi: int) -> None:
        i = bisect.bisect_right(self.starts, lo) - 1
        while i < len(self.views) and self.starts[i] < hi:
            h, s = self.hashers[i], self.starts[i]
            if h is not None:
                h.update(self.views[i][max(lo, s) - s : min(hi, s + len(self.views[i])) - s])
            i += 1

    def complete(self) -> bool:
        """Whether every byte was hashed (False after a failed read)."""
        if self.next == self.total:
            return True
        return self.chunks is not None and not self.cut and all(d is not None for d in self.chunks)

    def digest(self, i: int) -> str | None:
        """The hex digest of view ``i`` (None when not wanted); call once :meth:`complete`."""
        if self.chunks is not None and self.next != self.total:
            return combine_chunks(self.chunks)
        if self.hashers is not None:
            h = self.hashers[i]
            return h.hexdigest() if h is not None else None
        return self.digests[i]


def combine(header: str, tensors: Iterable[str]) -> str:
    """File-level digest: xxh3-128 of the header digest followed by the tensor digests in byte order."""
    h = xxhash.xxh3_128(bytes.fromhex(header))
    for d in tensors:
        h.update(bytes.fromhex(d))
    return h.hexdigest()


def hash_file(path: str, chunk: int | None) -> tuple[int, str, dict[str, str]]:
    """Read shard file ``path`` once: ``(size, header digest, {tensor name: digest})``, tensors in
    byte order, tensor digests with chunk size ``chunk`` (None: format version 2). The header's
    own structure is validated elsewhere (``safe_open``); here a header
    that cannot be parsed yields no tensor digests (then they mismatch the index).
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < 8:
            return size, hexdigest(f.read()), {}
        (n,) = struct.unpack("<Q", f.read(8))
        n = min(n, size - 8)
        raw = f.read(n)
        f.seek(0)
        header = hexdigest(f.read(8 + n))
        try:
            head = json.loads(raw)
            spans = sorted(
                (int(v["data_offsets"][0]), int(v["data_offsets"][1]), k)
                for k, v in head.items()
                if k != "__metadata__"
            )
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
            return size, header, {}
        base = 8 + n
        out: dict[str, str] = {}
        if not spans or size == base:
            return size, header, {k: hexdigest(b"") for b, e, k in spans if b == e}
        out.update(_hash_ranges(f.fileno(), [(base + max(b, 0), min(base + e, size), k) for b, e, k in spans], size, chunk))
    return size, header, out


def hash_bytes(data, chunk: int | None) -> tuple[int, str, dict[str, str]]:
    """:func:`hash_file` of a safetensors file's bytes ``data`` held in memory (a file a save
    writes whole from bytes, such as peft's ``adapter_model.safetensors``): ``(size, header
    digest, {tensor name: digest})``, tensors in byte order, with chunk size ``chunk``.

    Raises:
        ValueError: ``data`` is not a safetensors file (length, JSON header, offsets).
    """
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise ValueError(f"{len(view)} bytes: not a safetensors file")
    (n,) = struct.unpack("<Q", view[:8])
    if 8 + n > len(view):
        raise ValueError(f"a header of {n} bytes in {len(view)}: not a safetensors file")
    head = json.loads(bytes(view[8 : 8 + n]))
    base = 8 + n
    spans = sorted((int(v["data_offsets"][0]), int(v["data_offsets"][1]), k) for k, v in head.items() if k != "__metadata__")
    if any(not 0 <= b <= e <= len(view) - base for b, e, _ in spans):
        raise ValueError("tensor offsets past the end of the data: not a safetensors file")
    tensors = {k: tensor_hexdigest(view[base + b : base + e], chunk) for b, e, k in spans}
    return len(view), hexdigest(view[:base]), tensors


def _hash_ranges(fd: int, ranges: list[tuple[int, int, str]], size: int, chunk: int | None) -> dict[str, str]:
    """``{name: tensor digest (chunk size ``chunk``) of file bytes [begin, end)}`` for
    ``(begin, end, name)`` in byte order,
    read with ``preadv`` into one reused buffer, small ranges sharing one read. Not through a
    mapping: a file cut short while hashed (a checkpoint truncated or replaced under ``verify``)
    hashes what is there and mismatches, where a mapped read kills the process with SIGBUS."""
    out: dict[str, str] = {}
    buf = bytearray(max(1, min(CHUNK, size)))
    view = memoryview(buf)
    wlo = whi = 0  # file bytes [wlo, whi) are in buf
    for lo, hi, name in ranges:
        h = tensor_hasher(chunk)  # (0: TENSOR_CHUNK)
        while lo < hi:
            if not wlo <= lo < whi:
                got = os.preadv(fd, [view], lo)
                if got <= 0:
                    break  # cut short since the size was taken: the digest mismatches
                wlo, whi = lo, lo + got
            end = min(hi, whi)
            h.update(view[lo - wlo : end - wlo])
            lo = end
        out[name] = h.hexdigest()
    return out


def hash_spans(path: str, spans: Iterable[tuple[str, int, int]], chunk: int | None = 0) -> dict[str, str]:
    """``{name: tensor digest (chunk size ``chunk``) of bytes [begin, end) of file path}`` for each ``(name, begin, end)``,
    read with ``preadv`` (distributed saves: a tensor's bytes were written by several ranks, so one
    rank hashes it back from the page cache; never through a mapping, see :func:`_hash_ranges`).

    Raises:
        OSError: the file cannot be opened, or a span lies past its end (a file cut short).
    """
    spans = list(spans)
    out: dict[str, str] = {}
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for name, b, e in spans:
            if not 0 <= b <= e <= size:
                raise OSError(f"{path}: bytes [{b}, {e}) of {name!r} lie past the file's end ({size} bytes)")
            if b == e:
                out[name] = hexdigest(b"")
        todo = sorted((b, e, name) for name, b, e in spans if b < e)
        if todo:
            out.update(_hash_ranges(f.fileno(), todo, size, chunk))
    return out


def index_bytes_with_digest(text: bytes) -> tuple[bytes, str]:
    """``text`` (an index serialized with ``"index_xxh3_128": "<32 zeros>"``) with the zeros
    replaced by the digest of ``text``, and that digest."""
    placeholder = f'"{INDEX_FIELD}": "{ZERO}"'.encode()
    if text.count(placeholder) != 1:
        raise RuntimeError(f"index text must hold {placeholder!r} exactly once")
    value = hexdigest(text)
    return text.replace(placeholder, f'"{INDEX_FIELD}": "{value}"'.encode()), value


def index_digest_of(raw: bytes, recorded: str) -> str | None:
    """Digest of index bytes ``raw`` whose recorded value is ``recorded`` (recomputed with it
    zeroed); None when the field does not appear exactly once in ``raw``."""
    field = f'"{INDEX_FIELD}": "{recorded}"'.encode()
    if raw.count(field) != 1:
        return None
    return hexdigest(raw.replace(field, f'"{INDEX_FIELD}": "{ZERO}"'.encode()))
