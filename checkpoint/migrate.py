"""Migrate a checkpoint of any supported format to eager FQNs, explaining every decision.

The entry point of the migration pipeline: source (:mod:`checkpoint.sources`) -> names
(:mod:`checkpoint.plan.names`: a saved ``fqn_map``, the caller's ``rules``, wrapper-segment
removal, then with a ``model`` ``fqn.resolve`` against its real names, shapes and dtypes) ->
plan (:mod:`checkpoint.plan.migration`) -> write (``checkpoint.save``'s format, streamed one
tensor at a time, with ``migration_report.json`` in the same atomic commit). Nothing is guessed:
ambiguous, colliding or unknown keys stop the migration with the report unless
``allow_unresolved=True``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fqn import FQNMap

from .convert import run_recipe
from .errors import MigrationError, UnsupportedTensorError, external_errors
from .migration_report import (
    OPTIMIZER_GROUPS_NAME,
    REPORT_NAME,
    Collision,
    KeyDecision,
    MigrationReport,
    ShapeMismatch,
    Unresolved,
    read_report,
)
from .plan.migration import _file_of, _optimizer_meta, _plan_model, _plan_optimizer
from .plan.names import _load_fqn_map, compile_rules, naming_schemes, plan_names
from .plan.values import check_tied_values
from .progress import progress_bar
from .sources import open_source
from .tensor_checks import dtype_problem


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
    recipe: str | None = None,
    dims: dict[str, int] | None = None,
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
        recipe: a tensor-changing conversion (``fqnckpt recipes``; ``"auto"`` picks the one that
            fits ``model``), planned by :mod:`checkpoint.convert` and written here; returns its
            :class:`checkpoint.convert.ConversionReport`. ``dims`` overrides model dimensions.

    Returns:
        The :class:`MigrationReport` (also written to ``dst/migration_report.json``).

    Raises:
        MigrationError: unresolved / ambiguous / colliding / missing / shape-mismatched keys (without
            ``allow_unresolved``), or optimizer state that cannot be named; ``.report`` explains.
        UnsafePickleError, AmbiguousSourceError, CorruptCheckpointError, ...: from reading ``src``.
        CheckpointExistsError: ``dst`` exists and ``overwrite`` is False.
    """
    if recipe is not None:  # checkpoint.convert plans and streams; written in save's format
        from .save import converted_writer

        return run_recipe(src, dst, recipe, write=converted_writer(dst, max_shard_size, overwrite), model=model,
                          dims=dims, key=key, dry_run=dry_run, trusted_globals=trusted_globals, progress=progress)  # fmt: skip
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
