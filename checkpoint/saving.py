"""``save`` and ``save_streaming``: the front doors that save a module or a state_dict as sharded
safetensors checkpoints in eager FQNs, committed atomically.

They decide what is written (the parts: model, optimizer, extra files; :func:`prepare_parts`) and
hand it to the write pipeline, :func:`checkpoint.write.write_checkpoint` (plan, write, digest,
index, commit), as ``async_save``, ``migrate``, conversions and DCP's ``StorageWriter`` do. The
result is Hugging Face's layout (``model-0000k-of-0000n.safetensors`` +
``model.safetensors.index.json``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fqn import FQNMap, FQNMapFile

from .convert import CONVERSION_REPORT_NAME, run_recipe
from .convert.hf_files import hf_config_files
from .convert.meta_files import write_meta_checkpoint
from .peft_state import ADAPTER_WEIGHTS, find_peft, peft_state, saved_names_state
from .progress import counted_fetches
from .ranks import dist
from .state import Entry, object_state
from .storage.format import MODEL_PREFIX, OPTIMIZER_PREFIX, IndexFile, OptimizerMeta, parse_size
from .storage.extra_state import extra_state_file_bytes, snapshot_extra_state_parts
from .storage.layout import TensorSpec
from .storage.location import local_path, local_target, resolve
from .write import Part, join_failed_prepare, refuse_nested, side_file_record, spec_of, write_checkpoint
from .write.parts import fetch_checked
from .gc_pause import gc_paused


def converted_writer(path: str | os.PathLike, max_shard_size, overwrite: bool) -> Callable:
    """``write(specs, fetch, extra_files, layout)`` for :func:`checkpoint.convert.run_recipe`: the
    tensors streamed into this format at ``path`` (one model part; returns its index), or for
    ``layout="meta"`` into Meta's ``consolidated.NN.pth`` files; committed atomically either way."""

    def write(specs, fetch, extra, layout=None) -> IndexFile | None:
        if layout == "meta":  # local or any byte store (checkpoint.convert.meta_files)
            refuse_nested(local_target(resolve(path)))
            write_meta_checkpoint(local_target(resolve(path)), specs, fetch, extra, overwrite)
            return None
        return write_checkpoint(resolve(path), [Part(MODEL_PREFIX, list(specs), fetch)], max_shard_size, overwrite, extra)[0]

    return write


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
    return write_checkpoint(resolve(path, storage_options), [part], max_shard_size, overwrite, extra_files or {})[0]


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
    from that layout). Every other model is written the same either way. With DTensors (call on
    every rank) rank 0 converts and writes, each tensor gathered when the conversion asks for it
    (memory: one rule group, e.g. one layer's experts; no temporary copy), to a local path or a URL.

    ``recipe``: write another layout (``fqnckpt recipes``, e.g. ``hf-to-torchtitan-llama3``): saved
    as usual into a temporary directory beside ``path``, then converted by
    :mod:`checkpoint.convert`; returns its ``ConversionReport``. With DTensors (call on every rank)
    each rank saves its own bytes as usual and rank 0 alone converts, streamed (memory: one rule
    group, e.g. one layer's experts); every rank returns the report.

    ``path`` may be a URL (``s3://bucket/run/step-100``, ``memory://...``, ``file://...``): written
    through fsspec, committed without rename, each rank uploading its own files in bounded
    multipart uploads (:mod:`checkpoint.storage.commit`, :mod:`checkpoint.write.upload`).
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
    local ``path`` inside another checkpoint's folder (:func:`checkpoint.write.plan.refuse_nested`), :class:`~checkpoint.errors.UnsavableError`
    naming ``max_shard_size`` and its value for a size that is neither an int nor a size string
    (:func:`checkpoint.storage.format.parse_size`), before anything is written; on ranks whose
    peers failed, :class:`~checkpoint.errors.RankAgreementError`; ``ValueError`` for an unknown
    ``layout``, ``TypeError`` for ``layout="pretrained"`` with ``optimizer`` / ``extra_state``, and
    for ``layout`` with ``recipe``; ``NotImplementedError`` for DTensors to a URL with ``recipe``.
    """
    path = resolve(path, storage_options, transfer)
    if max_shard_size is not None:  # refused by name before any rank exchanges or writes a thing
        parse_size(max_shard_size, str(path))
    pretrained = pretrained_layout_for(obj, path, layout, optimizer, extra_state, recipe, "save")
    if pretrained is not None:
        return _save_with_recipe(obj, local_target(path), pretrained, max_shard_size, overwrite, progress, index=True)
    if recipe is not None:  # save as usual, then convert (checkpoint.convert) into path
        if optimizer is not None or extra_state is not None:
            raise TypeError("save(recipe=...) writes model tensors only: save the optimizer / extra_state without a recipe")
        return _save_with_recipe(obj, path, recipe, max_shard_size, overwrite, progress)
    parts, distributed, extra_files = prepare_agreed(path, obj, optimizer, extra_state, peft)
    with counted_fetches(parts, "save", progress):  # progress: counts each fetched tensor
        return write_checkpoint(path, parts, max_shard_size, overwrite, extra_files, distributed=distributed)[0]


def pretrained_layout_for(obj, path, layout: str | None, optimizer, extra_state, recipe=None, what: str = "save") -> Any:
    """The recipe converting ``obj``'s tensors into what ``save_pretrained`` writes, where a save
    (``what``: ``"save"`` / ``"async_save"``) with these arguments writes that layout (see
    :func:`save`'s ``layout``); None where it writes the module's own names and tensors.

    Raises ``ValueError`` for an unknown ``layout``, ``TypeError`` for ``layout="pretrained"`` with
    ``optimizer`` / ``extra_state`` and for ``layout`` with ``recipe``; for ``async_save`` of
    DTensors to a URL (its conversion reads a temporary save every rank writes to a local path),
    ``NotImplementedError`` for ``layout="pretrained"``, and a warning by default (written in the
    module's own layout)."""
    if layout not in (None, "pretrained", "memory"):
        raise ValueError(f"{what}(layout={layout!r}): 'pretrained' (what save_pretrained writes) or 'memory' (the module's own names)")
    if recipe is not None and layout is not None:
        raise TypeError(f"{what}(recipe={recipe!r}, layout={layout!r}): a recipe names the layout written; pass one of them")
    if layout == "pretrained" and (optimizer is not None or extra_state is not None):
        raise TypeError(f"{what}(layout='pretrained') writes model tensors only (as save_pretrained): the optimizer state and "
                        "extra_state are keyed by the in-memory parameters; save a training checkpoint with layout='memory'")  # fmt: skip
    if recipe is not None or layout == "memory" or optimizer is not None or extra_state is not None:
        return None
    pretrained = _pretrained_layout(obj)
    # async_save converts DTensors from a temporary save every rank writes: a local path (file://: the directory)
    if (pretrained is not None and what == "async_save" and local_path(local_target(path)) is None
            and object_state(obj).has_dtensor):  # fmt: skip
        if layout is not None:
            raise NotImplementedError(f"{what}(layout='pretrained') of DTensors to {path}: save to a shared local path, "
                                      "use save, or pass layout='memory'")  # fmt: skip
        warnings.warn(f"{what}({path}): DTensors are written to a URL in the module's "
                      "own layout (as layout='memory'): the on-disk layout of save_pretrained is converted on rank 0 from "
                      "a local path every rank shares (or by save); checkpoint.load reads either layout", stacklevel=4)  # fmt: skip
        return None
    return pretrained


def _pretrained_layout(obj) -> Any:
    """The ``fused-to-experts`` recipe (transformers' conversion mapping reversed, what
    ``save_pretrained`` writes) for a transformers model whose saved names it changes; else None
    (any other model, or transformers never imported)."""
    from .convert.transformers_rules import changes_keys, pretrained_recipe

    try:
        rec = pretrained_recipe(obj)
    except ValueError:  # a mapping fqnckpt does not translate: refused when asked for explicitly only
        return None
    if rec is None:
        return None
    back = rec.inverse()
    return back if changes_keys(back, (e.fqn for e in object_state(obj).entries)) else None


def _state_catalog(part: Part, where: str, fetch: Callable[[TensorSpec], torch.Tensor] | None = None) -> Any:
    """The model part of a single-process save as the source of a conversion
    (:class:`checkpoint.convert.catalog.Catalog`): each tensor fetched and checked as ``save``
    fetches it (or by ``fetch``), when the conversion asks for it."""
    from pathlib import Path

    from .convert.catalog import Catalog
    from .sources.base import Source, SourceSpec

    by_fqn = {s.fqn: s for s in part.specs}
    get_tensor = fetch or (lambda spec: fetch_checked(part, spec))

    class _Fetch:
        def get(self, key: str) -> torch.Tensor:
            return get_tensor(by_fqn[key])

    specs = {s.fqn: SourceSpec(s.fqn, s.shape, s.dtype) for s in part.specs}
    source = Source(Path(where), "safetensors", [], specs, dict.fromkeys(specs, "(in memory)"), _Fetch())
    return Catalog(Path(where), [source], None)


def _save_with_recipe(obj, path: str, recipe, max_shard_size, overwrite: bool, progress, index: bool = False):
    """``save(obj, path, recipe=...)``: saved in fqnckpt's layout into a temporary directory beside
    ``path`` (the destination's filesystem, which every rank of a distributed save writes), then
    converted into ``path`` by rank 0 alone, streamed one rule group at a time; every rank returns
    the report or raises (rank 0's own error; :class:`RankAgreementError` on the others).
    ``index``: return the model index written instead, and write no ``conversion_report.json``
    (the layout a model's own ``save_pretrained`` writes, not a conversion asked for); the
    conversion then reads the module's tensors directly, no temporary save (in a single process
    :func:`convert_state`, on many ranks :func:`convert_gathered`)."""
    distributed = object_state(obj).has_dtensor  # as save decides: DTensors mean every rank saves
    local = local_path(path)
    if local is None and distributed and not index:  # the ranks' shared temporary directory would be local
        raise NotImplementedError(f"save(recipe=...) of DTensors to {path}: save to a shared local path, then migrate")
    parent = None if local is None else os.path.dirname(os.path.abspath(local))  # a URL: converted from a local temp dir
    inner = converted_writer(path, max_shard_size, overwrite)
    written: list[IndexFile] = []

    def writer(specs, fetch, extra, layout=None) -> None:
        if index:
            extra = {k: v for k, v in extra.items() if k != CONVERSION_REPORT_NAME}
        written.append(inner(specs, fetch, extra, layout))

    if not distributed and index:  # converted straight from the module's tensors: nothing written twice
        part = prepare_parts(str(path), obj, None, None)[0][0]
        return convert_state(part, path, recipe, obj, max_shard_size, overwrite, progress)
    if not distributed:
        with tempfile.TemporaryDirectory(prefix=".fqnckpt-convert-", dir=parent) as tmp:
            save(obj, os.path.join(tmp, "ck"), max_shard_size=max_shard_size, progress=progress, layout="memory")
            return run_recipe(os.path.join(tmp, "ck"), path, recipe, model=obj, progress=progress, write=writer)

    if index:  # what save_pretrained writes: rank 0 converts the tensors as they are gathered, nothing written twice
        part, err = None, None
        try:
            part = prepare_parts(str(path), obj, None, None)[0][0]
        except Exception as e:  # noqa: BLE001 - agreed: every rank raises
            err = e
        dist.check_all(f"preparing {path}", err)
        return convert_gathered(part, path, recipe, obj, max_shard_size, overwrite, progress)

    def save_memory(ck: str) -> None:
        save(obj, ck, max_shard_size=max_shard_size, progress=progress, layout="memory")

    return convert_through_temporary(path, recipe, obj, save_memory, writer, written, progress, index)


def convert_gathered(part: Part, path, recipe, obj, max_shard_size, overwrite: bool, progress) -> IndexFile:
    """Every rank of a distributed save (on the group of :mod:`checkpoint.ranks.dist`): the model
    ``part`` converted by ``recipe`` (what ``save_pretrained`` writes) into ``path`` by rank 0, as
    :func:`convert_state` does in one process, each tensor gathered when the conversion asks for
    it (``DTensor.full_tensor`` on every rank, rank 0 naming the tensor first: the ranks follow
    rank 0's order), so no rank writes a temporary copy and rank 0 holds one rule group at a
    time. Returns on every rank the index written.

    Raises: rank 0's error on every rank (:class:`RankAgreementError` on the others)."""
    by_fqn = {s.fqn: s for s in part.specs}
    lock = threading.Lock()  # one gather at a time, whichever thread of the conversion fetches

    def gathered(spec: TensorSpec) -> torch.Tensor:  # the same verdict on every rank: same model
        t = part.fetch(spec)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"value of {spec.fqn!r} is a {type(t).__name__}, not a tensor")
        if t.is_meta:
            raise TypeError(f"{spec.fqn!r} is on the meta device: it has no data to save")
        return t.full_tensor() if isinstance(t, DTensor) else t

    index, error = None, None
    if dist.rank() == 0:

        def fetch(spec: TensorSpec) -> torch.Tensor:
            with lock:
                dist.broadcast_object(spec.fqn)
                return gathered(spec)

        try:
            writer, written = pretrained_writer(path, max_shard_size, overwrite)
            run_recipe(_state_catalog(part, str(path), fetch), path, recipe, model=obj, progress=progress, write=writer)
            index = written[0]
        except Exception as e:  # noqa: BLE001 - every rank raises it (check_all)
            error = e
        finally:
            dist.broadcast_object(None)  # the others stop serving
    else:
        while (fqn := dist.broadcast_object(None)) is not None:
            try:
                gathered(by_fqn[fqn])
            except Exception as e:  # noqa: BLE001 - rank 0 raises the same; served on until it stops
                error = error or e
    dist.check_all(f"save({path}) converting to save_pretrained's layout on rank 0", error)
    return dist.broadcast_object(index)


def convert_state(part: Part, path, recipe, obj, max_shard_size, overwrite: bool, progress) -> IndexFile:
    """Single process: the model ``part`` (its tensors fetched as a save fetches them, e.g. an
    async save's staged copies) converted by ``recipe`` (what ``save_pretrained`` writes) straight
    into ``path``, nothing written twice; returns the index written (no ``conversion_report.json``).

    Raises: what :func:`checkpoint.convert.run_recipe` and the write raise."""
    writer, written = pretrained_writer(path, max_shard_size, overwrite)
    run_recipe(_state_catalog(part, str(path)), path, recipe, model=obj, progress=progress, write=writer)
    return written[0]


def pretrained_writer(path, max_shard_size, overwrite: bool) -> tuple[Callable, list[IndexFile]]:
    """:func:`converted_writer` for the layout ``save_pretrained`` writes (no
    ``conversion_report.json``: a model's own layout, not a conversion asked for), and the list
    it appends each index written to."""
    inner = converted_writer(path, max_shard_size, overwrite)
    written: list[IndexFile] = []

    def writer(specs, fetch, extra, layout=None) -> None:
        written.append(inner(specs, fetch, {k: v for k, v in extra.items() if k != CONVERSION_REPORT_NAME}, layout))

    return writer, written


def convert_through_temporary(path, recipe, obj, save_memory: Callable[[str], Any], writer, written: list, progress,
                              index: bool) -> Any:  # fmt: skip
    """Every rank (a distributed save, on the group of :mod:`checkpoint.ranks.dist`):
    ``save_memory(directory)`` writes the module's own layout into a temporary directory beside
    ``path`` (rank 0 creates it), then rank 0 alone converts it into ``path`` by ``recipe`` through
    ``writer`` (which appends the index it writes to ``written``), and the directory is removed.
    Returns on every rank the conversion's report, or with ``index`` the index written.

    Raises: rank 0's error on every rank (:class:`RankAgreementError` on the others)."""
    parent = os.path.dirname(os.path.abspath(local_path(path)))
    tmp, err = None, None
    if dist.rank() == 0:
        try:
            os.makedirs(parent, exist_ok=True)  # as a save without conversion creates the destination's parents
            tmp = tempfile.mkdtemp(prefix=".fqnckpt-convert-", dir=parent)
        except Exception as e:  # noqa: BLE001 - agreed: no rank left waiting for rank 0's directory
            err = e
    tmp = dist.check_all_gather(f"save(recipe={getattr(recipe, 'name', recipe)!r}) preparing {parent}", err, tmp)[0]
    try:
        save_memory(os.path.join(tmp, "ck"))
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
    rank joins the first exchange of :func:`checkpoint.write.write_checkpoint` with its error, so it raises its
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
    """This rank's side of :func:`checkpoint.write.write_checkpoint`'s first exchange when it
    failed before it: raises ``error`` after every rank learnt of it."""
    join_failed_prepare(path, error)


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
        from .optim import optimizer_entries

        # A PEFT model's optimizer is keyed by the names its files use (load plans by the same)
        named = saved_names_state(obj, state) if model_state is not state else state
        opt_entries, opt_meta = optimizer_entries(optimizer, named)
        parts_entries.append((OPTIMIZER_PREFIX, opt_entries, [], None, opt_meta))
    parts = []
    for prefix, entries, groups, fm, om in parts_entries:
        by_fqn = {e.fqn: e.tensor for e in entries}
        specs = [spec_of(path, e.fqn, e.tensor) for e in entries]
        parts.append(Part(prefix, specs, lambda s, d=by_fqn: d[s.fqn], groups, fm, om))
    if ADAPTER_WEIGHTS in extra_files:  # the adapter's digests in the model index, as a shard's
        parts[0].extra_shards = {ADAPTER_WEIGHTS: side_file_record(extra_files[ADAPTER_WEIGHTS])}
    distributed = any(isinstance(e.tensor, DTensor) for _, es, *_ in parts_entries for e in es)
    return parts, distributed, extra_files


def _extra_state_files(path: str, extra_state, state) -> dict[str, bytes]:
    """``extra_state.json`` (+ this rank's per-rank file, gathered to rank 0 by
    :func:`checkpoint.write.write_checkpoint`). Per-rank entries need a save on every rank: refused (ValueError
    naming them) when one process saves for a world of several ranks."""
    shared, mine = snapshot_extra_state_parts(extra_state)
    rank, world = (dist.rank(), dist.world_size()) if dist.active() else (0, 1)
    if mine and world > 1 and not any(isinstance(e.tensor, DTensor) for e in state.entries):
        raise ValueError(
            f"saving {path}: extra_state entries {sorted(mine)} are PerRank, but this save of a "
            f"module without DTensors is one process's ({world} ranks): only rank {rank}'s values would be kept"
        )
    return extra_state_file_bytes(shared, mine, rank, world)
