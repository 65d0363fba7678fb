"""``StorageReader``: DCP's ``StorageReader`` interface over fqnckpt's readers.

What it reads (:func:`_open_source`):

- an fqnckpt or Hugging Face checkpoint: a directory with ``model.safetensors.index.json`` (the
  index is authoritative: only the files it names are read, through
  :func:`checkpoint.open_checkpoint`, which validates every header and path, hub-cache snapshots
  included), a directory with one ``model.safetensors``, one ``.safetensors`` file, or a URL;
  ``extra_state.json`` entries come back as DCP's non-tensor values (a rank's ``PerRank``
  entries on the same world size), tied names fqnckpt stored once (its alias groups) under every
  name, and ``checkpoint.save``'s optimizer part under ``get_optimizer_state_dict``'s keys
  (``state.<fqn>.<name>``, ``param_groups``);
- torch's ``HuggingFaceStorageWriter(save_distributed=True)`` output without consolidation: the
  per-rank ``shard-0000r-model-0000k-of-0000n.safetensors`` files (in the directory or its
  ``sharded/`` folder), each tensor's chunks placed by the ``DCP_SHARDING_INFO`` offsets in
  their headers, and checked to cover each tensor exactly;
- a directory of ``.safetensors`` files without an index (what ``safetensors.save_file`` or a
  rank-0 DCP save leaves): every file, a tensor stored in two files refused
  (:class:`~checkpoint.errors.DuplicateTensorError`) rather than one silently chosen.

Quantized weights of a checkpoint read whole (DeepSeek-style FP8 blocks with
``weight_scale_inv``, MXFP4 ``*_blocks`` / ``*_scales``: :mod:`checkpoint.convert.quant`) are
described and read dequantized as torch's ``QuantizedHuggingFaceStorageReader`` does (float32 in
the metadata, converted to each target's dtype; an FP8 target of an FP8 weight receives the
stored bytes), each rank reading only the FP8 rows / columns and scale blocks of its items.

``read_metadata`` describes each tensor as DCP's ``TensorStorageMetadata`` (global size, dtype,
stored chunks), so DCP's planners reshard onto any mesh and placements; ``read_data`` reads each
read item's block straight into its target where the bytes are one range of the file
(``preadv``), else through one reused window of whole rows (``CheckpointReader.copy_into``),
converting dtype on copy; no file is mapped. A target
DTensor with ``_StridedShard`` placements is filled block by block from
:func:`checkpoint.ranks.shards.local_blocks` (DCP's default planner places its local shard at
its first row only, which would load wrong values without an error). A column block
(``Shard(1)``) goes through the package's one block read (``CheckpointReader.copy_into``:
:func:`checkpoint.storage.tensor_read.copy_into`): each rank reads the block's whole rows, where
torch's reader copies its columns out of a mapping; about the same CPU time, without a mapping
that a file cut short turns into SIGBUS (a SIGBUS-safe read from a private mapping through
``process_vm_readv`` pins a page per run and is several times slower).

Integrity, before any target is written: a tensor read whole, or through all of its rows, is
checked against the index's xxh3-128 digest by one rank (the coordinator assigns each such tensor
to one of the ranks reading it); a tensor read only in row blocks (``Shard(0)``,
``_StridedShard(0)``, a 2-D mesh's blocks) is checked from its format-3 digest chunks, the
coordinator giving each chunk to exactly one rank (one whose rows hold it); on the whole default
process group the ranks then agree their outcomes and those chunk digests in one ``all_reduce``
of ``int64`` slots, so a mismatch found by any rank raises
:class:`~checkpoint.errors.CorruptCheckpointError` naming file and tensor on every rank before one
of them copies a byte. On a subgroup (DCP does not hand its
group to storage readers, so the ranks cannot exchange) each rank checks every tensor it reads
any block of, whole, before its own copies. Ranks that opened different checkpoints (an overwrite landing while they opened
it) are refused the same way instead of loading a mix.
"""

from __future__ import annotations

import contextlib

import io
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint import storage as dcp_storage
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.futures import Future

from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DuplicateTensorError,
    MetaTargetError,
    UnknownReadItemError,
    UnsupportedTensorError,
    UnwritableTargetError,
)
from ..plan.values import cast_problem, target_problem
from ..ranks import shards
from ..storage.format import OPTIMIZER_PREFIX, index_name
from ..storage.location import local_path, shown
from ..storage.views import checkpoint_view
from .location import Located

_DCP_SHARD = re.compile(r"^shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors$")
_SHARDING_KEY = "DCP_SHARDING_INFO"  # torch/distributed/checkpoint/_hf_utils.py
_OFFSETS_KEY = "saved_offsets"
# Meta targets: with a process group, DCP's DefaultLoadPlanner replaces them in the state_dict
# by tensors on the group's device before any read (torch's FileSystemReader and this reader
# alike); without one, torch's planner itself fails (it asks the default group for a device).
# A planner that leaves them meta would make every copy a no-op: refused by name instead.
_META_HOW = (
    "DCP's default planner replaces meta targets by new tensors only under an initialized process "
    "group; materialize them first (module.to_empty(device=...)) or load with a process group"
)


@dataclass(frozen=True)
class StoredChunk:
    """``Metadata.storage_data`` of one stored chunk: tensor ``key`` of reader number ``reader``,
    placed at element ``offsets`` of the global tensor, of ``shape``."""

    reader: int
    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ChecksPlan:
    """``LoadPlan.storage_data`` the coordinator gives each rank (:meth:`StorageReader.prepare_global_plan`):
    ``mine``, the ``(reader, key)`` of the tensors this rank checks whole; ``rows``, ``((reader,
    key), ((begin, end), ...))``: the byte ranges of tensors no rank reads whole whose format-3
    digest chunks this rank hashes (each chunk of them by exactly one rank); ``layout``, every
    such tensor, in one order on every rank (the slots of the exchange); ``exchange``: whether
    the ranks agree their outcomes and gather those chunk digests before any copy (on the
    default process group, which this load runs on all of)."""

    mine: frozenset
    rows: tuple = ()
    layout: tuple = ()
    exchange: bool = False


@dataclass(frozen=True)
class StoredExtra:
    """``Metadata.storage_data`` of a non-tensor value (an ``extra_state.json`` entry)."""

    key: str


def _confirm(readers: list, what: str) -> None:
    """``reader.confirm_unchanged()`` (or ``confirm_copied``) of every reader that has it."""
    for r in readers:
        confirm = getattr(r, what, None)
        if confirm is not None:
            confirm()


class _Source:
    """Open readers and, per tensor, its chunks; the extra-state values."""

    def __init__(self, where: str, readers: list, chunks: dict[str, list[StoredChunk]], extra: dict[str, Any]):
        # Extra-state entries are nested values ({"sched": {"lr": ..}}); DCP flattens the
        # caller's state_dict the same way (torch's flatten_state_dict): "sched.lr".
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        self.extra, self.paths = flatten_state_dict(extra) if extra else ({}, {})
        # torch's flatten stops at a list holding no tensor: [None, 3] once the tensor slot went to
        # the shard files. The loading caller's list still holds its tensor, so DCP flattens it to
        # "m.l.0" (tensor) and "m.l.1": such a list is offered element by element, as the caller has it.
        def expand(key: str, path: tuple, v: Any) -> None:
            if isinstance(v, list) and any(c.startswith(key + ".") for c in chunks):
                del self.extra[key], self.paths[key]
                for i, x in enumerate(v):
                    k = f"{key}.{i}"
                    if k not in chunks:
                        self.extra[k], self.paths[k] = x, (*path, i)
                        expand(k, (*path, i), x)

        for k in list(self.extra):
            if k in chunks:  # the None left where the tensor was: the tensor is in the shard files
                del self.extra[k], self.paths[k]
            else:
                expand(k, tuple(self.paths.get(k, (k,))), self.extra[k])
        self.where, self.readers, self.chunks = where, readers, chunks
        self.local = not any(getattr(r, "store", None) is not None for r in readers)

    def dtype(self, key: str) -> torch.dtype:
        c = self.chunks[key][0]
        return self.readers[c.reader].spec(c.key).dtype

    def read_global(self, key: str, gsl: Sequence[slice], dtype: torch.dtype) -> torch.Tensor:
        """Block ``tensor[gsl]`` of ``key`` (global step-1 slices) assembled from its chunks."""
        shape = [s.stop - s.start for s in gsl]
        out = torch.empty(shape, dtype=dtype)
        for c in self.chunks[key]:
            inter = []
            for s, o, n in zip(gsl, c.offsets, c.shape):
                lo, hi = max(s.start, o), min(s.stop, o + n)
                if lo >= hi:
                    break
                inter.append((lo, hi, o, s.start))
            else:
                src = self.readers[c.reader].get_slice(c.key, [slice(lo - o, hi - o) for lo, hi, o, _ in inter]) \
                    if inter else self.readers[c.reader].get(c.key)  # fmt: skip
                out[tuple(slice(lo - b, hi - b) for lo, hi, _, b in inter)] = src
        return out

    def close(self) -> None:
        for r in self.readers:
            r.close()
        self.readers = []


class StorageReader(Located, dcp_storage.StorageReader):
    """DCP ``StorageReader`` of fqnckpt / Hugging Face checkpoints and DCP's HF output (see the
    module docstring): ``dcp.load(state_dict, storage_reader=StorageReader(path))``.

    ``path``: a directory, a ``.safetensors`` file or a URL (``storage_options`` / ``transfer``
    as for :func:`checkpoint.load`); DCP's ``checkpoint_id`` replaces it when given. Keys are
    matched exactly as DCP's planner does (a DCP load raises on a missing key unless
    ``DefaultLoadPlanner(allow_partial_load=True)``).

    Raises (from ``read_metadata``, on every rank): what :func:`checkpoint.open_checkpoint` raises
    (``CheckpointNotFoundError``, ``MissingShardError``, ``UnsafePathError``,
    ``TensorNotInShardError``, ``DuplicateTensorError``, ``CorruptCheckpointError``);
    ``DuplicateTensorError`` for a tensor in two files without DCP sharding offsets;
    ``CorruptCheckpointError`` when DCP shard files do not cover a tensor exactly. From
    ``read_data``: ``UnknownReadItemError`` (a ``KeyError`` too) naming a read item's key and
    offsets that the checkpoint's metadata lacks, before anything is read; ``LoadError`` naming
    key and file when a read fails; ``MetaTargetError``
    naming every target still on the meta device, before anything is read (meta targets load as
    with torch's ``FileSystemReader``: under a process group DCP's default planner replaces them
    by tensors on the group's device; without one torch's planner raises before any reader runs).
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        transfer: Any = None,
    ) -> None:
        super().__init__()
        self._locate(path, storage_options, transfer)
        self.storage_data: dict[MetadataIndex, Any] = {}
        self.is_coordinator = False
        self._source: _Source | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._close()
        self._relocate(checkpoint_id)
        self.storage_data = {}

    def read_metadata(self) -> Metadata:
        """Every stored tensor as ``TensorStorageMetadata`` (global size, dtype, chunks) and every
        extra-state entry as ``BytesStorageMetadata``. Reads headers and indexes only."""
        src = self._open()
        sdm: dict[str, Any] = {}
        storage: dict[MetadataIndex, Any] = {}
        for key, chunks in src.chunks.items():
            size = [max(c.offsets[d] + c.shape[d] for c in chunks) for d in range(len(chunks[0].shape))]
            sdm[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=src.dtype(key)),
                size=torch.Size(size),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.shape)) for c in chunks],
            )
            for c in chunks:
                storage[MetadataIndex(key, torch.Size(c.offsets))] = c
        for key in src.extra:
            sdm[key] = BytesStorageMetadata()
            storage[MetadataIndex(key)] = StoredExtra(key)
        self.storage_data = storage
        planner_data = {k: (k,) for k in src.chunks} | src.paths
        md = Metadata(state_dict_metadata=sdm, storage_data=storage, planner_data=planner_data)
        md.storage_meta = StorageMeta(checkpoint_id=self.path, load_id=self.run_id)
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if metadata.storage_data:
            self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """This rank's plan, carrying which checkpoint this rank opened (:func:`_identity`) for
        the coordinator to compare."""
        return replace(plan, storage_data=_identity(self._open()))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: give each rank the stored tensors it checks against the index's digests
        (``LoadPlan.storage_data``, a :class:`ChecksPlan`): each tensor some rank reads whole (or
        all of its rows, a column block) is checked by one of those ranks, the one with the fewest
        bytes to check so far, so no tensor is hashed twice; a tensor read only in row blocks
        (``Shard(0)``) is checked from its format-3 digest chunks, each hashed by one rank
        (:func:`_share_chunks`: a rank whose rows hold the chunk's first byte) and gathered before
        any copy; one of a single chunk, without chunk digests (format 2) or dequantized, whole by
        one rank reading a block of it. Without the whole default process group (no exchange)
        each rank checks every tensor it reads any block of, whole.

        Raises :class:`~checkpoint.errors.CorruptCheckpointError` (on every rank, through DCP)
        when the ranks opened different checkpoints (a path per rank, or a save replaced it while
        they opened it): each rank would load another one's values."""
        seen = [p.storage_data for p in plans]
        if len({x for x in seen if x is not None}) > 1:
            first = next(x for x in seen if x is not None)
            other = [r for r, x in enumerate(seen) if x is not None and x != first]
            raise CorruptCheckpointError(
                str(self.path),
                f"ranks {other} opened another checkpoint than rank {seen.index(first)}: a StorageReader per "
                "rank with its own path, or a save replaced it during this load (each rank would load "
                "another one's values); give every rank the same path and load again",
            )
        src = self._open()
        readers_of: dict[tuple[int, str], set[int]] = {}
        size: dict[tuple[int, str], int] = {}  # bytes
        # Tensors read in blocks of some rows (Shard(0), a 2-D mesh's (Shard(0), Shard(1)) block):
        # (rank, begin, end) of the bytes of the rows each rank's item holds.
        spans: dict[tuple[int, str], list[tuple[int, int, int]]] = {}
        for r, p in enumerate(plans):
            for it in p.items:
                c = self.storage_data.get(it.storage_index) if it.type != LoadItemType.BYTE_IO else None
                if not isinstance(c, StoredChunk):
                    continue
                lengths, offsets = tuple(it.lengths), tuple(it.storage_offsets)
                every_row = len(c.shape) >= 2 and offsets[0] == 0 and lengths[0] == c.shape[0]
                item = src.readers[c.reader].spec(c.key).dtype.itemsize
                if lengths == c.shape or every_row:
                    readers_of.setdefault((c.reader, c.key), set()).add(r)
                    size[(c.reader, c.key)] = math.prod(c.shape) * item
                elif c.shape:
                    row = math.prod(c.shape[1:]) * item
                    lo, hi = offsets[0] * row, (offsets[0] + lengths[0]) * row
                    spans.setdefault((c.reader, c.key), []).append((r, lo, hi))
        load = [0] * len(plans)
        mine: list[set[tuple[int, str]]] = [set() for _ in plans]
        for k, ranks in readers_of.items():
            r = min(ranks, key=lambda r: (load[r], r))
            load[r] += size[k]
            mine[r].add(k)
        exchange = _whole_world(len(plans))  # every rank's checks agreed before any target is written
        if not exchange:  # each rank checks every tensor it reads, whole (_check_first)
            return [replace(p, storage_data=ChecksPlan(frozenset(m))) for p, m in zip(plans, mine)]
        # Tensors no rank reads whole: their digest chunks shared out, each hashed by one rank,
        # and gathered before any copy (_check_first, _agree, CheckpointReader.check_chunks). A
        # tensor of one chunk, without chunk digests (format 2) or dequantized is hashed whole by
        # one rank reading a block of it.
        rows: list[dict[tuple[int, str], list[tuple[int, int]]]] = [{} for _ in plans]
        layout = []
        for rk in sorted(set(spans) - set(readers_of)):
            rd, k = rk
            reader = src.readers[rd]
            if not hasattr(reader, "check_first") or reader.recorded_digest(k) is None:
                continue
            nbytes, chunk = reader.spec(k).nbytes, reader.digest_chunk
            deq = getattr(reader, "dequantized", None)
            if not chunk or nbytes <= chunk or (deq is not None and deq(k) is not None):
                r = min({r for r, _, _ in spans[rk]}, key=lambda r: (load[r], r))
                load[r] += nbytes
                mine[r].add(rk)
                continue
            layout.append(rk)
            for r, lo, hi in _share_chunks(nbytes, chunk, spans[rk], len(plans)):
                rows[r].setdefault(rk, []).append((lo, hi))
                load[r] += hi - lo
        shares = [tuple((rk, tuple(v)) for rk, v in w.items()) for w in rows]
        every = tuple(layout)
        return [
            replace(p, storage_data=ChecksPlan(frozenset(m), w, every, True))
            for p, m, w in zip(plans, mine, shares)
        ]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` into the planner's targets (see module docstring); the
        future is already complete."""
        src = self._open()
        try:
            for item in plan.items:
                _check_known(src, self.storage_data, item)
            with contextlib.ExitStack() as span:  # the check and the copies under one lease per file
                for r in src.readers:
                    if hasattr(r, "reading"):
                        span.enter_context(r.reading())
                self._check_first(src, plan, planner, _checks_of(plan))
                _confirm(src.readers, "confirm_unchanged")  # no file rewritten since its check
                self._read(src, plan, planner)
                _confirm(src.readers, "confirm_copied")
        finally:
            self._close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- helpers -------------------------------------------------------------------------------
    def _open(self) -> _Source:
        if self._source is None:
            self._source = _open_source(self._where())
        return self._source

    def _close(self) -> None:
        if self._source is not None:
            self._source.close()
            self._source = None

    def __del__(self) -> None:
        try:
            self._close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_source"] = None
        return state

    def _check_first(self, src: _Source, plan: LoadPlan, planner: LoadPlanner, checks: ChecksPlan | None) -> None:
        """Every digest this rank checks, before any target is written (``check_first`` of each
        reader). With ``checks.exchange`` (a load on the whole default process group): the
        tensors the coordinator gave it (``checks.mine``) whole and the digest chunks it gave it
        of the tensors no rank reads whole (``checks.rows``); the ranks then agree every rank's
        outcome and those chunk digests (:func:`_agree`), each rank checks the same combined
        digests, and a rank whose check failed stops every rank before its first write. Without
        it (no coordinator, or a subgroup): every tensor this rank reads any block of, whole.

        Raises:
            CorruptCheckpointError: a digest differs (file and tensor named), on this rank or,
                with the exchange, on any rank (its error's text named, with the rank).
        """
        whole: dict[int, list[str]] = {}
        rows: dict[int, dict[str, list[tuple[int, int]]]] = {}
        agreed = checks is not None and checks.exchange
        if agreed:  # the coordinator's share: whole tensors, and digest chunks of row-read ones
            for rd, k in sorted(checks.mine):
                whole.setdefault(rd, []).append(k)
            for (rd, k), ranges in checks.rows:
                rows.setdefault(rd, {})[k] = list(ranges)
        else:  # no rank can stop another: each checks every tensor it reads any of, whole
            for item in plan.items:
                c = self.storage_data.get(item.storage_index) if item.type != LoadItemType.BYTE_IO else None
                if isinstance(c, StoredChunk):
                    whole.setdefault(c.reader, []).append(c.key)
        digests: dict[tuple[int, str], dict[int, bytes]] = {}
        err: BaseException | None = None
        try:
            for r in sorted(set(whole) | set(rows)):
                check = getattr(src.readers[r], "check_first", None)
                if check is not None:
                    digests.update(((r, k), d) for k, d in check(whole.get(r, ()), rows.get(r)).items())
        except BaseException as e:  # noqa: BLE001 - raised after the exchange every rank joins
            err = e
        if not agreed:
            if err is not None:
                raise err
            return
        for (rd, k), chunks in zip(checks.layout, _agree(src, checks.layout, digests, err)):
            reader = src.readers[rd]
            if chunks is None:  # not every chunk hashed once (a rank skipped one): checked whole here
                reader.check_first([k])
            else:
                reader.check_chunks(k, chunks)

    def _read(self, src: _Source, plan: LoadPlan, planner: LoadPlanner) -> None:
        # The digests were checked first (_check_first): a reader with ``check_first`` hashes
        # nothing here; one without it checks what it reads whole, as it reads.
        checks = _checks_of(plan)
        assigned = checks.mine if checks is not None else None
        # Every target checked before the first read or write, as checkpoint.load does
        # (plan.values.target_problem): an expand()ed target failed mid-load in copy_ with a bare
        # RuntimeError; an inference tensor was written behind torch's back (torch's own readers
        # refuse it in copy_). Non-tensor values and scattered DTensors are applied after.
        inference = torch.is_inference_mode_enabled()
        meta: list[str] = []  # targets DCP's planner left on the meta device (see _META_HOW)
        later: list[ReadItem] = []
        pending: dict[int, list[tuple[ReadItem, torch.Tensor, tuple | None]]] = {}
        for item in plan.items:
            fqn = item.dest_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                later.append(item)
                continue
            dt = _planned(planner, fqn)
            if isinstance(dt, torch.Tensor) and dt.is_meta:
                meta.append(fqn)
                continue
            if _scattered(dt):
                why = target_problem(dt._local_tensor, inference)
                if why is not None:
                    raise UnwritableTargetError(fqn, src.where, why)
                later.append(item)
                continue
            c = self.storage_data[item.storage_index]
            target = planner.resolve_tensor(item).detach()
            why = target_problem(target, inference)
            if why is not None:
                raise UnwritableTargetError(fqn, src.where, why)
            if tuple(target.shape) != tuple(item.lengths):
                raise CorruptCheckpointError(
                    src.where, f"{fqn!r}: read item of {tuple(item.lengths)} for a target of {tuple(target.shape)}"
                )
            why = cast_problem(src.dtype(c.key), target.dtype)  # float4_e2m1fn_x2: same dtype only
            if why is not None:
                raise UnsupportedTensorError(src.where, fqn, why)
            slices = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
            whole = tuple(item.lengths) == c.shape
            pending.setdefault(c.reader, []).append((item, target, None if whole else slices))
        if meta:  # a copy into them would be a no-op reported as loaded: nothing is read
            raise MetaTargetError(sorted(set(meta)), src.where, _META_HOW)
        strided_done: set[str] = set()
        for item in later:
            if item.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(src.extra[item.storage_index.fqn], buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
            fqn = item.dest_index.fqn
            if fqn not in strided_done:  # the whole local shard, block by block
                dt = _planned(planner, fqn)
                local = dt._local_tensor
                for lsl, gsl in shards.local_blocks(dt):
                    local[lsl] = src.read_global(item.storage_index.fqn, gsl, src.dtype(item.storage_index.fqn))
                strided_done.add(fqn)
            planner.commit_tensor(item, planner.resolve_tensor(item))
        for r, items in pending.items():
            reader = src.readers[r]
            keys = [self.storage_data[it.storage_index].key for it, _, _ in items]
            pairs = [(k, t) if sl is None else (k, t, sl) for k, (_, t, sl) in zip(keys, items)]
            check: Any = True if assigned is None else {k for rr, k in assigned if rr == r}
            many = getattr(reader, "read_many", None)
            done = [False] * len(pairs) if many is None else many(pairs, check)
            for k, (item, target, sl), ok in zip(keys, items, done):
                # Else (a column block, a converting target) the package's one block read
                # (local files; checked against the digest when all rows pass through it), or a
                # new tensor copied in (object storage).
                if not ok and not (src.local and reader.copy_into(k, target, sl, check is True or k in check)):
                    target.copy_(reader.get(k) if sl is None else reader.get_slice(k, sl))
                planner.commit_tensor(item, target)


def _share_chunks(
    nbytes: int, chunk: int, spans: Sequence[tuple[int, int, int]], world: int
) -> list[tuple[int, int, int]]:
    """The digest chunks (``chunk`` bytes, the last one shorter) of a tensor of ``nbytes`` shared
    out among ``world`` ranks, each chunk to exactly one: to the ranks whose rows hold its first
    byte (``spans``: ``(rank, begin, end)`` byte ranges, overlapping where ranks hold the same rows,
    as on a 2-D mesh), a run of chunks held by the same ranks cut into as many consecutive parts;
    chunks no span holds (a rank whose planned item is not its real block) to every rank alike.
    Returns ``(rank, begin, end)`` chunk-aligned byte ranges (CheckpointReader.check_first's
    ``rows``: the chunks starting in them)."""
    n = -(-nbytes // chunk)
    cuts = {0, n}
    for _, lo, hi in spans:  # the chunks whose first byte lies in [lo, hi): ceil(lo / chunk) on
        cuts.update((min(n, -(-lo // chunk)), min(n, -(-hi // chunk))))
    bounds = sorted(cuts)
    out = []
    for a, b in zip(bounds, bounds[1:]):
        holders = sorted({r for r, lo, hi in spans if lo <= a * chunk < hi}) or list(range(world))
        m = len(holders)
        for j, r in enumerate(holders):
            lo, hi = a + (b - a) * j // m, a + (b - a) * (j + 1) // m
            if lo < hi:
                out.append((r, lo * chunk, min(nbytes, hi * chunk)))
    return out


def _agree(
    src: _Source, layout: Sequence[tuple[int, str]], digests: Mapping[tuple[int, str], Mapping[int, bytes]],
    err: BaseException | None,
) -> list[dict[int, bytes] | None]:
    """The exchange of :meth:`StorageReader._check_first` on the default process group: every
    rank's outcome and the chunk digests it hashed (``digests``: ``{(reader, key): {chunk index:
    16-byte digest}}`` of tensors of ``layout``, the coordinator's chunk-checked tensors in one
    order on every rank). One ``all_reduce`` (sum) of ``int64`` slots: a failure flag per rank,
    then per chunk of ``layout`` how many ranks hashed it and its digest's two halves (each chunk
    is hashed by one rank: the others add zeros), where ``all_gather_object`` pickles and gathers
    twice; the error texts are gathered only when a rank failed.

    Returns, per tensor of ``layout``, ``{chunk index: digest}`` of all its chunks, or None when
    not every chunk was hashed exactly once.

    Raises:
        BaseException: ``err``, this rank's own failure, after the other ranks learnt of it.
        CorruptCheckpointError: another rank failed (its rank and error text named).
    """
    import numpy as np
    import torch.distributed as dist

    from ..ranks.dist import collective_device
    from ..storage.digest import chunk_count

    world, rank = dist.get_world_size(), dist.get_rank()
    counts = [chunk_count(src.readers[rd].spec(k).nbytes, src.readers[rd].digest_chunk) for rd, k in layout]
    first = np.concatenate(([0], np.cumsum(counts, dtype=np.int64))).astype(np.int64)
    total = int(first[-1])
    slots = np.zeros(world + 3 * total, dtype="<i8")  # failed per rank | hashed per chunk | digests
    slots[rank] = err is not None
    hashed, halves = slots[world : world + total], slots[world + total :].reshape(total, 2)
    where = {rk: n for n, rk in enumerate(layout)}
    for rk, ds in digests.items():
        n = where.get(rk)
        if n is None or not ds:
            continue
        at = first[n] + np.fromiter(ds, dtype=np.int64, count=len(ds))
        hashed[at] += 1
        halves[at] = np.frombuffer(b"".join(ds.values()), dtype="<i8").reshape(-1, 2)
    t = torch.from_numpy(slots).to(collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    got = t.cpu().numpy()
    failed = np.flatnonzero(got[:world]).tolist()
    if failed:  # every rank sees the flags: all of them gather the texts, then raise
        texts: list[Any] = [None] * world
        dist.all_gather_object(texts, None if err is None else f"{type(err).__name__}: {err}")
        if err is not None:
            raise err
        why = f"rank {failed[0]} refused the checkpoint before any target was written: {texts[failed[0]]}"
        raise CorruptCheckpointError(src.where, why)
    hashed, raw = got[world : world + total], got[world + total :].astype("<i8").tobytes()
    out: list[dict[int, bytes] | None] = []
    for n, c in enumerate(counts):
        a = int(first[n])
        if not (hashed[a : a + c] == 1).all():
            out.append(None)
            continue
        out.append({i: raw[16 * (a + i) : 16 * (a + i) + 16] for i in range(c)})
    return out


def _check_known(src: _Source, storage: Mapping[MetadataIndex, Any], item: ReadItem) -> None:
    """Raise :class:`~checkpoint.errors.UnknownReadItemError` for a read item the checkpoint's
    metadata lacks (a tensor chunk by its storage index, a non-tensor value by its key)."""
    idx = item.storage_index
    if item.type == LoadItemType.BYTE_IO:
        if idx.fqn not in src.extra:
            raise UnknownReadItemError(src.where, idx.fqn)
    elif not isinstance(storage.get(idx), StoredChunk) or idx.fqn not in src.chunks:
        raise UnknownReadItemError(src.where, idx.fqn, tuple(idx.offset or ()))


def _checks_of(plan: LoadPlan) -> ChecksPlan | None:
    """The coordinator's :class:`ChecksPlan` of ``plan`` (a bare frozenset: the tensors this rank
    checks whole), None when DCP planned without the coordinator (then every tensor read whole is
    checked)."""
    sd = plan.storage_data
    if isinstance(sd, ChecksPlan):
        return sd
    return ChecksPlan(sd) if isinstance(sd, frozenset) else None


def _whole_world(ranks: int) -> bool:
    """Whether a load planned over ``ranks`` ranks runs on the whole default process group (the
    group the exchange of :meth:`StorageReader._check_first` uses: DCP does not
    hand its group to storage readers)."""
    import torch.distributed as dist

    return ranks > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() == ranks


def _identity(src: _Source) -> tuple:
    """Which checkpoint ``src`` opened: the index's own xxh3-128 digest (fqnckpt format 2: it
    covers every tensor's digest), else each open file's inode, size and mtime."""
    out = []
    for r in src.readers:
        meta = getattr(r, "meta", None)
        if meta is not None and meta.index_xxh3_128:
            out.append(meta.index_xxh3_128)
            continue
        for name, fd in sorted(getattr(r, "_fds", {}).items()):
            st = os.fstat(fd)
            out.append((name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _planned(planner: LoadPlanner, fqn: str) -> Any:
    state = getattr(planner, "state_dict", None)
    return state.get(fqn) if isinstance(state, Mapping) else None


def _scattered(t: Any) -> bool:
    """A DTensor whose local shard is several blocks of the global tensor (``_StridedShard``)."""
    if not isinstance(t, DTensor) or not any(isinstance(p, _StridedShard) for p in t.placements):
        return False
    return sum(1 for _ in shards.local_blocks(t)) > 1


# -- sources ---------------------------------------------------------------------------------------


def _open_source(where: Any) -> _Source:
    from ..storage.opening import open_checkpoint

    local = local_path(where)
    path = os.path.abspath(local) if local is not None else None
    if path is None or os.path.isfile(path) or os.path.isfile(os.path.join(path, index_name())) or os.path.isfile(
        os.path.join(path, "model.safetensors")
    ):  # fqnckpt's / Hugging Face's layout, on any byte store: one checkpoint for every part
        at = path if path is not None else where
        with checkpoint_view(at):
            rd = open_checkpoint(at)
            try:
                extra = _extra_values(rd.root) if rd.index_path is not None else {}
            except BaseException:
                rd.close()
                raise
        return _whole(shown(at), rd, extra)
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(path)
    for d in (path, os.path.join(path, "sharded")):
        names = sorted(n for n in os.listdir(d) if _DCP_SHARD.match(n)) if os.path.isdir(d) else []
        if names:
            return _files(path, [os.path.join(d, n) for n in names])
    names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors") and not n.startswith("."))
    if not names:
        raise CheckpointNotFoundError(path, f"no {index_name()}, no model.safetensors, no .safetensors files")
    return _files(path, [os.path.join(path, n) for n in names])


def _whole(where: str, rd, extra: dict[str, Any]) -> _Source:
    from ..convert.dequant import dequantized_view

    try:
        rd = dequantized_view(rd)  # FP8 / MXFP4 weights as torch's QuantizedHuggingFaceStorageReader has them
    except BaseException:
        rd.close()
        raise
    chunks = {k: [StoredChunk(0, k, (0,) * len(rd.spec(k).shape), rd.spec(k).shape)] for k in rd.keys()}
    readers = [rd]
    opt = _optimizer_part(rd)
    if opt is not None:
        part, keys, values = opt
        readers.append(part)
        for k in keys:
            if k in chunks:
                raise DuplicateTensorError(k, [rd.file_of(k), part.file_of(k)])
            chunks[k] = [StoredChunk(1, k, (0,) * len(part.spec(k).shape), part.spec(k).shape)]
        clash = sorted(set(values) & (set(extra) | set(chunks)))
        if clash:
            raise CorruptCheckpointError(where, f"optimizer state keys {clash[:10]} are also model tensors or extra state")
        extra = {**extra, **values}
    # Tied names fqnckpt stored once (alias groups, stored name first): a state_dict holding
    # every name (``lm_head.weight`` beside ``model.embed_tokens.weight``) finds each of them.
    for group in rd.alias_groups:
        stored = next((k for k in group if k in chunks), None)
        for alias in group:
            if stored is not None and alias not in chunks:
                chunks[alias] = chunks[stored]
    return _Source(where, readers, chunks, extra)


def _optimizer_part(rd) -> tuple[Any, list[str], dict[str, Any]] | None:
    """``checkpoint.save``'s optimizer part (``optimizer.safetensors.index.json``), under the keys
    of DCP's ``get_optimizer_state_dict`` flattened: ``state.<fqn>.<name>`` (tensors from the
    part's files; Python numbers and other values as non-tensor values) and ``param_groups``
    (hyper-parameters with ``params`` as FQNs): ``(part reader, tensor keys, values)``, None
    without one. Raises what :func:`checkpoint.plan.optimizer.saved_fqnckpt_optimizer` raises."""
    opener = getattr(rd, "open_part", None)
    part = opener(OPTIMIZER_PREFIX) if opener is not None else None
    if part is None:
        return None
    try:
        from ..plan.optimizer import saved_fqnckpt_optimizer

        saved = saved_fqnckpt_optimizer(part)
        values: dict[str, Any] = {f"state.{f}.{n}": v for f, d in saved.values.items() for n, v in d.items()}
        keys = []
        for d in saved.tensors.values():
            for k in d.values():
                if k in saved.scalars:  # a Python number in the optimizer, stored as a 0-d tensor
                    values[k] = part.get(k).item()
                else:
                    keys.append(k)
        values["param_groups"] = [{**hyper, "params": list(params)} for params, hyper in saved.groups]
    except BaseException:
        part.close()
        raise
    return part, keys, values


def _extra_values(root: str) -> dict[str, Any]:
    """``extra_state.json``'s values, and this rank's per-rank values (``PerRank`` entries of
    ``checkpoint.save``, from ``extra_state.rank-RRRRR-of-WWWWW.json``) when the load runs on as
    many ranks as the save. Raises ValueError naming the entries on another world size (their
    ``reshard`` rules live in the saving program: ``checkpoint.load(extra_state=...)`` applies
    them)."""
    from ..ranks import dist
    from ..storage.extra_state import decode_node, read_extra_state_file, read_rank_file

    doc = read_extra_state_file(root)
    if doc is None:
        return {}
    entries = dict(doc.entries)
    if doc.per_rank is not None:
        saved, world = doc.per_rank.world_size, dist.world_size()
        if saved != world:
            raise ValueError(
                f"{root}: extra-state entries {doc.per_rank.keys[:10]} were saved per rank by {saved} ranks; "
                f"this load runs on {world}: load them with checkpoint.load(extra_state={{key: PerRank(..., "
                "reshard=...)}}), whose reshard rule derives each rank's value"
            )
        entries.update(read_rank_file(root, doc, dist.rank()).entries)
    return {k: decode_node(e.value, k) for k, e in entries.items()}


def _files(root: str, paths: list[str]) -> _Source:
    """Several ``.safetensors`` files without an index: DCP's per-rank shard files (chunks placed
    by ``DCP_SHARDING_INFO``) or plain files (a tensor in two of them is refused)."""
    from ..storage.opening import open_checkpoint
    from ..storage.st_header import cover_problem, open_safetensors_with_header, shape_problem

    readers: list = []
    chunks: dict[str, list[StoredChunk]] = {}
    where: dict[str, list[str]] = {}
    try:
        for p in paths:
            rd = open_checkpoint(p)
            readers.append(rd)
            meta = open_safetensors_with_header(p)[0].metadata() or {}  # (the file is never mapped)
            info = None
            if _SHARDING_KEY in meta:
                try:
                    info = json.loads(meta[_SHARDING_KEY])
                except ValueError as e:
                    raise CorruptCheckpointError(p, f"{_SHARDING_KEY} is not JSON: {e}") from e
            for k in rd.keys():
                shape = rd.spec(k).shape
                off = (0,) * len(shape)
                if info is not None:
                    try:
                        off = tuple(int(x) for x in info[k][_OFFSETS_KEY])
                    except (KeyError, TypeError, ValueError) as e:
                        raise CorruptCheckpointError(p, f"{_SHARDING_KEY} has no {_OFFSETS_KEY} for {k!r}") from e
                    if len(off) != len(shape) or min(off, default=0) < 0:
                        raise CorruptCheckpointError(p, f"{_SHARDING_KEY} offsets {off} of {k!r} do not fit {shape}")
                elif k in chunks:
                    raise DuplicateTensorError(k, where[k] + [p])
                chunks.setdefault(k, []).append(StoredChunk(len(readers) - 1, k, off, shape))
                where.setdefault(k, []).append(p)
        for k, cs in chunks.items():  # DCP's chunks must cover the tensor exactly once
            dims = len(cs[0].shape)
            if any(len(c.shape) != dims for c in cs):
                raise CorruptCheckpointError(root, f"{k!r} has chunks of different ranks in {where[k]}")
            size = [max(c.offsets[d] + c.shape[d] for c in cs) for d in range(dims)]
            why = shape_problem(size) or cover_problem(size, [(c.offsets, c.shape) for c in cs])
            if why is not None:
                raise CorruptCheckpointError(root, f"the chunks of {k!r} in {where[k]} do not cover its {size} exactly: {why}")
            dtypes = {readers[c.reader].spec(k).dtype for c in cs}
            if len(dtypes) > 1:
                raise CorruptCheckpointError(root, f"{k!r} is stored with dtypes {sorted(map(str, dtypes))}")
    except BaseException:
        for r in readers:
            r.close()
        raise
    return _Source(root, readers, chunks, {})


__all__ = ["StorageReader", "StoredChunk", "StoredExtra"]
