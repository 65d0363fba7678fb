"""FSDP-style state access for the parallel module: gather a DTensor to a full plain tensor before
use, reduce its gradient back to the DTensor's placements after.

The captured graph runs on plain tensors (no op needs a DTensor sharding rule); the only cross-rank
work is here and at the output boundary (see :mod:`autoparallel.parallel_module`). Written by
hand because FSDP2 (``fully_shard``) manages its own ``Shard(0)`` parameters on a 1-D or HSDP mesh
and cannot take the plan's placements (``Shard(1)``, 2-D ``Shard`` / ``Replicate`` mixes) as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement


@dataclass(frozen=True)
class GatherSpec:
    """How one state tensor is gathered and its gradient reduced.

    ``compute_dtype``: dtype of the gathered tensor (the mixed-precision ``param_dtype`` for cast
    parameters, else the tensor's own); the all-gather moves this dtype. ``reduce_dtype``: dtype
    the gradient is summed in across ranks. ``data_dims``: mesh dims over which ranks hold different
    data (their gradients are summed); on the other mesh dims all ranks compute the same gradient.
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    data_dims: tuple[int, ...]

    @property
    def grad_placements(self) -> tuple[Placement, ...]:
        return tuple(Partial() if i in self.data_dims else Replicate() for i in range(self.mesh.ndim))


def _all_gather(local: torch.Tensor, spec: GatherSpec) -> torch.Tensor:
    if all(p.is_replicate() for p in spec.placements):
        return local
    d = DTensor.from_local(
        local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
    )
    return d.full_tensor()


class _Gather(torch.autograd.Function):
    """local shard -> full tensor in ``compute_dtype``; gradient -> summed over ``data_dims`` in
    ``reduce_dtype`` and scattered to the shard's placements, in the shard's dtype."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: GatherSpec) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = spec
        ctx.local_dtype = local.dtype
        return _all_gather(local.to(spec.compute_dtype), spec)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        spec: GatherSpec = ctx.spec
        grad = grad.to(spec.reduce_dtype)
        target = spec.placements
        src = spec.grad_placements
        if src != target:
            d = DTensor.from_local(
                grad, spec.mesh, src, run_check=False, shape=spec.shape, stride=grad.stride()
            )
            grad = d.redistribute(spec.mesh, target).to_local()
        return grad.to(ctx.local_dtype), None


def gather_full(t: torch.Tensor, spec: GatherSpec) -> torch.Tensor:
    """The full (unsharded) value of state tensor ``t`` as a plain tensor in ``spec.compute_dtype``.

    ``t``: a DTensor on ``spec.mesh`` with ``spec.placements`` (or a plain tensor, returned cast).
    Differentiable when ``t`` requires grad: ``t.grad`` receives a DTensor with ``t``'s placements
    and dtype holding the gradient summed over the ranks of ``spec.data_dims``.
    Collectives: one all-gather per sharded mesh dim in forward, one reduce-scatter / all-reduce
    per mesh dim in backward; none for a tensor replicated everywhere on a single data rank.
    """
    if not isinstance(t, DTensor):
        return t.to(spec.compute_dtype)
    if not (t.requires_grad and torch.is_grad_enabled()):
        return _all_gather(t._local_tensor.to(spec.compute_dtype), spec)
    return _Gather.apply(t.to_local(), spec)
