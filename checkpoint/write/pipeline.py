"""``save`` and ``save_streaming``: sharded safetensors checkpoints in eager FQNs, committed atomically.

One write path: a single process streams tensors one at a time through :func:`save_streaming`;
ranks holding DTensors each write only the bytes they own into the same full-tensor files
(:func:`write_parts_distributed`). Either way the result is Hugging Face's layout
(``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``).
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fqn import FQNMap, FQNMapFile

from ..testing import faults
from ..storage.local_commit import StagedCheckpoint, enclosing_checkpoint
from ..storage.commit import is_part
from ..convert import CONVERSION_REPORT_NAME, run_recipe
from ..convert.hf_files import hf_config_files
from ..convert.meta_files import write_meta_checkpoint
from ..errors import CheckpointError, CheckpointWriteError, NestedCheckpointError, RankMismatchError
from ..peft_state import ADAPTER_WEIGHTS, find_peft, peft_state, saved_names_state
from ..progress import counted_fetches
from ..ranks import dist, shards
from ..state import Entry, object_state
from ..storage import limits
from ..storage.format import (
    MODEL_PREFIX,
    OPTIMIZER_PREFIX,
    FileRecordV2,
    FqnckptMeta,
    IndexFile,
    IndexMetadata,
    OptimizerMeta,
    index_name,
)
from ..storage.extra_state import RANK_FILE_RE, extra_state_file_bytes, snapshot_extra_state_parts
from ..storage.layout import Layout, TensorSpec, plan_layout
from ..storage.location import local_path, local_target, resolve
from ..storage import digest, fskind, ownership, threads
from ..storage.writer import (
    BlockWriter,
    SequentialFileWriter,
    create_shard_file,
    distributed_record,
    block_runs,
    tensor_bytes,
)
from ..gc_pause import gc_paused


@dataclass
class Part:
    """One indexed part of a checkpoint (``model`` or ``optimizer``)."""

    prefix: str
    specs: list[TensorSpec]
    fetch: Callable[[TensorSpec], torch.Tensor]
    alias_groups: list[list[str]] = field(default_factory=list)
    fqn_map: FQNMapFile | None = None
    optimizer: OptimizerMeta | None = None
    extra_shards: dict[str, FileRecordV2] | None = None  # FqnckptMeta.extra_shards (the model part)


def converted_writer(path: str | os.PathLike, max_shard_size, overwrite: bool) -> Callable:
    """``write(specs, fetch, extra_files, layout)`` for :func:`checkpoint.convert.run_recipe`: the
    tensors streamed into this format at ``path`` (one model part; returns its index), or for
    ``layout="meta"`` into Meta's ``consolidated.NN.pth`` files; committed atomically either way."""

    def write(specs, fetch, extra, layout=None) -> IndexFile | None:
        if layout == "meta":  # local or any byte store (checkpoint.convert.meta_files)
            refuse_nested(local_target(resolve(path)))
            write_meta_checkpoint(local_target(resolve(path)), specs, fetch, extra, overwrite)
            return None
        return write_parts(resolve(path), [Part(MODEL_PREFIX, list(specs), fetch)], max_shard_size, overwrite, extra)[0]

    return write


def make_index(part: Part, layout: Layout, records: dict[str, FileRecordV2]) -> IndexFile:
    meta = FqnckptMeta(
        files=records,
        tensor_digest_chunk=digest.TENSOR_CHUNK,
        alias_groups=[list(g) for g in part.alias_groups],
        fqn_map=part.fqn_map,
        optimizer=part.optimizer,
        extra_shards=part.extra_shards,
    )
    return IndexFile(
        metadata=IndexMetadata(total_size=layout.total_size, fqnckpt=meta), weight_map=layout.weight_map
    )


def _check_extra_name(name: str) -> None:
    if name == ADAPTER_WEIGHTS:  # peft's adapter file beside the base model (checkpoint.peft_state)
        return
    if not name or "/" in name or "\\" in name or name.startswith(".") or name.endswith(".safetensors"):
        raise ValueError(f"extra file name {name!r} must be a plain file name, not hidden, not .safetensors")
    if name.endswith(".safetensors.index.json"):
        raise ValueError(f"extra file name {name!r} is reserved for indexes")


def _fetch_checked(part: Part, spec: TensorSpec) -> torch.Tensor:
    t = part.fetch(spec)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"value of {spec.fqn!r} is a {type(t).__name__}, not a tensor")
    if isinstance(t, DTensor):
        raise TypeError(
            f"{spec.fqn!r} is a DTensor: use checkpoint.save on every rank for distributed tensors"
        )
    if t.is_meta:
        raise TypeError(f"{spec.fqn!r} is on the meta device: it has no data to save")
    return t


def refuse_nested(path: Any) -> None:
    """Refuse a local save into a folder inside another checkpoint's directory
    (:func:`checkpoint.storage.local_commit.enclosing_checkpoint`): that checkpoint's overwrite and retention
    manage only their own files, and readers of it would meet the inner one's. The one rule of
    ``save``, ``async_save``, ``migrate``, conversions and DCP's ``StorageWriter``. A URL's store
    (no folders) passes.

    Raises:
        NestedCheckpointError: naming ``path`` and the enclosing checkpoint."""
    local = local_path(path)
    if local is None:
        return
    outer = enclosing_checkpoint(local)
    if outer is not None:
        raise NestedCheckpointError(local, outer)


def _plan_checked(path: str, parts: Sequence[Part], max_shard_size, world: int = 1) -> list[Layout]:
    """Plan every part's files and check everything safetensors must be able to read back (names,
    header sizes; dtypes were checked when the specs were made) before anything is written: a
    checkpoint no reader can open is never committed. Linear in the number of tensors.
    ``max_shard_size=None``: each part's default for ``world`` ranks (:func:`default_shard_size`).
    A local ``path`` inside another checkpoint is refused first (:func:`refuse_nested`)."""
    refuse_nested(path)
    for part in parts:
        for spec in part.specs:
            limits.check_name(spec.fqn, path)
        for group in part.alias_groups:
            for name in group:
                limits.check_name(name, path)
    layouts = [plan_layout(p.specs, max_shard_size, p.prefix, world) for p in parts]
    for lay in layouts:
        for f in lay.files:
            limits.check_header(f, path)
    return layouts


def _spec_of(path: str, fqn: str, tensor: torch.Tensor) -> TensorSpec:
    limits.check_name(fqn, path)
    limits.check_tensor(fqn, tensor, path)
    return TensorSpec.of(fqn, tensor)


def write_indexes_and_commit(staged: StagedCheckpoint, parts, indexes: Sequence[IndexFile]) -> None:
    """Data is in place: write the index files last, then move the checkpoint into place."""
    faults.fault_point("after_data_written")
    faults.fault_point("before_index_write")
    # The model index records every other file of the save (as on object storage): overwrite and
    # retention remove the files a record names, never a file for its name (checkpoint.storage.local_commit).
    others = sorted((getattr(staged, "written", set()) | {index_name(p.prefix) for p in parts}) - {index_name(MODEL_PREFIX)})
    digests = getattr(staged, "digests", {})
    kept, kept_digests = staged.carried(others)
    for part, idx in zip(parts, indexes):
        if part.prefix == MODEL_PREFIX and idx.metadata.fqnckpt is not None:  # a record, empty or not
            idx.metadata.fqnckpt.objects = {n: n for n in others} | kept
            idx.metadata.fqnckpt.object_digests = kept_digests | {n: digests[n] for n in others if n in digests and not is_part(n)} or None
    for part, idx in zip(parts, indexes):
        staged.write_file(index_name(part.prefix), idx.to_json_bytes())
    faults.fault_point("after_index_write")
    staged.commit()


def write_parts(
    path: str, parts: Sequence[Part], max_shard_size, overwrite: bool, extra_files: Mapping[str, bytes]
) -> list[IndexFile]:
    path = local_target(path)  # file:// commits as a local path
    for name in extra_files:
        _check_extra_name(name)
    layouts = _plan_checked(path, parts, max_shard_size)
    if local_path(path) is None:  # a byte store: streamed objects, committed by its index (checkpoint.storage.remote_save)
        from .upload import save_remote

        return save_remote(path, parts, layouts, overwrite, extra_files, make_index, _fetch_checked, False)
    indexes: list[IndexFile] = []
    try:
        with StagedCheckpoint(path, overwrite) as st:
            for part, layout in zip(parts, layouts):
                records: dict[str, FileRecordV2] = {}
                for fplan in layout.files:
                    w = SequentialFileWriter(os.path.join(st.dir, fplan.name), fplan)
                    try:
                        faults.fault_point("after_file_create")
                        kill_after_tensor = faults.armed("after_tensor_write")
                        for slot in fplan.slots:
                            w.write(slot, _fetch_checked(part, slot.spec))
                            if kill_after_tensor:
                                faults.fault_point("after_tensor_write")
                        records[fplan.name] = w.finish()
                    finally:
                        w.close()
                indexes.append(make_index(part, layout, records))
            for name, data in extra_files.items():
                st.write_file(name, bytes(data))
            write_indexes_and_commit(st, parts, indexes)
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointWriteError(path, f"{type(e).__name__}: {e}") from e
    return indexes


@gc_paused
def save_streaming(
    path: str | os.PathLike,
    specs: Sequence[TensorSpec],
    fetch: Callable[[TensorSpec], torch.Tensor],
    *,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    alias_groups: Sequence[Sequence[str]] = (),
    fqn_map: FQNMap | FQNMapFile | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> IndexFile:
    """Save tensors one at a time, single process: plan the layout from ``specs`` only, then call
    ``fetch(spec)`` for each tensor (in file / byte order), write it and drop it. Peak memory is
    about one tensor plus one write buffer.

    ``specs``: eager FQN, global shape (elements), dtype of each tensor; ``fetch`` must return a
    plain tensor of exactly that shape and dtype (any device). ``max_shard_size``: bytes of tensor
    data per file (int, or ``"5GB"`` = 5*10**9, ``"2GiB"`` = 2*2**30). ``alias_groups``: tied names,
    canonical (stored) name first. ``extra_files``: ``{file name: bytes}`` written into the
    checkpoint directory (e.g. ``migration_report.json``) inside the same atomic commit. ``path``
    may be a URL, as for :func:`save` (``storage_options`` go to the fsspec filesystem).

    Writes ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json`` (HF layout),
    atomically (see :mod:`checkpoint.storage.local_commit`). ``overwrite=True`` replaces only the files the
    previous checkpoint owns (:func:`checkpoint.storage.local_commit.owned_files`); other files and folders in
    ``path`` (``config.json``, tokenizer files, ...) stay. Returns the index written.

    Raises:
        UnsavableError: before anything is written, a name safetensors cannot hold (not UTF-8, e.g.
            a lone surrogate; empty; ``__metadata__``) or a shard header over safetensors' 100 MB
            limit (:mod:`checkpoint.storage.limits`); names the key / file.
        CheckpointExistsError: ``path`` exists and ``overwrite`` is False; or it is not a
            checkpoint directory (a file, a symlink, a non-empty directory without a checkpoint).
        CheckpointWriteError: an OS error while writing (e.g. disk full); ``path`` is untouched.
        TypeError: ``fetch`` returned a non-tensor, or a dtype safetensors cannot store.
        ValueError: a fetched tensor's shape/dtype differs from its spec; duplicate FQNs.
    """
    if isinstance(fqn_map, FQNMap):
        fqn_map = fqn_map.to_model()
    part = Part(MODEL_PREFIX, list(specs), fetch, [list(g) for g in alias_groups], fqn_map)
    return write_parts(resolve(path, storage_options), [part], max_shard_size, overwrite, extra_files or {})[0]


@gc_paused
def save(
    obj: torch.nn.Module | Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    *,
    max_shard_size: int | str | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    overwrite: bool = False,
    extra_state: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    recipe: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    transfer: Any = None,
    peft: str = "adapter",
    layout: str | None = None,
) -> IndexFile:
    """Save a module or state_dict as a sharded safetensors checkpoint keyed by eager FQNs.

    ``obj``: an ``nn.Module`` (eager, ``torch.compile``d, DDP, checkpoint-wrapped, FSDP2 /
    autoparallel parallel module with DTensor parameters) or a flat state_dict of tensors. Names
    go through the module's ``fqn_map`` if it has one, else :func:`fqn.canonical_fqn`. Tied
    tensors are stored once under the canonical FQN (alias group in the index); non-persistent
    buffers are never saved. Every dtype is stored bit-exactly.

    Single process (no DTensor): streamed through :func:`save_streaming`. With DTensors, call on
    every rank: each rank writes only the bytes it owns, once, into the final files (no gather, no
    per-rank files). With a plain replicated model (DDP) call it on one rank only.

    ``max_shard_size``: bytes of tensor data per shard file (int, ``"5GB"`` = 5*10**9,
    ``"2GiB"``), honoured as given. Default (``None``): 5 GB for a single-process save; a
    distributed save (world size > 1) splits each part into at least world-size files once it holds
    world size * 64 MiB (``min(5 GB, max(64 MiB, ceil(bytes / world size)))``,
    :func:`checkpoint.storage.layout.default_shard_size`), so that ranks start writing in different
    files (the kernel serializes writers of one file); a 1 GiB state on 4 ranks is 4 files of
    256 MiB instead of one. The HF layout is unchanged (readers follow the index; torch's DCP
    ``HuggingFaceStorageWriter`` also writes per-rank files); the layout depends on the world size.

    A transformers model (under any of these wrappers) also gets ``config.json`` (+
    ``generation_config.json``) naming its eager class (``LlamaForCausalLM``, never
    ``FSDPLlamaForCausalLM`` / ``OptimizedModule`` / ``PeftModel``): ``from_pretrained(path)``
    builds the saved model.

    ``peft``: for a peft ``PeftModel`` (maybe compiled or wrapped), ``"adapter"`` (default,
    lossless) writes the base model under its eager names plus peft's ``adapter_config.json`` and
    ``adapter_model.safetensors`` beside it (``AutoModelForCausalLM.from_pretrained(path)`` attaches
    the adapter; ``PeftModel.from_pretrained(base, path)`` reads it); ``"merged"`` writes one plain
    model with the LoRA weights merged as peft's ``merge_and_unload`` does (see
    :mod:`checkpoint.peft_state`). Ignored for other models. An optimizer's state is keyed by the
    same names (``<X>.weight``, peft's ``base_model.model.<X>.lora_A.weight``), as ``load`` into
    the PeftModel plans them.

    ``optimizer``: also writes ``optimizer-0000k-of-0000n.safetensors`` +
    ``optimizer.safetensors.index.json`` (state by FQN, see :mod:`checkpoint.optim`); needs a module.

    ``extra_state``: the rest of the training state (step, LR scheduler, RNG states, ...), written
    to ``extra_state.json`` in the same atomic commit (see :mod:`checkpoint.storage.extra_state`);
    on many ranks rank 0's values are saved.

    ``progress``: tqdm bar on stderr, rank 0 only (``None``: only when stderr is a terminal;
    shown after 1 s).

    ``layout``: for a transformers model (eager, wrapped or the parallel module) whose own
    conversion mapping (``transformers.conversion_mapping``) changes names or tensors on the way to
    disk, ``"pretrained"`` writes what ``save_pretrained`` writes (MoE experts per expert,
    ``mlp.experts.{e}.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.{e}.w1.weight``;
    ``from_pretrained`` and :func:`checkpoint.load` read it back), converted by the
    ``fused-to-experts`` recipe (:mod:`checkpoint.convert`); ``"memory"`` writes the module's own
    names and tensors (``mlp.experts.gate_up_proj``). Default (``None``): ``"pretrained"`` for
    model tensors alone, ``"memory"`` with ``optimizer=`` or ``extra_state=`` (a training
    checkpoint: the optimizer state is keyed by the in-memory parameters, and ``load`` resumes it
    from that layout). Every other model is written the same either way. With DTensors the
    ``"pretrained"`` layout needs a local ``path`` every rank shares (rank 0 converts); to a URL
    the default then writes the ``"memory"`` layout, with a warning.

    ``recipe``: write another layout (``fqnckpt recipes``, e.g. ``hf-to-torchtitan-llama3``): saved
    as usual into a temporary directory beside ``path``, then converted by
    :mod:`checkpoint.convert`; returns its ``ConversionReport``. With DTensors (call on every rank)
    each rank saves its own bytes as usual and rank 0 alone converts, streamed (memory: one rule
    group, e.g. one layer's experts); every rank returns the report.

    ``path`` may be a URL (``s3://bucket/run/step-100``, ``memory://...``, ``file://...``): written
    through fsspec, committed without rename, each rank uploading its own files in bounded
    multipart uploads (:mod:`checkpoint.storage.commit`, :mod:`checkpoint.storage.remote_save`).
    ``storage_options`` go to the fsspec filesystem (s3fs: ``endpoint_url``, ``key``, ``secret``,
    ...); ``transfer``: a :class:`checkpoint.storage.objstore.TransferConfig` (part size, parts in
    flight, retries). A URL whose scheme has no installed backend raises
    :class:`~checkpoint.errors.UnsupportedStorageError` (``pip install fqnckpt[s3]``); a URL is
    never taken as a local path. Failed requests are retried with backoff, then
    :class:`~checkpoint.errors.CheckpointWriteError` (the previous checkpoint stays readable).

    Returns the model index written. Raises what :func:`save_streaming` raises (every check
    before the first byte is written), :class:`~checkpoint.errors.UnsavableTypeError` naming the
    key for a dtype or layout safetensors cannot store (complex128, sparse, ...), ``TypeError``
    naming the key for a non-tensor value, :class:`~checkpoint.errors.NestedCheckpointError` for a
    local ``path`` inside another checkpoint's folder (:func:`refuse_nested`), ``ValueError``
    naming ``max_shard_size`` for a size that is neither an int nor a size string; on ranks whose
    peers failed, :class:`~checkpoint.errors.RankAgreementError`; ``ValueError`` for an unknown
    ``layout``, ``TypeError`` for ``layout="pretrained"`` with ``optimizer`` / ``extra_state``, and
    for ``layout`` with ``recipe``; ``NotImplementedError`` for DTensors to a URL in the
    ``"pretrained"`` layout.
    """
    path = resolve(path, storage_options, transfer)
    if layout not in (None, "pretrained", "memory"):
        raise ValueError(f"save(layout={layout!r}): 'pretrained' (what save_pretrained writes) or 'memory' (the module's own names)")
    if recipe is not None and layout is not None:
        raise TypeError(f"save(recipe={recipe!r}, layout={layout!r}): a recipe names the layout written; pass one of them")
    if layout == "pretrained" and (optimizer is not None or extra_state is not None):
        raise TypeError("save(layout='pretrained') writes model tensors only (as save_pretrained): the optimizer state and "
                        "extra_state are keyed by the in-memory parameters; save a training checkpoint with layout='memory'")  # fmt: skip
    if recipe is None and layout != "memory" and optimizer is None and extra_state is None:
        pretrained = _pretrained_layout(obj)
        target = local_target(path)  # file://: the directory, converted as a local path
        if pretrained is not None and layout is None and local_path(target) is None and object_state(obj).has_dtensor:
            warnings.warn(f"save({path}): DTensors are written to a URL in the module's "
                          "own layout (as layout='memory'): the on-disk layout of save_pretrained is converted on rank 0 from "
                          "a local path every rank shares; checkpoint.load reads either layout", stacklevel=3)  # fmt: skip
        elif pretrained is not None:
            return _save_with_recipe(obj, target, pretrained, max_shard_size, overwrite, progress, index=True)
    if recipe is not None:  # save as usual, then convert (checkpoint.convert) into path
        if optimizer is not None or extra_state is not None:
            raise TypeError("save(recipe=...) writes model tensors only: save the optimizer / extra_state without a recipe")
        return _save_with_recipe(obj, path, recipe, max_shard_size, overwrite, progress)
    parts, distributed, extra_files = prepare_agreed(path, obj, optimizer, extra_state, peft)
    with counted_fetches(parts, "save", progress):  # progress: counts each fetched tensor
        if distributed:
            return write_parts_distributed(path, parts, max_shard_size, overwrite, extra_files)[0]
        return write_parts(path, parts, max_shard_size, overwrite, extra_files)[0]


def _pretrained_layout(obj) -> Any:
    """The ``fused-to-experts`` recipe (transformers' conversion mapping reversed, what
    ``save_pretrained`` writes) for a transformers model whose saved names it changes; else None
    (any other model, or transformers never imported)."""
    from ..convert.transformers_rules import changes_keys, pretrained_recipe

    try:
        rec = pretrained_recipe(obj)
    except ValueError:  # a mapping fqnckpt does not translate: refused when asked for explicitly only
        return None
    if rec is None:
        return None
    back = rec.inverse()
    return back if changes_keys(back, (e.fqn for e in object_state(obj).entries)) else None


def _state_catalog(part: Part, where: str) -> Any:
    """The model part of a single-process save as the source of a conversion
    (:class:`checkpoint.convert.catalog.Catalog`): each tensor fetched and checked as ``save``
    fetches it, when the conversion asks for it."""
    from pathlib import Path

    from ..convert.catalog import Catalog
    from ..sources.base import Source, SourceSpec

    by_fqn = {s.fqn: s for s in part.specs}

    class _Fetch:
        def get(self, key: str) -> torch.Tensor:
            return _fetch_checked(part, by_fqn[key])

    specs = {s.fqn: SourceSpec(s.fqn, s.shape, s.dtype) for s in part.specs}
    source = Source(Path(where), "safetensors", [], specs, dict.fromkeys(specs, "(in memory)"), _Fetch())
    return Catalog(Path(where), [source], None)


def _save_with_recipe(obj, path: str, recipe, max_shard_size, overwrite: bool, progress, index: bool = False):
    """``save(obj, path, recipe=...)``: saved in fqnckpt's layout into a temporary directory beside
    ``path`` (the destination's filesystem, which every rank of a distributed save writes), then
    converted into ``path`` by rank 0 alone, streamed one rule group at a time; every rank returns
    the report or raises (rank 0's own error; :class:`RankAgreementError` on the others).
    ``index``: return the model index written instead, and write no ``conversion_report.json``
    (the layout a model's own ``save_pretrained`` writes, not a conversion asked for); in a single
    process the conversion then reads the module's tensors directly (no temporary save)."""
    distributed = object_state(obj).has_dtensor  # as save decides: DTensors mean every rank saves
    local = local_path(path)
    if local is None and distributed:  # the ranks' shared temporary directory would be local
        what = "save(layout='pretrained')" if index else "save(recipe=...)"
        raise NotImplementedError(f"{what} of DTensors to {path}: save to a shared local path, then migrate"
                                  + (", or pass layout='memory'" if index else ""))  # fmt: skip
    parent = None if local is None else os.path.dirname(os.path.abspath(local))  # a URL: converted from a local temp dir
    inner = converted_writer(path, max_shard_size, overwrite)
    written: list[IndexFile] = []

    def writer(specs, fetch, extra, layout=None) -> None:
        if index:
            extra = {k: v for k, v in extra.items() if k != CONVERSION_REPORT_NAME}
        written.append(inner(specs, fetch, extra, layout))

    if not distributed and index:  # converted straight from the module's tensors: nothing written twice
        part = prepare_parts(str(path), obj, None, None)[0][0]
        run_recipe(_state_catalog(part, str(path)), path, recipe, model=obj, progress=progress, write=writer)
        return written[0]
    if not distributed:
        with tempfile.TemporaryDirectory(prefix=".fqnckpt-convert-", dir=parent) as tmp:
            save(obj, os.path.join(tmp, "ck"), max_shard_size=max_shard_size, progress=progress, layout="memory")
            return run_recipe(os.path.join(tmp, "ck"), path, recipe, model=obj, progress=progress, write=writer)
    tmp, err = None, None
    if dist.rank() == 0:
        try:
            os.makedirs(parent, exist_ok=True)  # as a save without conversion creates the destination's parents
            tmp = tempfile.mkdtemp(prefix=".fqnckpt-convert-", dir=parent)
        except Exception as e:  # noqa: BLE001 - agreed: no rank left waiting for rank 0's directory
            err = e
    tmp = dist.check_all_gather(f"save(recipe={getattr(recipe, 'name', recipe)!r}) preparing {parent}", err, tmp)[0]
    try:
        save(obj, os.path.join(tmp, "ck"), max_shard_size=max_shard_size, progress=progress, layout="memory")
        report, error = None, None
        if dist.rank() == 0:
            try:
                report = run_recipe(os.path.join(tmp, "ck"), path, recipe, model=obj, progress=progress, write=writer)
                if index:
                    report = written[0]
            except Exception as e:  # noqa: BLE001 - every rank raises it (check_all)
                error = e
        dist.check_all(f"save(recipe={getattr(recipe, 'name', recipe)!r}) converting on rank 0", error)
        return dist.broadcast_object(report)
    finally:
        dist.barrier()  # every rank is done with tmp before rank 0 removes it
        if dist.rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)


def prepare_agreed(
    path: str, obj, optimizer, extra_state, peft: str = "adapter"
) -> tuple[list[Part], bool, dict[str, bytes]]:
    """:func:`prepare_parts`, with a failure on some ranks of a distributed save (state holding
    DTensors, process group up) agreed before any rank waits in another collective: the failing
    rank joins the first exchange of :func:`write_parts_distributed` with its error, so it raises its
    own error and every other rank a :class:`RankAgreementError` naming it (no hang, no bare
    backend error when it exits). A single-process save raises as usual."""
    try:
        return prepare_parts(path, obj, optimizer, extra_state, peft)
    except Exception as e:
        if not many_ranks(obj):
            raise
        agree_prepare_failure(path, e)
        raise  # (agree_prepare_failure raises: this rank's own error)


def many_ranks(obj) -> bool:
    """Whether a save of ``obj`` is collective (DTensors and a process group), as save decides."""
    try:
        return dist.active() and object_state(obj).has_dtensor
    except Exception:  # noqa: BLE001 - the state itself fails: the caller's error stands
        return False


def agree_prepare_failure(path: str, error: BaseException) -> None:
    """This rank's side of :func:`write_parts_distributed`'s first exchange when it failed before it:
    raises ``error`` after every rank learnt of it."""
    dist.check_all_gather(f"preparing {path}", error, None)


def prepare_parts(
    path: str, obj, optimizer, extra_state, peft: str = "adapter"
) -> tuple[list[Part], bool, dict[str, bytes]]:
    """What ``save`` writes: the parts, whether they hold DTensors, and the extra files (also used by
    :func:`checkpoint.training.async_save.async_save`, which stages the parts before writing)."""
    extra_files: dict[str, bytes] = {}
    state = object_state(obj)
    if extra_state is not None:
        extra_files = _extra_state_files(path, extra_state, state)
    extra_files.update(hf_config_files(obj))  # a transformers model: from_pretrained(dir) works
    model_state = state
    if isinstance(obj, torch.nn.Module) and find_peft(obj) is not None:  # eager base names (+ adapter files)
        model_state, adapter = peft_state(obj, state, peft)
        extra_files.update(adapter)
    fmap = state.fqn_map.to_model() if state.fqn_map is not None else None
    parts_entries: list[tuple[str, list[Entry], list[list[str]], FQNMapFile | None, OptimizerMeta | None]] = [
        (MODEL_PREFIX, model_state.entries, model_state.alias_groups, fmap, None)
    ]
    if optimizer is not None:
        if not isinstance(obj, torch.nn.Module):
            raise TypeError("saving an optimizer needs the nn.Module (parameters are matched by identity)")
        from ..optim import optimizer_entries

        # A PEFT model's optimizer is keyed by the names its files use (load plans by the same)
        named = saved_names_state(obj, state) if model_state is not state else state
        opt_entries, opt_meta = optimizer_entries(optimizer, named)
        parts_entries.append((OPTIMIZER_PREFIX, opt_entries, [], None, opt_meta))
    parts = []
    for prefix, entries, groups, fm, om in parts_entries:
        by_fqn = {e.fqn: e.tensor for e in entries}
        specs = [_spec_of(path, e.fqn, e.tensor) for e in entries]
        parts.append(Part(prefix, specs, lambda s, d=by_fqn: d[s.fqn], groups, fm, om))
    if ADAPTER_WEIGHTS in extra_files:  # the adapter's digests in the model index, as a shard's
        parts[0].extra_shards = {ADAPTER_WEIGHTS: side_file_record(extra_files[ADAPTER_WEIGHTS])}
    distributed = any(isinstance(e.tensor, DTensor) for _, es, *_ in parts_entries for e in es)
    return parts, distributed, extra_files


def side_file_record(data: bytes) -> FileRecordV2:
    """The index record (format version 3) of a safetensors file a save writes from ``data``
    (peft's adapter file): size, header and tensor digests, as :class:`SequentialFileWriter`
    records a shard. Raises ValueError when ``data`` is not a safetensors file."""
    size, header, tensors = digest.hash_bytes(data, digest.TENSOR_CHUNK)
    return FileRecordV2(size=size, digest=digest.combine(header, tensors.values()), header=header, tensors=tensors)


def _extra_state_files(path: str, extra_state, state) -> dict[str, bytes]:
    """``extra_state.json`` (+ this rank's per-rank file, gathered to rank 0 by
    :func:`write_parts_distributed`). Per-rank entries need a save on every rank: refused (ValueError
    naming them) when one process saves for a world of several ranks."""
    shared, mine = snapshot_extra_state_parts(extra_state)
    rank, world = (dist.rank(), dist.world_size()) if dist.active() else (0, 1)
    if mine and world > 1 and not any(isinstance(e.tensor, DTensor) for e in state.entries):
        raise ValueError(
            f"saving {path}: extra_state entries {sorted(mine)} are PerRank, but this save of a "
            f"module without DTensors is one process's ({world} ranks): only rank {rank}'s values would be kept"
        )
    return extra_state_file_bytes(shared, mine, rank, world)


# -- distributed ------------------------------------------------------------------------------


def _owned_blocks(t: torch.Tensor, index: int, fqn: str) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """The blocks this rank writes of tensor ``t``: ``(data, global element offset)`` pairs.

    A DTensor's local shard is written by the rank whose coordinate is 0 on every mesh dim that
    does not shard it (one writer per replica group), as one block per contiguous piece of the
    global tensor (several for ``_StridedShard``, see :mod:`checkpoint.ranks.shards`); a plain
    tensor (same on every rank) by rank ``index % world_size``.
    """
    if not isinstance(t, DTensor):
        return [(t, (0,) * t.dim())] if index % dist.world_size() == dist.rank() else []
    if any(p.is_partial() for p in t.placements):
        t = t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements])
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return []
    for d, p in enumerate(t.placements):
        if not isinstance(p, (Shard, _StridedShard)) and coord[d] != 0:
            return []
    try:
        blocks = list(shards.local_blocks(t))
    except RuntimeError as e:
        raise RuntimeError(f"{fqn!r}: {e}") from e
    local = t.to_local()
    return [(local[lsl], tuple(g.start for g in gsl)) for lsl, gsl in blocks]


def check_same_arguments(what: str, per_rank: Sequence[tuple], names: Sequence[str]) -> None:
    """Refuse a collective call whose ranks were given different arguments (``per_rank[r]``: rank
    ``r``'s values, in the order of ``names``): only rank 0's would take effect (it commits) and
    the others' would be ignored without a word, e.g. a destination per rank. The same verdict
    on every rank (every rank holds the same gathered values).

    Raises:
        RankMismatchError: naming the first argument that differs and each rank's value.
    """
    for i, name in enumerate(names):
        values = {r: repr(v[i]) for r, v in enumerate(per_rank)}
        if len(set(values.values())) > 1:
            raise RankMismatchError(what, name, values)


def _check_same_tensors(path: Any, fingerprints: Sequence[list]) -> None:
    """Ranks whose planned files differ (``fingerprints[r]``: rank ``r``'s ``[(file, header)]``
    per part): name the first tensor whose shape or dtype differs between ranks, or that some
    rank lacks, from the safetensors headers they planned. The same verdict on every rank.

    Raises:
        RankMismatchError: naming the tensor and each rank's shape and dtype ("absent")."""
    import json

    per_rank: list[dict[str, str]] = []
    for fp in fingerprints:
        seen: dict[str, str] = {}
        for files in fp:
            for _, header in files:
                n = int.from_bytes(header[:8], "little")
                for k, v in json.loads(header[8 : 8 + n]).items():
                    if k != "__metadata__":
                        seen[k] = f"{v['shape']} {v['dtype']}"
        per_rank.append(seen)
    for key in sorted({k for seen in per_rank for k in seen}):
        values = {r: seen.get(key, "absent") for r, seen in enumerate(per_rank)}
        if len(set(values.values())) > 1:
            raise RankMismatchError(
                f"saving {path}", f"the shape and dtype of tensor {key!r}", values,
                note="each rank must save the same tensors; nothing was committed",
            )  # fmt: skip


def _check_covered(path: Any, covered: Sequence[Mapping[str, int]], numel: Mapping[str, int]) -> None:
    """Every DTensor written whole by the ranks together (``covered[r][fqn]``: elements rank
    ``r`` wrote of it): ranks that hold one DTensor with different placements (an SPMD program
    that diverged) would leave rows no rank writes, zeros in a checkpoint whose digests still
    match, or write rows twice. The same verdict on every rank (the counts were gathered).

    Raises:
        RankMismatchError: naming the tensor and what each rank wrote; nothing is committed.
    """
    for fqn in sorted({k for c in covered for k in c}):
        total = sum(c.get(fqn, 0) for c in covered)
        if total != numel.get(fqn, total):
            per_rank = {r: f"{c.get(fqn, 0)} elements" for r, c in enumerate(covered)}
            raise RankMismatchError(
                f"saving {path}", f"the shards of DTensor {fqn!r}", per_rank,
                note=f"together they cover {total} of its {numel[fqn]} elements (placements differ between ranks?); nothing was committed",
            )  # fmt: skip


def write_parts_distributed(
    path: str,
    parts: Sequence[Part],
    max_shard_size,
    overwrite: bool,
    extra_files: Mapping[str, bytes] | None = None,
) -> list[IndexFile]:
    path = local_target(path)  # file:// commits as a local path
    extra_files = extra_files or {}
    for name in extra_files:
        _check_extra_name(name)
    if not dist.active():
        raise CheckpointError(
            f"saving {path}: the state holds DTensors but no default process group is initialized "
            "(torch.distributed.init_process_group, of any world size, one rank included)"
        )
    rank, world = dist.rank(), dist.world_size()
    layouts, fingerprint, extras, mine, failed = None, None, None, {}, None
    try:
        layouts = _plan_checked(path, parts, max_shard_size, world)  # same specs on every rank: same verdict
        fingerprint = [tuple((f.name, f.header) for f in lay.files) for lay in layouts]
        mine = {n: bytes(d) for n, d in extra_files.items() if RANK_FILE_RE.match(n)}
        extra_files = {n: d for n, d in extra_files.items() if n not in mine}
        extras = {name: hashlib.sha256(data).hexdigest() for name, data in extra_files.items()}
    except Exception as e:  # noqa: BLE001 - agreed in the exchange below (rank agreement)
        failed = e
    # One exchange for the layout and extra-state checks (and any rank's failure so far, e.g. its
    # extra_state or state_dict failing there alone: agree_prepare_failure); it also brings each
    # rank's per-rank extra state (a few KB) to rank 0, which writes it with the rest.
    local = local_path(path)
    args = (str(path) if local is None else os.path.abspath(local), bool(overwrite))  # a store: its URL
    gathered = dist.check_all_gather(f"preparing {path}", failed, (fingerprint, extras, mine, args))
    check_same_arguments(f"saving {path}", [g[3] for g in gathered], ("destination", "overwrite"))
    if len({hash(tuple(fp)) for fp, *_ in gathered}) != 1:
        _check_same_tensors(path, [fp for fp, *_ in gathered])
        raise CheckpointError(f"saving {path}: ranks planned different layouts (different models or dtypes?)")
    rank_files = {n: d for _, _, m, _ in gathered for n, d in m.items()}
    if rank_files and len(rank_files) != world:  # the same verdict on every rank
        raise CheckpointError(f"saving {path}: PerRank extra_state passed on {len(rank_files)} of {world} ranks")
    extra_files.update(rank_files if rank == 0 else {})
    differ = [r for r, (_, e, _, _) in enumerate(gathered) if e != gathered[0][1]]
    if differ and rank == 0:
        # Rank 0's is the one written; per-rank values (e.g. RNG states of ranks seeded apart)
        # would come back as rank 0's on every rank.
        warnings.warn(
            f"saving {path}: extra_state differs between ranks (rank 0 vs ranks {differ}); rank 0's is "
            "saved and every rank gets it back on load",
            stacklevel=2,
        )
    if local_path(path) is None:  # a byte store: streamed objects, committed by its index (checkpoint.storage.remote_save)
        from .upload import save_remote

        return save_remote(path, parts, layouts, overwrite, extra_files, make_index, fetch_tensor, True)
    files = [(lay, f) for lay in layouts for f in lay.files]

    staged: StagedCheckpoint | None = None
    err: BaseException | None = None
    staging_dir = None
    if rank == 0:
        try:
            staged = StagedCheckpoint(path, overwrite).__enter__()
            staging_dir = staged.dir
            for _, f in files:
                os.close(create_shard_file(os.path.join(staged.dir, f.name), f))
            faults.fault_point("after_file_create")
        except BaseException as e:  # noqa: BLE001 - agreed below, re-raised on every rank
            err = (
                e
                if not isinstance(e, OSError) or isinstance(e, CheckpointError)
                else CheckpointWriteError(path, str(e), 0)
            )
    try:
        staging_dir = dist.check_all_gather(f"preparing {path}", err, staging_dir)[0]
        err = None
        # Tensor digests (format version 3: chunked, see checkpoint.storage.digest). A tensor its
        # writer holds whole is hashed from memory beside its pwrite; of a tensor split over ranks
        # each rank hashes the chunks lying in its own bytes from its own memory beside their
        # pwrite, and notes the chunks starting in its bytes that run into another rank's: read
        # back from the file once every rank wrote (at most two per tensor and rank for Shard(0)).
        whole_digests: dict[str, str] = {}
        chunks: dict[str, list[tuple[int, bytes]]] = {}  # fqn -> [(chunk index, 16-byte digest)] hashed here
        back: dict[str, list[tuple[str, int, int, int]]] = {}  # file -> [(fqn, chunk, begin, end)] to read back
        writeback_on = not fskind.in_memory_dir(staging_dir)
        order = [(part, lay, f, i, slot) for part, lay in zip(parts, layouts) for f in lay.files for i, slot in enumerate(f.slots)]
        walk = _walk(_walk_starts([f.name for *_, f, _, _ in order], world)[rank], len(order))
        sizes = {slot.spec.fqn: slot.end - slot.begin for *_, slot in order}
        w, w_name = None, None
        covered: dict[str, int] = {}  # DTensor fqn -> elements this rank wrote of it
        try:
            kill_after_tensor = faults.armed("after_tensor_write")
            for k in walk:
                part, lay, f, i, slot = order[k]
                if w_name != f.name and w is not None:
                    w.close()
                    w, w_name = None, None
                t = fetch_tensor(part, slot.spec)
                blocks = _owned_blocks(t, _base(lay, f) + i, slot.spec.fqn)
                if isinstance(t, DTensor):
                    covered[slot.spec.fqn] = sum(b.numel() for b, _ in blocks)
                if not blocks:
                    continue
                if w is None:
                    w, w_name = BlockWriter(os.path.join(staging_dir, f.name), writeback_on), f.name
                if _whole_on_writer(t) and len(blocks) == 1 and tuple(blocks[0][0].shape) == slot.spec.shape:
                    whole_digests[slot.spec.fqn] = _write_hashed(w, slot, *blocks[0])
                else:
                    mine = chunks.setdefault(slot.spec.fqn, [])
                    for block in blocks:
                        _write_chunked(w, slot, *block, mine, back.setdefault(f.name, []))
                if kill_after_tensor:
                    faults.fault_point("after_tensor_write")
        except BaseException as e:  # noqa: BLE001 - agreed below
            err = e
        finally:
            if w is not None:
                w.close()
        if err is not None and isinstance(err, OSError):
            err = CheckpointWriteError(path, f"{type(err).__name__}: {err}", rank)
        dist.check_all(f"writing {path}", err)
        # Every file is fsynced by one rank (fsync flushes all ranks' pages of the file; each
        # writer started their writeback already) while the hash thread reads back this rank's
        # straddling chunks.
        err = None
        try:
            pool = threads.pool("hash-back", 1) if threads.cpus() >= 2 else None
            todo = {n: v for n, v in back.items() if v}
            reading = pool.submit(_read_back_chunks, staging_dir, todo) if pool and todo else None
            try:
                for j, (_, f) in enumerate(files):
                    if j % world == rank:
                        fd = os.open(os.path.join(staging_dir, f.name), os.O_RDONLY)
                        try:
                            faults.fault_point("before_file_fsync")
                            os.fsync(fd)
                        finally:
                            os.close(fd)
                        faults.fault_point("after_file_fsync")
            finally:
                ownership.settle([reading] if reading is not None else [])
            got = reading.result() if reading is not None else _read_back_chunks(staging_dir, todo) if todo else {}
            for fqn, more in got.items():
                chunks.setdefault(fqn, []).extend(more)
        except BaseException as e:  # noqa: BLE001
            err = (
                CheckpointWriteError(path, f"{type(e).__name__}: {e}", rank) if isinstance(e, OSError) else e
            )
        # Chunk digests travel as runs of consecutive chunks (16 bytes each): 1.6 MB per 100 GB.
        tensor_digests: dict[str, str] = {}
        pieces: dict[str, list[tuple[int, bytes]]] = {}
        hashed = dist.check_all_gather(f"hashing {path}", err, (whole_digests, _chunk_runs(chunks), covered))
        _check_covered(path, [c for *_, c in hashed], {sp.fqn: math.prod(sp.shape) for p in parts for sp in p.specs})
        for whole, runs, _ in hashed:
            tensor_digests.update(whole)
            for fqn, rs in runs.items():
                pieces.setdefault(fqn, []).extend(rs)
        for fqn, n in sizes.items():  # split tensors (an empty one has no chunk written)
            if fqn not in tensor_digests:
                tensor_digests[fqn] = _joined_digest(fqn, pieces.get(fqn, []), n)
        records = {f.name: distributed_record(f, tensor_digests) for _, f in files}
        indexes = [
            make_index(part, lay, {f.name: records[f.name] for f in lay.files})
            for part, lay in zip(parts, layouts)
        ]
        err = None
        if rank == 0:
            try:
                for name, data in extra_files.items():  # rank 0's, like the indexes
                    staged.write_file(name, bytes(data))
                write_indexes_and_commit(staged, parts, indexes)
            except BaseException as e:  # noqa: BLE001
                err = (
                    CheckpointWriteError(path, f"{type(e).__name__}: {e}", 0)
                    if isinstance(e, OSError) and not isinstance(e, CheckpointError)
                    else e
                )
        dist.check_all(f"committing {path}", err)
        return indexes
    finally:
        if staged is not None:
            staged.__exit__(None, None, None)


def _whole_on_writer(t: torch.Tensor) -> bool:
    """Whether the rank that writes ``t`` holds all of it (a plain tensor; a DTensor sharded on no
    mesh dim of more than one rank): decided from placements alone, so every rank agrees."""
    if not isinstance(t, DTensor):
        return True
    mesh = t.device_mesh
    return all(
        not isinstance(p, (Shard, _StridedShard)) or mesh.size(d) == 1 for d, p in enumerate(t.placements)
    )


def _write_hashed(w: BlockWriter, slot, local: torch.Tensor, offset) -> str:
    """Write a whole tensor while the hash thread reads the same memory; its digest (waited for
    even when the write fails: the memory is in use until then)."""
    pool = threads.pool("hash", 1) if threads.cpus() >= 2 else None
    if pool is None:
        w.write(slot, local, offset)
        return digest.tensor_hexdigest(tensor_bytes(local))
    data = tensor_bytes(local)
    hashed = pool.submit(digest.tensor_hexdigest, data)  # xxhash releases the GIL
    try:
        w.write(slot, local, offset)
    finally:
        ownership.settle([hashed])  # on every exit path, Ctrl-C included: it reads the caller's tensor
    return hashed.result()


def _write_chunked(w: BlockWriter, slot, local: torch.Tensor, offset, got: list, back: list) -> None:
    """Write block ``local`` (at element ``offset``) of a tensor split over ranks, hashing on the
    hash thread, beside the pwrite, each digest chunk (:data:`digest.TENSOR_CHUNK` bytes of the
    tensor) lying whole in one contiguous run of the block: ``(chunk index, 16-byte digest)``
    appended to ``got``; each chunk starting in a run but running past its end (into bytes another
    rank writes, or another run of this block) is appended to ``back`` as ``(fqn, chunk index,
    file begin, file end)``, read back once every rank wrote (:func:`_read_back_chunks`). Every
    chunk of the tensor is so hashed by the one rank writing its first byte."""
    spec, item, c = slot.spec, slot.spec.itemsize, digest.TENSOR_CHUNK
    nbytes = slot.end - slot.begin
    if not local.is_contiguous():  # (a _StridedShard block's view): one copy for the write and the hash
        local = local.contiguous()
    data = tensor_bytes(local)
    views: list[tuple[int, memoryview]] = []
    for g, lo, n in block_runs(spec.shape, tuple(local.shape), tuple(offset)):
        a, b, m = g * item, (g + n) * item, lo * item  # the run's tensor bytes [a, b), at m in data
        j = -(-a // c)  # the first chunk starting in the run
        while j * c < b:
            end = min((j + 1) * c, nbytes)
            if end <= b:
                views.append((j, data[m + j * c - a : m + end - a]))
            else:
                back.append((spec.fqn, j, slot.begin + j * c, slot.begin + end))
            j += 1
    pool = threads.pool("hash", 1) if threads.cpus() >= 2 and views else None

    def hash_views() -> list[tuple[int, bytes]]:
        return [(j, xxhash.xxh3_128_digest(v)) for j, v in views]

    if pool is None:
        w.write(slot, local, offset)
        got.extend(hash_views())
        return
    hashed = pool.submit(hash_views)  # xxhash releases the GIL
    try:
        w.write(slot, local, offset)
    finally:
        ownership.settle([hashed])  # on every exit path, Ctrl-C included: it reads the caller's tensor
    got.extend(hashed.result())


def _read_back_chunks(staging_dir: str, back: Mapping[str, list]) -> dict[str, list[tuple[int, bytes]]]:
    """Digests of the chunks in ``back`` (``{file: [(fqn, chunk index, begin, end)]}``), read back
    from the staged files with ``preadv`` (never through a mapping: a file cut short fails here
    rather than killing the process with SIGBUS), once every rank wrote them.

    Raises:
        OSError: a file ends before a chunk does (cut short) or cannot be read.
    """
    out: dict[str, list[tuple[int, bytes]]] = {}
    buf = memoryview(bytearray(digest.TENSOR_CHUNK))
    for name, items in back.items():
        fd = os.open(os.path.join(staging_dir, name), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            for fqn, j, b, e in sorted(items, key=lambda x: x[2]):
                view = buf[: e - b]
                got = 0
                while got < len(view):
                    n = os.preadv(fd, [view[got:]], b + got)
                    if n <= 0:
                        raise OSError(f"{os.path.join(staging_dir, name)} ends before byte {e} of {fqn!r} (cut short?)")
                    got += n
                out.setdefault(fqn, []).append((j, xxhash.xxh3_128_digest(view)))
        finally:
            os.close(fd)
    return out


def _chunk_runs(chunks: Mapping[str, list[tuple[int, bytes]]]) -> dict[str, list[tuple[int, bytes]]]:
    """``{fqn: [(first chunk index, concatenated digests of consecutive chunks)]}``: the chunk
    digests of :func:`_write_chunked` packed for the gather."""
    out: dict[str, list[tuple[int, bytes]]] = {}
    for fqn, items in chunks.items():
        runs: list[tuple[int, list[bytes]]] = []
        for j, d in sorted(items):
            if runs and runs[-1][0] + len(runs[-1][1]) == j:
                runs[-1][1].append(d)
            else:
                runs.append((j, [d]))
        out[fqn] = [(j, b"".join(ds)) for j, ds in runs]
    return out


def _joined_digest(fqn: str, runs: list[tuple[int, bytes]], nbytes: int) -> str:
    """The tensor digest of ``fqn`` (``nbytes`` bytes) from every rank's runs of chunk digests
    (:func:`_chunk_runs`); every chunk must be there exactly once."""
    if nbytes == 0:
        return digest.hexdigest(b"")
    joined = b"".join(d for _, d in sorted(runs))
    want = digest.chunk_count(nbytes, digest.TENSOR_CHUNK)
    starts = sorted(runs)
    if len(joined) != 16 * want or any(j != sum(len(d) for _, d in starts[:i]) // 16 for i, (j, _) in enumerate(starts)):
        raise RuntimeError(f"{fqn!r}: the ranks hashed {len(joined) // 16} of its {want} digest chunks (a save bug)")
    return joined.hex() if want == 1 else digest.hexdigest(joined)


def _write_orders(file_names: Sequence[str], world: int) -> list[list[int]]:
    """For the slots in the common order (``file_names[k]``: the shard file of slot ``k``, slots of
    one file consecutive): the order each rank writes them in, as indices. Rank ``r`` starts at
    file ``r * files // world`` and wraps around, so while there are as many files as ranks, ranks
    write different files at a time.

    Why: the kernel serializes writers of one file (the inode lock, held across each write's copy on
    tmpfs), so ranks going through the files in one order wait for each other; starting at
    different files comes close to each rank writing a file of its own
    (``tests/bench/shared_writes.py`` measures the three)."""
    n = len(file_names)
    return [_walk(first, n) for first in _walk_starts(file_names, world)]


def _walk_starts(file_names: Sequence[str], world: int) -> list[int]:
    """The slot each rank starts its walk at (see :func:`_write_orders`)."""
    starts = [k for k, name in enumerate(file_names) if k == 0 or name != file_names[k - 1]]
    return [starts[r * len(starts) // world] if starts else 0 for r in range(world)]


def _walk(first: int, n: int) -> list[int]:
    return list(range(first, n)) + list(range(first))


def _base(lay: Layout, f) -> int:
    """Index of the first slot of file ``f`` within its layout (spreads plain tensors over ranks)."""
    return lay.first_slot[f.name]


def fetch_tensor(part: Part, spec: TensorSpec) -> torch.Tensor:
    t = part.fetch(spec)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"value of {spec.fqn!r} is a {type(t).__name__}, not a tensor")
    if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
        raise ValueError(f"{spec.fqn!r} is {tuple(t.shape)} {t.dtype}, planned {spec.shape} {spec.dtype}")
    return t
