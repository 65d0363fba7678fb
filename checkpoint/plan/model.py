"""``plan_load``: every check of :func:`checkpoint.load`, reading only, into a :class:`LoadPlan`.

Names (:mod:`.names`), shapes, dtype conversions and targets (:mod:`.values`), the optimizer
(:mod:`.optimizer`) and extra state (:mod:`.extra_state`). Changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping

import torch
from torch.distributed.tensor import DTensor

from fqn.registry import dtype_name

from ..errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    LossyConversionError,
    MetaTargetError,
    UnsupportedTensorError,
    UnwritableTargetError,
)
from ..reports import DtypeConversion, ShapeMismatch
from ..state import ModuleState, object_state
from ..storage.format import OPTIMIZER_PREFIX, index_name
from ..storage.reader import CheckpointReader
from .actions import CopyAction, LoadPlan
from .names import match_stored
from .optimizer import plan_optimizer, saved_source_optimizer
from .values import (
    check_overlaps,
    file_of_key,
    cast_problem,
    stored_key,
    local_shard,
    overlap_clusters,
    read_target_block,
    conversion_kind_problem,
    needs_value_check,
    target_problem,
    target_span,
    value_problem,
)


def owner_slot(model: torch.nn.Module, name: str):
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if attr in owner._parameters:
        return owner, "_parameters", attr
    if attr in owner._buffers:
        return owner, "_buffers", attr
    raise AttributeError(f"{name!r} is neither a parameter nor a buffer of its module")



def plan_load(
    obj: torch.nn.Module | Mapping[str, torch.Tensor],
    reader: CheckpointReader,
    path: str,
    *,
    strict: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
    dtype: torch.dtype | None = None,
    assign: bool = False,
    allow_lossy: bool = False,
    verify: bool = False,
    state: ModuleState | None = None,
    agree: Callable[[], None] | None = None,
) -> LoadPlan:
    """Every check of :func:`load`, reading only (headers, and tensor data where a check needs
    values: duplicate spellings, range-narrowing conversions, targets sharing memory, optimizer
    state). Changes nothing. ``state``: ``object_state(obj)`` if the caller has it already.
    ``reader``: a :class:`CheckpointReader`, or any reader of that interface (e.g.
    :class:`checkpoint.sources.dcp.DCPSource`); one with ``prefetch`` reads every
    block at once after the name checks, and ``agree()`` is called first (ranks agree on the
    name checks before a collective read). Raises what :func:`load` raises."""
    state = state if state is not None else object_state(obj)
    model = obj if isinstance(obj, torch.nn.Module) else None
    if verify:
        reader.check_index_digest()
        for name in reader.files:
            reader.verify_file(name)
    report, pairs = match_stored(reader, state, model, path)
    copies: list[CopyAction] = []
    meta: list[str] = []
    lazy = torch.nn.parameter.UninitializedTensorMixin
    inference_mode = torch.is_inference_mode_enabled()
    spans: list[tuple[int, int, int, object]] = []
    spec_of, strided = reader.spec, torch.strided
    for e, key in pairs:  # per-tensor work kept small: 10^4-10^5 tensors per load
        spec = spec_of(key)
        t = e.tensor
        if isinstance(t, lazy):
            raise UnwritableTargetError(
                e.fqn,
                path,
                "it is an uninitialized lazy parameter / buffer (no shape yet): run one forward pass first",
            )
        if t.shape != spec.shape:  # torch.Size compares equal to the tuple
            report.shape_mismatched.append(
                ShapeMismatch(key=e.fqn, checkpoint_shape=list(spec.shape), target_shape=list(t.shape))
            )
            continue
        target = dtype if dtype is not None and (t.is_floating_point() or t.is_complex()) else t.dtype
        if spec.dtype != target:
            why = cast_problem(spec.dtype, target)
            if why:  # no conversion exists (float4_e2m1fn_x2): refused even with allow_lossy
                raise UnsupportedTensorError(file_of_key(reader, key), stored_key(reader, key), why)
            why = conversion_kind_problem(spec.dtype, target)
            if why and not allow_lossy:
                raise LossyConversionError(
                    stored_key(reader, key), file_of_key(reader, key), dtype_name(spec.dtype), dtype_name(target), why
                )
            report.dtype_converted.append(
                DtypeConversion(
                    key=e.fqn, checkpoint_dtype=dtype_name(spec.dtype), target_dtype=dtype_name(target)
                )
            )
        if assign:
            if isinstance(t, DTensor):
                raise UnwritableTargetError(e.fqn, path, "assign=True does not replace DTensor targets")
            if model is not None:
                for n in e.module_names:
                    owner_slot(model, n)
            elif not isinstance(obj, MutableMapping):
                raise TypeError(f"assign=True needs a mutable state_dict, got {type(obj).__name__}")
        elif (local := local_shard(t)).is_meta:
            meta.append(e.fqn)
        elif target == t.dtype or model is None:  # else module.to makes a new tensor
            if local.layout is strided and local.is_contiguous() and (inference_mode or not local.is_inference()):
                # the common target, which target_problem passes; its span inline (target_span)
                if target == t.dtype and (n := local.nbytes):
                    lo = local.data_ptr()
                    spans.append((lo, lo + n, len(copies), None if local.is_cpu else local.device))
            else:
                why = target_problem(local, inference_mode)
                if why:
                    raise UnwritableTargetError(e.fqn, path, why)
                if target == t.dtype and (span := target_span(local, len(copies))) is not None:
                    spans.append(span)  # for the check of targets sharing memory below
        elif local.is_inference() and not inference_mode:
            raise UnwritableTargetError(e.fqn, path, target_problem(local, inference_mode))
        copies.append(CopyAction(e, key, target, assign, spec.dtype))
        report.loaded_keys.append(e.fqn)
    for name in ("missing_keys", "unexpected_keys", "ignorable_keys", "loaded_keys"):
        getattr(report, name).sort()
    if strict and not report.ok:
        raise CheckpointMismatchError(report, path)
    if meta:
        raise MetaTargetError(meta, path)

    prefetch = getattr(reader, "prefetch", None)
    if prefetch is not None:  # the source reads every block at once (DCP: one collective read)
        if agree is not None:
            agree()  # every rank planned its names before a collective read
        prefetch([(a.key, a.entry.tensor) for a in copies])

    def read(a: CopyAction) -> torch.Tensor:
        return read_target_block(reader, a.key, a.entry.tensor)

    fits = getattr(reader, "fits", None)  # a bound on the values, known without reading them all
    for a in copies:
        if not allow_lossy and a.stored_dtype != a.dtype and needs_value_check(a.stored_dtype, a.dtype):
            if fits is not None and fits(a.key, a.dtype):
                continue
            why = value_problem(read(a), a.dtype)
            if why:
                raise LossyConversionError(
                    stored_key(reader, a.key), file_of_key(reader, a.key), dtype_name(a.stored_dtype), dtype_name(a.dtype), why
                )
    for cluster in overlap_clusters(copies, spans):
        check_overlaps(cluster, read, path)

    plan = LoadPlan(report, copies)
    if optimizer is not None and model is None:
        raise TypeError("optimizer= needs the nn.Module (parameters are matched by identity)")
    info = getattr(reader, "optimizer_info", False)
    if optimizer is not None and info is not False:  # optimizer state beside the model (DCP, pickle)
        if info is None:
            raise CheckpointNotFoundError(reader.where, f"no optimizer state in this {reader.kind}")

        def fetch(pairs: list) -> None:
            if agree is not None:
                agree()  # every rank planned the model before a collective read
            if prefetch is not None:
                prefetch(pairs)

        aliases = {stored: target for target, stored in report.filled_from.items()}
        saved = saved_source_optimizer(info, path, optimizer, state)
        plan.optimizer_state = plan_optimizer(optimizer, reader, state, saved, aliases, prefetch=fetch)
    elif optimizer is not None:
        opt = reader.open_part(OPTIMIZER_PREFIX)
        if opt is None:
            raise CheckpointNotFoundError(
                reader.root, f"no {index_name(OPTIMIZER_PREFIX)} (saved without optimizer=?)"
            )
        with opt as opt_reader:
            if verify:
                opt_reader.check_index_digest()
            for name in opt_reader.files if verify else ():
                opt_reader.verify_file(name)
            plan.optimizer_state = plan_optimizer(optimizer, opt_reader, state)
    return plan
