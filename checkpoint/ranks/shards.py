"""Which parts of the global tensor a DTensor's local shard holds, as rectangular blocks.

Every storage placement DTensor has is covered: ``Shard(d)`` on any dim, uneven shards, several
mesh dims sharding one tensor dim (2-D meshes), and ``_StridedShard`` (FSDP2 + TP and upstream
AutoParallel use it), whose local rows are not one contiguous range of the global tensor: e.g.
rows [0, 1, 4, 5] of 8. DTensor computes, per tensor dim, the global index of each local position
(``torch.distributed.tensor._utils._get_shard_size_and_offsets``, the step of
``compute_local_shape_and_global_offset`` that this module keeps instead of dropping: that public
function returns only the first offset, which is wrong for ``_StridedShard``). Each dim's indices
are cut into contiguous runs; the product of the runs over all dims gives blocks that are each a
plain slice of both the local and the global tensor, so a rank writes and reads only its own bytes
with no redistribution.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import _get_shard_size_and_offsets
from torch.distributed.tensor.placement_types import _StridedShard

Run = tuple[int, int, int]  # (local start, global start, length) along one dim


def _runs(index: torch.Tensor | None, size: int) -> list[Run]:
    """Contiguous runs of a dim whose local position i holds global index ``index[i]``
    (``None``: the whole dim, local == global)."""
    if size == 0:
        return []
    if index is None:
        return [(0, 0, size)]
    idx = index[:size].tolist()
    runs, start = [], 0
    for i in range(1, size + 1):
        if i == size or idx[i] != idx[i - 1] + 1:
            runs.append((start, idx[start], i - start))
            start = i
    return runs


def local_index(t: DTensor) -> tuple[tuple[int, ...], dict[int, torch.Tensor]] | None:
    """``(local shape, {tensor dim: global index of each local position})`` of ``t`` on this rank
    (dims not sharded are absent); None when this rank is not in ``t``'s mesh.

    Raises:
        NotImplementedError: a placement that is neither Shard, _StridedShard, Replicate nor
            Partial (a new kind of storage placement this code does not know).
    """
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    shape = list(t.shape)
    index: dict[int, torch.Tensor] = {}
    for mesh_dim, p in enumerate(t.placements):
        if isinstance(p, (Shard, _StridedShard)):
            size, offsets = _get_shard_size_and_offsets(
                shape[p.dim], mesh.size(mesh_dim), coord[mesh_dim], p, index.get(p.dim), t.shape[p.dim], False
            )
            shape[p.dim] = size
            index[p.dim] = offsets
        elif not (p.is_replicate() or p.is_partial()):
            raise NotImplementedError(f"placement {p!r} is not supported by checkpoint save / load")
    return tuple(shape), index


def local_blocks(t: DTensor) -> Iterator[tuple[tuple[slice, ...], tuple[slice, ...]]]:
    """Rectangular blocks of ``t``'s local shard: ``(local slices, global slices)`` pairs, one
    ``slice`` per dim, covering the local shard exactly once (nothing on ranks outside the mesh).

    Raises:
        RuntimeError: the local tensor's shape differs from the one its placements imply.
    """
    info = local_index(t)
    if info is None:
        return
    shape, index = info
    local = t._local_tensor
    if tuple(local.shape) != shape:
        raise RuntimeError(f"local shard of shape {tuple(local.shape)} differs from the expected {shape}")
    if not shape:
        yield (), ()
        return
    per_dim = [_runs(index.get(d), n) for d, n in enumerate(shape)]
    for combo in itertools.product(*per_dim):
        yield (
            tuple(slice(lo, lo + n) for lo, _, n in combo),
            tuple(slice(g, g + n) for _, g, n in combo),
        )


def read_local(reader, key: str, t: DTensor) -> torch.Tensor:
    """A new tensor shaped like ``t``'s local shard holding checkpoint tensor ``key``'s values at
    the positions this rank holds (stored dtype). ``reader`` is a ``CheckpointReader`` (reads only
    these blocks with ``get_slice``)."""
    shape = tuple(t._local_tensor.shape)
    if not t.dim():
        return reader.get(key)
    out = torch.empty(shape, dtype=reader.spec(key).dtype)
    for lsl, gsl in local_blocks(t):
        out[lsl] = reader.get_slice(key, gsl)
    return out
