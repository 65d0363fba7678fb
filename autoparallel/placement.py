"""Rule-based placement plans: ``{eager FQN: placements per mesh dim}``.

This is NOT a cost-model solver (meta-pytorch/autoparallel solves an ILP over sharding
strategies); it applies one FSDP-style rule plus the user's glob overrides. Any valid plan gives
the same numbers, because placements only decide storage: the parallel module gathers every tensor
to its full value before the graph reads it (see :mod:`autoparallel.gather`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fqn import FQNMap, TensorKind

from .errors import PlacementError

Plan = dict[str, tuple[Placement, ...]]


def fsdp_placements(shape: Sequence[int], mesh_shape: Sequence[int]) -> tuple[Placement, ...]:
    """FSDP-style placements of a tensor of ``shape`` on a mesh of ``mesh_shape``.

    ``Shard(0)`` on mesh dim ``i`` when dim 0 of the tensor still has at least as many rows as
    the product of the sizes of the mesh dims sharding it so far times ``mesh_shape[i]`` (every
    rank gets at least one row), else ``Replicate()``. Uneven shards are allowed (DTensor pads).
    Scalars (0-dim) are replicated.
    """
    out: list[Placement] = []
    ways = 1
    for size in mesh_shape:
        if len(shape) > 0 and shape[0] >= ways * size:
            out.append(Shard(0))
            ways *= size
        else:
            out.append(Replicate())
    return tuple(out)


def default_plan(fqn_map: FQNMap, mesh: DeviceMesh) -> Plan:
    """Default plan over the canonical eager FQNs of ``fqn_map``: parameters get
    :func:`fsdp_placements`, buffers are replicated (as FSDP does)."""
    plan: Plan = {}
    for rec in fqn_map:
        if rec.kind == TensorKind.parameter:
            plan[rec.fqn] = fsdp_placements(rec.shape, mesh.shape)
        else:
            plan[rec.fqn] = tuple(Replicate() for _ in mesh.shape)
    return plan


def validate_placements(
    name: str, placements: Sequence[Placement], ndim: int, mesh: DeviceMesh
) -> tuple[Placement, ...]:
    """Check one placement tuple: one entry per mesh dim, each a Placement, Shard dims in range.

    Raises:
        PlacementError: naming ``name`` and what is wrong.
    """
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise PlacementError(
            f"{name!r}: {len(placements)} placements for a {mesh.ndim}-D mesh {tuple(mesh.shape)}"
        )
    for p in placements:
        if not isinstance(p, Placement):
            raise PlacementError(f"{name!r}: {p!r} is not a torch.distributed.tensor Placement")
        if isinstance(p, Shard) and not -ndim <= p.dim < max(ndim, 1):
            raise PlacementError(f"{name!r}: {p} on a {ndim}-D tensor")
        if p.is_partial():
            raise PlacementError(f"{name!r}: Partial is not a storage placement")
    return placements


def apply_overrides(
    plan: Plan, overrides: Mapping[str, Sequence[Placement]], fqn_map: FQNMap, mesh: DeviceMesh
) -> Plan:
    """Return ``plan`` with entries replaced by ``overrides`` (``{FQN or fnmatch glob: placements}``).

    Globs match canonical FQNs and aliases (``output.weight`` reaches the tied embedding). Later
    overrides win.

    Raises:
        PlacementError: a pattern matches no tensor, or its placements are invalid.
    """
    plan = dict(plan)
    for pattern, placements in overrides.items():
        hits = [rec for rec in fqn_map if any(fnmatch.fnmatchcase(n, pattern) for n in rec.eager_names)]
        if not hits:
            raise PlacementError(f"placement override {pattern!r} matches no FQN of the model")
        for rec in hits:
            plan[rec.fqn] = validate_placements(rec.fqn, placements, len(rec.shape), mesh)
    return plan
