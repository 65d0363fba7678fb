"""Meta's own layout written: ``consolidated.00.pth`` ... ``consolidated.NN.pth`` (one
``torch.save`` of a plain ``{key: tensor}`` dict per model-parallel shard, readable with
``torch.load(weights_only=True)``) beside ``params.json``, committed atomically like every
checkpoint (:class:`checkpoint.storage.local_commit.StagedCheckpoint`: nothing half-written on failure).

Layout: transformers ``convert_llama_weights_to_hf.py`` (the reader side) and
``docs/guides/conversions.md``, Formulas (how shards split: Q / K / V, ``w1`` / ``w3``, ``output``
on dim 0 by whole heads; ``wo``, ``w2``, ``tok_embeddings`` on dim 1; norms replicated).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import torch

from ..storage.local_commit import StagedCheckpoint, fsync_path
from ..errors import CheckpointExistsError, ConcurrentSaveError
from ..storage.commit import (
    MODEL_INDEX, RECORD, ObjectRecord, check_clashes, holds_checkpoint, index_digest, is_part, owned_objects,
)
from ..storage.layout import TensorSpec
from ..storage.location import local_path

SHARD_FILE = "consolidated.{:02d}.pth"
_TARGET = re.compile(r"^consolidated\.(\d+)\.pth/(.+)$")


def shard_target(shard: int, key: str) -> str:
    """The plan's name for ``key`` in model-parallel shard ``shard``: ``consolidated.01.pth/key``."""
    return f"{SHARD_FILE.format(shard)}/{key}"


def split_shard_target(name: str) -> tuple[int, str]:
    """Inverse of :func:`shard_target`; a plain key belongs to shard 0 (a one-shard checkpoint)."""
    m = _TARGET.match(name)
    return (int(m.group(1)), m.group(2)) if m else (0, name)


def write_meta_checkpoint(path, specs: Sequence[TensorSpec], fetch: Callable[[TensorSpec], torch.Tensor],
                          extra: Mapping[str, bytes], overwrite: bool) -> None:  # fmt: skip
    """Write ``specs`` (named by :func:`shard_target` when there are several shards) as Meta's
    ``consolidated.NN.pth`` files plus the ``extra`` files (``params.json``, the report) at ``path``
    (a local path, or a byte store: ``memory://``, ``s3://``), with fqnckpt's record
    (:data:`checkpoint.storage.commit.RECORD`, every file written): an overwrite or a removal
    deletes what the record names, never a file for its name.

    Locally committed atomically like every checkpoint (:class:`checkpoint.storage.local_commit.StagedCheckpoint`).
    On object storage the files keep their names (Meta's readers glob ``consolidated.*.pth``): the
    previous checkpoint's record is removed first, the files are uploaded, the record written last
    (the commit marker), then what only the previous record named is deleted; an overwrite killed
    midway leaves no record (see docs/guides/object-storage.md).

    Every tensor gets its own storage (a shard's piece of a joined tensor is a view; saved as is,
    its whole base would be pickled). Memory: ``torch.save`` pickles a whole dict per file, so each
    tensor is first fetched in the plan's group order and spilled to a file in the staging
    directory, then mapped back privately (``UntypedStorage.from_file(shared=False)``: page cache,
    not anonymous memory) for ``torch.save``; anonymous memory stays bounded by one rule group, at
    the cost of writing each byte twice. The spill files are removed before the commit.

    Raises:
        CheckpointExistsError: a checkpoint is at ``path`` and ``overwrite`` is False, or a file
            the save writes is there and no record names it.
        OSError / CheckpointWriteError: writing failed; nothing is committed at ``path``.
    """
    if local_path(path) is None:  # a byte store: uploaded, the record written last
        with tempfile.TemporaryDirectory(prefix=".fqnckpt-meta-") as tmp:
            names = _write_files(tmp, specs, fetch, extra)
            _upload(path, tmp, names, overwrite)
        return
    with StagedCheckpoint(os.fspath(path), overwrite) as st:
        names = _write_files(st.dir, specs, fetch, extra)
        st.write_file(RECORD, _record(st.dir, names))
        st.commit()


def _write_files(d: str, specs, fetch, extra: Mapping[str, bytes]) -> list[str]:
    """The shard files and ``extra`` written and fsynced into directory ``d``; their names."""
    by_shard: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    spill = os.path.join(d, ".spill")
    os.mkdir(spill)
    for i, spec in enumerate(specs):  # group order: the plan computes each group once
        shard, key = split_shard_target(spec.fqn)
        by_shard[shard][key] = _spilled(fetch(spec), os.path.join(spill, str(i)))
    names = []
    for shard in sorted(by_shard):
        names.append(SHARD_FILE.format(shard))
        f = os.path.join(d, names[-1])
        torch.save(by_shard.pop(shard), f)
        fsync_path(f)
    shutil.rmtree(spill)
    for name, data in extra.items():
        with open(os.path.join(d, name), "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        names.append(name)
    return names


def _record(d: str, names: list[str]) -> bytes:
    """The record of files ``names`` written in directory ``d``: every name, and the sha256 of
    each side file (``params.json``; :func:`checkpoint.storage.commit.is_part` False), so that a
    removal deletes it while unedited."""
    digests = {}
    for name in names:
        if not is_part(name):
            with open(os.path.join(d, name), "rb") as f:
                digests[name] = index_digest(f.read())
    return ObjectRecord(objects=sorted(names), object_digests=digests).model_dump_json().encode()


def _upload(store, d: str, names: list[str], overwrite: bool) -> None:
    """Commit the files ``names`` of directory ``d`` to object store ``store`` (see
    :func:`write_meta_checkpoint`): the same ownership and clash rules as every save, and the
    same conditional commit markers as fqnckpt's layout there (:mod:`checkpoint.storage.commit`):
    the previous checkpoint's marker (its model index, or its record) is removed only if it is
    still the one read at the start (S3 ``If-Match``; ``memory://`` compare and swap), the
    record is written only where none appeared meanwhile, and a model index is never removed
    after the upload (it may be another save's, committed meanwhile: this one is then refused).

    Raises:
        CheckpointExistsError: a checkpoint is there and ``overwrite`` is False, or a file this
            save writes is there and no record names it.
        ConcurrentSaveError: another save committed there after this one read the store (its
            checkpoint stays whole; the objects this save uploaded that no record names are
            removed again).
    """
    from ..storage.objstore import PreconditionFailed

    with store.writer_lock():  # none on object storage: the conditional marker writes below
        index_raw, index_tag = store.get_tagged(MODEL_INDEX)
        record_raw, record_tag = store.get_tagged(RECORD)
        if not overwrite and (index_raw is not None or record_raw is not None or holds_checkpoint(store)):
            raise CheckpointExistsError(store.url)
        previous = owned_objects(store)
        check_clashes(store, names, previous)
        # Each object is replaced only if it is still what this save read (the previous
        # checkpoint's, or none): another Meta save writes the same fixed names.
        tags = {name: store.tag_of(name) for name in names}
        try:  # from here the previous checkpoint is no longer one of ours
            if index_raw is not None:
                store.delete_if(MODEL_INDEX, index_tag)
            if record_raw is not None:
                store.delete_if(RECORD, record_tag)
        except PreconditionFailed:
            raise ConcurrentSaveError(store.url) from None
        uploaded: list[str] = []
        try:
            for name in names:
                w = store.open_writer(
                    name, os.path.getsize(os.path.join(d, name)), if_match=tags[name], if_absent=tags[name] is None
                )
                try:
                    with open(os.path.join(d, name), "rb") as f:
                        while chunk := f.read(8 << 20):
                            w.write(chunk)
                    w.close()
                except BaseException:
                    w.abort()
                    raise
                uploaded.append(name)
            if store.get(MODEL_INDEX) is not None:  # a save of fqnckpt's layout committed meanwhile
                raise PreconditionFailed(f"{store.url_of(MODEL_INDEX)} appeared")
            store.put(RECORD, _record(d, names), if_absent=True)
        except PreconditionFailed:
            store.delete(sorted(set(uploaded) - owned_objects(store)))  # ours alone, named by no record
            raise ConcurrentSaveError(store.url) from None
        store.delete(sorted(previous - set(names) - {RECORD, MODEL_INDEX}))


def _spilled(t: torch.Tensor, f: str) -> torch.Tensor:
    """``t``'s values in a new tensor backed by a private mapping of file ``f`` (written here)."""
    t = t.detach().contiguous()
    if t.nbytes == 0:
        return t.clone()
    with open(f, "wb") as fh:
        fh.write(t.reshape(-1).view(torch.uint8).numpy().data)
    storage = torch.UntypedStorage.from_file(f, shared=False, nbytes=t.nbytes)
    return torch.empty(0, dtype=t.dtype).set_(storage, 0, t.shape, t.stride())


__all__ = ["SHARD_FILE", "shard_target", "split_shard_target", "write_meta_checkpoint"]
