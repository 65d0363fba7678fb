"""``load``: a checkpoint into an eager, wrapped or parallel module (any mesh / placements).

The entry point of the load pipeline: source (:mod:`checkpoint.storage.reader`, or
:mod:`checkpoint.sources` for DCP) -> names (:mod:`checkpoint.plan.names`) -> values
(:mod:`checkpoint.plan.values`) -> apply (:mod:`checkpoint.apply`). Two phases, so that a
rejected load changes nothing: :func:`plan_load` makes every check and returns a
:class:`LoadPlan`; :func:`apply_load` then only reads and writes. Each rank reads only the slices
of its local shards (``preadv`` straight into the local shard where its block is one byte range
of the file, else ``safe_open(...).get_slice``), so loading reshards.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterable, Mapping, MutableMapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .apply import apply_load, check_reads
from .storage.views import checkpoint_view
from .convert.dequant import DequantizingReader, dequantizing_reader
from .errors import CheckpointMismatchError, DCPLoadError, RankMismatchError
from .plan.actions import CopyAction, LoadPlan
from .plan.extra_state import plan_extra_state
from .plan.model import plan_load
from .peft_state import adapter_only_state, check_adapter_config, find_peft, has_adapter, open_adapter_reader, saved_names_state
from .plan.values import check_tied_values, guarded_get
from .progress import copy_progress
from .ranks import dist
from .reports import LoadReport
from .state import object_state
from .storage.location import local_path, resolve
from .storage.paths import trust_root
from .storage.urls import redact_url
from .gc_pause import gc_paused
from .sources.dcp import dcp_format
from .sources.targets import open_target_reader as open_source_target


@gc_paused
def load(
    obj: torch.nn.Module | Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    *,
    strict: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
    dtype: torch.dtype | None = None,
    verify: bool = False,
    assign: bool = False,
    allow_lossy: bool = False,
    extra_state: MutableMapping[str, Any] | None = None,
    progress: bool | None = None,
    recipe: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    transfer: Any = None,
    key: str | None = None,
    trusted_globals: Iterable[Any] = (),
) -> LoadReport:
    """Load a checkpoint into ``obj`` in place and return the :class:`LoadReport`.

    Validate, then mutate: every check below runs before the first byte of any target tensor or
    optimizer state changes, so a rejected load leaves model and optimizer bit-identical.

    ``obj``: an ``nn.Module`` (eager, compiled, DDP, checkpoint-wrapped, or with DTensor
    parameters on any mesh / placements: each rank reads only its slices) or a state_dict whose
    tensors are filled in place. ``path``: a directory with ``model.safetensors.index.json``
    (authoritative), a directory with one ``model.safetensors``, or one ``.safetensors`` file.
    A DCP directory is read through ``torch.distributed.checkpoint`` (see
    :mod:`checkpoint.plan.dcp`; its errors name DCP).

    Names: a checkpoint key fills the target tensor it names; with a module, also a spelling that
    the module resolves (wrapper segments such as ``_orig_mod.`` / ``module.`` are dropped only
    where the module says that child is a wrapper, :func:`fqn.canonical_fqn`); a state_dict
    target is matched by its keys exactly. Tied tensors are filled from whichever alias the
    checkpoint stored. Several stored keys naming one target tensor must hold equal values.
    Keys that are non-persistent buffers of the target are ``ignorable_keys``, not loaded.

    transformers models (eager, wrapped, FSDP2 or the parallel module): a checkpoint whose keys the
    model's own conversion mapping (``transformers.conversion_mapping``, the installed version)
    converts or renames, e.g. a ``save_pretrained`` directory or Hub snapshot of a MoE model with
    per-expert keys (``mlp.experts.0.gate_proj.weight``, Mixtral's
    ``block_sparse_moe.experts.0.w1.weight``) into the fused ``mlp.experts.gate_up_proj`` /
    ``down_proj``, is read through that conversion, as ``from_pretrained`` reads it (the
    ``experts-to-fused`` recipe, planned before any tensor is read; a rank reads only its experts'
    keys); then checked as any checkpoint. Model tensors only: ``optimizer=`` / ``extra_state=``
    are refused for it. A checkpoint in the model's own names opens as it is.

    Dtypes: tensors stored in another dtype are converted to the target's dtype and listed in
    ``dtype_converted``. A conversion that loses values is refused (:class:`LossyConversionError`)
    unless ``allow_lossy=True``: by kind (complex -> real, floating -> integer / bool, integer ->
    bool), or by value where the target's range is narrower (float32 -> float16 overflowing to
    inf, int64 -> int32 out of range; such tensors are read once more to check). Rounding within
    range (float32 -> bfloat16) is a conversion, not a loss. ``dtype``: the module's floating-point
    and complex parameters and buffers take this dtype (``module.to(dtype)``, like
    ``from_pretrained(torch_dtype=...)``), done after every check.

    ``assign``: replace each loaded target with the checkpoint's tensor (in the target's dtype,
    on the target's device, CPU for meta targets), keeping Parameter-ness and ``requires_grad``
    (torch's ``load_state_dict(assign=True)``); the optimizer's param groups then hold the new
    parameters. Needed for meta targets, which hold no data to copy into.

    A ``torch.save`` pickle (a state_dict, ``{"model": ..., "optimizer": ...}``, a compiled /
    DDP module's state_dict) goes through the same stages (:mod:`checkpoint.sources.targets`):
    unpickled only by torch's ``weights_only`` unpickler after the exact-global scan
    (:class:`UnsafePickleError` naming the global and the file), then the same name, shape and
    dtype checks; ``verify=True`` is refused (no checksums).

    ``optimizer``: also restore it from ``optimizer.safetensors.index.json``, by FQN, values
    exact (see :mod:`checkpoint.optim`); from a DCP checkpoint's or a pickle's optimizer
    state_dict (a pickle's integer ids are matched by position, as
    ``torch.optim.Optimizer.load_state_dict`` does, unless it carries ``param_names``). Another
    optimizer class's state is refused (:func:`checkpoint.plan.optimizer.plan_optimizer`). ``verify``: first check the index's own digest and
    re-hash every file read against the index's ``metadata.fqnckpt.files`` record (size; xxh3-128
    of header and each tensor, or sha256 for format version 1: safetensors itself has no checksum,
    so a flipped data byte otherwise loads silently); costs one extra read of the files.

    ``extra_state``: fill this dict from the checkpoint's ``extra_state.json``: objects with
    ``load_state_dict`` are restored in place, other keys get the saved value (see
    :mod:`checkpoint.storage.extra_state`); its entries appear in the report as
    ``extra_state.<key>`` (missing / unexpected / loaded), checked with everything else and applied
    after the tensors.

    ``progress``: tqdm bar on stderr, rank 0 only (``None``: only when stderr is a terminal;
    shown after 1 s).

    ``path`` may be a URL (``s3://...``, ``memory://...``): read through fsspec, each rank fetching
    only the byte ranges it needs (ranged GETs), every object named by the one model index fetched
    (:mod:`checkpoint.storage.remote_reader`); ``storage_options`` go to the fsspec filesystem,
    ``transfer`` (:class:`~checkpoint.storage.objstore.TransferConfig`) sets the retries; a read
    failing for good is a :class:`LoadError` naming the object.

    ``key``: which container of a ``torch.save`` pickle or DCP checkpoint holds the model when
    several do (``"model"``, ``"ema"``; the error without it lists them); ``TypeError`` for a
    safetensors checkpoint, which has none. ``trusted_globals``: pickle globals allowed beyond
    torch's ``weights_only`` safe set (classes / functions or ``"module.name"`` strings, as
    ``migrate`` takes them): the explicit allow-list an :class:`UnsafePickleError` points to.

    Ranks: a load into DTensors is collective over the ranks of their root mesh (the mesh their
    meshes were sliced from; usually every rank): each of them calls ``load`` with DTensors, and
    they agree on the checkpoint, the digests and the outcome, so a failure on one (an argument
    error included) is raised on all. A load of plain tensors makes no collective (rank 0 alone
    may load a module while the other ranks wait).

    ``recipe``: the checkpoint is in another layout (``fqnckpt recipes``): converted while loading
    (:mod:`checkpoint.convert.reader`; planned and checked against ``obj`` before a tensor is read,
    no temporary files), then checked and copied like any source. Each rank computes the targets
    it holds from their own source tensors (one rule group at a time) and keeps its block.
    Model tensors only: ``TypeError`` with ``optimizer=``, ``extra_state=`` or ``verify=True``.

    Raises (all before anything is changed):
        CheckpointNotFoundError, MissingShardError, UnsafePathError, TensorNotInShardError,
        DuplicateTensorError, CorruptCheckpointError: see :func:`checkpoint.storage.reader.open_local_checkpoint`.
        TiedValuesMismatchError: stored keys naming one target tensor hold different values.
        ChecksumMismatchError: ``verify`` and a file's size or digest, or the index's own digest,
            differs from the record.
        CheckpointMismatchError: ``strict`` and missing / unexpected / shape-mismatched keys
            (``.report`` carries the LoadReport). With ``strict=False`` the matching keys load.
        LossyConversionError: a dtype conversion would lose values (see above).
        MetaTargetError: targets on the meta device and ``assign`` is False.
        AdapterConfigMismatchError: a ``PeftModel`` target whose peft config differs from the
            checkpoint's ``adapter_config.json`` in a field that changes the math (``r``,
            ``lora_alpha``, ``use_rslora``, ``target_modules``, ...:
            :data:`checkpoint.peft_state.MATH_FIELDS`), naming each field and both values.
        UnwritableTargetError: a target cannot take an in-place copy (expanded / internally
            overlapping, inference tensor outside inference mode, sparse, uninitialized lazy).
        LoadError: safetensors / torch / the OS fail to read a tensor the checks need (names key
            and file).
        OverlappingTargetsError: distinct targets share memory and the checkpoint gives the shared
            elements different values.
        OptimizerMismatchError (``checkpoint.optim``): optimizer groups match no saved groups.
        TypeError: ``dtype`` without a module or not floating / complex; ``optimizer`` without a module;
            ``optimizer`` / ``extra_state`` for a checkpoint in transformers' on-disk layout.
        RankAgreementError: another rank of the DTensors' root mesh failed (an argument error included).
    Raises after the checks: LoadError, naming key and file, if torch or the OS fails while
    copying; CorruptCheckpointError, naming file and tensor, when a tensor read whole (or through
    all of its rows, or, across the ranks of a collective load, through their rows: its digest
    chunks gathered in the closing agreement) differs from the index's xxh3-128 digest (checked
    on the bytes just read: a flipped byte no longer loads silently; raised alike on every rank). Both stop the load there: tensors copied before it hold the checkpoint's
    values, the optimizer and ``extra_state`` are not applied; ``verify=True`` checks every
    file before anything changes.
    """
    # Collective when this rank holds DTensors: its agreements run on the ranks of their root mesh
    # (_agreement_group), so a rank loading plain tensors (rank 0 alone, a rank outside that mesh)
    # makes no collective. An argument error before the first agreement is agreed there.
    state = object_state(obj)
    collective = state.has_dtensor and dist.active()
    span = contextlib.ExitStack()
    if collective:
        span.enter_context(dist.using_group(_agreement_group(state)))
    err: BaseException | None = None
    try:
        path = resolve(path, storage_options, transfer)
        local = local_path(path)
        if recipe is not None and (optimizer is not None or verify or extra_state is not None):
            raise TypeError("load(recipe=...) reads model tensors only (no optimizer=, extra_state=, verify=): "
                            "the optimizer and extra state of another layout are not converted")  # fmt: skip
        if dtype is not None:
            if not isinstance(obj, torch.nn.Module):
                raise TypeError("dtype= needs an nn.Module")
            if not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or dtype.is_complex):
                raise TypeError(f"dtype= must be a floating point or complex torch.dtype, got {dtype!r}")
        fmt = dcp_format(local) if recipe is None and local is not None else None
        if fmt is not None and verify:
            raise DCPLoadError(path, "DCP stores no checksums, so verify=True cannot check it")
        peft_dir = None  # "both": model part + peft's adapter files; "adapter": a peft adapter directory
        if isinstance(obj, torch.nn.Module) and find_peft(obj) is not None and recipe is None:
            # A PeftModel target is planned under the names its files use (checkpoint.peft_state).
            if fmt is None and local is not None and os.path.isdir(local) and has_adapter(local):
                peft_dir = "both" if _has_model_part(local) else "adapter"
            state = adapter_only_state(obj, state) if peft_dir == "adapter" else saved_names_state(obj, state)
    except BaseException as e:  # noqa: BLE001 - agreed across ranks below
        if not collective:
            span.close()
            raise
        err = e
    agreed = False
    reader = plan = extra = None
    converted = False

    def agree() -> None:
        nonlocal agreed
        if collective:
            agreed = True  # a failure raised here was agreed already: not agreed twice below
            dist.check_all(f"planning {path}", None)
            agreed = False

    try:
        if err is not None:  # an argument error of this rank: agreed at the opening below
            raise err
        # Model and optimizer parts (and extra state) of one checkpoint: see checkpoint.storage.views.
        with checkpoint_view(path):
            if peft_dir is not None:  # the saved adapter config is the one peft would build
                check_adapter_config(obj, os.fspath(path))
            if peft_dir == "adapter":
                reader = open_adapter_reader(os.fspath(path))
            else:
                reader = open_load_reader(path, read_optimizer=optimizer is not None, recipe=recipe, model=obj,
                                            key=key, trusted_globals=trusted_globals, known=state.by_name(), verify=verify)  # fmt: skip
            converted = recipe is None and type(reader).__name__ == "ConvertedReader"  # transformers' own layout
            if converted and (optimizer is not None or extra_state is not None):
                raise TypeError(f"load({path}): the checkpoint is in transformers' on-disk layout (converted by the model's "
                                "conversion mapping while loading), which holds model tensors only: no optimizer= / extra_state=; "
                                "a training checkpoint is saved with layout='memory'")  # fmt: skip
            if peft_dir == "both":
                reader = open_adapter_reader(os.fspath(path), reader)
            elif peft_dir is None and recipe is None:  # FP8 / MXFP4 weights into other dtypes: dequantized
                reader = dequantizing_reader(reader, state, obj if isinstance(obj, torch.nn.Module) else None,
                                             str(path), dtype)  # fmt: skip
            plan = plan_load(
                obj, reader, f"DCP checkpoint {path}" if fmt else str(path), strict=strict, optimizer=optimizer, dtype=dtype,
                assign=assign, allow_lossy=allow_lossy, verify=verify and not converted, state=state, agree=agree,
            )  # fmt: skip
            if isinstance(reader, DequantizingReader):
                plan.report.dequantized = {a.entry.fqn: reader.dequantized(a.key) for a in plan.copies
                                           if reader.dequantized(a.key)}  # fmt: skip
            if extra_state is not None:
                extra = plan_extra_state(reader, extra_state, plan.report, plan=plan, optimizer=optimizer)
                if strict and not plan.report.ok:
                    raise CheckpointMismatchError(plan.report, str(path))
    except BaseException as e:  # noqa: BLE001 - agreed across ranks below
        err = e
    try:
        if collective and not agreed:
            opened = dist.check_all_gather(f"opening {path}", err, _opened(path, reader))
            _check_same_checkpoint(str(path), opened)
        elif err is not None:
            raise err
        err = None
        # Every digest first, then the copies: a flipped byte is refused before any target
        # changes. Chunk digests of Shard(0) rows are gathered from every rank and combined
        # (each rank then checks the same digests, so a mismatch is raised alike on all).
        rows: dict[str, dict[int, bytes]] = {}
        if hasattr(reader, "reading"):  # the check and the copies read the files under one lease
            span.enter_context(reader.reading())
        try:
            rows = check_reads(reader, plan.copies)
        except BaseException as e:  # noqa: BLE001 - agreed across ranks below
            err = e
        gathered = dist.check_all_gather(f"checking {path}", err, rows) if collective else [rows]
        if err is not None:
            raise err
        try:  # (each rank checks its own row keys: agreed, as ranks may load different tensors)
            for k in sorted(rows):
                reader.check_chunks(k, {i: d for g in gathered for i, d in g.get(k, {}).items()})
            confirm = getattr(reader, "confirm_unchanged", None)  # no file or object rewritten since the check
            if confirm is not None:
                confirm()
        except BaseException as e:  # noqa: BLE001 - agreed across ranks below
            err = e
        if collective:
            dist.check_all(f"checking {path}", err)
        elif err is not None:
            raise err
        try:
            expect = getattr(reader, "expect", None)  # object storage: read ahead in large ranged GETs
            if expect is not None:
                expect([a.key for a in plan.copies if not isinstance(a.entry.tensor, DTensor)])
            with copy_progress(reader, plan.copies, progress) as on_copy:
                apply_load(plan, obj, reader, optimizer=optimizer, dtype=dtype, on_copy=on_copy)
            copied = getattr(reader, "confirm_copied", None)  # a file rewritten in place during the copies
            if copied is not None:
                copied()
            if extra is not None:
                extra.apply()
        except BaseException as e:  # noqa: BLE001
            err = e
        if collective:
            dist.check_all(f"loading {path}", err)
        elif err is not None:
            raise err
    finally:
        span.close()
        if reader is not None:
            reader.close()
    return plan.report


def _opened(path: Any, reader: Any) -> str | None:
    """Which checkpoint a rank opened: the index's own xxh3-128 digest where the index has one
    (fqnckpt format 2 and later: it covers every tensor's digest, so the same content under
    another path, e.g. a node-local copy, counts as the same), else a hub-cache snapshot's
    repository and revision (``models--org--name/snapshots/<rev>``: each node's own cache
    passes), else a checkpoint directory's absolute path, or a URL. None for a single file: ``torch.save`` per rank (``ckpt.rank0.pt``,
    each holding its rank's local shards) is a layout where every rank reads its own file."""
    meta = getattr(reader, "meta", None)
    digest = getattr(meta, "index_xxh3_128", None)
    if digest:
        return f"index xxh3-128 {digest}"
    where = local_path(path)
    if where is None:  # a byte store: its (redacted) URL names it
        return redact_url(str(path))
    if not os.path.isdir(where):
        return None
    real, repo = os.path.realpath(where), trust_root(where)
    if repo != real:  # a hub-cache snapshot: its revision names it, wherever each node's cache is
        return f"{os.path.basename(repo)}/{os.path.relpath(real, repo)}"
    return os.path.abspath(where)


def _agreement_group(state: Any) -> Any:
    """The process group of a collective load's agreements: the ranks of the root mesh of the
    DTensors of ``state`` (the mesh their meshes were sliced from: a pipeline stage's ``dp`` mesh
    is sliced from the world's ``(pp, dp)`` mesh, so every stage agrees, and a corrupt tensor of
    one stage stops them all). None (the default group) when that spans every rank, or when the
    DTensors are on several root meshes or one of several dims (a group of their ranks would need
    every rank to create it); else the group of the one 1-D root mesh (a mesh of some ranks only:
    the ranks outside it load their own tensors without waiting for it)."""
    roots = {}  # by ranks and dims: slicing a mesh twice gives two equal DeviceMesh objects
    for e in state.entries:
        if isinstance(e.tensor, DTensor):
            m = e.tensor.device_mesh
            root = m._get_root_mesh() if hasattr(m, "_get_root_mesh") else m
            roots.setdefault((tuple(root.mesh.flatten().tolist()), root.ndim), root)
    ranks = {int(r) for (rs, _) in roots for r in rs}
    if len(ranks) == dist.world_size() or len(roots) != 1:
        return None
    (root,) = roots.values()
    return root.get_group() if root.ndim == 1 else None


def _check_same_checkpoint(what: str, opened: list[str | None]) -> None:
    """A collective load whose ranks opened different checkpoints (a checkpoint directory per
    rank, or one replaced between their opens) is refused on every rank before any tensor is
    read: each rank would fill its shards from another checkpoint, a model mixed from several
    without an error. Ranks that opened single files (None) are not compared.

    Raises:
        RankMismatchError: naming each rank's checkpoint.
    """
    named = {r: o for r, o in zip(dist.group_ranks(), opened) if o is not None}
    if len(set(named.values())) > 1:
        raise RankMismatchError(f"loading {what}", "checkpoints", named)


def _has_model_part(path: str) -> bool:
    """A model index or ``model.safetensors`` beside peft's adapter files (save(peft="adapter"))."""
    return os.path.isfile(os.path.join(path, "model.safetensors.index.json")) or os.path.isfile(
        os.path.join(path, "model.safetensors")
    )


def open_load_reader(path: str, read_optimizer: bool = True, recipe: str | None = None, model: Any = None,
                       key: str | None = None, trusted_globals: Iterable[Any] = (), known: Collection[str] = (),
                       verify: bool = False):  # fmt: skip
    """The source stage of ``load``: :func:`checkpoint.sources.targets.open_target_reader` (an
    fqnckpt / Hugging Face checkpoint, a DCP directory, a ``torch.save`` pickle, the format
    sniffed; ``read_optimizer``: also read DCP's optimizer param groups), or with ``recipe`` a :class:`~checkpoint.convert.reader.ConvertedReader` over
    the checked conversion of any source format (planned against ``model``). Without ``recipe``,
    for a transformers ``model`` whose conversion mapping changes keys of the checkpoint that are
    not its names (``known``), that conversion (:func:`checkpoint.convert.reader.pretrained_reader`;
    ``verify``: the source's checksums checked first). Raises what they raise (a conversion:
    RecipeError / ConversionError before any tensor is read)."""
    if recipe is not None:
        from .convert import open_conversion
        from .convert.reader import ConvertedReader

        model = model if isinstance(model, torch.nn.Module) else None
        return ConvertedReader(open_conversion(path, recipe, model=model, key=key, trusted_globals=trusted_globals))
    reader = open_source_target(path, read_optimizer=read_optimizer, key=key, trusted_globals=trusted_globals)
    if isinstance(model, torch.nn.Module):
        from .convert.reader import pretrained_reader

        reader = pretrained_reader(reader, path, model, known, verify=verify, key=key, trusted_globals=trusted_globals)
    return reader


__all__ = ["load", "plan_load", "apply_load", "LoadPlan", "CopyAction", "check_tied_values", "guarded_get"]
