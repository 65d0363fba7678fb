"""The data-parallel boundary of the parallel module: which mesh dims split the batch, the per-rank
(local) example inputs a graph is captured for, the check of forward's inputs against them, and the
redistribution of the local outputs to their constraints.

The module shards DATA on dim 0 (the batch) only: every rank runs the whole captured graph on its
local batch with full parameters. Input placements are therefore ``Shard(0)`` (the batch split over
that mesh dim) or ``Replicate()`` (every rank of that mesh dim gets the same tensor) per mesh dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.utils import _pytree as pytree

from .errors import InputError, PlacementError

Placements = tuple[Placement, ...]


def default_placements(ndim: int) -> Placements:
    """``Shard(0)`` on every mesh dim: the batch split over all ranks."""
    return tuple(Shard(0) for _ in range(ndim))


def input_placements_of(
    table: Sequence[Placements] | None, n_tensors: int, mesh_ndim: int
) -> list[Placements]:
    """Placements of each of the ``n_tensors`` input tensor leaves (default: :func:`default_placements`).

    Raises:
        PlacementError: a constraint is not ``Shard(0)`` / ``Replicate()`` on some mesh dim, or the
            number of constraints differs from the number of input tensors.
    """
    if table is None:
        return [default_placements(mesh_ndim)] * n_tensors
    if len(table) != n_tensors:
        raise PlacementError(f"{len(table)} input constraints for {n_tensors} input tensors")
    for i, placements in enumerate(table):
        for p in placements:
            if not (p.is_replicate() or (isinstance(p, Shard) and p.dim == 0)):
                raise PlacementError(
                    f"input #{i}: {p} is not supported; the parallel module splits data on dim 0 (the "
                    "batch) only: use Shard(0) or Replicate() on each mesh dim"
                )
    return [tuple(p) for p in table]


def data_dims(input_placements: Sequence[Placements], mesh_ndim: int) -> tuple[int, ...]:
    """Mesh dims over which some input is split (ranks along them see different data)."""
    return tuple(i for i in range(mesh_ndim) if any(p[i].is_shard() for p in input_placements))


def _ways(placements: Placements, mesh_shape: Sequence[int]) -> int:
    return math.prod(size for p, size in zip(placements, mesh_shape) if p.is_shard())


def local_inputs(args: tuple, kwargs: dict, table: Sequence[Placements] | None, mesh_shape: Sequence[int]):
    """Per-rank example inputs ``(args, kwargs)`` for capture: each tensor leaf's dim 0 divided by the
    number of ranks splitting it (its first rows: capture depends on shapes, not values).

    Raises:
        PlacementError: a constraint is invalid (see :func:`input_placements_of`), or an input's
            dim 0 is not divisible by the number of ranks splitting it (the graph is captured for
            one local shape, the same on every rank).
    """
    flat, spec = pytree.tree_flatten((args, kwargs))
    n = sum(isinstance(x, torch.Tensor) for x in flat)
    placements = iter(input_placements_of(table, n, len(mesh_shape)))
    out = []
    i = 0
    for x in flat:
        if isinstance(x, torch.Tensor):
            ways = _ways(next(placements), mesh_shape)
            if ways > 1:
                if x.ndim == 0 or x.shape[0] % ways:
                    raise PlacementError(
                        f"input #{i} of shape {tuple(x.shape)}: dim 0 must be divisible by the {ways} ranks "
                        "splitting it (every rank runs the same graph on an equal share of the batch)"
                    )
                x = x.narrow(0, 0, x.shape[0] // ways)
            i += 1
        out.append(x)
    return pytree.tree_unflatten(out, spec)


@dataclass(frozen=True)
class TensorLeaf:
    """A tensor argument of the capture: its local shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class InputSignature:
    """What forward's inputs must look like: the pytree structure, the local shape and dtype of each
    tensor leaf, and the value of each non-tensor leaf (baked into the captured graph)."""

    spec: pytree.TreeSpec
    leaves: tuple[Any, ...]  # TensorLeaf for tensors, the value otherwise

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> InputSignature:
        flat, spec = pytree.tree_flatten((args, kwargs))
        return cls(
            spec,
            tuple(TensorLeaf(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in flat),
        )

    @property
    def n_tensors(self) -> int:
        return sum(isinstance(x, TensorLeaf) for x in self.leaves)

    def check(self, flat: list, spec: pytree.TreeSpec, device_type: str | None = None, cast_floats: bool = False) -> None:
        """Raises :class:`InputError` naming the first input that differs from the capture's:
        structure, local shape, dtype (exactly; with ``cast_floats`` any floating dtype for a
        floating input, as forward casts it) and, with ``device_type``, the device type (the
        mesh's: a tensor elsewhere, e.g. on ``meta``, would die inside the captured graph)."""
        if spec != self.spec:
            raise InputError(
                f"forward got {_describe(spec)}; the graph was captured for {_describe(self.spec)}"
            )
        i = 0
        for k, (x, want) in enumerate(zip(flat, self.leaves)):
            if isinstance(x, torch.Tensor) and isinstance(want, TensorLeaf):
                shape, dtype = want.shape, want.dtype
                if tuple(x.shape) != shape:
                    raise InputError(
                        f"input tensor #{i} has shape {tuple(x.shape)}; the graph was captured for the local "
                        f"(per-rank) shape {shape}: pass this rank's share of the batch, of the captured size"
                    )
                if x.dtype != dtype and not (cast_floats and x.is_floating_point() and dtype.is_floating_point):
                    raise InputError(
                        f"input tensor #{i} has dtype {x.dtype}; the graph was captured for {dtype}"
                        + (" (cast it with .to(...))" if x.is_floating_point() == dtype.is_floating_point else "")
                    )
                if device_type is not None and x.device.type != device_type:
                    raise InputError(
                        f"input tensor #{i} is on device {x.device}; the module runs on {device_type} "
                        f"(its mesh's device type): move the input there"
                    )
                i += 1
            elif isinstance(x, torch.Tensor) or isinstance(want, TensorLeaf) or x != want:
                raise InputError(
                    f"argument leaf #{k} is {x!r}; the graph was captured with {want!r} (non-tensor "
                    "arguments are constants of the captured graph)"
                )


def _describe(spec: pytree.TreeSpec) -> str:
    args, kwargs = spec.children()
    if spec != pytree.tree_structure(((0,) * args.num_children, dict.fromkeys(kwargs.context, 0))):
        return f"arguments structured as {spec}"  # nested containers: show the whole structure
    return f"{args.num_children} positional argument(s) and keyword argument(s) {sorted(kwargs.context)}"


def output_to(y: torch.Tensor, mesh, data: Placements, want: Placements) -> torch.Tensor:
    """Local output ``y`` (placements ``data``: ``Shard(0)`` on the data dims) as this rank's part of
    placements ``want`` (differentiable). 0-dim outputs (e.g. a loss) stay this rank's own value,
    computed on its local batch, as in DDP / FSDP.

    Raises:
        PlacementError: ``want`` shards a dim that ``y`` lacks.
    """
    if y.ndim == 0 or want == data:
        return y
    for p in want:
        if isinstance(p, Shard) and not -y.ndim <= p.dim < y.ndim:
            raise PlacementError(f"output constraint {p} on an output of shape {tuple(y.shape)}")
    d = DTensor.from_local(y, mesh, data, run_check=False)
    return d.redistribute(mesh, want).to_local(grad_placements=want)


def data_placements(dims: Sequence[int], mesh_ndim: int) -> Placements:
    """Placements of a local output: ``Shard(0)`` on the data dims, ``Replicate()`` elsewhere."""
    return tuple(Shard(0) if i in dims else Replicate() for i in range(mesh_ndim))
