"""``checkpoint.load(module, dcp_dir)``: a DCP checkpoint loaded through ``torch.distributed.checkpoint``.

Names are resolved as ``migrate`` resolves them (the model container picked, wrapper segments
removed where the model says they are wrappers, container prefixes such as ``model.`` found by
``fqn.resolve`` against the model's names and shapes). Every check runs before any target
changes: DCP reads into fresh tensors shaped like the targets (``torch.empty_like``: a DTensor
keeps its mesh and placements, so each rank reads only its slices, resharding as DCP does), and
only once every read succeeded are the values copied into the targets.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from fqn import canonical_fqn
from fqn.registry import dtype_name

from ..errors import CheckpointError, CheckpointMismatchError
from ..ranks import dist
from ..reports import DtypeConversion, LoadReport, ShapeMismatch
from ..state import object_state
from ..sources.dcp import dcp_errors, dcp_format, open_dcp
from .names import plan_names
from .values import check_tied_values, conversion_kind_problem, target_problem


class DCPLoadError(CheckpointError, ValueError):
    """A DCP checkpoint cannot be loaded as asked (``path`` names the DCP directory)."""

    def __init__(self, path: str, why: str):
        self.path = str(path)
        super().__init__(f"DCP checkpoint {self.path}: {why}")


def _match(keys, specs, state, model) -> tuple[dict[str, list[str]], list[str]]:
    """``{target FQN: [source keys]}`` and the source keys matching no target."""
    by_name = state.by_name()
    found: dict[str, list[str]] = {}
    pending: list[str] = []
    for k in keys:
        name = k if k in by_name else canonical_fqn(k, model)
        if name in by_name:
            found.setdefault(by_name[name].fqn, []).append(k)
        else:
            pending.append(k)
    unknown: list[str] = []
    if pending and model is not None:
        planned, bad = plan_names(
            pending, {k: specs[k] for k in pending}, model=model, fqn_map=None, rules=()
        )
        for k, (target, _) in planned.items():
            if target in by_name:
                found.setdefault(by_name[target].fqn, []).append(k)
            else:
                unknown.append(k)
        unknown += [u.source for u in bad]
    else:
        unknown = pending
    return found, unknown


def load_dcp(
    obj: torch.nn.Module | Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    *,
    strict: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
    dtype: torch.dtype | None = None,
    verify: bool = False,
    allow_lossy: bool = False,
) -> LoadReport:
    """Load the DCP checkpoint at ``path`` into ``obj`` (see module docstring); the arguments
    mean what they mean for :func:`checkpoint.load`. Collective when a process group is active
    and ``obj`` holds DTensors (every rank calls it); otherwise a single process reads with
    ``no_dist=True``.

    Raises (all before any target changes):
        DCPLoadError: ``optimizer=`` (migrate the checkpoint first) or ``verify=True`` (DCP stores
            no checksums).
        CheckpointMismatchError: ``strict`` and missing / unexpected / shape-mismatched keys.
        TiedValuesMismatchError: two stored spellings of one target tensor differ.
        CorruptCheckpointError / UnsafePickleError / UnsafePathError: unreadable DCP metadata or
            data; any DCP ``CheckpointException`` becomes a CorruptCheckpointError naming DCP,
            the file, the keys and the rank.
    """
    from ..errors import LossyConversionError, MetaTargetError, UnwritableTargetError

    path = os.fspath(path)
    fmt = dcp_format(path) or "dcp"
    if optimizer is not None:
        raise DCPLoadError(
            path, "optimizer= is not read from DCP directly; migrate it first (`fqnckpt migrate SRC DST "
            "--model MODULE:CALLABLE` writes the optimizer files), then load DST with optimizer="
        )  # fmt: skip
    if verify:
        raise DCPLoadError(path, "DCP stores no checksums, so verify=True cannot check it")
    if dtype is not None and not isinstance(obj, torch.nn.Module):
        raise TypeError("dtype= needs an nn.Module")
    state = object_state(obj)
    model = obj if isinstance(obj, torch.nn.Module) else None
    src = open_dcp(Path(path), fmt, read_optimizer=False)
    try:
        keys = src.keys()
        specs = {k: (tuple(src.spec(k).shape), src.spec(k).dtype) for k in keys}
        found, unknown = _match(keys, specs, state, model)
        report = LoadReport(path=path)
        copies = []
        meta: list[str] = []
        for e in state.entries:
            stored = found.get(e.fqn)
            if not stored:
                report.missing_keys.append(e.fqn)
                continue
            if len(stored) > 1:  # two spellings of one tensor: equal values or refused
                check_tied_values(src, stored, f"DCP checkpoint {path}")
            key = stored[0]
            shape, sdt = specs[key]
            if shape != tuple(e.tensor.shape):
                report.shape_mismatched.append(
                    ShapeMismatch(key=e.fqn, checkpoint_shape=list(shape), target_shape=list(e.tensor.shape))
                )
                continue
            want = dtype if dtype is not None and e.tensor.is_floating_point() else e.tensor.dtype
            # The same target checks as checkpoint.load (validate everything, then mutate).
            local = e.tensor.to_local() if isinstance(e.tensor, DTensor) else e.tensor
            if local.is_meta:
                meta.append(e.fqn)
            elif want == e.tensor.dtype and (why := target_problem(e.tensor)):
                raise UnwritableTargetError(e.fqn, path, why)
            if sdt != want and (why := conversion_kind_problem(sdt, want)) and not allow_lossy:
                raise LossyConversionError(
                    key, f"DCP checkpoint {path}", dtype_name(sdt), dtype_name(want), why
                )
            if sdt != want:
                report.dtype_converted.append(
                    DtypeConversion(
                        key=e.fqn, checkpoint_dtype=dtype_name(sdt), target_dtype=dtype_name(want)
                    )
                )
            if key != e.fqn:
                report.filled_from[e.fqn] = key
            report.loaded_keys.append(e.fqn)
            copies.append((e, key, want))
        for k in unknown:
            (report.ignorable_keys if k in state.non_persistent else report.unexpected_keys).append(k)
        for f in ("missing_keys", "unexpected_keys", "ignorable_keys", "loaded_keys"):
            getattr(report, f).sort()
        if strict and not report.ok:
            raise CheckpointMismatchError(report, f"DCP checkpoint {path}")
        if meta:
            raise MetaTargetError(meta, path)
        bufs = {src._reader.flat[k]: torch.empty_like(e.tensor, dtype=want) for e, k, want in copies}
        _read(src, bufs, path)
    finally:
        src.close()
    if dtype is not None:
        obj.to(dtype)
    with torch.no_grad():
        for e, k, _ in copies:
            b = bufs[src._reader.flat[k]]
            if isinstance(e.tensor, DTensor):
                e.tensor.to_local().copy_(b.to_local())
            else:
                e.tensor.copy_(b)
    return report


def _read(src, bufs: dict[str, torch.Tensor], path: str) -> None:
    import torch.distributed.checkpoint as dcp

    from ..sources.dcp import _planner

    collective = dist.active() and any(isinstance(b, DTensor) for b in bufs.values())
    with dcp_errors(Path(path), list(bufs), src._reader.files_of(list(bufs))):
        dcp.load(bufs, storage_reader=src._reader.reader, planner=_planner(path), no_dist=not collective)


__all__ = ["load_dcp", "DCPLoadError", "dcp_format"]
