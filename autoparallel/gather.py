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
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
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


# ---------------------------------------------------------------------------------------------
# Bucketed path: Shard(0) parameters on a 1-D data-parallel mesh (the default FSDP-style plan).

BUCKET_BYTES = 64 << 20  # cap of one bucket's per-rank gradient buffer (reduce_dtype bytes)


@dataclass(frozen=True)
class _Member:
    """One tensor's slot in a bucket's per-rank flat buffer: ``rows`` (= ceil(dim 0 / world)) rows
    of ``shape[1:]`` at ``offset``; this rank's shard fills its first ``local_rows`` rows."""

    shape: torch.Size  # global shape
    rows: int
    local_rows: int
    offset: int

    @property
    def numel(self) -> int:
        return self.rows * self.shape[1:].numel()


class Bucket:
    """Tensors whose all-gather and gradient reduce-scatter are one collective each.

    Members (eager FQNs ``fqns``, all ``Shard(0)`` on the same 1-D mesh whose ranks split the data,
    same local / compute / reduce dtypes, contiguous) are packed into one flat per-rank buffer of
    ``size`` elements, each padded to ``ceil(dim 0 / world)`` rows as ``torch.chunk`` splits it (the
    padding of uneven shards lives only in the buffers). Forward: ``all_gather_into_tensor`` of the
    buffer in ``compute_dtype`` (``world * size`` elements), then one ``split_with_sizes_copy`` into
    the full tensors. Backward: ``_chunk_cat`` of the full gradients into a ``world x size`` buffer in
    ``reduce_dtype``, one ``reduce_scatter_tensor`` (sum), each local gradient a view of the result.
    """

    def __init__(self, fqns: list[str], specs: list[GatherSpec], local_dtype: torch.dtype):
        spec = specs[0]
        self.fqns = fqns
        self.mesh = spec.mesh
        self.compute_dtype = spec.compute_dtype
        self.reduce_dtype = spec.reduce_dtype
        self.local_dtype = local_dtype
        self.placements = spec.placements
        group = spec.mesh.get_group(0)
        self.world = group.size()
        self.group_name = group.group_name
        rank = spec.mesh.get_local_rank(0)
        members, offset = [], 0
        for s in specs:
            rows = -(-s.shape[0] // self.world)
            local_rows = max(0, min(rows, s.shape[0] - rank * rows))
            members.append(_Member(s.shape, rows, local_rows, offset))
            offset += members[-1].numel
        self.members: list[_Member] = members
        self.size = offset
        self.local_shapes = [torch.Size((m.local_rows, *m.shape[1:])) for m in members]
        self.device = torch.device(spec.mesh.device_type)

    def fits(self, tensors: list[torch.Tensor]) -> bool:
        """Whether ``tensors`` (the module's current state) still are the DTensor shards the bucket
        was built for; a reassigned tensor sends the bucket down the per-tensor path."""
        for t, shape in zip(tensors, self.local_shapes):
            if not isinstance(t, DTensor) or t._local_tensor.shape != shape or t.dtype != self.local_dtype:
                return False
        return True

    def start_gather(self, locals_: list[torch.Tensor]) -> torch.Tensor:
        """Pack the local shards and issue the all-gather; returns the (pending) output."""
        flat = torch.empty(self.size, dtype=self.compute_dtype, device=self.device)
        dst = [
            flat.narrow(0, m.offset, m.numel).view(m.rows, *m.shape[1:]).narrow(0, 0, m.local_rows)
            for m in self.members
        ]
        torch._foreach_copy_(dst, locals_)  # pad rows stay unwritten: they are never read
        if self.world == 1:
            return flat
        return torch.ops._c10d_functional.all_gather_into_tensor(flat, self.world, self.group_name)

    def finish_gather(self, out: torch.Tensor) -> list[torch.Tensor]:
        """Wait for the all-gather and copy each member out: full tensors in ``compute_dtype``."""
        if self.world > 1:
            out = torch.ops._c10d_functional.wait_tensor(out)
        padded = [
            torch.empty((self.world * m.rows, *m.shape[1:]), dtype=self.compute_dtype, device=self.device)
            for m in self.members
        ]
        torch.split_with_sizes_copy(
            out.view(self.world, self.size),
            [m.numel for m in self.members],
            dim=1,
            out=[p.view(self.world, -1) for p in padded],
        )
        return [p.narrow(0, 0, m.shape[0]) for p, m in zip(padded, self.members)]

    def zeros(self, k: int) -> torch.Tensor:
        """A zero gradient for member ``k`` (one the loss did not reach; the graph is the same on
        every rank, so every rank sends zeros for the same member)."""
        return torch.zeros(self.members[k].shape, dtype=self.compute_dtype, device=self.device)

    def start_reduce(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Pack the full gradients (cast to ``reduce_dtype``) and issue the reduce-scatter."""
        flat = torch.empty(self.world * self.size, dtype=self.reduce_dtype, device=self.device)
        torch._chunk_cat(grads, dim=0, num_chunks=self.world, out=flat.view(self.world, self.size))
        if self.world == 1:
            return flat
        return torch.ops._c10d_functional.reduce_scatter_tensor(flat, "sum", self.world, self.group_name)

    def finish_reduce(self, out: torch.Tensor) -> list[DTensor]:
        """Wait for the reduce-scatter; each member's summed local gradient as a DTensor like the
        parameter (a view of the output when ``reduce_dtype`` is the parameter's dtype)."""
        if self.world > 1:
            out = torch.ops._c10d_functional.wait_tensor(out)
        grads = []
        for m in self.members:
            g = out.narrow(0, m.offset, m.numel).view(m.rows, *m.shape[1:]).narrow(0, 0, m.local_rows)
            g = g.to(self.local_dtype)
            grads.append(
                DTensor.from_local(
                    g, self.mesh, self.placements, run_check=False, shape=m.shape, stride=_contiguous(m.shape)
                )
            )
        return grads


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def bucketable(spec: GatherSpec, t: torch.Tensor) -> bool:
    """Whether ``t`` (a parameter with ``spec``) takes the bucketed path: ``Shard(0)`` on a 1-D
    mesh whose ranks split the data, contiguous. Everything else (``Shard(1)``, ``Replicate()``,
    2-D meshes, ``_StridedShard``, buffers) is gathered per tensor by :func:`gather_full`."""
    return (
        isinstance(t, DTensor)
        and spec.mesh.ndim == 1
        and type(spec.placements[0]) is Shard
        and spec.placements[0].dim == 0
        and spec.data_dims == (0,)
        and spec.stride == _contiguous(spec.shape)
    )


def make_buckets(
    members: list[tuple[str, GatherSpec, torch.dtype]], cap_bytes: int = BUCKET_BYTES
) -> list[Bucket]:
    """Group ``(fqn, spec, local dtype)`` (in graph order) into buckets of one mesh and dtypes,
    each at most ``cap_bytes`` of gradient buffer per rank (a larger tensor gets its own)."""
    open_: dict[tuple, tuple[list[str], list[GatherSpec], int]] = {}
    done: list[Bucket] = []
    for fqn, spec, local_dtype in members:
        key = (id(spec.mesh), spec.compute_dtype, spec.reduce_dtype, local_dtype)
        world = spec.mesh.size()
        nbytes = -(-spec.shape[0] // world) * spec.shape[1:].numel() * spec.reduce_dtype.itemsize
        fqns, specs, size = open_.get(key, ([], [], 0))
        if fqns and size + nbytes > cap_bytes:
            done.append(Bucket(fqns, specs, local_dtype))
            fqns, specs, size = [], [], 0
        open_[key] = (fqns + [fqn], specs + [spec], size + nbytes)
    for (*_, local_dtype), (fqns, specs, _) in open_.items():
        done.append(Bucket(fqns, specs, local_dtype))
    return done


class _GatherBuckets(torch.autograd.Function):
    """DTensor parameters of all ``buckets`` -> their full tensors; gradients reduce-scattered
    bucket by bucket. All collectives of a direction are issued before the first is waited on."""

    @staticmethod
    def forward(ctx, buckets: list[Bucket], *params: DTensor):  # type: ignore[override]
        ctx.buckets = buckets
        ctx.set_materialize_grads(False)  # an output the loss does not reach gets no gradient, as in eager
        pending, i = [], 0
        for b in buckets:
            n = len(b.members)
            pending.append(b.start_gather([p._local_tensor for p in params[i : i + n]]))
            i += n
        return tuple(full for b, out in zip(buckets, pending) for full in b.finish_gather(out))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[override]
        pending, i = [], 0
        for b in ctx.buckets:
            n = len(b.members)
            pending.append(
                b.start_reduce([b.zeros(k) if g is None else g for k, g in enumerate(grads[i : i + n])])
            )
            i += n
        reduced = [g for b, out in zip(ctx.buckets, pending) for g in b.finish_reduce(out)]
        return (None, *(None if g is None else r for g, r in zip(grads, reduced)))


def gather_buckets(buckets: list[Bucket], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Full tensors of ``params`` (the buckets' members, concatenated in bucket order), in each
    bucket's ``compute_dtype``; differentiable (see :class:`Bucket`) when grad mode is on and some
    parameter requires grad."""
    if torch.is_grad_enabled() and any(p.requires_grad for p in params):
        return list(_GatherBuckets.apply(buckets, *params))
    out, i = [], 0
    pending = []
    for b in buckets:
        n = len(b.members)
        pending.append(b.start_gather([p._local_tensor for p in params[i : i + n]]))
        i += n
    for b, o in zip(buckets, pending):
        out.extend(b.finish_gather(o))
    return out
