"""Build the parallel module: the user's class and submodules, DTensor state at eager FQNs,
``forward`` running the captured per-rank graph on gathered state (FSDP semantics)."""

from __future__ import annotations

import copy
from collections import Counter
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
from .data import InputSignature, data_dims, data_placements, input_placements_of, output_to
from .errors import PlacementError, StateError
from .gather import (
    Bucket,
    BucketTape,
    GatherSpec,
    active_tape,
    bucketable,
    gather_buckets,
    gather_full,
    make_buckets,
    use_marker,
)
from .grad_reduce import check_reduce, grad_reduce
from .graph_passes import retarget_devices, with_use_markers
from .held_state import held_spec
from .init_weights import wrap_init_weights
from .mixed_precision import resolve_policy
from .placement import Plan
from .uninitialized import FreshState

Placements = tuple[Placement, ...]


@dataclass
class _Runtime:
    """What ``forward`` needs; kept off the module so ``state_dict`` never sees the graph."""

    gm: torch.fx.GraphModule
    attr_of: dict[str, str]  # eager FQN -> graph attribute
    slot_of: dict[str, tuple[nn.Module, str, str]]  # eager FQN -> (module, "_parameters"|"_buffers", key)
    gather: dict[str, GatherSpec]  # eager FQN -> how forward gathers it
    buckets: list[Bucket]  # parameters gathered / reduced by one collective per bucket
    single: list[tuple[str, str]]  # (eager FQN, graph attribute) gathered one by one
    mesh: DeviceMesh
    inputs: InputSignature
    cast_inputs_to: torch.dtype | None
    data: Placements  # placements of a local output: Shard(0) on the data dims
    outputs: list[Placements] | None
    output_dtype: torch.dtype | None
    training: tuple[bool, ...] | None  # each module's mode at capture, in named_modules order
    fresh: FreshState | None = None  # set by to_empty

    def tensor(self, fqn: str) -> torch.Tensor:
        mod, store, key = self.slot_of[fqn]
        return getattr(mod, store)[key]


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

        def to_empty(self, *, device, recurse: bool = True):
            out = super(cached, self).to_empty(device=device, recurse=recurse)
            rt: _Runtime = self._autoparallel
            rt.fresh = FreshState(rt.tensor, rt.attr_of)  # the tensors forward reads
            return out

        to_empty.__doc__ = (
            "``nn.Module.to_empty``; forward then refuses the tensors it allocated until something writes "
            "them (``init_weights``, ``checkpoint.load``, any in-place write)."
        )
        # eager_class: what checkpoint writes as config.json's "architectures" (the eager class loads it)
        attrs = {"forward": _parallel_forward, "to_empty": to_empty, "__module__": cls.__module__, "eager_class": cls}
        if callable(getattr(cls, "save_pretrained", None)):  # a transformers PreTrainedModel
            attrs["save_pretrained"] = _save_pretrained
        cached = type(f"AutoParallel{cls.__name__}", (cls,), attrs)
        _CLASSES[cls] = cached
    return cached


_CLASSES: dict[type, type] = {}


def _save_pretrained(
    self,
    save_directory,
    *,
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = True,
    push_to_hub: bool = False,
    **kwargs,
) -> None:
    """transformers' ``save_pretrained`` for the parallel module: call it on every rank. The
    DTensor state is written by :func:`checkpoint.save` (each rank its own bytes, Hugging Face's
    sharded safetensors layout, eager FQNs) with ``config.json`` / ``generation_config.json``, so
    ``from_pretrained(save_directory)`` of the eager class loads it; an existing checkpoint there is
    replaced (files it does not own stay), as ``save_pretrained`` does.

    Raises ``TypeError`` naming the options it cannot honour (``safe_serialization=False``,
    ``push_to_hub``, ``state_dict=``, ``variant=``, ...); else what :func:`checkpoint.save` raises."""
    unsupported = sorted(kwargs) + (["safe_serialization=False"] if not safe_serialization else [])
    unsupported += ["push_to_hub"] if push_to_hub else []
    if unsupported:
        raise TypeError(f"{type(self).__name__}.save_pretrained: not supported on the parallel module: {unsupported}")
    # Function-local: autoparallel builds modules without needing checkpoint; saving is its job.
    from checkpoint import save

    save(self, save_directory, max_shard_size=max_shard_size, overwrite=True)


def build_parallel_module(
    model: nn.Module,
    captured: Captured,
    plan: Plan,
    mesh: DeviceMesh,
    input_placements: Sequence[Placements] | None = None,
    output_placements: Sequence[Placements] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reduce: str = "mean",
) -> nn.Module:
    """The parallel module of ``model`` (not mutated; its tensors are not copied).

    An instance of a subclass of ``type(model)`` with ``model``'s submodules (same classes and
    structure, deep-copied), every parameter / buffer replaced by a DTensor on ``mesh`` with
    ``plan[fqn]`` placements (its storage), tied tensors shared under all their names,
    non-persistent buffers kept non-persistent. ``fqn_map`` is the capture's :class:`fqn.FQNMap`.
    ``init_weights`` (and every submodule's) runs in
    :func:`autoparallel.init_weights.dtensor_init_context`.

    Computation (FSDP semantics, data parallel only): ``captured`` must have been captured for
    the per-rank inputs (:func:`autoparallel.data.local_inputs`). ``forward(*args, **kwargs)``
    takes this rank's local tensors, of the captured shapes; the i-th tensor leaf is this rank's
    part of an input with ``input_placements[i]`` (``Shard(0)`` / ``Replicate()`` per mesh dim;
    default ``Shard(0)`` on every mesh dim). The graph runs on plain tensors: each parameter /
    buffer is all-gathered to its full value where forward starts (in the mixed-precision
    ``param_dtype`` for cast parameters), and each gradient is reduced over the mesh dims that
    split the data, in ``reduce_dtype``, and scattered back to the parameter's placements
    (``p.grad``: a DTensor like ``p``, in ``p``'s dtype). ``reduce="mean"`` (default) averages it
    over the data-parallel ranks (the product of those mesh dims' sizes) where and as FSDP2 does
    (:mod:`autoparallel.grad_reduce`): with a per-rank mean loss the gradient is that of the
    global batch's mean, on any number of ranks. ``reduce="sum"`` sums it, for a loss already
    normalised over the global batch (e.g. ``sum / global token count``). ``Shard(0)`` parameters on a 1-D data
    mesh do this in buckets (one ``all_gather_into_tensor`` and one ``reduce_scatter_tensor`` per
    bucket, the latter issued during backward as soon as the bucket's gradients are complete, so
    it overlaps the rest of backward); the module holds its own copy of the graph with a marker
    at each such parameter's first use (see :mod:`autoparallel.gather`). Other tensors are
    gathered and reduced one by one. The j-th tensor output leaf is
    redistributed from ``Shard(0)`` on the data dims to ``output_placements[j]`` (default: the
    same, no communication) and returned as this rank's local tensor (differentiable); a 0-dim
    output is this rank's value on its local batch.

    Forward raises :class:`autoparallel.errors.InputError` for inputs unlike the captured ones,
    :class:`autoparallel.errors.UninitializedStateError` after ``to_empty`` until the tensors it
    allocated are written (``init_weights``, ``checkpoint.load``, ``load_state_dict``), and
    :class:`StateError` when a module's train / eval mode differs from the capture's, or a tensor
    it holds (a replaced parameter / buffer) has another global shape, dtype, device type or mesh
    than the capture's, or a ``Partial`` placement; a DTensor replacement with other placements
    is gathered by its own placements (:mod:`autoparallel.held_state`).

    ``captured`` can build any number of modules: its graph is rewritten in place for the mesh's
    device and shared (it holds no state at run time; the marked copy shares its submodules).

    Raises:
        PlacementError: ``plan`` misses a tensor of the model; an input constraint is not
            ``Shard(0)`` / ``Replicate()``, or their number differs from the number of inputs.
        ValueError: ``reduce`` is neither ``"mean"`` nor ``"sum"``.
        StateError: ``captured`` records no example inputs (not made by :func:`autoparallel.capture`).
    """
    if captured.inputs is None:
        raise StateError("this capture records no example inputs; capture it with autoparallel.capture")
    check_reduce(reduce)
    in_placements = input_placements_of(input_placements, captured.inputs.n_tensors, mesh.ndim)
    dims = data_dims(in_placements, mesh.ndim)
    dp_world = 1
    for d in dims:
        dp_world *= mesh.size(d)
    policy = resolve_policy(mp_policy)
    eager = eager_tensors(model)
    by_id: dict[int, torch.Tensor] = {}
    by_fqn: dict[str, torch.Tensor] = {}
    fqn_of_id: dict[int, str] = {}
    gather: dict[str, GatherSpec] = {}
    for rec in eager:
        if rec.fqn not in plan:
            raise PlacementError(f"placement plan has no entry for {rec.fqn!r}")
        dt = _shard_tensor(rec.tensor, mesh, plan[rec.fqn])
        if isinstance(rec.tensor, nn.Parameter):
            dt = nn.Parameter(dt, requires_grad=rec.tensor.requires_grad)
        by_id[id(rec.tensor)] = dt
        by_fqn[rec.fqn] = dt
        fqn_of_id[id(rec.tensor)] = rec.fqn
        cast = policy is not None and rec.fqn in captured.cast_fqns
        reduce_dtype = policy.reduce_dtype if cast else dt.dtype
        gather[rec.fqn] = GatherSpec(
            mesh=mesh,
            placements=tuple(dt.placements),
            shape=dt.shape,
            stride=dt.stride(),
            compute_dtype=policy.param_dtype if cast else dt.dtype,
            reduce_dtype=reduce_dtype,
            data_dims=dims,
            grad_reduce=grad_reduce(reduce, reduce_dtype, dp_world),
            dtype=dt.dtype,
        )

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

    attr_of = {fqn: attr for fqn, attr in captured.attr_of.items() if fqn in slot_of}
    gm = _runtime_graph(captured, mesh)
    # A tensor the graph holds under two names would need two markers: gather it one by one.
    names = Counter(captured.fqn_map.to_eager(n) for n, _ in gm.named_parameters(remove_duplicate=False))
    one_name = {fqn for fqn in attr_of if names[fqn] == 1}
    in_bucket = [
        (fqn, gather[fqn], by_fqn[fqn].dtype)
        for fqn in attr_of
        if fqn in one_name and isinstance(by_fqn[fqn], nn.Parameter) and bucketable(gather[fqn], by_fqn[fqn])
    ]
    bucketed = {fqn for fqn, *_ in in_bucket}
    if bucketed:  # this module's own copy of the graph, reading bucketed parameters through markers
        gm = with_use_markers(gm, {attr_of[fqn] for fqn in bucketed}, use_marker)
    rt = _Runtime(
        gm=gm,
        attr_of=attr_of,
        slot_of=slot_of,
        gather=gather,
        buckets=make_buckets(in_bucket),
        single=[(fqn, attr) for fqn, attr in attr_of.items() if fqn not in bucketed],
        mesh=mesh,
        inputs=captured.inputs,
        cast_inputs_to=policy.param_dtype if policy is not None and policy.cast_forward_inputs else None,
        data=data_placements(dims, mesh.ndim),
        outputs=[tuple(p) for p in output_placements] if output_placements else None,
        output_dtype=policy.output_dtype if policy is not None else None,
        training=captured.training,
    )
    object.__setattr__(pmod, "_autoparallel", rt)
    object.__setattr__(pmod, "fqn_map", captured.fqn_map)
    wrap_init_weights(pmod)
    return pmod


def _runtime_graph(captured: Captured, mesh: DeviceMesh) -> torch.fx.GraphModule:
    """Make the captured graph run on ``mesh``'s device, IN PLACE and idempotently, so one capture
    serves any number of parallel modules (the graph holds no state at run time: forward passes
    the gathered tensors). Its own tensors become meta placeholders, freeing their memory.
    Why in place: copying a dgc graph trips over the fake tensors in its node metadata."""
    gm = captured.gm
    dst = torch.device(mesh.device_type)
    src = getattr(gm, "_autoparallel_device", captured.device)
    retarget_devices(gm, src, dst)
    object.__setattr__(gm, "_autoparallel_device", dst)
    for mod in gm.modules():
        for store in (mod._parameters, mod._buffers):
            for key, t in store.items():
                if t is not None and not t.is_meta:
                    meta = torch.empty_like(t, device="meta")
                    store[key] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return gm


def _check_modes(rt: _Runtime, pmod: nn.Module) -> None:
    if rt.training is None:
        return
    for (name, mod), captured_mode in zip(pmod.named_modules(remove_duplicate=False), rt.training):
        if mod.training != captured_mode:
            mode = "training" if captured_mode else "eval"
            raise StateError(
                f"module {name or type(pmod).__name__!r} is in {'training' if mod.training else 'eval'} mode, but "
                f"the graph was captured in {mode} mode (dropout and the like are fixed at capture): "
                f"call {'.train()' if captured_mode else '.eval()'}, or capture the model again in the mode wanted"
            )


def _parallel_forward(self, *args, **kwargs):
    rt: _Runtime = self._autoparallel
    if rt.fresh is not None:
        rt.fresh.check()
    _check_modes(rt, self)
    flat, spec = pytree.tree_flatten((args, kwargs))
    rt.inputs.check(flat, spec, rt.mesh.device_type, cast_floats=rt.cast_inputs_to is not None)
    if rt.cast_inputs_to is not None:
        flat = [
            x.to(rt.cast_inputs_to) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for x in flat
        ]
        args, kwargs = pytree.tree_unflatten(flat, spec)
    state, tape = _gather_state(rt)
    with active_tape(tape):
        out = torch.func.functional_call(rt.gm, state, args, kwargs, strict=False)
    flat, spec = pytree.tree_flatten(out)
    j = 0
    for k, y in enumerate(flat):
        if isinstance(y, torch.Tensor):
            want = _output_placements(rt, j, y)
            y = output_to(y, rt.mesh, rt.data, want)
            if rt.output_dtype is not None and y.is_floating_point():
                y = y.to(rt.output_dtype)
            flat[k] = y
            j += 1
    return pytree.tree_unflatten(flat, spec)


def _gather_state(rt: _Runtime) -> tuple[dict[str, torch.Tensor], BucketTape]:
    """``{graph attribute: value}`` and the call's :class:`BucketTape`: the buckets' members as
    placeholders from one autograd node that issues all their all-gathers (the graph's markers
    take the full tensors from the tape), the other tensors gathered one by one. Every tensor
    gathered one by one is checked first (:func:`autoparallel.held_state.held_spec`), so a refusal
    comes before any collective; a failure after the buckets' all-gathers were issued waits for
    them before it propagates."""
    state: dict[str, torch.Tensor] = {}
    ready: list[Bucket] = []
    tensors: list[torch.Tensor] = []
    one_by_one: list[str] = []
    for b in rt.buckets:
        ts = [rt.tensor(fqn) for fqn in b.fqns]
        if b.fits(ts):
            ready.append(b)
            tensors.extend(ts)
        else:  # a member was replaced by a tensor of another kind: gather it like any other
            one_by_one.extend(b.fqns)
    one_by_one.extend(fqn for fqn, _ in rt.single)
    specs = {fqn: held_spec(fqn, rt.tensor(fqn), rt.gather[fqn]) for fqn in one_by_one}
    where = {rt.attr_of[fqn]: (i, k) for i, b in enumerate(ready) for k, fqn in enumerate(b.fqns)}
    tape = BucketTape(ready, where)
    try:
        if ready:
            for attr, full in zip(where, gather_buckets(tape, tensors)):
                state[attr] = full
        for fqn in one_by_one:
            state[rt.attr_of[fqn]] = gather_full(rt.tensor(fqn), specs[fqn])
    except BaseException:
        # Every collective issued is waited on every exit path: the buckets' all-gathers are in
        # flight (into buffers of the tape) when a gather after them fails; left unwaited they
        # would meet a later collective of this rank (a hang or a mismatch).
        tape.end_forward()
        raise
    return state, tape


def _output_placements(rt: _Runtime, j: int, y: torch.Tensor) -> Placements:
    if rt.outputs is None:
        return rt.data
    if j >= len(rt.outputs):
        raise PlacementError(f"output tensor #{j} has no constraint ({len(rt.outputs)} given)")
    return rt.outputs[j]
