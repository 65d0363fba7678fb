"""The migration plan: an eager key for each source key (model and optimizer), into a
:class:`~checkpoint.migration_report.MigrationReport`. Reads headers only."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from pydantic import ValidationError

from fqn import TensorKind, dtype_name, eager_tensors

from ..errors import MigrationError
from ..migration_report import Collision, KeyDecision, MigrationReport, ShapeMismatch, Unresolved
from ..sources import OptimizerInfo, Source
from ..storage.format import OptimizerMeta, ParamGroup
from .names import plan_names


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return v



def _optimizer_names(
    info: OptimizerInfo, src: Source, model: nn.Module | None, fqn_map, rules, report: MigrationReport
) -> dict[str, str]:
    """``{str(param id): eager FQN}`` from the source's ``param_names`` or the model's order."""
    if info.param_names is not None:
        names = info.param_names
        specs = {n: ((), torch.float32) for n in names}
        planned, bad = plan_names(names, specs, model=model, fqn_map=fqn_map, rules=rules)
        report.unresolved.extend(bad)
        report.notes.append("optimizer state named by the source's param names")
        return {str(pid): planned[n][0] for pid, n in zip(info.param_ids, names) if n in planned}
    if model is None:
        raise MigrationError(
            report,
            f"optimizer state in {src.path} is keyed by position ({len(info.param_ids)} params) and carries no "
            "param_names; pass a model (--model) so its parameter order fixes the names"
            + (f", or pick the model container alone (key={src.container!r})" if info.separate else ""),
        )
    params = [t for t in eager_tensors(model) if t.kind == TensorKind.parameter]
    if len(params) != len(info.param_ids):
        raise MigrationError(
            report,
            f"optimizer state in {src.path} has {len(info.param_ids)} params but the model has {len(params)}: "
            "the order cannot name them",
        )
    report.notes.append("optimizer state named by the model's parameter order")
    return {str(pid): t.fqn for pid, t in zip(info.param_ids, params)}



def file_of(source: Source, key: str) -> str:
    return str(source.path / source.file_of(key)) if source.path.is_dir() else str(source.path)



def plan_model(source, keys, specs, model, fmap, compiled, report: MigrationReport) -> dict[str, str]:
    """Fill ``report`` for a model state_dict; return ``{eager key: source key}`` to write."""
    planned, bad = plan_names(keys, specs, model=model, fqn_map=fmap, rules=compiled)
    report.unresolved.extend(bad)
    by_target: dict[str, list[str]] = {}
    for k, (target, _) in planned.items():
        by_target.setdefault(target, []).append(k)
    tensors = {}
    canonical_of: dict[str, str] = {}
    if model is not None:
        for t in eager_tensors(model):
            for n in t.names:
                tensors[n] = t
                canonical_of[n] = t.fqn
    elif fmap is not None:
        canonical_of = {n: r.fqn for r in fmap for n in r.eager_names}
    # Tied aliases: the file keeps one copy under the canonical FQN, the index records the group.
    by_canon: dict[str, list[str]] = {}
    for target, srcs in by_target.items():
        by_canon.setdefault(canonical_of.get(target, target), []).extend(srcs)
    # One pass over targets (not one per canonical name: that was quadratic in the tensor count).
    clash_of: dict[str, str] = {}
    for t, ss in by_target.items():
        if len(ss) > 1:
            clash_of.setdefault(canonical_of.get(t, t), t)
    plan: dict[str, str] = {}
    for canon, srcs in sorted(by_canon.items()):
        srcs = sorted(srcs)
        if canon in clash_of:
            report.collisions.append(Collision(target=clash_of[canon], sources=srcs))
            continue
        chosen = next((s for s in srcs if planned[s][0] == canon), srcs[0])
        if model is not None:
            t = tensors[canon]
            if t.kind == TensorKind.non_persistent_buffer:
                report.ignorable.extend(srcs)
                continue
            if tuple(t.tensor.shape) != specs[chosen][0]:
                report.shape_mismatched.append(
                    ShapeMismatch(
                        source=chosen,
                        target=canon,
                        source_shape=list(specs[chosen][0]),
                        model_shape=list(t.tensor.shape),
                    )  # fmt: skip
                )
                continue
        plan[canon] = chosen
        if len(srcs) > 1:
            report.tied_sources.append(srcs)
        for s in srcs:
            steps = list(planned[s][1])
            if s != chosen:
                steps.append(f"tied alias of {canon!r}: stored once")
            sh, dt = specs[s]
            report.entries.append(
                KeyDecision.model_construct(  # our own values: no re-validation per tensor
                    source=s,
                    target=planned[s][0],
                    decided_by=steps,
                    shape=list(sh),
                    dtype=dtype_name(dt),
                    file=source.file_of(s),
                )  # fmt: skip
            )
    order = {k: i for i, k in enumerate(keys)}
    report.entries.sort(key=lambda e: order[e.source])
    if model is not None:
        collided = {canonical_of.get(c.target) for c in report.collisions}
        for t in eager_tensors(model):
            if t.kind == TensorKind.non_persistent_buffer:
                continue
            if t.fqn not in plan and t.fqn not in collided:
                report.missing.append(t.fqn)
            if t.aliases:
                report.alias_groups.append(t.names)
    elif fmap is not None:
        report.alias_groups = [g for g in fmap.alias_groups() if g[0] in plan]
    report.missing.sort()
    return plan



def plan_optimizer(
    source: Source,
    model,
    fmap,
    compiled,
    report: MigrationReport,
    keys: list[str],
    entries: list[KeyDecision],
) -> dict[str, str]:
    """Optimizer state keyed by id / position / source FQN -> ``state.<eager FQN>.<slot>`` (as
    DCP's ``get_optimizer_state_dict`` keys it, flattened); fills ``entries`` and the groups."""
    info = source.optimizer
    names = _optimizer_names(info, source, model, fmap, compiled, report)
    shapes = {t.fqn: tuple(t.tensor.shape) for t in eager_tensors(model)} if model is not None else {}
    unresolved = {u.source for u in report.unresolved}
    plan: dict[str, str] = {}
    for k in keys:
        pid, slot = info.state[k]
        name = names.get(str(pid))
        if name is None:
            if k not in unresolved:
                report.unresolved.append(Unresolved(source=k, reason=f"optimizer param {pid!r} has no name"))
            continue
        target = f"state.{name}.{slot}"
        sh, dt = tuple(source.spec(k).shape), source.spec(k).dtype
        want = shapes.get(name)
        if want is not None and sh not in ((), want):
            report.shape_mismatched.append(
                ShapeMismatch(source=k, target=target, source_shape=list(sh), model_shape=list(want))
            )
            continue
        if target in plan:
            report.collisions.append(Collision(target=target, sources=sorted([plan[target], k])))
            continue
        plan[target] = k
        entries.append(
            KeyDecision.model_construct(  # our own values: no re-validation per tensor
                source=k,
                target=target,
                decided_by=["optimizer param name"],
                shape=list(sh),
                dtype=dtype_name(dt),
                file=source.file_of(k),
            )  # fmt: skip
        )
    groups = []
    for g, ids in zip(info.groups, info.group_ids):
        groups.append({**_jsonable(g), "params": [names.get(str(i), f"<unnamed {i}>") for i in ids]})
    report.optimizer_param_groups = groups
    return plan



def optimizer_meta(source: Source, report: MigrationReport, opt_plan: dict[str, str]):
    """The optimizer index metadata (:mod:`checkpoint.optim` format) of a migrated optimizer."""

    scalars = sorted(t for t, s in opt_plan.items() if s in source.optimizer.scalars)
    try:
        groups = [ParamGroup(**g) for g in report.optimizer_param_groups or []]
    except ValidationError as e:
        raise MigrationError(
            report, f"optimizer param groups cannot be stored: {e.errors()[0]['msg']}"
        ) from None
    return OptimizerMeta(optimizer_class="unknown", param_groups=groups, python_scalars=scalars)


def carry_fqnckpt_optimizer(opt_reader: Any, mapping: dict[str, str]) -> tuple[dict[str, str], OptimizerMeta]:
    """The optimizer part of an fqnckpt checkpoint, carried into a migration: ``{new key: stored
    key}`` and the index metadata, with every parameter FQN renamed by ``mapping`` (stored model
    key -> eager key; unchanged where absent), ``$ref`` keys included.

    Raises:
        MigrationError-free: a part without fqnckpt optimizer metadata raises
        :class:`~checkpoint.optim.OptimizerMismatchError` (names the index).
    """
    from ..optim import OptimizerMismatchError

    meta = opt_reader.meta.optimizer if opt_reader.meta else None
    if meta is None:
        raise OptimizerMismatchError(f"{opt_reader.index_path} holds no fqnckpt optimizer metadata")
    fqns = {n for g in meta.param_groups for n in g.params}
    rename = {f"state.{f}.": f"state.{mapping.get(f, f)}." for f in fqns}

    def new_key(key: str) -> str:
        for old in sorted((o for o in rename if key.startswith(o)), key=len, reverse=True):
            return rename[old] + key[len(old) :]
        return key

    def refs(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: (new_key(x) if k == "$ref" and isinstance(x, str) else refs(x)) for k, x in v.items()}
        if isinstance(v, list):
            return [refs(x) for x in v]
        return v

    plan = {new_key(k): k for k in opt_reader.keys()}
    groups = [
        ParamGroup(**{**g.model_dump(), "params": [mapping.get(n, n) for n in g.params]}) for g in meta.param_groups
    ]
    new = meta.model_copy(
        update={
            "param_groups": groups,
            "python_scalars": [new_key(k) for k in meta.python_scalars],
            "state_values": {mapping.get(f, f): refs(d) for f, d in meta.state_values.items()},
        }
    )
    return plan, new
