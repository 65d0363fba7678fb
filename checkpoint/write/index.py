"""Stages 4 and 5 of the write pipeline, index and commit: the digests become each file's record
and each part's index (``model.safetensors.index.json``: Hugging Face's ``weight_map`` plus
fqnckpt's record, :class:`checkpoint.storage.format.FqnckptMeta`), written last; then the
checkpoint is committed. On a local path the staged directory is renamed into place
(:class:`checkpoint.storage.local_commit.StagedCheckpoint`); on object storage the model index is
the commit point (:mod:`checkpoint.write.upload`, :mod:`checkpoint.storage.commit`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..storage import digest
from ..storage.commit import is_part
from ..storage.format import MODEL_PREFIX, FileRecordV2, FqnckptMeta, IndexFile, IndexMetadata, index_name
from ..storage.layout import Layout
from ..storage.local_commit import StagedCheckpoint
from ..storage.writer import distributed_record
from ..testing import faults
from .plan import Part


def make_index(part: Part, layout: Layout, records: Mapping[str, FileRecordV2]) -> IndexFile:
    """The index of ``part`` laid out as ``layout``, with each file's record (``records``:
    ``{file name: record}``, format version 3)."""
    meta = FqnckptMeta(
        files=dict(records),
        tensor_digest_chunk=digest.TENSOR_CHUNK,
        alias_groups=[list(g) for g in part.alias_groups],
        fqn_map=part.fqn_map,
        optimizer=part.optimizer,
        extra_shards=part.extra_shards,
    )
    return IndexFile(
        metadata=IndexMetadata(total_size=layout.total_size, fqnckpt=meta), weight_map=layout.weight_map
    )


def indexes_of(parts: Sequence[Part], layouts: Sequence[Layout], tensor_digests: Mapping[str, str]) -> list[IndexFile]:
    """Every part's index from every tensor's digest (``{fqn: digest}``; the header digests come
    from the planned headers, which are the bytes written)."""
    digests = dict(tensor_digests)
    return [make_index(part, lay, {f.name: distributed_record(f, digests) for f in lay.files}) for part, lay in zip(parts, layouts)]


def side_file_record(data: bytes) -> FileRecordV2:
    """The index record (format version 3) of a safetensors file a save writes from ``data``
    (peft's adapter file): size, header and tensor digests, as
    :class:`checkpoint.storage.writer.SequentialFileWriter` records a shard.

    Raises:
        ValueError: ``data`` is not a safetensors file."""
    size, header, tensors = digest.hash_bytes(data, digest.TENSOR_CHUNK)
    return FileRecordV2(size=size, digest=digest.combine(header, tensors.values()), header=header, tensors=tensors)


def write_indexes_and_commit(
    staged: StagedCheckpoint, parts: Sequence[Part], indexes: Sequence[IndexFile], extra_files: Mapping[str, bytes] | None = None
) -> None:
    """Data is in place in ``staged``: write the extra files (``{name: bytes}``), then the index
    files last, then move the checkpoint into place (:meth:`StagedCheckpoint.commit`). The model
    index records every other file of the save (as on object storage): overwrite and retention
    remove the files a record names, never a file for its name (:mod:`checkpoint.storage.local_commit`).

    Raises:
        OSError: writing or committing failed; the previous checkpoint stays whole."""
    for name, data in (extra_files or {}).items():
        staged.write_file(name, bytes(data))
    faults.fault_point("after_data_written")
    faults.fault_point("before_index_write")
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
