"""FSDP-style state access for the parallel module: gather each DTensor to a full plain tensor
before the graph runs, reduce its gradient back to the DTensor's placements after.

The captured graph runs on plain tensors (no op needs a DTensor sharding rule); the only cross-rank
work is here and at the output boundary (see :mod:`autoparallel.parallel_module`). Two paths:

* Bucketed (:class:`Bucket`): parameters stored ``Shard(0)`` on a 1-D mesh whose ranks split the
  data (the default FSDP-style plan), grouped in graph order into buckets of the same dtypes, at most
  :data:`BUCKET_BYTES` of gradients each. Forward: each bucket's local shards are packed (padded to
  ``ceil(dim 0 / world)`` rows, as ``torch.chunk`` splits them) into one flat buffer in
  ``param_dtype`` and gathered by one ``all_gather_into_tensor``; all are issued where forward
  starts, and each is waited on where the graph first uses one of its members (a marker node at
  each parameter's first use, :class:`BucketTape`), so it arrives while the graph computes with
  the earlier buckets (on accelerators; on CPU each collective is waited as it is issued, see
  ``Bucket.overlap``). Backward: a bucket's full gradients are packed (``_chunk_cat``) into one
  ``reduce_dtype`` buffer and reduced (summed, or averaged as FSDP2 does:
  :mod:`autoparallel.grad_reduce`) by one ``reduce_scatter_tensor``, issued as soon as the
  bucket's last gradient is complete (the marker's backward), so it runs while backward computes
  the earlier layers; all are waited on when autograd reaches the parameters, at the end of
  backward.
* Per tensor (:func:`gather_full`): every other tensor (``Shard(1)``, ``Replicate()``, 2-D meshes,
  ``_StridedShard``, buffers): ``DTensor.full_tensor`` in forward, ``redistribute`` of the
  gradient (``Partial`` over the data dims) in backward, synchronously.

Written by hand because FSDP2 (``fully_shard``) manages its own ``Shard(0)`` parameters on a 1-D or
HSDP mesh and cannot take the plan's placements (``Shard(1)``, 2-D ``Shard`` / ``Replicate`` mixes)
as they are; the bucketed path packs, pads and unpacks as FSDP2's ``_fsdp_collectives`` does.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from .grad_reduce import GradReduce


@dataclass(frozen=True)
class GatherSpec:
    """How one state tensor is gathered and its gradient reduced.

    ``compute_dtype``: dtype of the gathered tensor (the mixed-precision ``param_dtype`` for cast
    parameters, else the tensor's own); the all-gather moves this dtype. ``reduce_dtype``: dtype
    the gradient is reduced in across ranks. ``data_dims``: mesh dims over which ranks hold different
    data (their gradients are reduced); on the other mesh dims all ranks compute the same gradient.
    ``grad_reduce``: how (sum, or FSDP2's mean over the data-parallel ranks; see
    :mod:`autoparallel.grad_reduce`).
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    data_dims: tuple[int, ...]
    grad_reduce: GradReduce = GradReduce()
    dtype: torch.dtype | None = None  # the stored tensor's dtype (None: not checked)

    @property
    def grad_placements(self) -> tuple[Placement, ...]:
        op = self.grad_reduce.op
        return tuple(Partial(op) if i in self.data_dims else Replicate() for i in range(self.mesh.ndim))


def _all_gather(local: torch.Tensor, spec: GatherSpec) -> torch.Tensor:
    if all(p.is_replicate() for p in spec.placements):
        return local
    d = DTensor.from_local(
        local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
    )
    return d.full_tensor()


class _Gather(torch.autograd.Function):
    """local shard -> full tensor in ``compute_dtype``; gradient -> reduced over ``data_dims`` in
    ``reduce_dtype`` (``grad_reduce``) and scattered to the shard's placements, in the shard's dtype."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: GatherSpec) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = spec
        ctx.local_dtype = local.dtype
        return _all_gather(local.to(spec.compute_dtype), spec)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        spec: GatherSpec = ctx.spec
        target = spec.placements
        src = spec.grad_placements
        if src != target:
            # ``before`` divides in place: a copy (autograd's gradient is not ours) when it divides.
            grad = spec.grad_reduce.before(grad.to(spec.reduce_dtype, copy=spec.grad_reduce.pre is not None))
            d = DTensor.from_local(
                grad, spec.mesh, src, run_check=False, shape=spec.shape, stride=grad.stride()
            )
            grad = spec.grad_reduce.after(d.redistribute(spec.mesh, target).to_local())
        else:
            grad = grad.to(spec.reduce_dtype)
        return grad.to(ctx.local_dtype), None


def gather_full(t: torch.Tensor, spec: GatherSpec) -> torch.Tensor:
    """The full (unsharded) value of state tensor ``t`` as a plain tensor in ``spec.compute_dtype``.

    ``t``: a DTensor on ``spec.mesh`` with ``spec.placements`` (or a plain tensor, returned cast).
    Differentiable when ``t`` requires grad: ``t.grad`` receives a DTensor with ``t``'s placements
    and dtype holding the gradient reduced over the ranks of ``spec.data_dims`` (``spec.grad_reduce``:
    summed or averaged).
    Collectives: one all-gather per sharded mesh dim in forward, one reduce-scatter / all-reduce
    per mesh dim in backward; none for a tensor replicated everywhere on a single data rank.
    """
    if not isinstance(t, DTensor):
        return t.to(spec.compute_dtype)
    if not (t.requires_grad and torch.is_grad_enabled()):
        return _all_gather(t._local_tensor.to(spec.compute_dtype), spec)
    return _Gather.apply(t.to_local(), spec)


# Bucketed path: Shard(0) parameters on a 1-D data-parallel mesh (the default FSDP-style plan).

BUCKET_BYTES = 8 << 20  # cap of one bucket's reduce-scatter input (the padded full gradients)


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
    ``reduce_dtype``, one ``reduce_scatter_tensor`` (sum or FSDP2's mean: ``grad_reduce``), each
    local gradient a view of the result.
    """

    def __init__(self, fqns: list[str], specs: list[GatherSpec], local_dtype: torch.dtype):
        spec = specs[0]
        self.fqns = fqns
        self.mesh = spec.mesh
        self.compute_dtype = spec.compute_dtype
        self.reduce_dtype = spec.reduce_dtype
        self.grad_reduce = spec.grad_reduce
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
        # On CPU (gloo) each collective is waited on as soon as it is issued: torch 2.13's
        # functional all_gather_into_tensor with several in flight on one gloo group corrupts
        # the heap ("malloc(): unaligned tcache chunk detected" on a gloo worker thread, or a
        # SIGSEGV) within seconds (tests/repro/gloo_functional_inflight.py, no fqnckpt; issue
        # 34's CI abort). Overlap buys little on CPU; accelerators keep it.
        self.overlap = self.device.type != "cpu"

    def fits(self, tensors: list[torch.Tensor]) -> bool:
        """Whether ``tensors`` (the module's current state) still are the DTensor shards the bucket
        was built for; a reassigned tensor sends the bucket down the per-tensor path."""
        for t, shape, m in zip(tensors, self.local_shapes, self.members):
            if not (
                isinstance(t, DTensor)
                and t.device_mesh is self.mesh
                and t.shape == m.shape  # the global shape too: every rank takes the same path
                and t._local_tensor.shape == shape
                and t.dtype == self.local_dtype
                and t.placements == self.placements
            ):
                return False
        return True

    def start_gather(self, locals_: list[torch.Tensor]) -> InFlight:
        """Pack the local shards and issue the all-gather."""
        flat = torch.empty(self.size, dtype=self.compute_dtype, device=self.device)
        dst = [
            flat.narrow(0, m.offset, m.numel).view(m.rows, *m.shape[1:]).narrow(0, 0, m.local_rows)
            for m in self.members
        ]
        torch._foreach_copy_(dst, locals_)  # pad rows stay unwritten: they are never read
        if self.world == 1:
            return flat, flat
        return self._issued(flat, torch.ops._c10d_functional.all_gather_into_tensor(flat, self.world, self.group_name))

    def _issued(self, flat: torch.Tensor, out: torch.Tensor) -> InFlight:
        """A collective just issued: left in flight where :attr:`overlap`, else waited now (a
        later :func:`_wait` on it returns at once)."""
        if not self.overlap:
            out = torch.ops._c10d_functional.wait_tensor(out)
        return flat, out

    def finish_gather(self, work: InFlight) -> list[torch.Tensor]:
        """Wait for the all-gather and copy each member out: full tensors in ``compute_dtype``."""
        out = _wait(work, self.world)
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

    def start_reduce(self, grads: list[torch.Tensor]) -> InFlight:
        """Pack the full gradients (cast to ``reduce_dtype``) and issue the reduce-scatter."""
        flat = torch.empty(self.world * self.size, dtype=self.reduce_dtype, device=self.device)
        torch._chunk_cat(grads, dim=0, num_chunks=self.world, out=flat.view(self.world, self.size))
        if self.world == 1:
            return flat, flat
        self.grad_reduce.before(flat)
        return self._issued(
            flat, torch.ops._c10d_functional.reduce_scatter_tensor(flat, self.grad_reduce.op, self.world, self.group_name)
        )

    def finish_reduce(self, work: InFlight) -> list[DTensor]:
        """Wait for the reduce-scatter; each member's reduced local gradient as a DTensor like the
        parameter (a view of the output when ``reduce_dtype`` is the parameter's dtype)."""
        out = _wait(work, self.world)
        if self.world > 1:
            self.grad_reduce.after(out)
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


# A collective in flight: (its input, its pending output). The input is held until the wait so
# that its memory cannot be reused while the backend may still read it (no stream to record on CPU).
InFlight = tuple[torch.Tensor, torch.Tensor]


def _wait(work: InFlight, world: int) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(work[1]) if world > 1 else work[1]


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
    members: list[tuple[str, GatherSpec, torch.dtype]], cap_bytes: int | None = None
) -> list[Bucket]:
    """Group ``(fqn, spec, local dtype)`` (in graph order) into buckets of one mesh and dtypes,
    each at most ``cap_bytes`` (default :data:`BUCKET_BYTES`) of reduce-scatter input: the padded
    full gradients in ``reduce_dtype``; a larger tensor gets a bucket of its own. Several buckets
    let the first ones' reduce-scatters run while backward computes the others' gradients."""
    cap_bytes = BUCKET_BYTES if cap_bytes is None else cap_bytes
    open_: dict[tuple, tuple[list[str], list[GatherSpec], int]] = {}
    done: list[Bucket] = []
    for fqn, spec, local_dtype in members:
        key = (id(spec.mesh), spec.compute_dtype, spec.reduce_dtype, spec.grad_reduce, local_dtype)
        world = spec.mesh.size()
        nbytes = world * -(-spec.shape[0] // world) * spec.shape[1:].numel() * spec.reduce_dtype.itemsize
        fqns, specs, size = open_.get(key, ([], [], 0))
        if fqns and size + nbytes > cap_bytes:
            done.append(Bucket(fqns, specs, local_dtype))
            fqns, specs, size = [], [], 0
        open_[key] = (fqns + [fqn], specs + [spec], size + nbytes)
    for (*_, local_dtype), (fqns, specs, _) in open_.items():
        done.append(Bucket(fqns, specs, local_dtype))
    return done


class BucketTape:
    """One forward call's bookkeeping for overlapping the buckets' collectives with compute.

    ``where``: ``{graph attribute: (bucket #, member #)}``. The graph reads each such attribute
    through :func:`use_marker`, placed just before its first use (see
    :func:`autoparallel.graph_passes.with_use_markers`).

    Forward: :class:`_GatherBuckets` issues every bucket's all-gather and hands the graph
    placeholders; the first marker of a bucket waits for its all-gather and copies its members out
    (:meth:`full`), so later buckets arrive while the graph computes with earlier ones.
    Backward: a marker's autograd node runs as soon as its member's full gradient is complete
    (autograd runs the ready node made last first); when all members of a bucket have arrived, its
    reduce-scatter is issued (asynchronously) and backward goes on. :class:`_GatherBuckets`'
    backward, which autograd runs after all of them, waits for them and reduces the buckets not
    issued yet (one with a member the loss does not reach).
    """

    def __init__(self, buckets: list[Bucket], where: dict[str, tuple[int, int]]):
        self.buckets = buckets
        self.where = where
        self.gathers: list[InFlight | None] = [None] * len(buckets)  # all-gathers in flight
        self.fulls: list[list[torch.Tensor] | None] = [None] * len(buckets)
        self.reset()

    def start_gathers(self, params) -> None:
        """Issue every bucket's all-gather (``params``: the members, in bucket order)."""
        i = 0
        for b_i, b in enumerate(self.buckets):
            n = len(b.members)
            self.gathers[b_i] = b.start_gather([p._local_tensor for p in params[i : i + n]])
            i += n

    def full(self, attr: str) -> torch.Tensor:
        """The full tensor of ``attr`` (waits for its bucket's all-gather the first time)."""
        b, k = self.where[attr]
        fulls = self.fulls[b]
        if fulls is None:
            fulls = self.fulls[b] = self.buckets[b].finish_gather(self.gathers[b])  # type: ignore[arg-type]
            self.gathers[b] = None
        return fulls[k]

    def end_forward(self) -> None:
        """Drop the full tensors (autograd keeps what backward needs) and wait for any all-gather
        no marker asked for (an attribute the graph does not read)."""
        for b, work in zip(self.buckets, self.gathers):
            if work is not None:
                _wait(work, b.world)
        self.gathers = [None] * len(self.buckets)
        self.fulls = [None] * len(self.buckets)

    def reset(self) -> None:
        """Forget backward's state (after the gradients were handed over, for a next backward)."""
        self.grads: list[list[torch.Tensor | None]] = [[None] * len(b.members) for b in self.buckets]
        self.arrived = [0] * len(self.buckets)
        self.pending: list[InFlight | None] = [None] * len(self.buckets)
        self.drain_queued = False

    def arrive(self, attr: str, grad: torch.Tensor) -> None:
        b, k = self.where[attr]
        self.grads[b][k] = grad
        self.arrived[b] += 1
        if self.arrived[b] == len(self.buckets[b].members):
            self.pending[b] = self.buckets[b].start_reduce(self.grads[b])  # type: ignore[arg-type]
            self.grads[b] = [None] * len(self.grads[b])
            if not self.drain_queued:  # a backward that never reaches the parameters leaves none pending
                self.drain_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._drain)

    def _drain(self) -> None:
        for b, out in zip(self.buckets, self.pending):
            if out is not None:
                b.finish_reduce(out)
        self.reset()


_ACTIVE = threading.local()  # .tape: the BucketTape of the forward call running the graph


@contextmanager
def active_tape(tape: BucketTape):
    """Make :func:`use_marker` use ``tape`` while the graph runs (this thread); ends its forward."""
    prev = getattr(_ACTIVE, "tape", None)
    _ACTIVE.tape = tape
    try:
        yield
    finally:
        _ACTIVE.tape = prev
        tape.end_forward()


def use_marker(t: torch.Tensor, attr: str) -> torch.Tensor:
    """The value of graph attribute ``attr``: the full tensor from the active :class:`BucketTape`
    (``t`` is its placeholder) through a node whose backward hands the gradient to the tape; ``t``
    itself when no tape tracks ``attr``."""
    tape = getattr(_ACTIVE, "tape", None)
    if tape is None or attr not in tape.where:
        return t
    if t.requires_grad and torch.is_grad_enabled():
        return _Ready.apply(tape, attr, t)
    return tape.full(attr)


class _Ready(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tape: BucketTape, attr: str, placeholder: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.tape, ctx.attr = tape, attr
        return tape.full(attr)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.tape.arrive(ctx.attr, grad)
        # The tape holds the gradient; _GatherBuckets gets a placeholder that costs no memory.
        return None, None, grad.new_zeros(()).expand(grad.shape)


def _placeholders(buckets: list[Bucket]) -> list[torch.Tensor]:
    # NaN, not zeros: a read that bypassed the markers would show, not compute quietly.
    out = []
    for b in buckets:
        nan = torch.full((), float("nan"), dtype=b.compute_dtype, device=b.device)
        out.extend(nan.expand(m.shape) for m in b.members)
    return out


class _GatherBuckets(torch.autograd.Function):
    """DTensor parameters of all ``tape.buckets`` -> placeholders of their full tensors (the
    markers read the real ones from the tape); gradients reduce-scattered bucket by bucket (see
    :class:`BucketTape`)."""

    @staticmethod
    def forward(ctx, tape: BucketTape, *params: DTensor):  # type: ignore[override]
        ctx.tape = tape
        ctx.set_materialize_grads(False)  # an output the loss does not reach gets no gradient, as in eager
        tape.start_gathers(params)
        return tuple(_placeholders(tape.buckets))

    @staticmethod
    def backward(ctx, *given: torch.Tensor | None):  # type: ignore[override]
        tape: BucketTape = ctx.tape
        i, missing = 0, []
        for bi, b in enumerate(tape.buckets):
            n = len(b.members)
            if tape.pending[bi] is None:  # not issued while backward ran: issue it now
                # A member that did not arrive through its marker has no gradient (given: None).
                grads = [g if g is not None else given[i + k] for k, g in enumerate(tape.grads[bi])]
                missing.extend(g is None for g in grads)
                tape.pending[bi] = b.start_reduce(
                    [b.zeros(k) if g is None else g for k, g in enumerate(grads)]
                )
            else:
                missing.extend([False] * n)
            i += n
        pending = list(tape.pending)
        tape.reset()
        reduced = [g for b, out in zip(tape.buckets, pending) for g in b.finish_reduce(out)]
        return (None, *(None if m else r for m, r in zip(missing, reduced)))


def gather_buckets(tape: BucketTape, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Placeholders for the full tensors of ``params`` (the members of ``tape.buckets``, in bucket
    order), whose all-gathers are issued; :func:`use_marker` gives the graph the real ones, in each
    bucket's ``compute_dtype``. Differentiable (see :class:`BucketTape`) when grad mode is on and
    some parameter requires grad."""
    if torch.is_grad_enabled() and any(p.requires_grad for p in params):
        return list(_GatherBuckets.apply(tape, *params))
    tape.start_gathers(params)
    return _placeholders(tape.buckets)
