"""The apply stage: carry out a checked :class:`~checkpoint.plan.actions.LoadPlan`. Only reads
and writes remain here (bytes read from the source, copied into the targets)."""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from .errors import CheckpointError, LoadError
from .plan.actions import CopyAction, LoadPlan
from .plan.model import owner_slot
from .plan.values import file_of_key, read_target_block
from .ranks import shards
from .reports import LoadReport
from .state import object_state
from .storage.format import OPTIMIZER_PREFIX, index_name
from .storage.reader import CheckpointReader
from .storage.tensor_read import release_scratch


@torch.no_grad()
def apply_load(
    plan: LoadPlan,
    obj: torch.nn.Module | Mapping[str, torch.Tensor],
    reader: CheckpointReader,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    dtype: torch.dtype | None = None,
    on_copy: Callable[[str], None] | None = None,
) -> LoadReport:
    """Carry out a checked :class:`LoadPlan`: ``module.to(dtype)``, the copies (or replacements),
    the optimizer state. Only reads and writes remain here; a failure of torch or the OS (e.g. the
    file vanishes from under a mapping) is a :class:`LoadError` naming key and file. The digests
    were checked first (:func:`check_reads`); a reader without ``check_first`` checks each
    tensor as it is read."""
    copies = plan.copies
    if dtype is not None:
        try:
            obj.to(dtype)
        except Exception as e:  # noqa: BLE001
            raise LoadError(f"module.to({dtype})", reader.root, f"{type(e).__name__}: {e}") from e
        # Buffers are new tensors now (parameters keep their identity): find each target again.
        fresh = object_state(obj).by_name()
        copies = [CopyAction(fresh[a.entry.fqn], a.key, a.dtype, a.assign, a.stored_dtype) for a in copies]
    replaced: dict[int, torch.Tensor] = {}
    try:
        _apply_copies(copies, obj, reader, on_copy, replaced)
    finally:
        release_scratch()
    if optimizer is not None and plan.optimizer_state is not None:
        if replaced:
            for g in optimizer.param_groups:
                g["params"] = [replaced.get(id(p), p) for p in g["params"]]
        try:
            apply_optimizer(optimizer, plan.optimizer_state)
        except Exception as e:  # noqa: BLE001
            raise LoadError(
                "optimizer state",
                os.path.join(reader.root, index_name(OPTIMIZER_PREFIX)),
                f"{type(e).__name__}: {e}",
            ) from e
        plan.report.optimizer_loaded = True
    return plan.report


def _apply_copies(copies, obj, reader, on_copy, replaced: dict[int, torch.Tensor]) -> None:
    """The copies of :func:`apply_load` (straight reads first, then one by one)."""
    # hashed by another rank (check_reads): only DTensor targets have any
    others = _checks(reader, copies)[2] if any(isinstance(a.entry.tensor, DTensor) for a in copies) else set()
    direct = _read_direct(reader, copies, on_copy, others)
    for a in copies:
        if id(a) in direct:
            continue  # same dtype, contiguous CPU target: bytes read straight into it
        if on_copy is not None:
            on_copy(a.key)  # progress
        try:
            t = a.entry.tensor
            if not a.assign and not isinstance(t, DTensor) and reader.read_into(a.key, t):
                continue
            if not a.assign and _copy_into(reader, a.key, t, a.key not in others):
                continue  # converted / strided / sharded: through a window, no whole-size tensor
            src = read_target_block(reader, a.key, t)
            if a.assign:
                replaced.update(_assign(obj, a, src))
            elif isinstance(t, DTensor):
                local = t.to_local()
                if local.numel():
                    local.copy_(src)
            else:
                t.copy_(src)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - torch / OS errors are named by key and file
            raise LoadError(a.key, file_of_key(reader, a.key), f"{type(e).__name__}: {e}") from e


def check_reads(reader, copies: list[CopyAction]) -> dict[str, dict[int, bytes]]:
    """The load's data check, run before any target is written (``reader.check_first``): every
    tensor this rank reads whole or passes whole through memory is hashed and compared with the
    index; for a DTensor target whose placements shard dim 0 (``Shard(0)``,
    ``_StridedShard(0)``) and a checkpoint with format-3 chunk digests, the chunks starting in this
    rank's rows are hashed and returned, ``{key: {chunk index: digest}}``, for the load to gather
    from every rank and check (:meth:`CheckpointReader.check_chunks`) before it copies. A tensor
    every rank of a mesh reads the same bytes of (``Replicate``, ``Shard(1)``, or ``Shard(0)``
    without chunk digests) is hashed by one mesh rank in turn (:func:`_checker`): the load's
    agreement raises its mismatch on every rank. Readers without digests check nothing.

    Raises:
        CorruptCheckpointError: a tensor this rank hashed whole differs from its digest (file and
            tensor named), before any target changed.
    """
    check_first = getattr(reader, "check_first", None)
    if check_first is None:
        return {}
    whole, rows, _ = _checks(reader, copies)
    return check_first(whole, rows)


def _checks(reader, copies: list[CopyAction]) -> tuple[list[str], dict[str, list[tuple[int, int]]], set[str]]:
    """``(whole, rows, others)`` of :func:`check_reads`: the keys this rank hashes whole, the byte
    ranges of its ``Shard(0)`` rows per key, and the keys another rank of the mesh hashes."""
    chunk = getattr(reader, "digest_chunk", None)
    whole: list[str] = []
    rows: dict[str, list[tuple[int, int]]] = {}
    others: set[str] = set()
    for a in copies:
        t = a.entry.tensor
        if not isinstance(t, DTensor) or not t.dim():
            whole.append(a.key)
            continue
        if chunk and any(getattr(p, "dim", None) == 0 for p in t.placements):
            row = reader.spec(a.key).nbytes // t.shape[0] if t.shape[0] else 0
            spans = rows.setdefault(a.key, [])
            for _, gsl in shards.local_blocks(t):
                lo, hi, _ = gsl[0].indices(t.shape[0])
                spans.append((lo * row, hi * row))
            continue
        (whole.append(a.key) if _checker(t, a.key) else others.add(a.key))
    return whole, rows, others


def _checker(t: DTensor, key: str) -> bool:
    """Whether this rank hashes tensor ``key``, whose bytes every rank of ``t``'s mesh reads: the
    mesh rank ``crc32(key) % mesh size``, a choice every rank of the mesh makes alike from the key
    alone, whatever else each rank loads (a count over each rank's own copies would differ
    between ranks with different copies, and then no rank might check it)."""
    mesh = t.device_mesh
    size = mesh.size()
    if size <= 1:
        return True
    coord = mesh.get_coordinate()
    return coord is not None and int(np.ravel_multi_index(tuple(coord), tuple(mesh.shape))) == zlib.crc32(key.encode()) % size


class _AllBut:
    """A container holding every key but ``skip`` (``read_many``'s ``check``)."""

    def __init__(self, skip: set[str]):
        self.skip = skip

    def __contains__(self, key: object) -> bool:
        return key not in self.skip

    def __bool__(self) -> bool:
        return True


def _read_direct(reader, copies: list[CopyAction], on_copy, others: set[str] = frozenset()) -> set[int]:
    """The copies read straight into their targets by one ``reader.read_many`` (readers that
    have it: adjacent tensors in one ``preadv``); ids of the copies done. A DTensor
    target's local shard is read block by block where each block is one contiguous byte range of
    the file (a ``Shard(0)`` row block is): one copy, page cache -> local shard, instead of
    ``get_slice`` into a new tensor and ``copy_`` into the shard (two copies).
    Tensors read whole are checked against their digests (a no-op for those :func:`check_reads`
    checked first), but those of ``others`` (hashed by another rank)."""
    read_many = getattr(reader, "read_many", None)
    if read_many is None:
        return set()
    items: list[tuple] = []
    owner: list[CopyAction] = []
    for a in copies:
        t = a.entry.tensor
        if a.assign:
            continue
        if not isinstance(t, DTensor):
            items.append((a.key, t))
            owner.append(a)
            continue
        if not t.dim() or a.dtype != a.stored_dtype:
            continue
        try:
            blocks = list(shards.local_blocks(t))
        except Exception:  # noqa: BLE001 - the block read below names it (key, file)
            continue
        local = t._local_tensor
        for lsl, gsl in blocks:
            items.append((a.key, local[lsl], gsl))
            owner.append(a)
    if not items:
        return set()
    check = _AllBut(others) if others else True
    # Targets on an accelerator go through pinned host buffers (checkpoint.device_load).
    # (is_cpu first: ~0.1 us a tensor where device.type costs ~0.8 us, and loads take 10^5 tensors)
    on_device = [i for i, it in enumerate(items) if not it[1].is_cpu and not it[1].is_meta]
    if on_device:
        from .device_load import read_to_device

        moved = set(on_device)
        host = [i for i in range(len(items)) if i not in moved]
        done = [False] * len(items)
        for i, ok in zip(host, read_many([items[i] for i in host], check) if host else []):
            done[i] = ok
        for i, ok in zip(on_device, read_to_device(reader, [items[i] for i in on_device])):
            done[i] = ok
    else:
        done = read_many(items, check)  # its errors name key and file
    if all(done):  # the common case: every target read straight
        out = set(map(id, owner))
    else:
        missed = {id(a) for a, ok in zip(owner, done) if not ok}
        out = {id(a) for a in owner if id(a) not in missed}
    if on_copy is not None:
        for a in copies:
            if id(a) in out:
                on_copy(a.key)  # progress
    return out


def _copy_into(reader, key: str, t: torch.Tensor, mine: bool = True) -> bool:
    """``reader.copy_into`` (a local window, or ranged GETs) for a target read neither straight nor replaced:
    a plain CPU tensor whole, a DTensor's CPU local shard block by block; False when the reader
    or the target cannot (then the block is read whole and copied). ``check`` is passed where the
    block holds every row (a plain target, ``Replicate``, ``Shard(1)``), once per rank (``mine``:
    False when another rank checks it): a no-op after :func:`check_reads`, the check of a reader
    without ``check_first``."""
    copy = getattr(reader, "copy_into", None)
    if copy is None or t.is_meta:
        return False
    if not isinstance(t, DTensor):
        return t.is_cpu and copy(key, t, check=True)  # all its bytes pass through: digest checked
    local = t._local_tensor
    if not local.is_cpu or not t.dim():
        return False
    if not local.numel():
        return True
    blocks = list(shards.local_blocks(t))
    hashed = not mine  # one whole-tensor check (copy_into hashes a block of every row)
    for lsl, gsl in blocks:
        rows = _all_rows(gsl, t.shape)
        copy(key, local[lsl], gsl, check=rows and not hashed)
        hashed = hashed or rows
    return True


def _all_rows(gsl, shape) -> bool:
    """Whether global block ``gsl`` (slices) of a tensor of ``shape`` holds every dim-0 row."""
    return len(shape) >= 1 and (not gsl or gsl[0].indices(shape[0])[:2] == (0, shape[0]))


def _assign(obj, a: CopyAction, src: torch.Tensor) -> dict[int, torch.Tensor]:
    """Replace target ``a.entry`` (every name of it) with the checkpoint value, in the target's
    dtype and device (CPU for meta), keeping Parameter-ness and ``requires_grad`` (torch's
    ``load_state_dict(assign=True)``). Returns {id(old parameter): new parameter}."""
    old = a.entry.tensor
    device = torch.device("cpu") if old.is_meta else old.device
    value = src.to(device=device, dtype=a.dtype)
    if value is src:
        value = src.clone()  # never share memory with the reader's mapping
    if not isinstance(obj, torch.nn.Module):
        for n in a.entry.module_names:
            obj[n] = value
        return {}
    new = (
        torch.nn.Parameter(value, requires_grad=old.requires_grad)
        if isinstance(old, torch.nn.Parameter)
        else value
    )
    for n in a.entry.module_names:
        owner, slots, attr = owner_slot(obj, n)
        getattr(owner, slots)[attr] = new
    return {id(old): new} if new is not value else {}


def apply_optimizer(optimizer: torch.optim.Optimizer, planned: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(planned)`` (``planned`` from :func:`plan_optimizer`)."""
    optimizer.load_state_dict(planned)
