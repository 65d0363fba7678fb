"""Stage 2 of the write pipeline, write: the bytes of the planned files, on a local path (shard files
created with their header in the staging directory, tensor bytes ``pwrite``-n at planned offsets
straight from tensor memory, each tensor hashed beside its write). Object storage streams whole
files instead (:mod:`checkpoint.write.upload`).

- One process (:func:`write_sequential`): each file front to back
  (:class:`checkpoint.storage.writer.SequentialFileWriter`), never read back.
- Many ranks (:func:`create_files`, then :func:`write_owned` on every rank): each rank writes only
  the bytes it owns (:func:`owned_blocks`), once, into the shared preallocated files
  (:class:`checkpoint.storage.writer.BlockWriter`); a DCP ``StorageWriter`` writes the blocks its
  planner gave each rank (:func:`write_block_hashed`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import xxhash
from torch.distributed.tensor import DTensor, Replicate

from ..errors import CheckpointError, CheckpointWriteError
from ..ranks import dist, shards
from ..storage import digest, fskind, ownership, threads
from ..storage.format import FileRecordV2
from ..storage.layout import FilePlan, Layout, TensorSlot, TensorSpec
from ..storage.local_commit import StagedCheckpoint
from ..storage.writer import BlockWriter, SequentialFileWriter, block_runs, create_shard_file, tensor_bytes
from ..testing import faults
from .digests import Back, Chunks
from .plan import Part, plain_writer, walk, walk_starts, whole_on_writer, writes_shard


def fetch_checked(part: Part, spec: TensorSpec) -> torch.Tensor:
    """``part.fetch(spec)`` for a single-process write: a plain tensor with data.

    Raises:
        TypeError: naming the key, for a non-tensor, a DTensor (saved on every rank instead) or a
            meta tensor."""
    t = part.fetch(spec)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"value of {spec.fqn!r} is a {type(t).__name__}, not a tensor")
    if isinstance(t, DTensor):
        raise TypeError(
            f"{spec.fqn!r} is a DTensor: use checkpoint.save on every rank for distributed tensors"
        )
    if t.is_meta:
        raise TypeError(f"{spec.fqn!r} is on the meta device: it has no data to save")
    return t


def fetch_tensor(part: Part, spec: TensorSpec) -> torch.Tensor:
    """``part.fetch(spec)`` for a write on many ranks: a tensor (a DTensor: its global shape) of
    the planned shape and dtype.

    Raises:
        TypeError: a non-tensor; ValueError: shape or dtype differ from the plan (names the key)."""
    t = part.fetch(spec)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"value of {spec.fqn!r} is a {type(t).__name__}, not a tensor")
    if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
        raise ValueError(f"{spec.fqn!r} is {tuple(t.shape)} {t.dtype}, planned {spec.shape} {spec.dtype}")
    return t


def write_sequential(staging_dir: str, part: Part, layout: Layout) -> dict[str, FileRecordV2]:
    """One process: write each file of ``part`` front to back into ``staging_dir``, hashing each
    tensor on the way, fsynced; returns each file's index record."""
    records: dict[str, FileRecordV2] = {}
    for fplan in layout.files:
        w = SequentialFileWriter(os.path.join(staging_dir, fplan.name), fplan)
        try:
            faults.fault_point("after_file_create")
            kill_after_tensor = faults.armed("after_tensor_write")
            for slot in fplan.slots:
                w.write(slot, fetch_checked(part, slot.spec))
                if kill_after_tensor:
                    faults.fault_point("after_tensor_write")
            records[fplan.name] = w.finish()
        finally:
            w.close()
    return records


def create_files(path: str, overwrite: bool, files: Sequence[FilePlan]) -> StagedCheckpoint:
    """Open the staging directory of a write on many ranks (:class:`StagedCheckpoint`, holding
    the checkpoint's writer lock) and create every shard file there, preallocated, with its header
    (:func:`checkpoint.storage.writer.create_shard_file`); the ranks then fill in their bytes.
    The caller exits the returned staging (commits or removes it).

    Raises:
        CheckpointExistsError: as :class:`StagedCheckpoint`; OSError: creating a file failed
        (nothing is left behind)."""
    staged = StagedCheckpoint(path, overwrite).__enter__()
    try:
        for f in files:
            os.close(create_shard_file(os.path.join(staged.dir, f.name), f))
        faults.fault_point("after_file_create")
    except BaseException:
        staged.__exit__(None, None, None)
        raise
    return staged


def owned_blocks(t: torch.Tensor, index: int, fqn: str) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """The blocks this rank writes of tensor ``t``: ``(data, global element offset)`` pairs.

    A DTensor's local shard is written by the rank whose coordinate is 0 on every mesh dim that
    does not shard it (:func:`checkpoint.write.plan.writes_shard`), as one block per contiguous
    piece of the global tensor (several for ``_StridedShard``, see :mod:`checkpoint.ranks.shards`);
    a plain tensor (same on every rank) by :func:`checkpoint.write.plan.plain_writer` of ``index``.
    """
    if not isinstance(t, DTensor):
        return [(t, (0,) * t.dim())] if plain_writer(index, dist.world_size()) == dist.rank() else []
    if any(p.is_partial() for p in t.placements):
        t = t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements])
    if not writes_shard(t):
        return []
    try:
        blocks = list(shards.local_blocks(t))
    except RuntimeError as e:
        raise RuntimeError(f"{fqn!r}: {e}") from e
    local = t.to_local()
    return [(local[lsl], tuple(g.start for g in gsl)) for lsl, gsl in blocks]


def write_hashed(w: BlockWriter, slot: TensorSlot, local: torch.Tensor, offset) -> str:
    """Write a whole tensor while the hash thread reads the same memory; its digest (waited for
    even when the write fails: the memory is in use until then)."""
    pool = threads.pool("hash", 1) if threads.cpus() >= 2 else None
    if pool is None:
        w.write(slot, local, offset)
        return digest.tensor_hexdigest(tensor_bytes(local))
    data = tensor_bytes(local)
    hashed = pool.submit(digest.tensor_hexdigest, data)  # xxhash releases the GIL
    try:
        w.write(slot, local, offset)
    finally:
        ownership.settle([hashed])  # on every exit path, Ctrl-C included: it reads the caller's tensor
    return hashed.result()


def write_chunked(w: BlockWriter, slot: TensorSlot, local: torch.Tensor, offset, got: list, back: list) -> None:
    """Write block ``local`` (at element ``offset``) of a tensor split over ranks, hashing on the
    hash thread, beside the pwrite, each digest chunk (:data:`digest.TENSOR_CHUNK` bytes of the
    tensor) lying whole in one contiguous run of the block: ``(chunk index, 16-byte digest)``
    appended to ``got``; each chunk starting in a run but running past its end (into bytes another
    rank writes, or another run of this block) is appended to ``back`` as ``(fqn, chunk index,
    file begin, file end)``, read back once every rank wrote
    (:func:`checkpoint.write.digests.read_back_chunks`). Every chunk of the tensor is so hashed by
    the one rank writing its first byte."""
    spec, item, c = slot.spec, slot.spec.itemsize, digest.TENSOR_CHUNK
    nbytes = slot.end - slot.begin
    if not local.is_contiguous():  # (a _StridedShard block's view): one copy for the write and the hash
        local = local.contiguous()
    data = tensor_bytes(local)
    views: list[tuple[int, memoryview]] = []
    for g, lo, n in block_runs(spec.shape, tuple(local.shape), tuple(offset)):
        a, b, m = g * item, (g + n) * item, lo * item  # the run's tensor bytes [a, b), at m in data
        j = -(-a // c)  # the first chunk starting in the run
        while j * c < b:
            end = min((j + 1) * c, nbytes)
            if end <= b:
                views.append((j, data[m + j * c - a : m + end - a]))
            else:
                back.append((spec.fqn, j, slot.begin + j * c, slot.begin + end))
            j += 1
    pool = threads.pool("hash", 1) if threads.cpus() >= 2 and views else None

    def hash_views() -> list[tuple[int, bytes]]:
        return [(j, xxhash.xxh3_128_digest(v)) for j, v in views]

    if pool is None:
        w.write(slot, local, offset)
        got.extend(hash_views())
        return
    hashed = pool.submit(hash_views)  # xxhash releases the GIL
    try:
        w.write(slot, local, offset)
    finally:
        ownership.settle([hashed])  # on every exit path, Ctrl-C included: it reads the caller's tensor
    got.extend(hashed.result())


@dataclass
class Hashed:
    """What a writer on many ranks hashed beside its writes: ``whole`` ``{fqn: digest}`` of the
    tensors it wrote whole, ``chunks`` the chunk digests of split ones (:func:`write_chunked`),
    ``back`` the chunks to read back, ``covered`` ``{DTensor fqn: elements written}``."""

    whole: dict[str, str] = field(default_factory=dict)
    chunks: Chunks = field(default_factory=dict)
    back: Back = field(default_factory=dict)
    covered: dict[str, int] = field(default_factory=dict)


def write_block_hashed(
    w: BlockWriter, slot: TensorSlot, blocks: Sequence[tuple[torch.Tensor, tuple[int, ...]]], whole: bool, out: Hashed
) -> None:
    """Write this rank's ``blocks`` of the slot's tensor, hashed beside the write: a tensor held
    ``whole`` by this writer as one block is hashed whole (:func:`write_hashed`), any other block
    chunk by chunk (:func:`write_chunked`); the digests go to ``out``."""
    fqn = slot.spec.fqn
    if whole and len(blocks) == 1 and tuple(blocks[0][0].shape) == slot.spec.shape:
        out.whole[fqn] = write_hashed(w, slot, *blocks[0])
        return
    mine = out.chunks.setdefault(fqn, [])
    for block in blocks:
        write_chunked(w, slot, *block, mine, out.back.setdefault(slot.file, []))


def write_owned(
    path: str, staging_dir: str, parts: Sequence[Part], layouts: Sequence[Layout], rank: int, world: int
) -> Hashed:
    """Many ranks: write the bytes this rank owns of every tensor (:func:`owned_blocks`) into the
    files :func:`create_files` made, starting at a file of its own (see
    :func:`checkpoint.write.plan.write_orders`), each block hashed beside its write.

    Raises:
        CheckpointWriteError: an OS error (naming ``path`` and the rank); what ``fetch`` raises."""
    out = Hashed()
    writeback_on = not fskind.in_memory_dir(staging_dir)
    order = [(part, lay, f, i, slot) for part, lay in zip(parts, layouts) for f in lay.files for i, slot in enumerate(f.slots)]
    steps = walk(walk_starts([f.name for *_, f, _, _ in order], world)[rank], len(order))
    w, w_name = None, None
    try:
        kill_after_tensor = faults.armed("after_tensor_write")
        for k in steps:
            part, lay, f, i, slot = order[k]
            if w_name != f.name and w is not None:
                w.close()
                w, w_name = None, None
            t = fetch_tensor(part, slot.spec)
            blocks = owned_blocks(t, lay.first_slot[f.name] + i, slot.spec.fqn)
            if isinstance(t, DTensor):
                out.covered[slot.spec.fqn] = sum(b.numel() for b, _ in blocks)
            if not blocks:
                continue
            if w is None:
                w, w_name = BlockWriter(os.path.join(staging_dir, f.name), writeback_on), f.name
            write_block_hashed(w, slot, blocks, whole_on_writer(t), out)
            if kill_after_tensor:
                faults.fault_point("after_tensor_write")
    except OSError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointWriteError(path, f"{type(e).__name__}: {e}", rank) from e
    finally:
        if w is not None:
            w.close()
    return out
