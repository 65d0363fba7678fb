"""Migrate a checkpoint of any supported format to eager FQNs, explaining every decision.

The entry point of the migration pipeline: source (:mod:`checkpoint.sources`) -> names
(:mod:`checkpoint.plan.names`: a saved ``fqn_map``, the caller's ``rules``, wrapper-segment
removal, then with a ``model`` ``fqn.resolve`` against its real names, shapes and dtypes) ->
plan (:mod:`checkpoint.plan.migration`) -> write (``checkpoint.save``'s format through the write
pipeline, :func:`checkpoint.write.write_checkpoint`, streamed one tensor at a time, with ``migration_report.json`` in the same atomic commit). Nothing is guessed:
ambiguous, colliding or unknown keys stop the migration with the report unless
``allow_unresolved=True``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fqn import FQNMap

from .convert import run_recipe
from .convert.quant_recipes import QUANT_RECIPES, run_quant_recipe
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
from .plan.extra_state import source_extra_state
from .plan.migration import file_of, optimizer_meta, plan_model, plan_optimizer, carry_fqnckpt_optimizer
from .plan.names import load_fqn_map, compile_rules, naming_schemes, plan_names
from .plan.values import check_tied_values, stored_key
from .progress import progress_bar
from .sources import open_source
from .storage.extra_state import (
    EXTRA_STATE_FILE,
    checked_extra_state_files,
    extra_state_file_bytes,
    read_extra_state_file,
)
from .storage.format import MODEL_PREFIX, OPTIMIZER_PREFIX, index_name
from .storage import paths
from .storage.location import local_path, local_target, options_for, resolve
from .storage.opening import open_checkpoint
from .storage.views import checkpoint_view
from .tensor_checks import storable_problem
from .gc_pause import gc_paused


@gc_paused
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
    storage_options: Mapping[str, Any] | None = None,
) -> MigrationReport:
    """Rewrite the checkpoint at ``src`` under eager FQNs into ``dst`` (``checkpoint.save`` format).

    Args:
        src: any format :func:`checkpoint.sources.open_source` reads (torch pickles, safetensors
            file / shards / index, DCP directory, DCP per-rank safetensors shards).
        dst: output directory (HF layout: ``model-0000k-of-0000n.safetensors`` + index, hashed,
            written atomically) with ``migration_report.json`` inside. ``src`` / ``dst`` may be
            URLs (``s3://...``, through fsspec; ``storage_options`` go to its filesystem); a URL
            source is read as fqnckpt / Hugging Face safetensors, model tensors only (its
            optimizer and extra state are not carried).
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
            ``dequantize-bf16`` / ``dequantize-fp32`` / ``quantize-fp8``: FP8-block and MXFP4
            weights to and from floating point (:mod:`checkpoint.convert.quant_recipes`; returns
            its ``QuantRecipeReport``).

    Returns:
        The :class:`MigrationReport` (also written to ``dst/migration_report.json``).

    Raises:
        MigrationError: unresolved / ambiguous / colliding / missing / shape-mismatched keys (without
            ``allow_unresolved``), or optimizer state that cannot be named; ``.report`` explains.
        UnsafePickleError, AmbiguousSourceError, CorruptCheckpointError, ...: from reading ``src``.
        CheckpointExistsError: ``dst`` exists and ``overwrite`` is False.
        NestedCheckpointError: ``dst`` lies inside another checkpoint's folder (as for ``save``).
    """
    if recipe is not None:  # checkpoint.convert plans and streams (a URL source too); written in save's format
        from .saving import converted_writer

        if storage_options and options_for(src, storage_options) is None and options_for(dst, storage_options) is None:
            resolve(dst, storage_options)  # the TypeError naming the local path
        out = resolve(dst, options_for(dst, storage_options))
        if recipe in QUANT_RECIPES:  # FP8 / MXFP4 <-> floating point (checkpoint.convert.quant_recipes)
            if model is not None or dims or key is not None:
                raise TypeError(f"recipe {recipe!r} changes dtypes only, under the stored names: it takes no "
                                "model=, dims= or key=")  # fmt: skip
            return run_quant_recipe(resolve(src, options_for(src, storage_options)), out, recipe,
                                    write=converted_writer(out, max_shard_size, overwrite), dry_run=dry_run)  # fmt: skip
        return run_recipe(src, out, recipe, write=converted_writer(out, max_shard_size, overwrite), model=model,
                          dims=dims, key=key, dry_run=dry_run, trusted_globals=trusted_globals, progress=progress,
                          storage_options=options_for(src, storage_options))  # fmt: skip
    dst = resolve(dst, storage_options)  # a URL is written through fsspec, never as a local path
    if not dry_run:  # refused before the source is read, as the write would refuse it
        from .write import refuse_nested

        refuse_nested(local_target(dst))
    # A URL source: every part read from the one model index fetched (optimizer, extra state),
    # as from a local checkpoint directory.
    stack, view = contextlib.ExitStack(), None
    src_where = resolve(src, options_for(src, storage_options))
    if local_path(src_where) is None:  # a byte store: its parts are the objects its model index names
        view = stack.enter_context(checkpoint_view(src_where))
    with stack:
        fmap = load_fqn_map(fqn_map)
        compiled = compile_rules(rules)
        src_path = Path(src)
        opt_part = None
        if view is not None and view.object_of(index_name(OPTIMIZER_PREFIX)) is not None:  # a URL: the same parts
            with external_errors(os.fspath(src), what="reading"):
                opt_part = open_checkpoint(view.store, prefix=OPTIMIZER_PREFIX)
        elif src_path.is_dir() and (src_path / index_name(OPTIMIZER_PREFIX)).is_file():
            # An fqnckpt checkpoint with optimizer state (e.g. a CheckpointManager step): the model
            # part is the source, the optimizer part is carried over under the new names.
            with external_errors(os.fspath(src), what="reading"):
                opt_part = open_checkpoint(src_path, prefix=OPTIMIZER_PREFIX)
            src_path = src_path / index_name(MODEL_PREFIX)
        try:
            with external_errors(os.fspath(src), what="reading"):
                source = open_source(src_path if opt_part is not None and view is None else src, key=key, trusted_globals=trusted_globals)
        except BaseException:
            if opt_part is not None:
                opt_part.close()
            raise
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
                plan = plan_optimizer(source, model, fmap, compiled, report, keys, report.entries)
            else:
                plan = plan_model(source, keys, specs, model, fmap, compiled, report)
                if info is not None:
                    opt_keys = list(info.state)
                    opt_plan = plan_optimizer(
                        source, model, fmap, compiled, report, opt_keys, report.optimizer_entries
                    )
            if not report.ok and not allow_unresolved:
                raise MigrationError(report, report.problems())
            opt_meta = None
            if opt_part is not None:
                opt_plan, opt_meta = carry_fqnckpt_optimizer(opt_part, report.mapping)
                report.notes.append(f"optimizer part {index_name(OPTIMIZER_PREFIX)} carried over by FQN")
                report.optimizer_entries = [
                    KeyDecision.model_construct(
                        source=s, target=t, decided_by=["fqnckpt optimizer part"] if s == t else ["renamed FQN"],
                        shape=list(opt_part.spec(s).shape), dtype=str(opt_part.spec(s).dtype).removeprefix("torch."),
                        file=opt_part.file_of(s),
                    )  # fmt: skip
                    for t, s in opt_plan.items()
                ]
            extra_files = _extra_state_files(source, opt_part, report, view)
            extra_files.update(_adapter_files(report, plan))
            opt_src = opt_part if opt_part is not None else source
            for s in plan.values():  # refused before anything is written, naming file and key
                why = storable_problem(source.spec(s).dtype, tuple(source.spec(s).shape))
                if why is not None:
                    raise UnsupportedTensorError(file_of(source, s), stored_key(source, s), why)
            for s in opt_plan.values():
                why = storable_problem(opt_src.spec(s).dtype, tuple(opt_src.spec(s).shape))
                if why is not None:
                    raise UnsupportedTensorError(file_of(source, s), stored_key(source, s), why)
            report.total_bytes = sum(source.nbytes(s) for s in plan.values()) + sum(
                opt_src.spec(s).nbytes for s in opt_plan.values()
            )
            for srcs in report.tied_sources:  # never let one alias silently stand for a different one
                check_tied_values(source, srcs, str(src))
            if info is not None and info.separate:
                opt_meta = optimizer_meta(source, report, opt_plan)
            if dry_run:
                return report
            _write(source, plan, dst if local_path(dst) is None else Path(dst), report, fmap, max_shard_size, overwrite, progress, opt_plan, opt_meta,
                   opt_src, extra_files)  # fmt: skip
            return report
        finally:
            source.close()
            if opt_part is not None:
                opt_part.close()


def _adapter_files(report: MigrationReport, plan: dict[str, str]) -> dict[str, bytes]:
    """peft's adapter files beside a PEFT model's base (``save(peft="adapter")``), carried byte
    for byte: their names are peft's (``base_model.model.<X>.lora_A.weight``), which a rename of
    the base does not reach, so a migration that renames base tensors says so in a note."""
    from .peft_state import ADAPTER_CONFIG, ADAPTER_WEIGHTS, has_adapter

    root = report.source
    if not isinstance(root, str) or not os.path.isdir(root) or not has_adapter(root):
        return {}
    out = {}
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        with open(paths.member(root, name), "rb") as f:
            out[name] = f.read()
    renamed = any(t != s for t, s in plan.items())
    report.notes.append("peft adapter files carried unchanged" + (
        " (base tensors were renamed: the adapter's names follow peft's, not the new base names)" if renamed else ""))
    return out


def _extra_state_files(source, opt_part, report: MigrationReport, view=None) -> dict[str, bytes]:
    """``extra_state.json`` for the migrated checkpoint: an fqnckpt source's own file, or the
    DCP entries that are neither model nor optimizer (torchtitan's ``lr_scheduler``,
    ``dataloader``, ``train_state``, top-level values), each classified in ``report.entry_kinds``.

    Raises:
        MigrationError: an entry has no exact encoding in extra state (names it).
    """
    root = view.store.url if view is not None else Path(report.source)
    has_file = view.member_bytes(EXTRA_STATE_FILE) is not None if view is not None else (root.is_dir() and (root / EXTRA_STATE_FILE).is_file())
    if opt_part is not None or has_file:
        doc = read_extra_state_file(str(root))
        if doc is None:
            return {}
        report.extra_state = sorted([*doc.entries, *(doc.per_rank.keys if doc.per_rank else ())])
        return checked_extra_state_files(str(root))  # per-rank files too, as they are
    if not source.format.startswith("dcp"):
        return {}
    report.entry_kinds = dict(sorted(source.entry_kinds().items()))
    try:
        entries = source_extra_state(source)
    except (TypeError, ValueError) as e:
        raise MigrationError(report, f"cannot place a DCP entry in extra state: {e}") from None
    if not entries:
        return {}
    report.extra_state = sorted(entries)
    return extra_state_file_bytes(entries)


def _write(
    source, plan, dst, report, fmap, max_shard_size, overwrite, progress, opt_plan=None, opt_meta=None,
    opt_src=None, extra_files=None,
) -> None:
    from .write import Part, layouts_of, write_checkpoint
    from .storage.layout import TensorSpec

    opt_src = opt_src if opt_src is not None else source

    def specs_of(p: dict[str, str], src=source) -> list[TensorSpec]:
        return [TensorSpec(t, tuple(src.spec(s).shape), src.spec(s).dtype) for t, s in p.items()]

    bar = progress_bar(report.total_bytes, "migrate", progress)

    def fetcher(p: dict[str, str], src=source):
        def fetch(spec) -> torch.Tensor:
            t = src.get(p[spec.fqn])
            bar.update(t.nbytes)
            return t

        return fetch

    if isinstance(fmap, FQNMap):
        fmap = fmap.to_model()
    parts = [
        Part(
            MODEL_PREFIX,
            specs_of(plan),
            fetcher(plan),
            [g for g in report.alias_groups if g[0] in plan],
            fmap,
        )
    ]
    if opt_meta is not None:
        parts.append(
            Part(OPTIMIZER_PREFIX, specs_of(opt_plan, opt_src), fetcher(opt_plan, opt_src), optimizer=opt_meta)
        )
    if source.format.startswith("dcp"):  # DCP reads in batches along the order the writer asks
        order = []
        for layout, p in zip(layouts_of(parts, max_shard_size), (plan, opt_plan)):
            order += [p[slot.spec.fqn] for f in layout.files for slot in f.slots]
        source.read_ahead(order)
    report.written = True
    extra = {**(extra_files or {}), REPORT_NAME: report.model_dump_json(indent=2).encode()}
    if report.optimizer_param_groups is not None and opt_meta is None:
        import json

        extra[OPTIMIZER_GROUPS_NAME] = json.dumps(report.optimizer_param_groups, indent=2).encode()
    try:
        write_checkpoint(dst if local_path(dst) is None else os.fspath(dst), parts, max_shard_size, overwrite, extra)
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
