"""How a checkpoint is committed on object storage, where there is no rename (S3: a copy and a
delete) and no lock: the model index is the commit marker.

1. Every object of a save except the model index gets a name unique to the save: the save's
   token (12 hex digits) after the first dot, ``model-00001-of-00002.<token>.safetensors``,
   ``extra_state.<token>.json``, ``optimizer.<token>.safetensors.index.json`` (Hugging Face
   configs such as ``config.json`` keep their names: transformers reads them by name). Each rank
   uploads its own shard files; rank 0 the small files.
2. Once every rank's uploads are complete, rank 0 writes ``model.safetensors.index.json`` as one
   PUT (readers see the old bytes or the new, whole). It names the shard objects in
   ``weight_map`` and every other object of the save in ``metadata.fqnckpt.objects``.
3. Only then are the objects the previous checkpoint owned (:func:`owned_objects`), and not the
   new one, deleted, with leftovers of killed saves (token-named objects no index names).
   Objects fqnckpt did not write are never deleted.

A reader fetches the model index once and reads only the objects it names (see
:mod:`checkpoint.storage.remote_reader`): a killed save (no new index) leaves the previous
checkpoint readable; a checkpoint without an index is not one; the objects of two saves never
mix, since names are unique per save. A reader still reading a checkpoint whose objects a newer
save deleted gets :class:`~checkpoint.errors.MissingShardError` / ``LoadError``, never the
newer bytes. One writer at a time per checkpoint, as on a local disk (no lock exists there).
"""

from __future__ import annotations

import re
import uuid
import warnings

from pydantic import ValidationError

from ..errors import CheckpointError, CheckpointExistsError
from .format import MODEL_PREFIX, OPTIMIZER_PREFIX, IndexFile, index_name
from .objstore import ObjectStore

MODEL_INDEX = index_name(MODEL_PREFIX)
_TOKENED = re.compile(r"^[^./\\]+\.([0-9a-f]{12})\..+$")


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


def owned_objects(store: ObjectStore, index: IndexFile | None) -> set[str]:
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


class RemoteCommit:
    """One save's commit on ``store`` (see module docstring). Create it (checks the target),
    name objects with :meth:`name`, then :meth:`commit` with the model index bytes.

    Raises:
        CheckpointExistsError: a committed checkpoint is there and ``overwrite`` is False.
    """

    def __init__(self, store: ObjectStore, overwrite: bool):
        self.store, self.token = store, new_token()
        raw = store.get(MODEL_INDEX)
        if raw is not None and not overwrite:
            raise CheckpointExistsError(store.url)
        self.previous = parse_index(raw)  # an index that does not parse owns nothing we can name

    def name(self, logical: str) -> str:
        """The object name of file ``logical`` in this save (the model index keeps its name)."""
        return logical if logical == MODEL_INDEX else stored_name(logical, self.token)

    def commit(self, index_bytes: bytes, new_owned: set[str]) -> None:
        """PUT the model index (the commit point), then delete what only the previous checkpoint
        owned and leftovers of killed saves."""
        old = owned_objects(self.store, self.previous)
        self.store.put(MODEL_INDEX, index_bytes)
        try:  # committed: a failure from here on leaves only unnamed objects, never a bad checkpoint
            stale = old - new_owned - {MODEL_INDEX}
            leftovers = {
                n for n in self.store.listing() if (t := token_of(n)) is not None and t != self.token
            }
            self.store.delete(sorted(stale | (leftovers - new_owned)))
        except (OSError, CheckpointError) as e:
            warnings.warn(
                f"{self.store.url}: committed, but removing the replaced objects failed ({e}); "
                "the next save there removes them",
                stacklevel=2,
            )


__all__ = ["RemoteCommit", "owned_objects", "stored_name", "token_of", "parse_index", "MODEL_INDEX"]


def is_committed(store: ObjectStore, listing: dict[str, tuple[str, int]] | None = None) -> bool:
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


def remove_checkpoint(store: ObjectStore) -> None:
    """Delete the checkpoint at ``store``: its model index first (from then on no reader takes
    it for a checkpoint), then the objects it owned and token-named leftovers of killed saves.
    Objects fqnckpt did not write stay."""
    index = parse_index(store.get(MODEL_INDEX))
    owned = owned_objects(store, index)
    store.delete([MODEL_INDEX])
    leftovers = {n for n in store.listing() if token_of(n) is not None}
    store.delete(sorted((owned | leftovers) - {MODEL_INDEX}))
