"""The one extra-state planner: the checkpoint's extra state (``extra_state.json`` of an fqnckpt
checkpoint, format :mod:`checkpoint.storage.extra_state`; the non-model entries of a DCP
checkpoint such as torchtitan's ``lr_scheduler``, ``dataloader``, ``train_state``) matched with
the caller's ``extra_state``, every check made before anything changes.

For a stateful target (``state_dict`` / ``load_state_dict``): the stored entry must have been
saved stateful, by the same class (fqnckpt records the class name), as a dict with the keys of the
target's own ``state_dict()``; then the object's own ``load_state_dict`` is tried on a deep copy
of it (sharing the model, optimizer and tensors it references, which it must not change), or,
where the object cannot be copied, on the object itself with its ``state_dict()`` and
attributes put back afterwards. Any refusal is :class:`ExtraStateMismatchError` naming the entry.

A :class:`~checkpoint.storage.extra_state.PerRank` target takes this rank's saved value (same
world size) or the value its ``reshard`` rule derives from every saved rank's (another world
size; no rule: refused naming the entry); the checks above then apply to the wrapped object.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CorruptCheckpointError, ExtraStateMismatchError
from ..ranks import dist
from ..sources.dcp import EXTRA_KINDS, read_entries
from ..storage.extra_state import (
    EXTRA_STATE_FILE,
    REPORT_PREFIX,
    PerRank,
    decode_node,
    is_stateful,
    rank_file_name,
    ExtraStateEntry,
    read_extra_state_file,
    read_rank_file,
    snapshot_extra_state,
)


@dataclass
class StoredExtra:
    """One stored extra-state entry: ``stateful`` (None where the format does not say, DCP),
    ``class_name`` (None where not recorded), the decoded ``value``."""

    stateful: bool | None
    class_name: str | None
    value: Any


class ExtraStateRestore:
    """Checked entries ready to apply; built by :func:`plan_extra_state` before anything is mutated."""

    def __init__(self, target: MutableMapping[str, Any], values: dict[str, Any]):
        self.target, self.values = target, values

    def apply(self) -> None:
        """Restore stateful objects in place (``load_state_dict``) and set plain values in the
        caller's dict. A tensor goes to the device of the tensor the dict held under its key."""
        for k, v in self.values.items():
            cur = self.target[k]
            if isinstance(cur, PerRank):
                if is_stateful(cur.value):
                    cur.value.load_state_dict(v)
                else:
                    cur.value = v.to(cur.value.device) if _both_tensors(v, cur.value) else v
                continue
            if is_stateful(cur):
                cur.load_state_dict(v)
            else:
                if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor):
                    v = v.to(cur.device)
                self.target[k] = v


def _both_tensors(a: Any, b: Any) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)


def _decoded(e: Any, k: str, where: str) -> StoredExtra:
    try:
        value = decode_node(e.value, k)
    except ValueError as err:
        raise CorruptCheckpointError(where, f"extra_state {k!r}: {err}") from err
    return StoredExtra(e.stateful, e.class_name, value)


def _per_rank_stored(reader: Any, k: str, target: PerRank) -> StoredExtra | None:
    """This rank's value of per-rank entry ``k`` (re-derived by ``target.reshard`` when the
    checkpoint was saved by another number of ranks); None where the checkpoint has none."""
    root = reader.root if getattr(reader, "index_path", None) else None
    doc = read_extra_state_file(root) if root is not None else None
    if doc is None or doc.per_rank is None or k not in doc.per_rank.keys:
        return None
    rank, world = (dist.rank(), dist.world_size()) if dist.active() else (0, 1)
    saved_world = doc.per_rank.world_size
    if saved_world == world:
        rf = read_rank_file(root, doc, rank)
        return _decoded(rf.entries[k], k, os.path.join(root, rank_file_name(rank, world)))
    if target.reshard is None:
        raise ExtraStateMismatchError(
            k, os.path.join(root, EXTRA_STATE_FILE),
            f"was saved per rank by {saved_world} ranks and this world has {world}; "
            f"PerRank({type(target.value).__name__}) has no reshard rule (PerRank(..., reshard=fn))",
        )  # fmt: skip
    saved = [
        _decoded(read_rank_file(root, doc, r).entries[k], k, os.path.join(root, rank_file_name(r, saved_world)))
        for r in range(saved_world)
    ]
    value = target.reshard([e.value for e in saved], rank, world)
    return StoredExtra(saved[0].stateful, saved[0].class_name, value)


def _stored(reader: Any, where: str) -> dict[str, StoredExtra]:
    """The extra state the checkpoint behind ``reader`` holds (empty for a single file)."""
    entries = getattr(reader, "extra_entries", None)
    if entries is not None:  # DCP: top-level entries that are not model or optimizer
        return {k: StoredExtra(None, None, v) for k, v in entries().items()}
    root = reader.root if getattr(reader, "index_path", None) else None
    doc = read_extra_state_file(root) if root is not None else None
    out = {}
    for k, e in (doc.entries if doc is not None else {}).items():
        out[k] = _decoded(e, k, where)
    return out


def _per_rank_keys(reader: Any) -> list[str]:
    root = reader.root if getattr(reader, "index_path", None) else None
    doc = read_extra_state_file(root) if root is not None else None
    return list(doc.per_rank.keys) if doc is not None and doc.per_rank is not None else []


def _shared(plan: Any, optimizer: Any) -> dict[int, Any]:
    """deepcopy memo making a copy share what it must not duplicate or change."""
    memo: dict[int, Any] = {}
    for obj in (optimizer, *(a.entry.tensor for a in getattr(plan, "copies", ()))):
        if obj is not None:
            memo[id(obj)] = obj
    return memo


def _try_load(key: str, cur: Any, value: Any, where: str, memo: dict[int, Any]) -> None:
    """Run ``cur.load_state_dict(value)`` where it changes nothing (see module docstring)."""
    try:
        trial = copy.deepcopy(cur, dict(memo))
    except Exception:  # noqa: BLE001 - an object that cannot be copied: snapshot and restore
        trial = None
    if trial is not None:
        try:
            trial.load_state_dict(value)
        except Exception as e:  # noqa: BLE001 - the object's own check refused the state
            raise ExtraStateMismatchError(
                key, where, f"was refused by {type(cur).__name__}.load_state_dict: {type(e).__name__}: {e}"
            ) from e
        return
    before = copy.deepcopy(cur.state_dict())
    attrs = dict(vars(cur)) if hasattr(cur, "__dict__") else None
    try:
        cur.load_state_dict(value)
        err = None
    except Exception as e:  # noqa: BLE001
        err = e
    if attrs is not None:
        vars(cur).clear()
        vars(cur).update(attrs)
    cur.load_state_dict(before)
    if err is not None:
        raise ExtraStateMismatchError(
            key, where, f"was refused by {type(cur).__name__}.load_state_dict: {type(err).__name__}: {err}"
        ) from err


def plan_extra_state(
    reader: Any,
    extra_state: MutableMapping[str, Any],
    report,
    *,
    plan: Any = None,
    optimizer: Any = None,
) -> ExtraStateRestore:
    """Match the checkpoint's extra state with the caller's ``extra_state``, record the result in
    ``report`` (``LoadReport``; entries are named ``extra_state.<key>`` in ``missing_keys``
    (named by the caller, not stored: a strict failure), ``ignorable_keys`` (stored, not named:
    not read) and ``loaded_keys``) and check what matches (see module docstring).
    Mutates nothing.

    ``reader``: the load's source (a :class:`~checkpoint.storage.reader.CheckpointReader`, whose
    directory may hold ``extra_state.json``, or a DCP reader with ``extra_entries()``).
    ``plan`` / ``optimizer``: what a trial copy shares instead of copying.

    Raises:
        TypeError: ``extra_state`` is not a mutable mapping.
        ExtraStateMismatchError: a stored entry's kind (stateful or plain), class, or keys differ
            from the target's, or the target's ``load_state_dict`` refuses it (names key and file).
        CorruptCheckpointError, ChecksumMismatchError: see
            :func:`~checkpoint.storage.extra_state.read_extra_state_file`; also undecodable data.
    """
    if not isinstance(extra_state, MutableMapping):
        raise TypeError(f"extra_state must be a mutable mapping to fill, got {type(extra_state).__name__}")
    where = os.path.join(reader.root or "", EXTRA_STATE_FILE) if not hasattr(reader, "extra_entries") else reader.root
    stored = _stored(reader, where)
    values: dict[str, Any] = {}
    memo = _shared(plan, optimizer)
    per_rank_keys = _per_rank_keys(reader)
    for k, target in extra_state.items():
        if isinstance(target, PerRank):
            if k in stored:
                raise ExtraStateMismatchError(k, where, "was saved for every rank alike, but the target is PerRank")
            e = _per_rank_stored(reader, k, target)
            cur = target.value
        elif k in per_rank_keys:
            raise ExtraStateMismatchError(
                k, where, f"was saved per rank (PerRank), but the target is a {type(target).__name__}"
            )
        else:
            e, cur = stored.get(k), target
        if e is None:
            report.missing_keys.append(REPORT_PREFIX + k)
            continue
        stateful = is_stateful(cur)
        # A stateful entry of unknown class (migrated from DCP) may also fill a plain target.
        if e.stateful is not None and e.stateful != stateful and not (e.stateful and e.class_name is None):
            saved = f"through state_dict() ({e.class_name})" if e.stateful else "as a plain value"
            raise ExtraStateMismatchError(k, where, f"was saved {saved}, but the target is a {type(cur).__name__}")
        if stateful:
            if e.class_name is not None and e.class_name != type(cur).__name__:
                raise ExtraStateMismatchError(
                    k, where, f"was saved from a {e.class_name}, but the target is a {type(cur).__name__}"
                )
            if not isinstance(e.value, Mapping):
                raise ExtraStateMismatchError(
                    k, where, f"holds a {type(e.value).__name__}, not a state_dict for {type(cur).__name__}"
                )
            want = cur.state_dict()
            if isinstance(want, Mapping) and set(want) != set(e.value):
                raise ExtraStateMismatchError(
                    k, where, f"has keys {sorted(map(str, e.value))} differ from the target's "
                    f"state_dict() keys {sorted(map(str, want))}",
                )  # fmt: skip
            _try_load(k, cur, e.value, where, memo)
        values[k] = e.value
        report.loaded_keys.append(REPORT_PREFIX + k)
    # The caller's dict names what to restore: a stored entry it does not name (torchtitan's
    # dataloader when only the scheduler is wanted) is left unread and listed as ignorable, as
    # load(extra_state=None) leaves them all; a named entry the checkpoint lacks stays missing.
    report.ignorable_keys.extend(REPORT_PREFIX + k for k in (*stored, *per_rank_keys) if k not in extra_state)
    for field in ("missing_keys", "ignorable_keys", "loaded_keys"):
        getattr(report, field).sort()
    return ExtraStateRestore(extra_state, values)


__all__ = ["ExtraStateRestore", "StoredExtra", "plan_extra_state"]


def source_extra_state(source: Any) -> dict[str, ExtraStateEntry]:
    """The extra state of a migration source (a DCP checkpoint's entries that are neither model
    nor optimizer, ``source.extra_state``), encoded as ``extra_state.json`` holds it: torchtitan's
    :data:`~checkpoint.sources.dcp.EXTRA_KINDS` saved as dicts are marked stateful (torchtitan
    saves them from ``Stateful`` objects; the class is not recorded). ``{}`` for a source
    without. ``migrate`` writes these entries; ``fqnckpt diff`` compares them with a migrated
    checkpoint's, so equal content compares equal.

    Raises:
        TypeError / ValueError: an entry has no exact encoding in extra state (names it).
    """
    if not source.extra_state:
        return {}
    keys = {t: ks for t, ks in source._reader.extra_keys.items() if t in source.extra_state}
    values = read_entries(source, keys)
    entries = snapshot_extra_state(values)
    for k, e in entries.items():
        if source.extra_state.get(k) in EXTRA_KINDS and isinstance(values[k], dict):
            entries[k] = e.model_copy(update={"stateful": True})
    return entries
