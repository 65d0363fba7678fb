"""``StorageWriter``: DCP's ``StorageWriter`` interface writing an fqnckpt checkpoint.

DCP calls (``torch/distributed/checkpoint/storage.py``, ``state_dict_saver.py``): ``reset`` and
``set_up_storage_writer`` on every rank, ``prepare_local_plan`` on every rank,
``prepare_global_plan`` on the coordinator with every rank's plan, ``write_data`` on every rank,
``finish`` on the coordinator with every rank's results. Here:

- ``prepare_global_plan`` (coordinator) sees every tensor's global shape and dtype in the ranks'
  write items, plans the Hugging Face files with fqnckpt's layout
  (:func:`checkpoint.storage.layout.plan_layout`, or DCP's ``fqn_to_index_mapping`` as
  ``HuggingFaceStorageWriter`` takes it), checks every name and header against safetensors'
  limits, opens the staging directory (:class:`checkpoint.storage.local_commit.StagedCheckpoint`) and creates the
  final shard files with their headers; each rank's plan carries where its items go.
- ``write_data`` (every rank) ``pwrite``-s each item it was given (DCP's planner already chose one
  writer per replicated chunk) at its offsets of the final files
  (:func:`checkpoint.storage.writer.write_block`): each byte is written once, no per-rank files,
  no consolidation pass (a ``_StridedShard`` DTensor, whose local rows are not one range of the
  global tensor, needs :class:`checkpoint.dcp.SavePlanner`: DCP's default planner refuses it).
  Non-tensor values (DCP's ``BYTE_IO`` items) are
  unpickled with ``weights_only=True`` and kept as fqnckpt extra state.
- ``finish`` (coordinator) fsyncs every file, reads back the digest chunks no rank held whole and
  joins every tensor's digest, writes ``extra_state.json`` and the index, and commits atomically.

These are the stages of the write pipeline (:mod:`checkpoint.write`), called from DCP's callbacks
instead of in one :func:`checkpoint.write.write_checkpoint` call since DCP runs them apart: plan
(:func:`checkpoint.write.plan.plan_parts`), files (:func:`checkpoint.write.parts.create_files`),
bytes hashed beside their write (:func:`checkpoint.write.parts.write_block_hashed`), digests
(:mod:`checkpoint.write.digests`), index and commit (:mod:`checkpoint.write.index`): the files,
digests and index are those ``checkpoint.save`` writes for the same tensors and layout.

Object storage (``s3://``, ...): an object cannot be filled in byte ranges by several processes,
so ``write_data`` hands the whole save to :func:`checkpoint.write.write_checkpoint`, as
``checkpoint.save`` does: each file is uploaded by one rank, a DTensor's bytes reaching it by
``full_tensor()`` on the default process group, committed by the model index.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import math
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint import storage as dcp_storage
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ..storage.local_commit import StagedCheckpoint
from ..errors import CheckpointError, CheckpointWriteError, RankMismatchError, UnsavableError
from ..ranks import dist
from ..storage.extra_state import extra_state_file_bytes, snapshot_extra_state
from ..storage.format import MODEL_PREFIX, parse_size
from ..storage.layout import Layout, TensorSlot, TensorSpec
from ..storage.location import local_path, shown
from .location import Located
from ..storage import fskind
from ..storage.writer import BlockWriter
from ..write import Part, check_same_arguments, plan_parts, write_checkpoint, write_indexes_and_commit
from ..write.digests import chunk_runs, settle_files, tensor_digests
from ..write.index import indexes_of
from ..write.parts import Hashed, create_files, write_block_hashed
from ..write.plan import layout_by_index
from .planner import TiedKeys


@dataclass(frozen=True)
class _LocalPlan:
    """``SavePlan.storage_data`` of one rank (local path): the staging directory and the slot of
    each of its tensors in the final files."""

    staging_dir: str
    slots: dict[str, TensorSlot]


@dataclass(frozen=True)
class _RemotePlan:
    """``SavePlan.storage_data`` of one rank (object storage): the whole layout, every rank
    uploading its files through :func:`checkpoint.write.write_checkpoint`."""

    layout: Layout
    extra_keys: tuple[str, ...]
    aliases: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class _RankArgs:
    """``SavePlan.storage_data`` of a local plan: this rank's destination and ``overwrite``, and
    the global shape and dtype of each tensor it plans (``tensors``: ``(fqn, shape, dtype)``,
    one per key), compared by the coordinator before DCP's dedup is looked at (``inner``: what
    the planner put there, e.g. TiedKeys)."""

    destination: str
    overwrite: bool
    inner: Any = None
    tensors: tuple[tuple[str, tuple[int, ...], str], ...] = ()


@dataclass(frozen=True)
class Written:
    """``WriteResult.storage_data`` of a tensor item: its file, the tensor's absolute byte range
    there, its digest when this rank wrote it whole (else None), else the runs of digest chunks
    this rank hashed of it (:func:`checkpoint.write.digests.chunk_runs`) and the chunks it left to
    read back (``(fqn, chunk index, file begin, file end)``)."""

    relative_path: str
    begin: int
    end: int
    digest: str | None = None
    chunks: tuple[tuple[int, bytes], ...] = ()
    back: tuple[tuple[str, int, int, int], ...] = ()


@dataclass(frozen=True)
class ExtraValue:
    """``WriteResult.storage_data`` of a non-tensor value: the value (checked encodable)."""

    value: Any


def _agreed(what: str, plans: list[SavePlan]) -> list[SavePlan]:
    """The local plans with their :class:`_RankArgs` taken off, after checking that every rank
    was given the same destination and ``overwrite`` (a ``StorageWriter`` per rank with its own
    path would write every rank's bytes into the coordinator's checkpoint while the others
    believe they saved elsewhere), and that every tensor key planned by several ranks has one
    global shape and dtype on all of them. DCP's planner keeps one copy of a replicated (plain)
    tensor, from whichever rank its dedup picks, so ranks whose plain tensors disagree would
    commit a mix of them; the comparison uses what each rank planned before that dedup. Plans
    without them (a planner that dropped storage_data) pass.

    Raises:
        RankMismatchError: the ranks differ (DCP raises it on every rank as CheckpointException);
            for a tensor it names the key and each rank's shape and dtype.
    """
    ranked = [(r, p.storage_data) for r, p in enumerate(plans) if isinstance(p.storage_data, _RankArgs)]
    args = [(a.destination, a.overwrite) for _, a in ranked]
    check_same_arguments(f"saving {what}", args, ("destination", "overwrite"))  # checkpoint.save's rule
    seen: dict[str, dict[int, str]] = {}
    for r, a in ranked:
        for fqn, shape, dtype in a.tensors:
            seen.setdefault(fqn, {})[r] = f"{list(shape)} {dtype}"
    for fqn, values in seen.items():
        if len(set(values.values())) > 1:
            raise RankMismatchError(
                f"saving {what}", f"the shape and dtype of tensor {fqn!r}", values,
                note="each rank must save the same tensor under one key; nothing was committed",
            )  # fmt: skip
    return [replace(p, storage_data=p.storage_data.inner) if isinstance(p.storage_data, _RankArgs) else p for p in plans]


# Saves prepared by a coordinator of this process and not finished (a rank failed, so DCP never
# called finish): each holds the checkpoint's writer lock. The next save to the same path releases
# it first, so a retry in this process does not wait on its own lock.
_PENDING: dict[str, StagedCheckpoint] = {}
_PENDING_LOCK = threading.Lock()


@atexit.register
def _abort_all() -> None:
    """Saves a rank failed (DCP never called finish): their staging directories and locks."""
    for path in list(_PENDING):
        _abort(path)


def _abort(path: str | None) -> None:
    if path is None:
        return
    with _PENDING_LOCK:
        st = _PENDING.pop(path, None)
    if st is not None:
        st.__exit__(None, None, None)  # removes the staging directory, releases the lock


class StorageWriter(Located, dcp_storage.StorageWriter):
    """DCP ``StorageWriter`` writing an fqnckpt checkpoint at ``path`` (see module docstring).

    ``dcp.save(state_dict, storage_writer=StorageWriter(path))``; ``dcp.async_save`` (thread or
    process checkpointer) the same way. ``path``: a directory, or a URL (``s3://...``) with
    ``storage_options`` / ``transfer`` as for :func:`checkpoint.save`; DCP's ``checkpoint_id``
    replaces it when given. The keys are DCP's flattened state_dict keys (``{"model": sd}`` saves
    ``model.<fqn>``; pass the model's state_dict itself for a Hugging Face checkpoint).

    ``fqn_to_index_mapping``: ``{fqn: k}`` puts tensor ``fqn`` in
    ``model-0000k-of-0000N.safetensors`` (``N`` = the largest ``k``), as torch's
    ``HuggingFaceStorageWriter`` does (a tensor missing from it is refused); without it tensors
    are split into files of at most ``max_shard_size`` bytes of data (``"5GB"``, ``"2GiB"`` or an
    int). ``overwrite``: replace a checkpoint already at ``path`` (DCP's default; only files the old
    checkpoint owns are replaced, :mod:`checkpoint.storage.local_commit`), else
    :class:`~checkpoint.errors.CheckpointExistsError`.

    Shapes are global (DTensor) shapes; dtypes are those safetensors stores (float / bfloat16 /
    float8 / int / uint / bool / complex64). Errors raised on a rank reach every rank as DCP's
    ``CheckpointException`` (a ``BaseException``) carrying the original: an
    :class:`~checkpoint.errors.UnsavableError` for a name or header safetensors cannot hold, a
    ``TypeError`` for a dtype it cannot store or a non-tensor value extra state cannot hold (both
    naming the key), ``ValueError`` for keys missing from ``fqn_to_index_mapping``,
    :class:`~checkpoint.errors.RankMismatchError` (a ``ValueError``) naming the key and each rank's
    shape and dtype for a tensor whose shape or dtype differ between ranks (plain tensors
    included, which DCP's planner keeps from one rank only), :class:`~checkpoint.errors.CheckpointWriteError` for an OS
    error (the previous checkpoint at ``path`` stays whole), :class:`~checkpoint.errors.NestedCheckpointError`
    when ``path`` lies inside another checkpoint's folder.

    ``process_group``: the group ``dcp.save`` runs on (DCP does not hand it to storage writers,
    so pass the same one here: ``dcp.save(sd, process_group=g, storage_writer=StorageWriter(url,
    process_group=g))``); the collectives of an object-storage save run on it (a local save
    needs none beyond DCP's own). ``use_collectives=False`` is refused on several ranks: one
    index and shared shard files need every rank's tensors, which only a collective plan shows
    the coordinator. Tensors sharing storage under two keys (tied weights) are written under
    each key, as torch's ``FileSystemWriter`` and ``HuggingFaceStorageWriter`` do (DCP plans each
    key as its own tensor and hands the storage layer no storage identity); a load fills each
    key (``checkpoint.save`` of the model stores them once, as an alias group); with
    :class:`checkpoint.dcp.SavePlanner` they are written once and the other keys recorded as
    aliases, as ``checkpoint.save`` does.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        fqn_to_index_mapping: Mapping[str, int] | None = None,
        *,
        max_shard_size: int | str = "5GB",
        overwrite: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        transfer: Any = None,
        process_group: Any = None,
    ) -> None:
        super().__init__()
        self._locate(path, storage_options, transfer)
        self.process_group = process_group
        self.fqn_to_index_mapping = dict(fqn_to_index_mapping) if fqn_to_index_mapping is not None else None
        if fqn_to_index_mapping is None:
            parse_size(max_shard_size, self.path or "")  # a bad size (a float, "1.5") fails here, before DCP plans
        self.max_shard_size = max_shard_size
        self.overwrite = overwrite
        self.is_coordinator = False
        self.rank = 0
        self._layout: Layout | None = None
        self._aliases: list[list[str]] = []
        self._staged_path: str | None = None

    # -- DCP interface -------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A new save: ``checkpoint_id`` (a path or URL) replaces ``path`` when given."""
        self._abandon()
        self._relocate(checkpoint_id)
        self._layout = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Raises ValueError for ``use_collectives=False`` on several ranks (see the class
        docstring), NotImplementedError for an object-storage save on a ``process_group`` that
        is not every rank."""
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        if kwargs.get("use_collectives") is False and dist.world_size() > 1:
            raise ValueError(
                f"saving {self.path}: checkpoint.dcp.StorageWriter cannot save with use_collectives=False "
                "on several ranks: the ranks write into shared Hugging Face shard files and one index, "
                "laid out from every rank's tensors, and without collectives no rank sees the others' "
                "(DCP then writes per-rank metadata, which FileSystemWriter's .distcp format has and an "
                "HF checkpoint has not). Save with use_collectives=True (DCP's default)"
            )
        path = self._require_path()
        group = self.process_group
        if group is not None and local_path(path) is None and torch.distributed.get_world_size(group) != dist.world_size():
            raise NotImplementedError(
                f"saving {path}: an object-storage save agrees on its upload and commit through "
                "collectives numbered by the default group; a process_group of some ranks only is not "
                "supported (use a group of every rank, e.g. a gloo group for async_save)"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Adds this rank's destination, ``overwrite`` and its tensors' global shapes and dtypes
        for the coordinator to compare."""
        dest = shown(self._require_path())  # as resolve() takes it
        tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}
        for it in plan.items:
            if it.type != WriteItemType.BYTE_IO and it.tensor_data is not None:
                td = it.tensor_data
                tensors.setdefault(it.index.fqn, (it.index.fqn, tuple(td.size), str(td.properties.dtype)))
        args = _RankArgs(dest, bool(self.overwrite), plan.storage_data, tuple(tensors.values()))
        return replace(plan, storage_data=args)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: plan the files from every rank's items, create them (local paths), and give
        each rank where its items go. Raises before anything is written (see class docstring)."""
        where = self._where()
        plans = _agreed(str(self.path), plans)
        tied = next((p.storage_data for p in plans if isinstance(p.storage_data, TiedKeys)), None)
        self._aliases = [list(g) for g in tied.groups] if tied is not None else []
        plans = _dedup(plans)
        specs, extra_keys = _specs_of(plans, str(self.path))
        chosen = None
        if self.fqn_to_index_mapping is not None:
            chosen = [layout_by_index(specs, self.fqn_to_index_mapping, MODEL_PREFIX, str(self.path))]
        part = Part(MODEL_PREFIX, specs, None, self._aliases)
        layout = plan_parts(str(self.path), [part], self.max_shard_size, layouts=chosen)[0]  # checkpoint.save's checks
        self._layout = layout
        if local_path(where) is None:  # a byte store: uploaded per file, committed by its index
            data = _RemotePlan(layout, tuple(extra_keys), tuple(tuple(g) for g in self._aliases))
            return [replace(p, storage_data=data) for p in plans]
        _abort(self.path)  # a failed save of this process still holding the lock
        try:
            st = create_files(where, self.overwrite, layout.files)
        except OSError as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointWriteError(where, f"{type(e).__name__}: {e}", self.rank) from e
        with _PENDING_LOCK:
            _PENDING[self.path] = st
        self._staged_path = self.path
        slots = layout.slots
        out = []
        for p in plans:
            mine = {it.index.fqn: slots[it.index.fqn] for it in p.items if it.type != WriteItemType.BYTE_IO}
            out.append(replace(p, storage_data=_LocalPlan(st.dir, mine)))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items into the final files (see module docstring); the future is
        already complete (a failure raises here, which DCP hands to every rank)."""
        data = plan.storage_data
        try:
            if isinstance(data, _RemotePlan):
                results = self._write_remote(plan, data, planner)
            else:
                results = self._write_local(plan, data, planner)
        except BaseException:
            self._abandon()  # the coordinator's own failure: DCP will not call finish()
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: fsync the files, read back the digest chunks no rank held whole, write
        ``extra_state.json`` and the index, commit. (Object storage: committed in ``write_data``
        already.)"""
        layout = self._layout
        assert layout is not None, "finish() without prepare_global_plan()"
        if local_path(self._where()) is None:
            return
        with _PENDING_LOCK:
            st = _PENDING.pop(self._staged_path, None)
        self._staged_path = None
        if st is None:
            raise CheckpointWriteError(str(self.path), "the save was abandoned before finish() (reset() or another save)")
        try:
            extra, written = _collect(results)
            missing = sorted(set(layout.slots) - set(written.seen))
            if missing:
                raise CheckpointWriteError(
                    str(self.path), f"no rank wrote {missing[:10]}{' ...' if len(missing) > 10 else ''}"
                )
            got = settle_files(st.dir, [f.name for f in layout.files], written.back, fsync_threads=4)
            sizes = {fqn: slot.end - slot.begin for fqn, slot in layout.slots.items()}
            digests = tensor_digests([written.whole], [written.runs, chunk_runs(got)], sizes)
            part = Part(MODEL_PREFIX, [s.spec for s in layout.slots.values()], None, self._aliases)
            files = {}
            if extra:
                files = extra_state_file_bytes(snapshot_extra_state(_nested(extra, metadata.planner_data)))
            write_indexes_and_commit(st, [part], indexes_of([part], [layout], digests), files)
        except OSError as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointWriteError(str(self.path), f"{type(e).__name__}: {e}", self.rank) from e
        finally:
            st.__exit__(None, None, None)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.run_id)

    # -- helpers -------------------------------------------------------------------------------
    def _abandon(self) -> None:
        if self._staged_path is not None:
            _abort(self._staged_path)
            self._staged_path = None

    def __del__(self) -> None:
        try:
            self._abandon()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __getstate__(self) -> dict[str, Any]:  # the process checkpointer pickles the writer
        state = dict(self.__dict__)
        state["_staged_path"] = None
        state["process_group"] = None  # not picklable; the checkpointer process has its own
        return state

    def _write_local(self, plan: SavePlan, data: _LocalPlan, planner: SavePlanner) -> list[WriteResult]:
        results: list[WriteResult] = []
        files: dict[str, BlockWriter] = {}
        writeback_on = not fskind.in_memory_dir(data.staging_dir)
        item: WriteItem | None = None
        try:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    results.append(_extra_result(item, planner))
                    continue
                slot = data.slots[item.index.fqn]
                t = planner.resolve_data(item)
                w = files.get(slot.file)
                if w is None:
                    w = files[slot.file] = BlockWriter(os.path.join(data.staging_dir, slot.file), writeback_on)
                blocks = _blocks(item, t)
                hashed = Hashed()
                write_block_hashed(w, slot, blocks, True, hashed)  # a block that is the whole tensor: hashed whole
                fqn = item.index.fqn
                written = Written(slot.file, slot.begin, slot.end, hashed.whole.get(fqn),
                                  tuple(chunk_runs(hashed.chunks).get(fqn, ())),
                                  tuple(x for v in hashed.back.values() for x in v))  # fmt: skip
                n = sum(local.numel() * local.element_size() for local, _ in blocks)
                results.append(WriteResult(index=item.index, size_in_bytes=n, storage_data=written))
        except OSError as e:
            if isinstance(e, CheckpointError):
                raise
            key = f" writing {item.index.fqn!r}" if item is not None else ""
            raise CheckpointWriteError(str(self.path), f"{type(e).__name__}{key}: {e}", self.rank) from e
        finally:
            for w in files.values():  # starts writeback of the rest (disk); finish() fsyncs each file
                w.close()
        return results

    def _write_remote(self, plan: SavePlan, data: _RemotePlan, planner: SavePlanner) -> list[WriteResult]:
        state = getattr(planner, "state_dict", None)
        specs = [s.spec for f in data.layout.files for s in f.slots]
        if not isinstance(state, Mapping) or any(s.fqn not in state for s in specs):
            raise NotImplementedError(
                f"saving {self.path}: object storage needs a planner holding the flattened state_dict "
                "(DCP's DefaultSavePlanner), since each file's rank gathers whole tensors"
            )
        files: dict[str, bytes] = {}
        if dist.rank() == 0 and data.extra_keys:
            values = {k: state[k] for k in data.extra_keys}
            files = extra_state_file_bytes(snapshot_extra_state(_nested(values, getattr(planner, "mappings", None))))
        part = Part(MODEL_PREFIX, specs, lambda s: state[s.fqn], [list(g) for g in data.aliases])
        group = dist.using_group(self.process_group) if self.process_group is not None else contextlib.nullcontext()
        with group:  # the ranks agree on upload and commit on the caller's group, not the default one
            write_checkpoint(self._where(), [part], self.max_shard_size, self.overwrite, files,
                             distributed=dist.active(), layouts=[data.layout], agreed=True)  # fmt: skip
        return [
            WriteResult(index=it.index, size_in_bytes=0, storage_data=None) for it in plan.items
        ]



def _dedup(plans: list[SavePlan]) -> list[SavePlan]:
    """Drop a chunk planned by several ranks from all but the first (DCP's default planner
    already does; a planner that does not would write the same bytes twice)."""
    seen: set[tuple[str, tuple[int, ...]]] = set()
    out = []
    for p in plans:
        keep = []
        for it in p.items:
            key = (it.index.fqn, tuple(it.index.offset or ()))
            if key in seen:
                continue
            seen.add(key)
            keep.append(it)
        out.append(p if len(keep) == len(p.items) else replace(p, items=keep))
    return out


def _specs_of(plans: Sequence[SavePlan], path: str) -> tuple[list[TensorSpec], list[str]]:
    """Every tensor's spec (global shape, dtype) from the ranks' write items, in first-seen order,
    and the non-tensor keys. Raises TypeError / ValueError naming the key and ranks."""
    specs: dict[str, TensorSpec] = {}
    where: dict[str, int] = {}
    volume: dict[str, int] = {}
    extra: list[str] = []
    for rank, p in enumerate(plans):
        for it in p.items:
            fqn = it.index.fqn
            if it.type == WriteItemType.BYTE_IO:
                if fqn not in extra:
                    extra.append(fqn)
                continue
            td = it.tensor_data
            try:
                spec = TensorSpec(fqn, tuple(td.size), td.properties.dtype)
            except TypeError as e:
                raise UnsavableError(fqn, f"{e} (rank {rank})", path) from e
            prev = specs.setdefault(fqn, spec)
            if prev != spec:
                raise ValueError(
                    f"saving {path}: {fqn!r} is {spec.shape} {spec.dtype} on rank {rank} but "
                    f"{prev.shape} {prev.dtype} on rank {where[fqn]}"
                )
            where.setdefault(fqn, rank)
            volume[fqn] = volume.get(fqn, 0) + math.prod(td.chunk.sizes)
    for fqn in extra:
        if fqn in specs:
            raise ValueError(f"saving {path}: {fqn!r} is a tensor on some ranks and not on others")
    holes = [k for k, s in specs.items() if volume[k] != s.numel]
    if holes:  # a hole would be committed as zeros
        raise ValueError(
            f"saving {path}: the ranks' chunks of {holes[:10]} do not add up to the tensor "
            "(elements missing or planned twice)"
        )
    return list(specs.values()), extra


def _blocks(item: WriteItem, t: torch.Tensor) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """``(local block, global element offset)`` pairs of item ``item`` whose data is ``t``."""
    chunk = item.tensor_data.chunk
    if isinstance(t, DTensor):
        t = t.to_local()
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(chunk.sizes):
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{item.index.fqn!r}: the planner resolved {shape}, its write item says {tuple(chunk.sizes)}")
    return [(t, tuple(chunk.offsets))]


def _extra_result(item: WriteItem, planner: SavePlanner) -> WriteResult:
    """A non-tensor value as an extra-state entry. DCP hands it over pickled (``torch.save``);
    unpickled only with ``weights_only=True`` (torch's safe unpickler)."""
    fqn = item.index.fqn
    try:
        buf = planner.resolve_data(item)
        raw = buf.getvalue() if isinstance(buf, io.BytesIO) else bytes(buf)
        value = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as e:  # noqa: BLE001 - named, typed below
        raise TypeError(f"{fqn!r}: a non-tensor value that DCP cannot pickle or weights_only unpickling refuses ({e}); "
                        "extra state holds numbers, str, tensors, lists and dicts") from e  # fmt: skip
    snapshot_extra_state({fqn: value})  # refused here, on the rank holding it, naming the key
    return WriteResult(index=item.index, size_in_bytes=len(raw), storage_data=ExtraValue(value))


def _nested(flat: Mapping[str, Any], mappings: Mapping[str, Any] | None) -> dict[str, Any]:
    """DCP's flattened non-tensor values back in the caller's nesting (``{"sched": {"lr": ..}}``
    from ``sched.lr``, by DCP's own ``planner_data`` paths): extra-state entries are top-level keys,
    as ``checkpoint.save(extra_state=...)`` writes them."""
    from torch.distributed.checkpoint._traverse import set_element

    out: dict[str, Any] = {}
    for k, v in flat.items():
        path = (mappings or {}).get(k) or (k,)
        set_element(out, path, v)
    return out


@dataclass
class _Written:
    """What the ranks wrote (:func:`_collect`): the tensors ``seen``, the digests of those written
    whole, the chunk-digest runs of the others and the chunks to read back by file."""

    seen: set[str]
    whole: dict[str, str]
    runs: dict[str, list[tuple[int, bytes]]]
    back: dict[str, list[tuple[str, int, int, int]]]


def _collect(results: list[list[WriteResult]]) -> tuple[dict[str, Any], _Written]:
    """Non-tensor values, and what every rank wrote and hashed of each tensor."""
    extra: dict[str, Any] = {}
    out = _Written(set(), {}, {}, {})
    for rank_results in results:
        for wr in rank_results:
            d = wr.storage_data
            if isinstance(d, ExtraValue):
                extra[wr.index.fqn] = d.value
            elif isinstance(d, Written):
                fqn = wr.index.fqn
                out.seen.add(fqn)
                if d.digest is not None:
                    out.whole.setdefault(fqn, d.digest)
                out.runs.setdefault(fqn, []).extend(d.chunks)
                out.back.setdefault(d.relative_path, []).extend(d.back)
    return extra, out



__all__ = ["StorageWriter", "Written", "ExtraValue"]
