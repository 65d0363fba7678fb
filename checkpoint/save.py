"""``save`` and ``save_streaming``: sharded safetensors checkpoints in eager FQNs, committed atomically.

One write path: a single process streams tensors one at a time through :func:`save_streaming`;
ranks holding DTensors each write only the bytes they own into the same full-tensor files
(:func:`_save_distributed`). Either way the result is Hugging Face's layout
(``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fqn import FQNMap, FQNMapFile

from . import _faults
from .atomic import StagedCheckpoint
from .errors import CheckpointError, CheckpointWriteError
from .progress import counted_fetches
from .ranks import dist
from .state import Entry, object_state
from .storage.format import (
    MODEL_PREFIX,
    OPTIMIZER_PREFIX,
    FileRecord,
    FqnckptMeta,
    IndexFile,
    IndexMetadata,
    OptimizerMeta,
    index_name,
)
from .storage.layout import Layout, TensorSpec, plan_layout
from .storage.writer import SequentialFileWriter, create_shard_file, open_shard_file, sha256_file, write_block
from .tensor_checks import check_storable


@dataclass
class _Part:
    """One indexed part of a checkpoint (``model`` or ``optimizer``)."""

    prefix: str
    specs: list[TensorSpec]
    fetch: Callable[[TensorSpec], torch.Tensor]
    alias_groups: list[list[str]] = field(default_factory=list)
    fqn_map: FQNMapFile | None = None
    optimizer: OptimizerMeta | None = None


def _index(part: _Part, layout: Layout, records: dict[str, FileRecord]) -> IndexFile:
    meta = FqnckptMeta(
        files=records,
        alias_groups=[list(g) for g in part.alias_groups],
        fqn_map=part.fqn_map,
        optimizer=part.optimizer,
    )
    return IndexFile(
        metadata=IndexMetadata(total_size=layout.total_size, fqnckpt=meta), weight_map=layout.weight_map
    )


def _check_extra_name(name: str) -> None:
    if not name or "/" in name or "\\" in name or name.startswith(".") or name.endswith(".safetensors"):
        raise ValueError(f"extra file name {name!r} must be a plain file name, not hidden, not .safetensors")
    if name.endswith(".safetensors.index.json"):
        raise ValueError(f"extra file name {name!r} is reserved for indexes")


def _fetch_checked(part: _Part, spec: TensorSpec) -> torch.Tensor:
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


def _write_indexes_and_commit(staged: StagedCheckpoint, parts, indexes: Sequence[IndexFile]) -> None:
    """Data is in place: write the index files last, then move the checkpoint into place."""
    _faults.fault_point("after_data_written")
    _faults.fault_point("before_index_write")
    for part, idx in zip(parts, indexes):
        staged.write_file(index_name(part.prefix), idx.to_json_bytes())
    _faults.fault_point("after_index_write")
    staged.commit()


def _save_parts(
    path: str, parts: Sequence[_Part], max_shard_size, overwrite: bool, extra_files: Mapping[str, bytes]
) -> list[IndexFile]:
    for name in extra_files:
        _check_extra_name(name)
    layouts = [plan_layout(p.specs, max_shard_size, p.prefix) for p in parts]
    indexes: list[IndexFile] = []
    try:
        with (
            StagedCheckpoint(path, overwrite) as st,
            ThreadPoolExecutor(1, thread_name_prefix="fqnckpt-hash") as pool,
        ):
            for part, layout in zip(parts, layouts):
                records: dict[str, FileRecord] = {}
                for fplan in layout.files:
                    w = SequentialFileWriter(os.path.join(st.dir, fplan.name), fplan, pool)
                    try:
                        _faults.fault_point("after_file_create")
                        for slot in fplan.slots:
                            w.write(slot, _fetch_checked(part, slot.spec))
                            _faults.fault_point("after_tensor_write")
                        records[fplan.name] = FileRecord(size=fplan.size, sha256=w.finish())
                    finally:
                        w.close()
                indexes.append(_index(part, layout, records))
            for name, data in extra_files.items():
                st.write_file(name, bytes(data))
            _write_indexes_and_commit(st, parts, indexes)
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointWriteError(path, f"{type(e).__name__}: {e}") from e
    return indexes


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
) -> IndexFile:
    """Save tensors one at a time, single process: plan the layout from ``specs`` only, then call
    ``fetch(spec)`` for each tensor (in file / byte order), write it and drop it. Peak memory is
    about one tensor plus one write buffer.

    ``specs``: eager FQN, global shape (elements), dtype of each tensor; ``fetch`` must return a
    plain tensor of exactly that shape and dtype (any device). ``max_shard_size``: bytes of tensor
    data per file (int, or ``"5GB"`` = 5*10**9, ``"2GiB"`` = 2*2**30). ``alias_groups``: tied names,
    canonical (stored) name first. ``extra_files``: ``{file name: bytes}`` written into the
    checkpoint directory (e.g. ``migration_report.json``) inside the same atomic commit.

    Writes ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json`` (HF layout),
    atomically (see :mod:`checkpoint.atomic`). Returns the index written.

    Raises:
        CheckpointExistsError: ``path`` exists and ``overwrite`` is False.
        CheckpointWriteError: an OS error while writing (e.g. disk full); ``path`` is untouched.
        TypeError: ``fetch`` returned a non-tensor, or a dtype safetensors cannot store.
        ValueError: a fetched tensor's shape/dtype differs from its spec; duplicate FQNs.
    """
    if isinstance(fqn_map, FQNMap):
        fqn_map = fqn_map.to_model()
    part = _Part(MODEL_PREFIX, list(specs), fetch, [list(g) for g in alias_groups], fqn_map)
    return _save_parts(os.fspath(path), [part], max_shard_size, overwrite, extra_files or {})[0]


def save(
    obj: torch.nn.Module | Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    optimizer: torch.optim.Optimizer | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
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

    ``optimizer``: also writes ``optimizer-0000k-of-0000n.safetensors`` +
    ``optimizer.safetensors.index.json`` (state by FQN, see :mod:`checkpoint.optim`); needs a module.

    ``progress``: tqdm bar on stderr, rank 0 only (``None``: only when stderr is a terminal;
    shown after 1 s).

    Returns the model index written. Raises what :func:`save_streaming` raises, and
    :class:`~checkpoint.errors.UnsupportedTensorError` naming the key for a sparse / quantized
    tensor or a dtype safetensors cannot hold, before anything is written;
    ``TypeError`` naming the key for a non-tensor value; on ranks whose peers failed,
    :class:`~checkpoint.errors.RankAgreementError`.
    """
    path = os.fspath(path)
    state = object_state(obj)
    fmap = state.fqn_map.to_model() if state.fqn_map is not None else None
    parts_entries: list[tuple[str, list[Entry], list[list[str]], FQNMapFile | None, OptimizerMeta | None]] = [
        (MODEL_PREFIX, state.entries, state.alias_groups, fmap, None)
    ]
    if optimizer is not None:
        if not isinstance(obj, torch.nn.Module):
            raise TypeError("saving an optimizer needs the nn.Module (parameters are matched by identity)")
        from .optim import optimizer_entries

        opt_entries, opt_meta = optimizer_entries(optimizer, state)
        parts_entries.append((OPTIMIZER_PREFIX, opt_entries, [], None, opt_meta))
    parts = []
    for prefix, entries, groups, fm, om in parts_entries:
        by_fqn = {e.fqn: e.tensor for e in entries}
        check_storable(((e.fqn, e.tensor) for e in entries), path)
        specs = [TensorSpec.of(e.fqn, e.tensor) for e in entries]
        parts.append(_Part(prefix, specs, lambda s, d=by_fqn: d[s.fqn], groups, fm, om))
    with counted_fetches(parts, "save", progress):  # progress hook: counts each fetched tensor
        if any(isinstance(e.tensor, DTensor) for _, es, *_ in parts_entries for e in es):
            return _save_distributed(path, parts, max_shard_size, overwrite)[0]
        return _save_parts(path, parts, max_shard_size, overwrite, {})[0]


# -- distributed ------------------------------------------------------------------------------


def _owned_block(t: torch.Tensor, index: int, fqn: str) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """The block this rank writes of tensor ``t`` and its element offset, or None.

    A DTensor's local shard is written by the rank whose coordinate is 0 on every mesh dim that
    does not shard it (one writer per replica group); a plain tensor (same on every rank) by rank
    ``index % world_size``.
    """
    if not isinstance(t, DTensor):
        return (t, (0,) * t.dim()) if index % dist.world_size() == dist.rank() else None
    if any(isinstance(p, Partial) for p in t.placements):
        t = t.redistribute(
            t.device_mesh, [Replicate() if isinstance(p, Partial) else p for p in t.placements]
        )
    if any(type(p) not in (Shard, Replicate) for p in t.placements):  # e.g. _StridedShard
        raise NotImplementedError(
            f"{fqn!r}: placements {t.placements} are not supported for saving (Shard/Replicate only)"
        )
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return None
    for d, p in enumerate(t.placements):
        if not isinstance(p, Shard) and coord[d] != 0:
            return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t.to_local()
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(
            f"{fqn!r}: local shard of shape {tuple(local.shape)} differs from the expected {tuple(shape)}"
        )
    return local, tuple(offset)


def _save_distributed(path: str, parts: Sequence[_Part], max_shard_size, overwrite: bool) -> list[IndexFile]:
    if not dist.active():
        raise RuntimeError("DTensor parameters need an initialized process group to save")
    rank, world = dist.rank(), dist.world_size()
    layouts = [plan_layout(p.specs, max_shard_size, p.prefix) for p in parts]
    fingerprint = [tuple((f.name, f.header) for f in lay.files) for lay in layouts]
    if len(set(map(hash, map(tuple, dist.all_gather_object(fingerprint))))) != 1:
        raise CheckpointError(f"saving {path}: ranks planned different layouts (different models or dtypes?)")
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
            _faults.fault_point("after_file_create")
        except BaseException as e:  # noqa: BLE001 - agreed below, re-raised on every rank
            err = (
                e
                if not isinstance(e, OSError) or isinstance(e, CheckpointError)
                else CheckpointWriteError(path, str(e), 0)
            )
    try:
        dist.check_all(f"preparing {path}", err)
        staging_dir = dist.broadcast_object(staging_dir)
        err = None
        try:
            for part, lay in zip(parts, layouts):
                for f in lay.files:
                    fd = None
                    try:
                        for i, slot in enumerate(f.slots):
                            block = _owned_block(
                                _fetch_any(part, slot.spec), _base(lay, f) + i, slot.spec.fqn
                            )
                            if block is None:
                                continue
                            fd = fd if fd is not None else open_shard_file(os.path.join(staging_dir, f.name))
                            write_block(fd, slot, *block)
                            _faults.fault_point("after_tensor_write")
                    finally:
                        if fd is not None:
                            os.close(fd)
        except BaseException as e:  # noqa: BLE001
            err = (
                CheckpointWriteError(path, f"{type(e).__name__}: {e}", rank) if isinstance(e, OSError) else e
            )
        dist.check_all(f"writing {path}", err)
        # Every file is fsynced and hashed by one rank (fsync flushes all ranks' pages of the file).
        err, mine = None, {}
        try:
            for j, (_, f) in enumerate(files):
                if j % world == rank:
                    p = os.path.join(staging_dir, f.name)
                    fd = os.open(p, os.O_RDONLY)
                    try:
                        _faults.fault_point("before_file_fsync")
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    _faults.fault_point("after_file_fsync")
                    mine[f.name] = FileRecord(size=os.path.getsize(p), sha256=sha256_file(p))
        except BaseException as e:  # noqa: BLE001
            err = (
                CheckpointWriteError(path, f"{type(e).__name__}: {e}", rank) if isinstance(e, OSError) else e
            )
        dist.check_all(f"hashing {path}", err)
        records: dict[str, FileRecord] = {}
        for d in dist.all_gather_object(mine):
            records.update(d)
        indexes = [
            _index(part, lay, {f.name: records[f.name] for f in lay.files})
            for part, lay in zip(parts, layouts)
        ]
        err = None
        if rank == 0:
            try:
                _write_indexes_and_commit(staged, parts, indexes)
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


def _base(lay: Layout, f) -> int:
    """Index of the first slot of file ``f`` within its layout (spreads plain tensors over ranks)."""
    n = 0
    for g in lay.files:
        if g is f:
            return n
        n += len(g.slots)
    return n


def _fetch_any(part: _Part, spec: TensorSpec) -> torch.Tensor:
    t = part.fetch(spec)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"value of {spec.fqn!r} is a {type(t).__name__}, not a tensor")
    if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
        raise ValueError(f"{spec.fqn!r} is {tuple(t.shape)} {t.dtype}, planned {spec.shape} {spec.dtype}")
    return t
