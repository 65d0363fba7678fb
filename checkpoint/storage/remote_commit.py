"""How a checkpoint is committed on object storage, where there is no rename (S3: a copy and a
delete) and no lock: the model index is the commit marker, and what may be deleted is known only
from records fqnckpt wrote, never from object names.

1. The save reads the model index there (its bytes and, on S3, its ETag) and writes a staging
   manifest, ``.fqnckpt-staging.<token>.json`` (:class:`StagingManifest`), before its first
   part: the save's token (12 hex digits), the digest of the index it started from (``base``) and
   every object name it will write.
2. Every object of the save except the model index gets a name unique to the save: the token
   after the first dot, ``model-00001-of-00002.<token>.safetensors``, ``extra_state.<token>.json``,
   ``optimizer.<token>.safetensors.index.json`` (Hugging Face configs such as ``config.json``
   keep their names: transformers reads them by name). Each rank uploads its own shard files;
   rank 0 the small files.
3. Once every rank's uploads are complete, rank 0 writes ``model.safetensors.index.json`` as one
   PUT (readers see the old bytes or the new, whole), conditional on the index it started from:
   S3 ``If-Match: <ETag>`` (``If-None-Match: *`` when there was none), so of two concurrent saves
   the later commit is refused (:class:`~checkpoint.errors.ConcurrentSaveError`, its own objects
   removed) and the index never names objects another save deleted. Backends without conditional
   writes (``memory://``, ``file://``) re-read the index just before the PUT: a narrow race
   remains there (one writer at a time, as the README says per backend).
4. Only then are deleted: the objects the previous index owned (:func:`owned_objects`) and not
   the new one; and of every other staging manifest that can no longer commit (its ``base`` is not
   the new index), the objects it names that carry its token, its incomplete multipart uploads
   (S3 ``list_multipart_uploads`` filtered to those names) and the manifest. Our manifest last.
   Objects no fqnckpt record names are never deleted, whatever their names.

A reader fetches the model index once and reads only the objects it names (see
:mod:`checkpoint.storage.remote_reader`): a killed save (no new index) leaves the previous
checkpoint readable; a checkpoint without an index is not one; the objects of two saves never
mix, since names are unique per save. A reader still reading a checkpoint whose objects a newer
save deleted gets :class:`~checkpoint.errors.MissingShardError` / ``LoadError``, never the
newer bytes.
"""

from __future__ import annotations

import hashlib
import re
import uuid
import warnings
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import CheckpointError, CheckpointExistsError, CheckpointWriteError, ConcurrentSaveError, LoadError
from .format import MODEL_PREFIX, OPTIMIZER_PREFIX, IndexFile, index_name
from .bytestore import ByteStore
from .objstore import PreconditionFailed

MODEL_INDEX = index_name(MODEL_PREFIX)
_TOKENED = re.compile(r"^[^./\\]+\.([0-9a-f]{12})\..+$")
STAGING_PREFIX = ".fqnckpt-staging."
_STAGING = re.compile(r"^\.fqnckpt-staging\.([0-9a-f]{12})\.json$")


class StagingManifest(BaseModel):
    """``.fqnckpt-staging.<token>.json``: written by a save before its first part (see module
    docstring). ``base``: sha256 (hex) of the model index bytes the save started from, None when
    there was none; ``objects``: the names the save writes (each carries ``token``)."""

    model_config = ConfigDict(extra="forbid")
    format: Literal["fqnckpt-staging-1"] = "fqnckpt-staging-1"
    token: str = Field(pattern=r"^[0-9a-f]{12}$")
    base: str | None
    objects: list[str]


def staging_name(token: str) -> str:
    return f"{STAGING_PREFIX}{token}.json"


def index_digest(raw: bytes | None) -> str | None:
    return hashlib.sha256(raw).hexdigest() if raw is not None else None


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def stored_name(name: str, token: str) -> str:
    """``model-00001-of-00002.safetensors`` -> ``model-00001-of-00002.<token>.safetensors``."""
    head, _, rest = name.partition(".")
    return f"{head}.{token}.{rest}" if rest else f"{head}.{token}"


def token_of(name: str) -> str | None:
    """The save token in an object name fqnckpt wrote, else None."""
    m = _TOKENED.match(name)
    return m.group(1) if m else None


def parse_index(raw: bytes | None) -> IndexFile | None:
    if raw is None:
        return None
    try:
        return IndexFile.model_validate_json(raw)
    except (ValidationError, ValueError):
        return None


def owned_objects(store: ByteStore, index: IndexFile | None) -> set[str]:
    """Objects the checkpoint of ``index`` (its model index, already fetched) owns: the index,
    the shards it names, the objects of ``metadata.fqnckpt.objects`` and the optimizer shards
    its optimizer index names. Plain names only."""
    if index is None:
        return set()
    owned = {MODEL_INDEX, *index.files()}
    meta = index.metadata.fqnckpt
    objects = dict(meta.objects or {}) if meta is not None else {}
    owned.update(objects.values())
    opt_name = objects.get(index_name(OPTIMIZER_PREFIX))
    if opt_name is not None:
        opt = parse_index(store.get(opt_name))
        if opt is not None:
            owned.update(opt.files())
    return {n for n in owned if n and "/" not in n and "\\" not in n and n not in (".", "..")}


def staged_saves(store: ByteStore, listing: Iterable[str] | None = None) -> list[StagingManifest]:
    """The staging manifests under ``store`` (saves started and not yet cleaned up: running, or
    killed). An object with a manifest's name whose content is not one (or whose token differs
    from its name's) is not ours: skipped, never deleted."""
    out = []
    for name in sorted(store.listing() if listing is None else listing):
        m = _STAGING.match(name)
        if m is None:
            continue
        try:
            man = StagingManifest.model_validate_json(store.get(name) or b"")
        except (ValidationError, ValueError, LoadError):
            continue
        if man.token == m.group(1):
            out.append(man)
    return out


def _named(man: StagingManifest) -> set[str]:
    """The objects ``man`` names that carry its token (a manifest never leads to another name)."""
    return {n for n in man.objects if "/" not in n and "\\" not in n and token_of(n) == man.token}


def leftovers(store: ByteStore, listing: dict[str, tuple[str, int]] | None = None) -> dict[str, list[str]]:
    """What saves left under ``store`` that no index names: ``{"staging": manifests,
    "objects": objects they name that exist, "uploads": incomplete multipart uploads of those
    objects}`` (``inspect`` lists them; the next commit there removes those of dead saves)."""
    listing = store.listing() if listing is None else listing
    mans = staged_saves(store, listing)
    named = set().union(*(_named(m) for m in mans)) if mans else set()
    # a save killed after its commit, before its cleanup, leaves a manifest naming live objects
    named -= owned_objects(store, parse_index(store.get(MODEL_INDEX)))
    return {
        "staging": [staging_name(m.token) for m in mans],
        "objects": sorted(n for n in named if n in listing),
        "uploads": sorted(n for n, _ in store.uploads() if n in named) if mans else [],
    }


def _clean(store: ByteStore, dead: list[StagingManifest], keep: set[str]) -> None:
    """Abort the uploads and delete the objects (but ``keep``) of saves ``dead``, then their manifests."""
    if not dead:
        return
    named = set().union(*(_named(m) for m in dead)) - keep
    for name, upload_id in store.uploads():
        if name in named:
            store.abort_upload(name, upload_id)
    store.delete(sorted(named))
    store.delete([staging_name(m.token) for m in dead])


class RemoteCommit:
    """One save's commit on ``store`` (see module docstring). Create it (checks the target),
    :meth:`begin` with the names the save writes, name objects with :meth:`name`, then
    :meth:`commit` with the model index bytes (or :meth:`abort`).

    Raises:
        CheckpointExistsError: a committed checkpoint is there and ``overwrite`` is False.
        CheckpointWriteError: the model index could not be read.
    """

    def __init__(self, store: ByteStore, overwrite: bool):
        self.store, self.token = store, new_token()
        try:
            raw, self.tag = store.get_tagged(MODEL_INDEX)
        except LoadError as e:  # a save: the failure is a write failure, named as such
            raise CheckpointWriteError(store.url, str(e)) from None
        if raw is not None and not overwrite:
            raise CheckpointExistsError(store.url)
        self.raw = raw
        self.base = index_digest(raw)
        self.previous = parse_index(raw)  # an index that does not parse owns nothing we can name
        self.manifest: StagingManifest | None = None
        self.committed = False

    def name(self, logical: str) -> str:
        """The object name of file ``logical`` in this save (the model index keeps its name)."""
        return logical if logical == MODEL_INDEX else stored_name(logical, self.token)

    def begin(self, objects: Iterable[str]) -> None:
        """Write the staging manifest naming ``objects`` (before the first part of the save)."""
        self.manifest = StagingManifest(token=self.token, base=self.base, objects=sorted(set(objects)))
        self.store.put(staging_name(self.token), self.manifest.model_dump_json().encode())

    def superseded(self) -> bool:
        """Whether another save committed here since this one started (then what this save wrote
        may have been removed by that commit's cleanup: its failure is a ConcurrentSaveError)."""
        try:
            return index_digest(self.store.get(MODEL_INDEX)) != self.base
        except (OSError, CheckpointError):
            return False

    def abort(self) -> None:
        """Remove what this save wrote (best effort: what stays is cleaned by the next commit)."""
        try:
            if self.manifest is not None and not self.committed:
                _clean(self.store, [self.manifest], set())
        except (OSError, CheckpointError):
            pass

    def commit(self, index_bytes: bytes, new_owned: set[str]) -> None:
        """PUT the model index (the commit point) if the index is still the one this save started
        from, then delete what only the previous checkpoint owned and what dead saves left.

        Raises:
            ConcurrentSaveError: another save committed there meanwhile (this one is removed).
        """
        old = owned_objects(self.store, self.previous)
        try:
            self.store.put(MODEL_INDEX, index_bytes, if_match=self.tag, if_absent=self.raw is None)
        except PreconditionFailed:
            self.abort()
            raise ConcurrentSaveError(self.store.url) from None
        self.committed = True
        try:  # committed: a failure from here on leaves only unnamed objects, never a bad checkpoint
            self.store.delete(sorted(old - new_owned - {MODEL_INDEX}))
            new = index_digest(index_bytes)
            dead = [m for m in staged_saves(self.store) if m.token != self.token and m.base != new]
            _clean(self.store, dead, new_owned)
            self.store.delete([staging_name(self.token)])
        except (OSError, CheckpointError) as e:
            warnings.warn(
                f"{self.store.url}: committed, but removing the replaced objects failed ({e}); "
                "the next save there removes them",
                stacklevel=2,
            )


__all__ = [
    "RemoteCommit", "StagingManifest", "owned_objects", "stored_name", "token_of", "parse_index", "leftovers",
    "staged_saves", "is_committed", "remove_checkpoint", "MODEL_INDEX",
]  # fmt: skip


def is_committed(store: ByteStore, listing: dict[str, tuple[str, int]] | None = None) -> bool:
    """A complete checkpoint at ``store``: its model index parses and every object it owns
    (:func:`owned_objects`) exists, shards with the byte size recorded. No tensor data is read."""
    index = parse_index(store.get(MODEL_INDEX))
    if index is None:
        return False
    listing = store.listing() if listing is None else listing
    meta = index.metadata.fqnckpt
    objects = dict(meta.objects or {}) if meta is not None else {}
    opt_name = objects.get(index_name(OPTIMIZER_PREFIX))
    opt = parse_index(store.get(opt_name)) if opt_name is not None else None
    if opt_name is not None and opt is None:
        return False
    for idx in (index, opt):
        if idx is None:
            continue
        recs = idx.metadata.fqnckpt.files if idx.metadata.fqnckpt is not None else {}
        for name in idx.files():
            if name not in listing or (name in recs and listing[name][1] != recs[name].size):
                return False
    return all(name in listing for name in objects.values())


def remove_checkpoint(store: ByteStore, unborn: bool = False) -> None:
    """Delete the checkpoint at ``store``: its model index first (from then on no reader takes it
    for a checkpoint; on S3 only if unchanged since read, so a save committed meanwhile stays),
    then the objects it owned, and what saves that can no longer commit left (their base was an
    index; with ``unborn`` also saves started where there was none: retention of a step that no
    save may still be writing). Objects no fqnckpt record names stay.

    Raises:
        ConcurrentSaveError: a save committed there after the index was read (nothing removed).
    """
    raw, tag = store.get_tagged(MODEL_INDEX)
    owned = owned_objects(store, parse_index(raw))
    if raw is not None:
        try:
            store.delete_if(MODEL_INDEX, tag)
        except PreconditionFailed:
            raise ConcurrentSaveError(store.url, "a save committed there while it was being removed; it stays") from None
    store.delete(sorted(owned - {MODEL_INDEX}))
    _clean(store, [m for m in staged_saves(store) if unborn or m.base is not None], set())
    store.remove_dir_if_empty()  # as a local retention leaves no directory behind
