"""Writes through views of a sharded DTensor inside ``init_weights``: exact on every mesh.

Single-device init code writes through indexing, slices and views of a parameter:
``nn.init.zeros_(w[padding_idx])``, ``w.data[idx] = 0``, ``w[:, :k].normal_()``. On a DTensor
split over ranks, a view that cuts across the split (a row of a ``Shard(0)`` weight, a column of a
``Shard(1)`` one) is not a view of the local shard: DTensor gathers the full tensor and returns a
view of that copy, so an in-place write to it is lost (and ``w.data[0] = 0`` raises inside
DTensor). Inside :func:`autoparallel.init_weights.dtensor_init_context` such a view is a
:class:`ShardView` instead: the DTensor plus the view's geometry (sizes, strides, storage offset)
in the tensor's global layout, computed on a meta tensor by the view op itself, so any chain of
strided views composes (``w[0]``, ``w[2:5, 1]``, ``w.view(-1)[3:]``, ``w.t()[0]``, ``split`` /
``unbind`` pieces). Views DTensor keeps on the local shard (its sharding propagation needs no
redistribution: ``w.t()``, ``w[:, 0]`` of a ``Shard(0)`` weight) stay DTensors.

An in-place op on a :class:`ShardView` (or an ``out=`` into one: ``torch.eye(..., out=view)``)
runs on a plain tensor of the view's shape and each rank copies back the elements of the view
that lie in its local shard, so the result on every mesh is the single-device result:

* ops that do not read their target (``copy_``, ``fill_``, ``zero_``, random fills, ``out=``)
  start from an empty tensor; random fills are those of :mod:`autoparallel.mesh_init` on a plain
  tensor of the view's shape, as on one device (a view of a parameter is a temporary there too);
* element-wise ops (``torch.Tag.pointwise``: ``mul_``, ``clamp_``, ``masked_fill_`` ...) start
  from the local elements (the others are never read back);
* other in-place ops, and any read of a :class:`ShardView` (``w[0].sum()``, ``w[0] * 2``), use the
  view's full values: the DTensor's ``full_tensor()`` on every rank (a collective; ranks run the
  same init code), announced by one :class:`~autoparallel.mesh_init.FullTensorWarning` per tensor.

Each write builds int64 index tensors of the view's size on every rank (the view's elements and
their place in the local shard): cheap for rows and columns, the size of the tensor for a view of
all of it. In-place ops DTensor refuses on a DTensor (no sharding strategy: ``fill_`` with a 0-dim
tensor, as ``w.data[i] = 0`` does; or its placements would change: ``w[index_tensor] = v``) run
on the local tensor where that is exact (``fill_`` / ``zero_``, or a tensor no mesh dim splits),
else take the :class:`ShardView` path on the whole tensor. Refused with
:class:`~autoparallel.errors.InitWriteError` (nothing written): a write other than ``fill_`` /
``zero_`` into a view whose elements overlap (stride 0, as after ``expand``; single-device torch
refuses those too), a view of a DTensor with placements other than ``Shard`` / ``Replicate``, and
any use of a :class:`ShardView` outside the init context. A view of a strided view that DTensor
kept local (``w[:, :4][0]`` of a ``Shard(0)`` weight) is placed by the coordinates of that view
(row-major), so a ``view`` single-device torch refuses on it (not contiguous) is accepted here.
Written by hand: DTensor has no write-through views of redistributed tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Replicate, Shard
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .errors import InitWriteError
from .uninitialized import note_written

# In-place ops whose result does not depend on the target's values.
_OVERWRITE = {"copy_", "fill_", "zero_"}
# In-place ops that read their target element by element without the pointwise tag.
_ELEMENTWISE = {"masked_fill_"}
# Ops that read only a tensor's metadata (shape, dtype, device).
_METADATA = {
    "new_empty",
    "new_empty_strided",
    "new_zeros",
    "new_ones",
    "new_full",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "rand_like",
    "randn_like",
    "randint_like",
}


def _dense(shape, stride) -> bool:
    """Every element at its own position, no gaps: a permutation of a contiguous layout."""
    acc = 1
    for n, st in sorted(((n, st) for n, st in zip(shape, stride) if n != 1), key=lambda x: x[1]):
        if st != acc:
            return False
        acc *= n
    return True


def _is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and any(
        not p.is_replicate() and t.device_mesh.size(i) > 1 for i, p in enumerate(t.placements)
    )


class ShardView(torch.Tensor):
    """A view of a DTensor that its local shard cannot hold: the DTensor (``base``, named ``fqn``
    in messages) and the view's geometry as a meta tensor (``geometry``: sizes, strides and
    storage offset in a dense layout of ``base`` whose strides are ``base_strides``). Usable only
    inside the init context (module doc); its own dispatch raises
    :class:`~autoparallel.errors.InitWriteError`."""

    base: DTensor
    geometry: torch.Tensor
    fqn: str
    base_strides: tuple[int, ...]

    @staticmethod
    def __new__(cls, base: DTensor, geometry: torch.Tensor, name: str, layout: tuple[int, ...]):
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            geometry.shape,
            strides=geometry.stride(),
            dtype=base.dtype,
            device=base._local_tensor.device,
            requires_grad=False,
        )
        r.base = base
        r.geometry = geometry
        r.fqn = name
        r.base_strides = layout
        return r

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"ShardView(of {self.fqn!r}, shape={tuple(self.shape)})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        view = next(x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, ShardView))
        raise InitWriteError(
            f"{func} on a view of {view.fqn!r} outside init_weights: a view of a sharded "
            "parameter that cuts across its shards exists only while init code runs; take the "
            "view again where it is used"
        )


def _geometry(t: DTensor, name: str) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(the meta tensor standing for ``t``, the strides of the layout it stands in): ``t``'s own
    global layout where it is dense, else row-major coordinates of ``t`` (a strided view DTensor
    keeps local: its slices and rows still map to its elements; refusals: module doc)."""
    if any(type(p) not in (Shard, Replicate) for p in t.placements):
        raise InitWriteError(
            f"init code wrote through a view of {name!r}, whose placements {tuple(t.placements)} "
            "have no exact write-through view (only Shard / Replicate)"
        )
    if _dense(t.shape, t.stride()):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"), tuple(t.stride())
    geometry = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return geometry, tuple(geometry.stride())


def _keeps_local(func, args, kwargs) -> bool:
    """DTensor runs this view op on the local shard (no redistribution): its output aliases it."""
    try:
        dispatcher = DTensor._op_dispatcher
        info = dispatcher.unwrap_to_op_info(func, args, kwargs)
        dispatcher.sharding_propagator.propagate(info)
        return not info.output_sharding.needs_redistribute
    except Exception:  # no strategy, or a propagation that fails: take the exact path
        return False


def _same_geometry(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()


def _positions(geometry: torch.Tensor, shape, layout, offset, box) -> tuple[torch.Tensor, tuple]:
    """(indices into the view's row-major order, per-dim indices into the local shard) of the
    view's elements that lie in the local box ``offset`` + ``box`` of a ``shape`` tensor laid out
    densely with strides ``layout`` (the coordinate of a position on dim d:
    ``pos // layout[d] % shape[d]``)."""
    with _disable_current_modes(), torch.no_grad():
        pos = torch.tensor(geometry.storage_offset(), dtype=torch.int64)
        for n, st in zip(geometry.shape, geometry.stride()):
            pos = pos.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st
        pos = pos.reshape(-1)
        keep = torch.ones(pos.shape, dtype=torch.bool)
        coords = []
        for d, (n, st) in enumerate(zip(shape, layout)):
            rel = pos.div(st, rounding_mode="floor").remainder_(max(n, 1)).sub_(offset[d])
            keep &= (rel >= 0) & (rel < box[d])
            coords.append(rel)
        sel = keep.nonzero().flatten()
        return sel, tuple(c[sel] for c in coords)


def _written(func, args, kwargs) -> int | str | None:
    """Where ``func`` writes in place: the position or keyword (``out=``) of that argument."""
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            if i < len(args):
                return i
            if a.name in kwargs:
                return a.name
    return None


def _arg(args, kwargs, slot):
    return args[slot] if isinstance(slot, int) else kwargs[slot]


def _with(args, kwargs, slot, value):
    if isinstance(slot, int):
        return (*args[:slot], value, *args[slot + 1 :]), kwargs
    return args, {**kwargs, slot: value}


class ShardWrites(TorchDispatchMode):
    """Make views of sharded DTensors :class:`ShardView` s and run the ops on them (module doc).
    Entered innermost in the init context, so it sees every op before the random fills' mode.

    ``name_of(t)``: the FQN of a DTensor (or None), for messages; ``warn_full(t, why)``: called
    before the full tensor of a sharded DTensor is made on every rank."""

    def __init__(self, name_of: Callable[[DTensor], str | None], warn_full: Callable[[DTensor, str], None]):
        super().__init__()
        self.name_of = name_of
        self.warn_full = warn_full

    def _name(self, t: DTensor) -> str:
        return self.name_of(t) or f"DTensor{tuple(t.shape)}"

    def _full(self, t: torch.Tensor, why: str) -> torch.Tensor:
        """The full (single-device) value of a ShardView or DTensor; plain tensors unchanged."""
        if isinstance(t, ShardView):
            if _is_sharded(t.base):
                self.warn_full(t.base, why)
            base = t.base
            full = torch.empty_strided(base.shape, t.base_strides, dtype=base.dtype, device=t.device)
            full.copy_(base.full_tensor())
            return full.as_strided(t.geometry.shape, t.geometry.stride(), t.geometry.storage_offset())
        if isinstance(t, DTensor):
            if _is_sharded(t):
                self.warn_full(t, why)
            return t.full_tensor()
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        if not any(isinstance(x, (ShardView, DTensor)) for x in leaves):
            return func(*args, **kwargs)
        src = args[0] if args else None
        if func.is_view and isinstance(src, (ShardView, DTensor)):
            return self._view(func, src, args, kwargs)
        slot = _written(func, args, kwargs)
        if slot is not None:
            dst = _arg(args, kwargs, slot)
            if isinstance(dst, ShardView):
                return self._write(func, args, kwargs, slot, dst)
            if isinstance(dst, DTensor):
                try:
                    return func(*args, **kwargs)
                except (RuntimeError, NotImplementedError) as e:
                    # Refused by DTensor before any computation: no sharding strategy (fill_ with
                    # a 0-dim tensor), or its placements would change (index_put_).
                    if not isinstance(e, NotImplementedError) and "placement changes" not in str(e):
                        raise
                op = func.overloadpacket.__name__
                if op in ("fill_", "zero_") or not _is_sharded(dst):
                    # The same value everywhere, or every rank holds all of it: on the local tensor.
                    full = lambda t: self._full(t, f"{op} reads it")  # noqa: E731
                    rest = pytree.tree_map_only((ShardView, DTensor), full, _with(args, kwargs, slot, None))
                    rest_args, rest_kwargs = _with(*rest, slot, dst._local_tensor)
                    with torch.no_grad():
                        func(*rest_args, **rest_kwargs)
                    note_written(dst)
                    return dst
                name = self._name(dst)
                geometry, layout = _geometry(dst, name)
                self._write(func, args, kwargs, slot, ShardView(dst, geometry, name, layout))
                return dst
        if any(isinstance(x, ShardView) for x in leaves):
            if func.overloadpacket.__name__ in _METADATA:
                make = lambda v: torch.empty(v.shape, dtype=v.dtype, device=v.device)  # noqa: E731
            else:  # a read: the views' full values
                make = lambda v: self._full(v, "a read of a view of it")  # noqa: E731
            args, kwargs = pytree.tree_map_only(ShardView, make, (args, kwargs))
        return func(*args, **kwargs)

    def _view(self, func, src, args, kwargs):
        if isinstance(src, DTensor):
            if _keeps_local(func, args, kwargs):
                return func(*args, **kwargs)
            name = self._name(src)
            base, (geometry, layout) = src, _geometry(src, name)
        else:
            base, geometry, name, layout = src.base, src.geometry, src.fqn, src.base_strides
        out = func(geometry, *args[1:], **kwargs)
        if isinstance(src, DTensor) and isinstance(out, torch.Tensor) and _same_geometry(out, geometry):
            return func(*args, **kwargs)  # the whole tensor (detach, alias, w[:]): DTensor's own
        return pytree.tree_map_only(torch.Tensor, lambda g: ShardView(base, g, name, layout), out)

    def _write(self, func, args, kwargs, slot, view: ShardView):
        base, geometry, name = view.base, view.geometry, view.fqn
        op = func.overloadpacket.__name__
        overlap = any(st == 0 and n > 1 for n, st in zip(geometry.shape, geometry.stride()))
        if overlap and op not in ("fill_", "zero_"):
            raise InitWriteError(
                f"{func} writes a view of {name!r} whose elements overlap (stride 0): "
                "single-device torch refuses such writes too"
            )
        local = base._local_tensor
        box, offset = compute_local_shape_and_global_offset(base.shape, base.device_mesh, base.placements)
        if tuple(box) != tuple(local.shape):
            raise InitWriteError(
                f"{func} writes a view of {name!r}: local shard {tuple(local.shape)}, its placements "
                f"give {tuple(box)}"
            )
        shape, layout = tuple(base.shape), view.base_strides
        sel, where = _positions(geometry, shape, layout, tuple(offset), tuple(box))
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        if op in _OVERWRITE or isinstance(slot, str) or seeded:  # does not read its target (out=)
            tmp = torch.empty(geometry.shape, dtype=base.dtype, device=local.device)
        elif op in _ELEMENTWISE or torch.Tag.pointwise in func.tags:
            tmp = torch.zeros(geometry.shape, dtype=base.dtype, device=local.device)
            with torch.no_grad():
                tmp.view(-1)[sel] = local[where]
        else:
            tmp = self._full(view, f"{op} of a view of it reads all its values").clone()
        others = _with(args, kwargs, slot, None)
        rest_args, rest_kwargs = pytree.tree_map_only(
            (ShardView, DTensor), lambda t: self._full(t, f"{op} reads it"), others
        )
        rest_args, rest_kwargs = _with(rest_args, rest_kwargs, slot, tmp)
        with torch.no_grad():
            func(*rest_args, **rest_kwargs)  # the modes below (random fills) see a plain tensor
            local[where] = tmp.reshape(-1)[sel].to(local.dtype)
        note_written(base)
        return view
