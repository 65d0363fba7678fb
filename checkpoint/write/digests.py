"""Stage 3 of the write pipeline, digest: every tensor's digest (format version 3: xxh3-128 over
:data:`checkpoint.storage.digest.TENSOR_CHUNK` chunks, see :mod:`checkpoint.storage.digest`)
from the bytes the writers hashed beside their writes, and the few chunks no writer held whole
read back from the files once every writer is done.

A tensor its writer holds whole is hashed from memory beside its ``pwrite``
(:func:`checkpoint.write.parts.write_hashed`). Of a tensor split over ranks each rank hashes the
chunks lying in its own bytes from its own memory beside their ``pwrite`` and notes the chunks
starting in its bytes that run into another rank's (:func:`checkpoint.write.parts.write_chunked`):
those are read back here (:func:`read_back_chunks`, at most two per tensor and rank for
``Shard(0)``), and the chunk digests of all ranks joined (:func:`joined_digest`). Every chunk is
hashed by the one rank writing its first byte, so no byte is hashed twice.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

from ..errors import RankMismatchError
from ..storage import digest, ownership, threads
from ..testing import faults

# The chunk digests a writer hashed: {fqn: [(chunk index, 16-byte digest)]}; and the chunks it must
# read back: {file: [(fqn, chunk index, file begin, file end)]}.
Chunks = dict[str, list[tuple[int, bytes]]]
Back = dict[str, list[tuple[str, int, int, int]]]


def read_back_chunks(staging_dir: str, back: Mapping[str, list]) -> Chunks:
    """Digests of the chunks in ``back`` (``{file: [(fqn, chunk index, begin, end)]}``), read back
    from the staged files with ``preadv`` (never through a mapping: a file cut short fails here
    rather than killing the process with SIGBUS), once every rank wrote them.

    Raises:
        OSError: a file ends before a chunk does (cut short) or cannot be read.
    """
    out: Chunks = {}
    buf = memoryview(bytearray(digest.TENSOR_CHUNK))
    for name, items in back.items():
        fd = os.open(os.path.join(staging_dir, name), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            for fqn, j, b, e in sorted(items, key=lambda x: x[2]):
                view = buf[: e - b]
                got = 0
                while got < len(view):
                    n = os.preadv(fd, [view[got:]], b + got)
                    if n <= 0:
                        raise OSError(f"{os.path.join(staging_dir, name)} ends before byte {e} of {fqn!r} (cut short?)")
                    got += n
                out.setdefault(fqn, []).append((j, xxhash.xxh3_128_digest(view)))
        finally:
            os.close(fd)
    return out


def fsync_file(path: str) -> None:
    """``fsync`` one staged file (flushes every writer's pages of it), between the fault points
    the crash tests kill at."""
    fd = os.open(path, os.O_RDONLY)
    try:
        faults.fault_point("before_file_fsync")
        os.fsync(fd)
    finally:
        os.close(fd)
    faults.fault_point("after_file_fsync")


def settle_files(staging_dir: str, fsync_names: Sequence[str], back: Back, fsync_threads: int = 1) -> Chunks:
    """Once every writer is done: ``fsync`` the files ``fsync_names`` (on ``fsync_threads``
    threads; fsync releases the GIL) while the hash thread reads back the chunks of ``back``
    (:func:`read_back_chunks`); returns their digests.

    Raises:
        OSError: a failed fsync or read back."""
    pool = threads.pool("hash-back", 1) if threads.cpus() >= 2 else None
    todo = {n: v for n, v in back.items() if v}
    reading = pool.submit(read_back_chunks, staging_dir, todo) if pool and todo else None
    try:
        paths = [os.path.join(staging_dir, n) for n in fsync_names]
        if fsync_threads > 1 and len(paths) > 1:
            with ThreadPoolExecutor(min(fsync_threads, len(paths))) as ex:
                list(ex.map(fsync_file, paths))
        else:
            for p in paths:
                fsync_file(p)
    finally:
        ownership.settle([reading] if reading is not None else [])
    return reading.result() if reading is not None else read_back_chunks(staging_dir, todo) if todo else {}


def chunk_runs(chunks: Mapping[str, list[tuple[int, bytes]]]) -> dict[str, list[tuple[int, bytes]]]:
    """``{fqn: [(first chunk index, concatenated digests of consecutive chunks)]}``: the chunk
    digests of :func:`checkpoint.write.parts.write_chunked` packed for the gather (16 bytes a
    chunk: 1.6 MB per 100 GB)."""
    out: dict[str, list[tuple[int, bytes]]] = {}
    for fqn, items in chunks.items():
        runs: list[tuple[int, list[bytes]]] = []
        for j, d in sorted(items):
            if runs and runs[-1][0] + len(runs[-1][1]) == j:
                runs[-1][1].append(d)
            else:
                runs.append((j, [d]))
        out[fqn] = [(j, b"".join(ds)) for j, ds in runs]
    return out


def joined_digest(fqn: str, runs: list[tuple[int, bytes]], nbytes: int) -> str:
    """The tensor digest of ``fqn`` (``nbytes`` bytes) from every rank's runs of chunk digests
    (:func:`chunk_runs`); every chunk must be there exactly once.

    Raises:
        RuntimeError: chunks missing or hashed twice (a bug of the writers' plan)."""
    if nbytes == 0:
        return digest.hexdigest(b"")
    joined = b"".join(d for _, d in sorted(runs))
    want = digest.chunk_count(nbytes, digest.TENSOR_CHUNK)
    starts = sorted(runs)
    if len(joined) != 16 * want or any(j != sum(len(d) for _, d in starts[:i]) // 16 for i, (j, _) in enumerate(starts)):
        raise RuntimeError(f"{fqn!r}: the ranks hashed {len(joined) // 16} of its {want} digest chunks (a save bug)")
    return joined.hex() if want == 1 else digest.hexdigest(joined)


def tensor_digests(
    whole: Sequence[Mapping[str, str]], runs: Sequence[Mapping[str, list[tuple[int, bytes]]]], sizes: Mapping[str, int]
) -> dict[str, str]:
    """Every tensor's digest: those hashed whole by their writer (``whole[r]``: rank or item
    ``r``'s ``{fqn: digest}``), the others joined from every writer's chunk runs (``runs[r]``,
    :func:`chunk_runs`); ``sizes``: ``{fqn: tensor bytes}`` of every tensor written.

    Raises:
        RuntimeError: a tensor's chunks were not each hashed once (:func:`joined_digest`)."""
    out: dict[str, str] = {}
    pieces: dict[str, list[tuple[int, bytes]]] = {}
    for w in whole:
        out.update(w)
    for r in runs:
        for fqn, rs in r.items():
            pieces.setdefault(fqn, []).extend(rs)
    for fqn, n in sizes.items():  # split tensors (an empty one has no chunk written)
        if fqn not in out:
            out[fqn] = joined_digest(fqn, pieces.get(fqn, []), n)
    return out


def check_covered(path: Any, covered: Sequence[Mapping[str, int]], numel: Mapping[str, int]) -> None:
    """Every DTensor written whole by the ranks together (``covered[r][fqn]``: elements rank
    ``r`` wrote of it): ranks that hold one DTensor with different placements (an SPMD program
    that diverged) would leave rows no rank writes, zeros in a checkpoint whose digests still
    match, or write rows twice. The same verdict on every rank (the counts were gathered).

    Raises:
        RankMismatchError: naming the tensor and what each rank wrote; nothing is committed.
    """
    for fqn in sorted({k for c in covered for k in c}):
        total = sum(c.get(fqn, 0) for c in covered)
        if total != numel.get(fqn, total):
            per_rank = {r: f"{c.get(fqn, 0)} elements" for r, c in enumerate(covered)}
            raise RankMismatchError(
                f"saving {path}", f"the shards of DTensor {fqn!r}", per_rank,
                note=f"together they cover {total} of its {numel[fqn]} elements (placements differ between ranks?); nothing was committed",
            )  # fmt: skip
