"""Migrate a checkpoint of any supported format to eager FQNs, explaining every decision.

Each source key goes through, in order: a saved ``fqn_map`` (names recorded at capture time), the
caller's ``rules`` (regexes applied to whole segments), wrapper-segment removal
(``fqn.canonical_fqn``), then, with a ``model``, ``fqn.resolve`` against the model's real names,
shapes and dtypes (dynamo / export flattened spellings, container prefixes, weight_norm). Nothing
is guessed: ambiguous, colliding or unknown keys stop the migration with the report unless
``allow_unresolved=True``. Tensors are then streamed one at a time into ``checkpoint.save``'s
format with ``migration_report.json`` in the same atomic commit.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn
from pydantic import BaseModel, ConfigDict, Field, ValidationError

import fqn
from fqn import FQNMap, TensorKind, canonical_fqn, dtype_name, eager_tensors
from fqn.rules import WRAPPER_SEGMENTS

from .errors import CorruptCheckpointError, MigrationError, UnsupportedTensorError, external_errors
from .load import check_tied_values
from .progress import progress_bar
from .sources import OptimizerInfo, Source, open_source
from .tensor_checks import dtype_problem

REPORT_NAME = "migration_report.json"
OPTIMIZER_GROUPS_NAME = "optimizer_param_groups.json"
REPORT_VERSION = 1


# -- report schema -------------------------------------------------------------------------------------
class KeyDecision(BaseModel):
    """One source key and the eager key it became; ``decided_by`` lists the steps that renamed it
    (empty when unchanged); ``shape`` in elements, ``dtype`` like ``"float32"``."""

    model_config = ConfigDict(extra="forbid")

    source: str
    target: str
    decided_by: list[str] = Field(default_factory=list)
    shape: list[int]
    dtype: str
    file: str


class Unresolved(BaseModel):
    """A source key that maps to no eager key (``reason``), with candidates when ambiguous."""

    model_config = ConfigDict(extra="forbid")

    source: str
    reason: str
    candidates: list[str] = Field(default_factory=list)


class Collision(BaseModel):
    """Several source keys mapped to one eager key: none of them is migrated."""

    model_config = ConfigDict(extra="forbid")

    target: str
    sources: list[str]


class ShapeMismatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str
    target: str
    source_shape: list[int]
    model_shape: list[int]


class MigrationReport(BaseModel):
    """``migration_report.json``: every source key -> eager key with the rule or provenance that
    decided it, plus what was refused. ``missing`` are model keys the source lacks, ``ignorable``
    source keys that are non-persistent buffers of the model (dropped), ``skipped`` non-tensor
    source entries (name -> type). ``written`` is False for a dry run or a refused migration."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = REPORT_VERSION
    source: str
    source_format: str
    container: str | None = None
    destination: str | None = None
    dry_run: bool = False
    written: bool = False
    entries: list[KeyDecision] = Field(default_factory=list)
    unresolved: list[Unresolved] = Field(default_factory=list)
    collisions: list[Collision] = Field(default_factory=list)
    shape_mismatched: list[ShapeMismatch] = Field(default_factory=list)
    missing: list[str] = Field(default_factory=list)
    ignorable: list[str] = Field(default_factory=list)
    alias_groups: list[list[str]] = Field(default_factory=list)
    # Source keys that hold one tied tensor: stored once, after their values were checked equal.
    tied_sources: list[list[str]] = Field(default_factory=list)
    skipped: dict[str, str] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)
    optimizer_param_groups: list[dict[str, Any]] | None = None
    # Optimizer state kept beside a model container ({"model", "optim"}): source key -> state.<fqn>.<slot>,
    # written to optimizer-*.safetensors + optimizer.safetensors.index.json (checkpoint.optim format).
    optimizer_entries: list[KeyDecision] = Field(default_factory=list)
    total_bytes: int = 0

    @property
    def ok(self) -> bool:
        """True when nothing was unresolved, colliding, shape-mismatched or missing."""
        return not (self.unresolved or self.collisions or self.shape_mismatched or self.missing)

    @property
    def mapping(self) -> dict[str, str]:
        """``{source key: eager key}`` of every migrated key."""
        return {e.source: e.target for e in self.entries}

    def counts(self) -> dict[str, int]:
        """Numbers of renamed / unchanged / unresolved (incl. collisions) / missing keys."""
        renamed = sum(e.source != e.target for e in self.entries)
        return {
            "renamed": renamed,
            "unchanged": len(self.entries) - renamed,
            "unresolved": len(self.unresolved) + sum(len(c.sources) for c in self.collisions),
            "shape_mismatched": len(self.shape_mismatched),
            "missing": len(self.missing),
        }

    def problems(self) -> str:
        parts = []
        if self.unresolved:
            parts.append(f"unresolved {[u.source for u in self.unresolved][:10]}")
        if self.collisions:
            parts.append(
                "collisions " + "; ".join(f"{c.sources} -> {c.target!r}" for c in self.collisions[:10])
            )
        if self.shape_mismatched:
            parts.append(
                f"shape-mismatched {[(m.source, m.source_shape, m.model_shape) for m in self.shape_mismatched][:10]}"
            )
        if self.missing:
            parts.append(f"missing from the source {self.missing[:10]}")
        return "; ".join(parts)


# -- naming schemes ----------------------------------------------------------------------------------------
_DYNAMO = re.compile(r"^(L_+self_|l_+self_|L_+s_|self_+modules|getattr_|l__self___)|___dict_____modules")
_EXPORT = re.compile(r"^[pbc]_[A-Za-z0-9_]+$")


def naming_schemes(name: str) -> list[str]:
    """Naming kinds a key shows: ``wrapper:<segment>``, ``dynamo``, ``export``,
    ``parametrization``, ``weight_norm_legacy``, ``fsdp1_flat_param``; ``[]`` for a plain name.
    Heuristic, for reports and ``fqnckpt inspect`` only; never used to decide a name."""
    segs = name.split(".")
    out = [f"wrapper:{s}" for s in dict.fromkeys(segs) if s in WRAPPER_SEGMENTS]
    if _DYNAMO.search(name):
        out.append("dynamo")
    elif "." not in name and _EXPORT.match(name):
        out.append("export")
    if "parametrizations" in segs:
        out.append("parametrization")
    if segs[-1] in ("weight_g", "weight_v"):
        out.append("weight_norm_legacy")
    if "_flat_param" in segs or "flat_param" in segs:
        out.append("fsdp1_flat_param")
    return out


# -- rules ---------------------------------------------------------------------------------------------------
def compile_rules(rules: Iterable[tuple[str, str] | str]) -> list[tuple[str, re.Pattern, str]]:
    """``[(regex, replacement)]`` (or ``"REGEX=REPL"`` strings) compiled so a match starts and ends
    on segment boundaries (``layer`` never matches inside ``layers``).

    Raises:
        ValueError: a rule is not ``(regex, replacement)`` or its regex does not compile.
    """
    out = []
    for rule in rules:
        if isinstance(rule, str):
            pat, sep, repl = rule.rpartition("=")
            if not sep:
                raise ValueError(f"rule {rule!r} is not REGEX=REPLACEMENT")
        else:
            pat, repl = rule
        try:
            rx = re.compile(rf"(?:(?<![^.])|(?=\.))(?:{pat})(?:(?![^.])|(?<=\.))")
        except re.error as e:
            raise ValueError(f"rule regex {pat!r} does not compile: {e}") from None
        try:
            rx.sub(repl, "")  # parses the replacement template (bad group references) up front
        except re.error as e:
            raise ValueError(f"rule {pat!r}: replacement {repl!r} is invalid: {e}") from None
        out.append((pat, rx, repl))
    return out


def _apply_rules(name: str, rules: Sequence[tuple[str, re.Pattern, str]]) -> tuple[str, list[str]]:
    used = []
    for pat, rx, repl in rules:
        new = rx.sub(repl, name)
        if new != name:
            new = ".".join(s for s in new.split(".") if s)  # a removed segment leaves no empty one
            used.append(f"rule {pat!r}")
            name = new
    return name, used


# -- the migration --------------------------------------------------------------------------------------------
def _load_fqn_map(fqn_map: FQNMap | str | os.PathLike | None) -> FQNMap | None:
    if fqn_map is None or isinstance(fqn_map, FQNMap):
        return fqn_map
    try:
        return FQNMap.from_json(Path(fqn_map).read_bytes())
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"])) or "document"
        raise CorruptCheckpointError(str(fqn_map), f"not an FQN map JSON: {where}: {err['msg']}") from None
    except OSError as e:  # missing, a directory, unreadable: ours, naming the file
        raise CorruptCheckpointError(str(fqn_map), f"cannot read the FQN map: {e.strerror or e}") from None


def _resolve(names: list[str], model: nn.Module, shapes: dict) -> tuple[dict[str, str], list[Unresolved]]:
    """``fqn.resolve_report`` over all names at once (a container prefix must fit them all); when it
    refuses (ambiguity, two names on one target) name by name, so each failure is reported."""
    try:
        rep = fqn.resolve_report(names, model, shapes)
        bad = [Unresolved(source=n, reason="matches no tensor of the model") for n in rep.unexpected]
        return dict(rep.mapping), bad
    except fqn.FQNError:
        pass
    found: dict[str, str] = {}
    bad = []
    for n in names:
        try:
            rep = fqn.resolve_report([n], model, {n: shapes[n]})
        except fqn.AmbiguousFQNError as e:
            bad.append(Unresolved(source=n, reason=str(e), candidates=list(e.candidates)))
            continue
        except fqn.FQNError as e:
            bad.append(Unresolved(source=n, reason=str(e)))
            continue
        found.update(rep.mapping)
        bad.extend(Unresolved(source=u, reason="matches no tensor of the model") for u in rep.unexpected)
    return found, bad


def _resolve_label(before: str, after: str) -> str:
    kinds = naming_schemes(before)
    if "dynamo" in kinds or "export" in kinds:
        return "fqn.resolve: flattened name matched by model names/shapes"
    if (
        "parametrization" in kinds
        or "weight_norm_legacy" in kinds
        or after.endswith(("weight_g", "weight_v"))
    ):
        return "fqn.resolve: weight_norm spelling of the model"
    if after.endswith(before) or before.endswith(after):
        return "fqn.resolve: container prefix"
    return "fqn.resolve"


def plan_names(
    keys: Sequence[str],
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    *,
    model: nn.Module | None,
    fqn_map: FQNMap | None,
    rules: Sequence[tuple[str, re.Pattern, str]],
) -> tuple[dict[str, tuple[str, list[str]]], list[Unresolved]]:
    """``{source key: (eager key, decided_by)}`` and the keys that map to nothing."""
    out: dict[str, tuple[str, list[str]]] = {}
    bad: list[Unresolved] = []
    pending: dict[str, tuple[str, list[str]]] = {}  # post-rule name -> (source key, steps)
    eager_names = {n for t in eager_tensors(model) for n in t.names} if model is not None else None
    for key in keys:
        if fqn_map is not None and key in fqn_map:
            rec = fqn_map.record(key)
            out[key] = (rec.fqn, [] if rec.fqn == key else [f"fqn_map ({rec.provenance.value})"])
            continue
        name, steps = _apply_rules(key, rules)
        try:
            canon = canonical_fqn(name, model)
        except fqn.FlatParamError as e:
            bad.append(Unresolved(source=key, reason=str(e)))
            continue
        if canon != name:
            steps.append("wrapper segments")
        if eager_names is None:
            if "dynamo" in naming_schemes(canon):
                bad.append(
                    Unresolved(
                        source=key, reason="flattened dynamo name: pass model= or fqn_map= to resolve it"
                    )
                )
            else:
                out[key] = (canon, steps)
        elif canon in eager_names:
            out[key] = (canon, steps)
        else:
            pending[canon] = (key, steps)
    if pending:
        shapes = {n: specs[src] for n, (src, _) in pending.items()}
        found, failed = _resolve(list(pending), model, shapes)
        for n, target in found.items():
            src, steps = pending[n]
            out[src] = (target, [*steps, _resolve_label(n, target)] if target != n else steps)
        reported = set()
        for u in failed:
            bad.append(Unresolved(source=pending[u.source][0], reason=u.reason, candidates=u.candidates))
            reported.add(u.source)
        for n in pending:
            if n not in found and n not in reported:
                bad.append(Unresolved(source=pending[n][0], reason="fqn.resolve returned no name for it"))
    return out, bad


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


def migrate(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    model: nn.Module | None = None,
    fqn_map: FQNMap | str | os.PathLike | None = None,
    rules: Iterable[tuple[str, str] | str] = (),
    key: str | None = None,
    dry_run: bool = False,
    max_shard_size: int | str = "5GB",
    allow_unresolved: bool = False,
    trusted_globals: Iterable[Any] = (),
    overwrite: bool = False,
    progress: bool | None = None,
) -> MigrationReport:
    """Rewrite the checkpoint at ``src`` under eager FQNs into ``dst`` (``checkpoint.save`` format).

    Args:
        src: any format :func:`checkpoint.sources.open_source` reads (torch pickles, safetensors
            file / shards / index, DCP directory, DCP per-rank safetensors shards).
        dst: output directory (HF layout: ``model-0000k-of-0000n.safetensors`` + index, hashed,
            written atomically) with ``migration_report.json`` inside.
        model: the target eager model: names are resolved against its real FQNs / shapes / dtypes
            and the result must load strictly into it (checked from headers before writing).
        fqn_map: an :class:`fqn.FQNMap` (or its JSON file) recorded at capture time.
        rules: ``[(regex, replacement), ...]`` applied in order to whole segments.
        key: which container of a pickle to migrate (``"model"``, ``"optimizer"``, ``"a/b"``).
        dry_run: plan and return the report, write nothing.
        max_shard_size: bytes per output shard (int or ``"5GB"``).
        allow_unresolved: migrate what resolves, drop (and report) the rest instead of stopping.
        trusted_globals: pickle globals allowed beyond the ``weights_only`` safe set.
        overwrite: replace an existing checkpoint at ``dst``.
        progress: tqdm bar on stderr (``None``: only when stderr is a terminal; shown after 1 s).

    Returns:
        The :class:`MigrationReport` (also written to ``dst/migration_report.json``).

    Raises:
        MigrationError: unresolved / ambiguous / colliding / missing / shape-mismatched keys (without
            ``allow_unresolved``), or optimizer state that cannot be named; ``.report`` explains.
        UnsafePickleError, AmbiguousSourceError, CorruptCheckpointError, ...: from reading ``src``.
        CheckpointExistsError: ``dst`` exists and ``overwrite`` is False.
    """
    fmap = _load_fqn_map(fqn_map)
    compiled = compile_rules(rules)
    with external_errors(os.fspath(src), what="reading"):
        source = open_source(src, key=key, trusted_globals=trusted_globals)
    try:
        report = MigrationReport(
            source=str(src),
            source_format=source.format,
            container=source.container,
            destination=None if dry_run else str(dst),
            dry_run=dry_run,
            skipped=dict(source.skipped),
            notes=list(source.notes),
        )
        keys = source.keys()
        specs = {k: (tuple(source.spec(k).shape), source.spec(k).dtype) for k in keys}
        info = source.optimizer
        opt_plan: dict[str, str] = {}
        if info is not None and not info.separate:  # the chosen container is an optimizer
            plan = _plan_optimizer(source, model, fmap, compiled, report, keys, report.entries)
        else:
            plan = _plan_model(source, keys, specs, model, fmap, compiled, report)
            if info is not None:
                opt_keys = list(info.state)
                opt_plan = _plan_optimizer(
                    source, model, fmap, compiled, report, opt_keys, report.optimizer_entries
                )
        if not report.ok and not allow_unresolved:
            raise MigrationError(report, report.problems())
        for s in [
            *plan.values(),
            *opt_plan.values(),
        ]:  # refused before anything is written, naming file and key
            why = dtype_problem(source.spec(s).dtype)
            if why is not None:
                raise UnsupportedTensorError(_file_of(source, s), s, why)
        report.total_bytes = sum(source.nbytes(s) for s in plan.values()) + sum(
            source.nbytes(s) for s in opt_plan.values()
        )
        for srcs in report.tied_sources:  # never let one alias silently stand for a different one
            check_tied_values(source, srcs, str(src))
        opt_meta = _optimizer_meta(source, report, opt_plan) if info is not None and info.separate else None
        if dry_run:
            return report
        _write(source, plan, Path(dst), report, fmap, max_shard_size, overwrite, progress, opt_plan, opt_meta)
        return report
    finally:
        source.close()


def _file_of(source: Source, key: str) -> str:
    return str(source.path / source.file_of(key)) if source.path.is_dir() else str(source.path)


def _plan_model(source, keys, specs, model, fmap, compiled, report: MigrationReport) -> dict[str, str]:
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


def _plan_optimizer(
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


def _optimizer_meta(source: Source, report: MigrationReport, opt_plan: dict[str, str]):
    """The optimizer index metadata (:mod:`checkpoint.optim` format) of a migrated optimizer."""
    from .storage.format import OptimizerMeta, ParamGroup

    scalars = sorted(t for t, s in opt_plan.items() if s in source.optimizer.scalars)
    try:
        groups = [ParamGroup(**g) for g in report.optimizer_param_groups or []]
    except ValidationError as e:
        raise MigrationError(
            report, f"optimizer param groups cannot be stored: {e.errors()[0]['msg']}"
        ) from None
    return OptimizerMeta(optimizer_class="unknown", param_groups=groups, python_scalars=scalars)


def _write(
    source, plan, dst, report, fmap, max_shard_size, overwrite, progress, opt_plan=None, opt_meta=None
) -> None:
    from .save import _Part, _save_parts
    from .storage.format import MODEL_PREFIX, OPTIMIZER_PREFIX
    from .storage.layout import TensorSpec, plan_layout

    def specs_of(p: dict[str, str]) -> list[TensorSpec]:
        return [TensorSpec(t, tuple(source.spec(s).shape), source.spec(s).dtype) for t, s in p.items()]

    bar = progress_bar(report.total_bytes, "migrate", progress)

    def fetcher(p: dict[str, str]):
        def fetch(spec) -> torch.Tensor:
            t = source.get(p[spec.fqn])
            bar.update(t.nbytes)
            return t

        return fetch

    if isinstance(fmap, FQNMap):
        fmap = fmap.to_model()
    parts = [
        _Part(
            MODEL_PREFIX,
            specs_of(plan),
            fetcher(plan),
            [g for g in report.alias_groups if g[0] in plan],
            fmap,
        )
    ]
    if opt_meta is not None:
        parts.append(_Part(OPTIMIZER_PREFIX, specs_of(opt_plan), fetcher(opt_plan), optimizer=opt_meta))
    if source.format.startswith("dcp"):  # DCP reads in batches along the order the writer asks
        order = []
        for part, p in zip(parts, (plan, opt_plan)):
            layout = plan_layout(part.specs, max_shard_size, part.prefix)
            order += [p[slot.spec.fqn] for f in layout.files for slot in f.slots]
        source.read_ahead(order)
    report.written = True
    extra = {REPORT_NAME: report.model_dump_json(indent=2).encode()}
    if report.optimizer_param_groups is not None and opt_meta is None:
        import json

        extra[OPTIMIZER_GROUPS_NAME] = json.dumps(report.optimizer_param_groups, indent=2).encode()
    try:
        _save_parts(os.fspath(dst), parts, max_shard_size, overwrite, extra)
    except BaseException:
        report.written = False
        raise
    finally:
        bar.close()


def read_report(path: str | os.PathLike) -> MigrationReport:
    """The :class:`MigrationReport` stored in a migrated checkpoint directory (or a report file)."""
    p = Path(path)
    if p.is_dir():
        p = p / REPORT_NAME
    return MigrationReport.model_validate_json(p.read_bytes())


__all__ = [
    "MigrationReport",
    "KeyDecision",
    "Unresolved",
    "Collision",
    "ShapeMismatch",
    "migrate",
    "plan_names",
    "compile_rules",
    "naming_schemes",
    "read_report",
    "REPORT_NAME",
]
