"""Build the parallel module: the user's class and submodules, DTensor state at eager FQNs,
``forward`` running the captured graph under DTensor."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Placement
from torch.utils import _pytree as pytree

from fqn import eager_tensors

from .capture import Captured
from .errors import PlacementError, StateError
from .graph_passes import gather_state_before_use, replicate_free_tensors, retarget_devices
from .init_weights import wrap_init_weights
from .placement import Plan

Placements = tuple[Placement, ...]


@dataclass
class _Runtime:
    """What ``forward`` needs; kept off the module so ``state_dict`` never sees the graph."""

    gm: torch.fx.GraphModule
    attr_of: dict[str, str]  # eager FQN -> graph attribute
    slot_of: dict[str, tuple[nn.Module, str, str]]  # eager FQN -> (module, "_parameters"|"_buffers", key)
    mesh: DeviceMesh
    inputs: list[Placements] | None
    outputs: list[Placements] | None
    mp_policy: MixedPrecisionPolicy | None


def _shard_tensor(t: torch.Tensor, mesh: DeviceMesh, placements: Placements) -> DTensor:
    # Meta tensors hold no values to broadcast; real ones are taken from rank 0 so all ranks agree.
    # Clone: the local shard / replica would otherwise share storage with the user's tensor.
    if t.is_meta:
        return distribute_tensor(t.detach(), mesh, placements, src_data_rank=None)
    return distribute_tensor(t.detach().clone(), mesh, placements, src_data_rank=0)


def _parallel_class(cls: type) -> type:
    """A subclass of the user's class whose ``forward`` runs the captured graph (cached per class)."""
    cached = _CLASSES.get(cls)
    if cached is None:
        cached = type(
            f"AutoParallel{cls.__name__}",
            (cls,),
            {"forward": _parallel_forward, "__module__": cls.__module__},
        )
        _CLASSES[cls] = cached
    return cached


_CLASSES: dict[type, type] = {}


def build_parallel_module(
    model: nn.Module,
    captured: Captured,
    plan: Plan,
    mesh: DeviceMesh,
    input_placements: Sequence[Placements] | None = None,
    output_placements: Sequence[Placements] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """The parallel module of ``model`` (not mutated; its tensors are not copied).

    An instance of a subclass of ``type(model)`` with ``model``'s submodules (same classes and
    structure, deep-copied), every parameter / buffer replaced by a DTensor on ``mesh`` with
    ``plan[fqn]`` placements, tied tensors shared under all their names, non-persistent buffers
    kept non-persistent. ``fqn_map`` is the capture's :class:`fqn.FQNMap`. ``init_weights`` (and
    every submodule's) runs in :func:`autoparallel.init_weights.dtensor_init_context`.

    ``forward(*args, **kwargs)`` takes local tensors: the i-th tensor leaf of ``(args, kwargs)``
    becomes ``DTensor.from_local(x, mesh, input_placements[i])`` (default ``Shard(0)`` on every
    mesh dim); the j-th tensor leaf of the result is redistributed to ``output_placements[j]``
    (default: same) and returned as its local tensor (differentiable).

    ``captured`` is consumed: its graph is rewritten in place (a second call raises
    :class:`StateError`; :meth:`AutoParallel.apply_placement` captures again by itself).

    Raises:
        PlacementError: ``plan`` misses a tensor of the model.
        StateError: ``captured`` already built a parallel module.
    """
    eager = eager_tensors(model)
    by_id: dict[int, torch.Tensor] = {}
    fqn_of_id: dict[int, str] = {}
    for rec in eager:
        if rec.fqn not in plan:
            raise PlacementError(f"placement plan has no entry for {rec.fqn!r}")
        dt = _shard_tensor(rec.tensor, mesh, plan[rec.fqn])
        if isinstance(rec.tensor, nn.Parameter):
            dt = nn.Parameter(dt, requires_grad=rec.tensor.requires_grad)
        by_id[id(rec.tensor)] = dt
        fqn_of_id[id(rec.tensor)] = rec.fqn

    # Share the tensors in the copy (no data copied), then swap them for DTensors slot by slot.
    memo = {id(rec.tensor): rec.tensor for rec in eager}
    pmod = copy.deepcopy(model, memo)
    slot_of: dict[str, tuple[nn.Module, str, str]] = {}
    for mod in pmod.modules():
        for store in ("_parameters", "_buffers"):
            d = getattr(mod, store)
            for key, t in d.items():
                if t is not None and id(t) in by_id:
                    slot_of.setdefault(fqn_of_id[id(t)], (mod, store, key))
                    d[key] = by_id[id(t)]
    pmod.__class__ = _parallel_class(type(model))

    gm = _runtime_graph(captured, mesh)
    rt = _Runtime(
        gm=gm,
        attr_of=dict(captured.attr_of),
        slot_of=slot_of,
        mesh=mesh,
        inputs=[tuple(p) for p in input_placements] if input_placements else None,
        outputs=[tuple(p) for p in output_placements] if output_placements else None,
        mp_policy=mp_policy,
    )
    object.__setattr__(pmod, "_autoparallel", rt)
    object.__setattr__(pmod, "fqn_map", captured.fqn_map)
    wrap_init_weights(pmod)
    return pmod


def _runtime_graph(captured: Captured, mesh: DeviceMesh) -> torch.fx.GraphModule:
    """Rewrite the captured graph IN PLACE to run under DTensor on ``mesh``; its own tensors become
    meta placeholders (forward always passes the parallel module's DTensors), freeing their memory.
    Why in place: copying a dgc graph trips over the fake tensors in its node metadata."""
    gm = captured.gm
    if getattr(gm, "_autoparallel_consumed", False):
        raise StateError("this capture already built a parallel module; capture again")
    retarget_devices(gm, captured.device, torch.device(mesh.device_type))
    replicate_free_tensors(gm, mesh)
    gather_state_before_use(gm, mesh)
    for mod in gm.modules():
        for store in (mod._parameters, mod._buffers):
            for key, t in store.items():
                if t is not None and not t.is_meta:
                    meta = torch.empty_like(t, device="meta")
                    store[key] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    object.__setattr__(gm, "_autoparallel_consumed", True)
    return gm


def _placements(table: list[Placements] | None, i: int, mesh: DeviceMesh, what: str) -> Placements:
    from torch.distributed.tensor import Shard

    if table is None:
        return tuple(Shard(0) for _ in range(mesh.ndim))
    if i >= len(table):
        raise PlacementError(f"{what} tensor #{i} has no constraint ({len(table)} given)")
    return table[i]


def _parallel_forward(self, *args, **kwargs):
    rt: _Runtime = self._autoparallel
    mesh = rt.mesh
    flat, spec = pytree.tree_flatten((args, kwargs))
    cast_to = rt.mp_policy.param_dtype if rt.mp_policy and rt.mp_policy.cast_forward_inputs else None
    i = 0
    for k, x in enumerate(flat):
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            if cast_to is not None and x.is_floating_point():
                x = x.to(cast_to)
            flat[k] = DTensor.from_local(x, mesh, _placements(rt.inputs, i, mesh, "input"), run_check=False)
            i += 1
    args, kwargs = pytree.tree_unflatten(flat, spec)
    state = {
        attr: getattr(rt.slot_of[fqn][0], rt.slot_of[fqn][1])[rt.slot_of[fqn][2]]
        for fqn, attr in rt.attr_of.items()
    }
    out = torch.func.functional_call(rt.gm, state, args, kwargs, strict=False)
    out_dtype = rt.mp_policy.output_dtype if rt.mp_policy else None
    flat, spec = pytree.tree_flatten(out)
    j = 0
    for k, y in enumerate(flat):
        if isinstance(y, DTensor):
            placements = _placements(rt.outputs, j, mesh, "output")
            y = y.redistribute(mesh, placements).to_local(grad_placements=placements)
            if out_dtype is not None and y.is_floating_point():
                y = y.to(out_dtype)
            flat[k] = y
            j += 1
    return pytree.tree_unflatten(flat, spec)
