"""How a checkpoint is committed on a byte store, what it owns, what killed saves leave and how it
is removed: written once over :class:`~checkpoint.storage.bytestore.ByteStore` for every backend
(plain local paths and ``file://`` through :class:`~checkpoint.storage.bytestore.LocalStore`,
``memory://`` and ``s3://`` through fsspec). Only the commit point differs, by what the store
offers:

- **rename** (:class:`~checkpoint.storage.bytestore.LocalStore`): the save's files are written
  in a staging directory under the checkpoint's writer lock and renamed into place
  (:class:`checkpoint.storage.local_commit.StagedCheckpoint`); file names stay Hugging Face's.
- **no rename** (object stores, :class:`RemoteCommit` below): the model index is the commit
  marker, every other object carries the save's token.

Written once for both (this module): what a checkpoint owns (:func:`owned_objects`: only what a
record fqnckpt wrote names), whether it is complete (:func:`is_committed`), what killed saves
left (:func:`leftovers`, listed by ``inspect``) and their removal (:func:`clean_dead`, by every
commit), the removal of a checkpoint (:func:`remove_checkpoint`, the manager's retention). What
each backend guarantees to concurrent writers is in docs/guides/object-storage.md.

The object-store commit:

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
   removed) and the index never names objects another save deleted. ``memory://`` compares and
   swaps under one process-wide lock; other fsspec backends without conditional writes re-read
   the index just before the PUT: a narrow race remains there (docs/commit-protocol.md lists each backend).
4. Only then are deleted: the objects the previous index owned (:func:`owned_objects`) and not
   the new one; and of every other staging manifest that can no longer commit (its ``base`` is not
   the new index), the objects it names that carry its token, its incomplete multipart uploads
   (S3 ``list_multipart_uploads`` filtered to those names), what it ``replaces`` (the objects of
   its base checkpoint: a save killed between its index PUT and this step leaves them named
   there) and the manifest. Our manifest last.
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
import json
import re
import uuid
import warnings
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..testing import faults
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
    there was none; ``objects``: the names the save writes (each carries ``token``);
    ``replaces``: the objects of the checkpoint of ``base`` that carry another save's token (what
    the commit deletes after its index PUT; a save killed in between leaves them named here, so
    the next commit there removes them instead of leaving them unowned forever)."""

    model_config = ConfigDict(extra="forbid")
    format: Literal["fqnckpt-staging-1"] = "fqnckpt-staging-1"
    token: str = Field(pattern=r"^[0-9a-f]{12}$")
    base: str | None
    objects: list[str]
    replaces: list[str] = []


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


# Files a checkpoint without a record of fqnckpt's (another tool's, or fqnckpt's before its model
# index listed every file) owns by name: the ones its readers open by name or glob, so that an
# overwrite leaves none of them stale. With a record, only what the record names is owned.
UNRECORDED_NAMES = frozenset(
    [MODEL_INDEX, index_name(OPTIMIZER_PREFIX), f"{MODEL_PREFIX}.safetensors", f"{OPTIMIZER_PREFIX}.safetensors",
     "migration_report.json", "conversion_report.json", "extra_state.json"]
)  # fmt: skip
_MODEL_PARALLEL = re.compile(r"^consolidated\.\d{2,}\.pth$")  # Meta's shards: its readers glob these names
RECORD = ".fqnckpt-record.json"  # the record of a checkpoint without a model index (Meta's layout)


class ObjectRecord(BaseModel):
    """:data:`RECORD`: every object a save of a layout without a model index wrote (Meta's
    ``consolidated.NN.pth``, ``params.json``, the report), written last; what an overwrite or a
    removal of that checkpoint deletes."""

    model_config = ConfigDict(extra="forbid")
    format: Literal["fqnckpt-record-1"] = "fqnckpt-record-1"
    objects: list[str]
    # sha256 (index_digest) of each side file among ``objects`` (params.json): a removal deletes
    # one only while its bytes are these, as a model index's ``object_digests`` rules.
    object_digests: dict[str, str] = Field(default_factory=dict)


def _plain(name: object) -> bool:
    return isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


def _record(store: ByteStore) -> ObjectRecord | None:
    try:
        return ObjectRecord.model_validate_json(store.get(RECORD) or b"")
    except (ValidationError, ValueError):
        return None


def _per_rank_files(store: ByteStore) -> list[str]:
    """The per-rank extra-state files an unrecorded checkpoint's ``extra_state.json`` lists
    (``per_rank.world_size``; read as plain JSON: inspect imports no torch)."""
    try:
        doc = json.loads(store.get("extra_state.json") or b"null")
        world = doc["per_rank"]["world_size"] if isinstance(doc, dict) and isinstance(doc.get("per_rank"), dict) else None
    except (ValueError, KeyError, TypeError):
        return []
    if not isinstance(world, int) or isinstance(world, bool) or not 0 < world < 1 << 20:
        return []
    return [f"extra_state.rank-{r:05d}-of-{world:05d}.json" for r in range(world)]  # extra_state.rank_file_name


_UNREAD = object()


def owned_objects(store: ByteStore, index: IndexFile | None | object = _UNREAD, listing: Iterable[str] | None = None) -> set[str]:
    """Objects the checkpoint at ``store`` owns, from its records only: its model index (``index``
    when already fetched and parsed), the shards it names, the objects of its
    ``metadata.fqnckpt.objects`` and the shards of the optimizer index named there; or, without a
    model index, what :data:`RECORD` names. A checkpoint without any fqnckpt record (another
    tool's) owns the names its readers open (:data:`UNRECORDED_NAMES`, Meta's
    ``consolidated.NN.pth`` among ``listing``) and the files its indexes name. Plain names only;
    the same on every byte store."""
    if index is _UNREAD:
        index = parse_index(store.get(MODEL_INDEX))
    owned: set[str] = set()
    objects = None
    if index is not None:
        owned |= {MODEL_INDEX, *index.files()}
        meta = index.metadata.fqnckpt
        objects = dict(meta.objects) if meta is not None and meta.objects is not None else None
    record = _record(store)
    if record is not None:
        owned |= {RECORD, *record.objects}
    opt_name = index_name(OPTIMIZER_PREFIX)
    if objects is not None:
        owned.update(objects.values())
        opt_name = objects.get(opt_name)
    elif record is None:  # no record of ours: the names readers of this layout open
        listing = store.listing() if listing is None else listing
        if index is None and not holds_checkpoint(store, listing):
            return set()  # no checkpoint: nothing here is one's
        owned |= UNRECORDED_NAMES | set(_per_rank_files(store))
        meta = {n for n in listing if _MODEL_PARALLEL.match(n)}
        owned |= meta | ({"params.json"} if meta else set())  # Meta's layout: its shards and their params
    if opt_name is not None and (index is not None or record is None):
        opt = parse_index(store.get(opt_name)) if _plain(opt_name) else None
        if opt is not None:
            owned.update(opt.files())
    return {n for n in owned if _plain(n)}


def recorded_object(index: IndexFile | None, name: str) -> str | None:
    """The object holding file ``name`` (``optimizer.safetensors.index.json``,
    ``extra_state.json``) of the checkpoint whose model index is ``index``: with a record of
    ours (``metadata.fqnckpt.objects``), the object it names, None when the save wrote none;
    without one (another tool's checkpoint), ``name``. Every reader resolves parts through this,
    so a file another run left beside a checkpoint is never read as one of its parts."""
    if name == MODEL_INDEX:
        return name
    meta = index.metadata.fqnckpt if index is not None else None
    if meta is not None and meta.objects is not None:
        return meta.objects.get(name)
    return name


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


def _replaced(man: StagingManifest) -> set[str]:
    """The objects of the checkpoint ``man``'s save started from (``replaces``): garbage once
    that checkpoint's index is no longer there (the manifest is dead), tokened names only."""
    return {n for n in man.replaces if _plain(n) and token_of(n) not in (None, man.token)}


def holds_checkpoint(store: ByteStore, listing: Iterable[str] | None = None) -> bool:
    """Whether a checkpoint is at ``store`` (what a save without ``overwrite`` refuses to replace):
    a model index, fqnckpt's :data:`RECORD`, a single ``model.safetensors`` or Meta's first shard."""
    listing = store.listing() if listing is None else listing
    return any(n in listing for n in (MODEL_INDEX, RECORD, f"{MODEL_PREFIX}.safetensors", "consolidated.00.pth"))


# Objects readers open instead of our index when they are there: transformers opens
# model.safetensors before any index; fqnckpt's readers and DCP read a directory holding DCP's
# .metadata as that DCP checkpoint. A stale one beside a new save would shadow it.
SHADOWING = frozenset({"model.safetensors", ".metadata"})


# Parts a reader of a checkpoint without a record of ours opens by name (older fqnckpt, scripts):
# beside a new save they would be taken for its optimizer or extra state.
FOREIGN_PARTS = frozenset([index_name(OPTIMIZER_PREFIX), f"{OPTIMIZER_PREFIX}.safetensors", "extra_state.json"])


def check_clashes(
    store: ByteStore, names: Iterable[str], owned: set[str], listing: Iterable[str] | None = None, overwrite: bool = True
) -> None:
    """Refuse a save that would replace an object no fqnckpt record names (a user's
    ``config.json``, a foreign ``model-00001-of-00001.safetensors`` beside no index), or leave
    beside it one that readers open instead of its index (:data:`SHADOWING`), or, without
    ``overwrite``, one that readers of an unrecorded checkpoint take for its optimizer or extra
    state (:data:`FOREIGN_PARTS`): ``names`` are the names the save writes as they are, ``owned``
    what the checkpoint there owns. The same rule on every byte store.

    Raises:
        CheckpointExistsError: naming the objects; nothing of the save is committed."""
    listing = store.listing() if listing is None else listing
    shadowing = SHADOWING if overwrite else SHADOWING | FOREIGN_PARTS
    clash = sorted(
        n for n in (set(names) | shadowing) - owned - {MODEL_INDEX} if n in listing and (n in shadowing or not n.startswith("."))
    )
    if clash:
        raise CheckpointExistsError(
            store.url, f"{clash} exist there and no record of the checkpoint names them (not written by fqnckpt); "
            "refusing to replace them, or to leave them beside the new checkpoint where readers open them "
            "instead of its index or as its parts: move them away, or save elsewhere",
        )


# What a save of fqnckpt's writes as parts of a checkpoint (tensor files, indexes, DCP's metadata,
# extra state, reports, the record, every tokened object name). Everything else a record names
# (config.json, generation_config.json, tokenizer files, params.json) is a
# side file that users edit and other tools open by name: an overwrite never removes one (the new
# save replaces it when it writes its own), a removal only while its bytes match the record.
_PART_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".distcp", ".index.json")
# adapter_config.json is a part: it gives the meaning of adapter_model.safetensors (rank, alpha).
_PART_NAMES = frozenset([".metadata", "migration_report.json", "conversion_report.json", "adapter_config.json"])


def is_part(name: str) -> bool:
    """Whether object ``name`` is a part of a checkpoint (see above), not a side file."""
    return name.endswith(_PART_SUFFIXES) or name in _PART_NAMES or name == RECORD or name.startswith("extra_state") or token_of(name) is not None


def carried_side_files(store: ByteStore, previous: IndexFile | None, writing: Iterable[str]) -> tuple[dict[str, str], dict[str, str]]:
    """The side files (:func:`is_part` False) the record ``previous`` (the model index a save
    replaces) names and that stay there because the save does not write them (``writing``: the
    names it writes): ``(objects, object_digests)`` to carry into the new record, so that they
    stay the checkpoint's (a later save may replace them, a removal deletes them while unedited)."""
    meta = previous.metadata.fqnckpt if previous is not None else None
    if meta is None or meta.objects is None:
        return {}, {}
    listing, writing = store.listing(), set(writing)
    kept = {n: o for n, o in meta.objects.items() if not is_part(o) and n not in writing and listing.get(o, ("",))[0] == "file"}
    digests = {o: d for o, d in (meta.object_digests or {}).items() if o in kept.values()}
    return kept, digests


def removable(
    store: ByteStore, index: IndexFile | None | object = _UNREAD, listing: dict[str, tuple[str, int]] | None = None, side: bool = False
) -> dict[str, int | None]:
    """What an overwrite (``side=False``) or a removal (``side=True``) of the checkpoint at
    ``store`` deletes, ``{name: recorded byte size or None}``: the objects it owns
    (:func:`owned_objects`) that still match their record. A part (:func:`is_part`) matches while
    it is no directory and, where the index records its size, has that size; a side file only
    with ``side``, and only while its bytes' sha256 is the one the record holds. An object that
    changed since its save is no longer the checkpoint's: it stays. The same on every byte store."""
    listing = store.listing() if listing is None else listing
    if index is _UNREAD:
        index = parse_index(store.get(MODEL_INDEX))
    meta = index.metadata.fqnckpt if isinstance(index, IndexFile) else None
    sizes = {n: r.size for n, r in meta.files.items()} if meta is not None else {}
    digests = dict(meta.object_digests or {}) if meta is not None else {}
    if index is None and (record := _record(store)) is not None:  # Meta's layout: the record's digests
        digests = dict(record.object_digests)
    out: dict[str, int | None] = {}
    for name in owned_objects(store, index, listing):
        kind, size = listing.get(name, ("missing", 0))
        if kind in ("missing", "directory"):
            continue
        if is_part(name):
            if kind != "file" or sizes.get(name) in (None, size):
                out[name] = sizes.get(name)
        elif side and kind == "file" and name in digests and index_digest(store.get(name)) == digests[name]:
            out[name] = size
    return out


def leftovers(store: ByteStore, listing: dict[str, tuple[str, int]] | None = None) -> dict[str, list[str]]:
    """What unfinished saves left under ``store`` that no record of the checkpoint names:
    ``{"staging": staging manifests and staging directories, "objects": objects the manifests
    name that exist, "uploads": unfinished writers of those objects (S3 multipart uploads, a
    local writer's partial file)}``. ``inspect`` lists them; the next save there removes those of
    saves that can no longer commit (:func:`clean_dead`). The same on every byte store."""
    listing = store.listing() if listing is None else listing
    mans = staged_saves(store, listing)
    now = index_digest(store.get(MODEL_INDEX))
    named = set().union(*(_named(m) | (_replaced(m) if m.base != now else set()) for m in mans)) if mans else set()
    # a save killed after its commit, before its cleanup, leaves a manifest naming live objects
    named -= owned_objects(store, listing=listing)
    return {
        "staging": sorted([staging_name(m.token) for m in mans] + store.staging_areas()),
        "objects": sorted(n for n in named if n in listing),
        "uploads": sorted(n for n, _ in store.uploads() if n in named) if mans else [],
    }


def _clean(store: ByteStore, dead: list[StagingManifest], keep: set[str], replaced: bool = True) -> None:
    """Abort the uploads and delete the objects (but ``keep``) of saves ``dead`` (``replaced``:
    and what they replaced: only for manifests whose base index is gone), then their manifests."""
    if not dead:
        return
    named = set().union(*(_named(m) | (_replaced(m) if replaced else set()) for m in dead)) - keep
    for name, upload_id in store.uploads():
        if name in named:
            store.abort_upload(name, upload_id)
    store.delete(sorted(named))
    store.delete([staging_name(m.token) for m in dead])


def clean_dead(store: ByteStore, keep: set[str], *, token: str | None = None, unborn: bool = False) -> None:
    """Remove what saves that can no longer commit at ``store`` left (but ``keep``): the staging
    manifests whose ``base`` is not the model index there now (``unborn``: also those started
    where there was none), the objects they name and their unfinished uploads, and the store's
    staging areas (:meth:`~checkpoint.storage.bytestore.ByteStore.staging_areas`: a local
    save's staging directories, dead once the writer lock is held). ``token``: this save's own
    manifest, skipped. Called by every commit and removal; the same on every byte store."""
    mans = [m for m in staged_saves(store) if m.token != token]
    if mans:  # the index is read only when there are manifests (a local save has none)
        raw = store.get(MODEL_INDEX)
        now = index_digest(raw)
        dead = [m for m in mans if m.base != now or (unborn and m.base is None)]
        if dead:
            _clean(store, dead, keep | owned_objects(store, parse_index(raw)) if raw is not None else keep)
    for area in store.staging_areas():
        store.remove_staging_area(area)


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
        if not overwrite and (raw is not None or holds_checkpoint(store)):
            raise CheckpointExistsError(store.url)
        self.raw = raw
        self.base = index_digest(raw)
        self.previous = parse_index(raw)  # an index that does not parse owns nothing we can name
        self.manifest: StagingManifest | None = None
        self.committed = False

    def name(self, logical: str) -> str:
        """The object name of file ``logical`` in this save (the model index keeps its name)."""
        return logical if logical == MODEL_INDEX else stored_name(logical, self.token)

    def begin(self, objects: Iterable[str], plain: Iterable[str] = (), overwrite: bool = True) -> None:
        """Write the staging manifest naming ``objects`` (before the first part of the save);
        ``plain``: the names the save writes as they are (``config.json``), checked first.

        Raises:
            CheckpointExistsError: a ``plain`` name exists and no record of the checkpoint there
                names it (:func:`check_clashes`); nothing written."""
        prev = owned_objects(self.store, self.previous) if self.previous is not None or self.raw is None else set()
        check_clashes(self.store, plain, prev, overwrite=overwrite)
        replaces = sorted(n for n in prev if token_of(n) not in (None, self.token))
        self.manifest = StagingManifest(token=self.token, base=self.base, objects=sorted(set(objects)), replaces=replaces)
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
            if self.manifest is not None and not self.committed:  # what it replaces is still live
                _clean(self.store, [self.manifest], set(), replaced=False)
        except (OSError, CheckpointError):
            pass

    def commit(self, index_bytes: bytes, new_owned: set[str]) -> None:
        """PUT the model index (the commit point) if the index is still the one this save started
        from, then delete what only the previous checkpoint owned and what dead saves left.

        Raises:
            ConcurrentSaveError: another save committed there meanwhile (this one is removed).
        """
        old = set(removable(self.store, self.previous)) if self.previous is not None or self.raw is None else set()
        try:
            self.store.put(MODEL_INDEX, index_bytes, if_match=self.tag, if_absent=self.raw is None)
        except PreconditionFailed:
            self.abort()
            raise ConcurrentSaveError(self.store.url) from None
        self.committed = True
        faults.fault_point("after_index_put")  # killed here: our manifest names what we replace
        try:  # committed: a failure from here on leaves only unnamed objects, never a bad checkpoint
            self.store.delete(sorted(old - new_owned - {MODEL_INDEX}))
            clean_dead(self.store, new_owned, token=self.token)
            self.store.delete([staging_name(self.token)])
        except (OSError, CheckpointError) as e:
            warnings.warn(
                f"{self.store.url}: committed, but removing the replaced objects failed ({e}); "
                "the next save there removes them",
                stacklevel=2,
            )


__all__ = [
    "RemoteCommit", "StagingManifest", "ObjectRecord", "owned_objects", "stored_name", "token_of", "parse_index",
    "leftovers", "clean_dead", "check_clashes", "removable", "is_part", "recorded_object", "carried_side_files", "FOREIGN_PARTS", "holds_checkpoint", "staged_saves", "is_committed", "remove_checkpoint", "MODEL_INDEX",
    "RECORD", "UNRECORDED_NAMES",
]  # fmt: skip


def is_committed(store: ByteStore, listing: dict[str, tuple[str, int]] | None = None) -> bool:
    """A complete checkpoint at ``store``: its model index parses and every object it owns
    (:func:`owned_objects`) exists, shards (and the optimizer's) with the byte size recorded;
    an unrecorded checkpoint's per-rank extra-state files too. No tensor data is read. The same
    on every byte store (the manager's steps)."""
    index = parse_index(store.get(MODEL_INDEX))
    if index is None:
        return False
    listing = store.listing() if listing is None else listing
    meta = index.metadata.fqnckpt
    objects = dict(meta.objects) if meta is not None and meta.objects is not None else None
    opt_name = objects.get(index_name(OPTIMIZER_PREFIX)) if objects is not None else index_name(OPTIMIZER_PREFIX)
    if objects is None and opt_name not in listing:
        opt_name = None  # unrecorded: an optimizer index only where there is one
    opt = parse_index(store.get(opt_name)) if opt_name is not None and _plain(opt_name) else None
    if opt_name is not None and opt is None:
        return False

    def present(name: str) -> bool:
        return name in listing and listing[name][0] != "directory"

    for idx in (index, opt):
        if idx is None:
            continue
        recs = idx.metadata.fqnckpt.files if idx.metadata.fqnckpt is not None else {}
        for name in idx.files():
            if not present(name) or (name in recs and listing[name][1] != recs[name].size):
                return False
    named = objects.values() if objects is not None else _per_rank_files(store)
    return all(present(name) for name in named)


def remove_checkpoint(store: ByteStore, unborn: bool = False) -> None:
    """Delete the checkpoint at ``store`` under its writer lock (a local save's; object stores
    have none): its model index first, or without one the record of Meta's layout (from then on
    no reader takes it for a checkpoint; on S3 and ``memory://`` only if unchanged since read, so
    a save committed meanwhile stays), then
    the objects it owned (:func:`owned_objects`), and what saves that can no longer commit left
    (:func:`clean_dead`; with ``unborn`` also saves started where there was none: retention of a
    step that no save may still be writing). Objects no fqnckpt record names stay, and so does
    the directory holding them. The same on every byte store (the manager's retention).

    Raises:
        ConcurrentSaveError: a save committed there after the index was read (nothing removed).
    """
    with store.writer_lock():
        raw, tag = store.get_tagged(MODEL_INDEX)
        record_raw, record_tag = store.get_tagged(RECORD) if raw is None else (None, None)
        owned = set(removable(store, parse_index(raw), side=True))
        try:  # the commit marker first: a model index, else the record of Meta's layout
            if raw is not None:
                store.delete_if(MODEL_INDEX, tag)
            elif record_raw is not None:
                store.delete_if(RECORD, record_tag)
        except PreconditionFailed:
            raise ConcurrentSaveError(store.url, "a save committed there while it was being removed; it stays") from None
        faults.fault_point("removal_after_index")
        store.delete(sorted(owned - {MODEL_INDEX, RECORD}))
        store.delete([RECORD])
        clean_dead(store, set(), unborn=unborn)
        store.remove_dir_if_empty()
