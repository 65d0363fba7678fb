"""Stages 2 to 5 of the write pipeline on object storage: a planned checkpoint uploaded and committed
without rename (:mod:`checkpoint.storage.commit`): one process, or every rank of a distributed save.

Each shard file is uploaded by one rank (file ``j`` by rank ``j % world_size``), front to back
through the byte store's streaming writer (a bounded multipart upload on S3, a renamed file locally); its
xxh3-128 digests are computed on the way, so nothing is read back. A DTensor's bytes reach the
file's rank through ``DTensor.full_tensor()`` (all ranks of its mesh take part, one tensor at a
time): an object cannot be written in byte ranges by several processes (S3 parts are at least
5 MiB), so the shared-file scheme of local saves does not carry over. ``async_save`` gathers in
its call instead (``checkpoint.training.async_save``), so the background
thread runs no collective on the DTensors' groups.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..testing import faults
from ..errors import CheckpointError, CheckpointWriteError, ConcurrentSaveError
from ..ranks import dist
from ..storage import digest
from ..storage.format import MODEL_PREFIX, FileRecordV2, IndexFile, index_name
from ..storage.layout import FilePlan, Layout, TensorSlot
from ..storage.bytestore import ByteStore, ByteWriter
from .index import make_index
from ..storage.commit import MODEL_INDEX, RemoteCommit, carried_side_files, is_part, stored_name
from ..storage.writer import check_matches, stats, tensor_bytes

# Files of a save renamed per save (readers find them through the model index); other extra
# files (Hugging Face's config.json, ...) keep their names: transformers opens them by name.
_TOKENED_FILES = ("extra_state.", "migration_report.json")


class _ShardUpload:
    """One shard file streamed front to back into an :class:`ByteWriter`, hashed on the way."""

    def __init__(self, writer: ByteWriter, plan: FilePlan):
        self.w, self.plan = writer, plan
        self.header = digest.hexdigest(plan.header)
        self.tensors: dict[str, str] = {}
        self.w.write(plan.header)
        self.pos = plan.data_start

    def write(self, slot: TensorSlot, tensor: torch.Tensor) -> None:
        check_matches(slot, tensor)
        if slot.begin != self.pos:
            raise RuntimeError(f"{self.plan.name}: {slot.spec.fqn!r} planned at byte {slot.begin}, stream at {self.pos}")
        data = tensor_bytes(tensor)
        h = digest.tensor_hasher()
        for lo in range(0, len(data), digest.CHUNK):
            piece = data[lo : lo + digest.CHUNK]
            h.update(piece)
            self.w.write(piece)
        self.tensors[slot.spec.fqn] = h.hexdigest()
        self.pos += len(data)
        stats.bytes_written += len(data)
        faults.fault_point("after_tensor_write")

    def finish(self) -> FileRecordV2:
        if self.pos != self.plan.size:
            raise RuntimeError(f"{self.plan.name}: {self.plan.size - self.pos} bytes not written")
        self.w.close()
        return FileRecordV2(
            size=self.plan.size,
            digest=digest.combine(self.header, self.tensors.values()),
            header=self.header,
            tensors=self.tensors,
        )


def _object_name(name: str, token: str) -> str:
    return stored_name(name, token) if name.endswith(".safetensors") or name.startswith(_TOKENED_FILES) else name


def _renamed(index: IndexFile, token: str) -> IndexFile:
    """``index`` naming the save's objects instead of the planned file names."""
    index.weight_map = {k: stored_name(v, token) for k, v in index.weight_map.items()}
    meta = index.metadata.fqnckpt
    if meta is not None:
        meta.files = {stored_name(n, token): r for n, r in meta.files.items()}
    return index


def _wrap(store: ByteStore, e: BaseException, rank: int | None) -> BaseException:
    if isinstance(e, CheckpointError) or not isinstance(e, OSError):
        return e
    return CheckpointWriteError(store.url, f"{type(e).__name__}: {store.scrub(str(e))}", rank)


def save_remote(
    store: ByteStore,
    parts: Sequence[Any],
    layouts: Sequence[Layout],
    overwrite: bool,
    extra_files: Mapping[str, bytes],
    fetch: Callable[[Any, Any], torch.Tensor],
    distributed: bool,
) -> list[IndexFile]:
    """Upload ``parts`` as planned in ``layouts`` and commit (see module docstring).
    ``extra_files``: rank 0's are written (``{name: bytes}``). ``fetch(part, spec)``: the tensor
    of ``spec`` (:func:`checkpoint.write.parts.fetch_checked` / ``fetch_tensor``).

    Raises:
        CheckpointExistsError: a committed checkpoint is there and ``overwrite`` is False.
        CheckpointWriteError: a request failed for good (after the retries); whatever was
            committed there before is intact and readable.
        RankAgreementError: another rank failed (distributed).
    """
    rank, world = (dist.rank(), dist.world_size()) if distributed else (0, 1)
    files = [(part, lay, f) for part, lay in zip(parts, layouts) for f in lay.files]
    commit, token, err = None, None, None
    if rank == 0:
        try:
            commit = RemoteCommit(store, overwrite)
            token = commit.token
            # The staging manifest names every object of the save before the first part.
            named = [stored_name(f.name, token) for _, _, f in files]
            named += [_object_name(x, token) for x in extra_files if _object_name(x, token) != x]
            named += [stored_name(index_name(p.prefix), token) for p in parts if p.prefix != MODEL_PREFIX]
            commit.begin(named, plain=[x for x in extra_files if _object_name(x, token) == x], overwrite=overwrite)
        except BaseException as e:  # noqa: BLE001 - agreed below
            err = _wrap(store, e, 0 if distributed else None)
    if distributed:
        dist.check_all(f"preparing {store.url}", err)
        token = dist.broadcast_object(token)
    elif err is not None:
        raise err
    try:
        return _upload_and_commit(store, parts, layouts, files, extra_files, fetch, distributed, commit, token, rank, world)
    except BaseException as e:
        why = None
        if commit is not None:
            commit.abort()  # best effort; a killed save's objects go with the next commit there
            if isinstance(e, (OSError, CheckpointError)) and not isinstance(e, ConcurrentSaveError) and commit.superseded():
                why = f"another save committed there while this one was writing ({store.scrub(str(e))})"
        if distributed and isinstance(e, (OSError, CheckpointError)):
            # Every rank left the same agreed collective with an error: rank 0's verdict on whether
            # another save overtook this one is every rank's (the same named error everywhere).
            why = dist.broadcast_object(why)
            if isinstance(e, ConcurrentSaveError):
                raise
        if why is not None:
            raise ConcurrentSaveError(store.url, why) from None
        raise


def _upload_and_commit(store, parts, layouts, files, extra_files, fetch, distributed, commit, token, rank, world):
    records: dict[str, FileRecordV2] = {}
    err = None
    try:
        for j, (part, _lay, f) in enumerate(files):
            mine = j % world == rank
            up = _ShardUpload(store.open_writer(stored_name(f.name, token), f.size), f) if mine else None
            try:
                for slot in f.slots:
                    if up is None:  # another rank's file: only a DTensor's gather needs this rank
                        t = part.fetch(slot.spec)
                        if isinstance(t, DTensor):
                            t.full_tensor()  # collective: every rank of the mesh, in file order
                        continue
                    t = fetch(part, slot.spec)
                    if isinstance(t, DTensor):
                        t = t.full_tensor()
                    up.write(slot, t)
                    del t
                if up is not None:
                    records[f.name] = up.finish()
                    up = None
            finally:
                if up is not None:
                    up.w.abort()
    except BaseException as e:  # noqa: BLE001
        err = _wrap(store, e, rank if distributed else None)
    if distributed:
        dist.check_all(f"writing {store.url}", err)
        for d in dist.all_gather_object(records):
            records.update(d)
    elif err is not None:
        raise err
    indexes = [
        _renamed(make_index(part, lay, {f.name: records[f.name] for f in lay.files}), token)
        for part, lay in zip(parts, layouts)
    ]
    err = None
    if rank == 0:
        try:
            faults.fault_point("after_data_written")
            objects: dict[str, str] = {}
            for name, data in extra_files.items():
                objects[name] = _object_name(name, token)
                store.put(objects[name], bytes(data))
            model_index = None
            for part, idx in zip(parts, indexes):
                if part.prefix == MODEL_PREFIX:
                    model_index = idx
                    continue
                name = index_name(part.prefix)
                objects[name] = stored_name(name, token)
                store.put(objects[name], idx.to_json_bytes())
            assert model_index is not None and model_index.metadata.fqnckpt is not None
            kept, kept_digests = carried_side_files(store, commit.previous, objects)
            model_index.metadata.fqnckpt.objects = objects | kept
            model_index.metadata.fqnckpt.object_digests = kept_digests | {
                objects[n]: hashlib.sha256(bytes(d)).hexdigest() for n, d in extra_files.items() if not is_part(objects[n])
            } or None
            owned = {MODEL_INDEX, *objects.values()}
            owned.update(stored_name(f.name, token) for _, _, f in files)
            faults.fault_point("before_index_write")
            commit.commit(model_index.to_json_bytes(), owned)
            faults.fault_point("after_index_write")
        except BaseException as e:  # noqa: BLE001
            err = _wrap(store, e, 0 if distributed else None)
    if distributed:
        dist.check_all(f"committing {store.url}", err)
    elif err is not None:
        raise err
    return indexes


__all__ = ["save_remote"]
