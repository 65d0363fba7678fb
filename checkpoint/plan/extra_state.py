"""The one extra-state planner: the checkpoint's ``extra_state.json`` matched with the caller's
``extra_state`` (format: :mod:`checkpoint.storage.extra_state`), checked before anything changes."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from ..storage.extra_state import EXTRA_STATE_FILE, REPORT_PREFIX, _decode, is_stateful, read_extra_state_file


class ExtraStateRestore:
    """Decoded entries ready to apply; built by :func:`plan_extra_state` before anything is mutated."""

    def __init__(self, target: MutableMapping[str, Any], values: dict[str, Any]):
        self.target, self.values = target, values

    def apply(self) -> None:
        """Restore stateful objects in place (``load_state_dict``) and set plain values in the
        caller's dict. A tensor goes to the device of the tensor the dict held under its key."""
        for k, v in self.values.items():
            cur = self.target[k]
            if is_stateful(cur):
                cur.load_state_dict(v)
            else:
                if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor):
                    v = v.to(cur.device)
                self.target[k] = v



def plan_extra_state(root: str | None, extra_state: MutableMapping[str, Any], report) -> ExtraStateRestore:
    """Match the checkpoint's extra state with the caller's ``extra_state``, record the result in
    ``report`` (``LoadReport``; entries are named ``extra_state.<key>`` in ``missing_keys``,
    ``unexpected_keys`` and ``loaded_keys``) and decode what matches. Mutates nothing else.

    ``root``: the checkpoint directory (None for a single-file checkpoint: nothing stored).
    A stateful target must have been saved stateful, and a plain one plain.

    Raises:
        TypeError: ``extra_state`` is not a mutable mapping, or a stored entry's kind (saved through
            ``state_dict()`` or plain) differs from the target's (names the key and file).
        CorruptCheckpointError, ChecksumMismatchError: see :func:`read_extra_state_file`; also
            undecodable data.
    """
    if not isinstance(extra_state, MutableMapping):
        raise TypeError(f"extra_state must be a mutable mapping to fill, got {type(extra_state).__name__}")
    doc = read_extra_state_file(root) if root is not None else None
    stored = doc.entries if doc is not None else {}
    values: dict[str, Any] = {}
    path = os.path.join(root or "", EXTRA_STATE_FILE)
    for k, cur in extra_state.items():
        if k not in stored:
            report.missing_keys.append(REPORT_PREFIX + k)
            continue
        e = stored[k]
        if e.stateful != is_stateful(cur):
            saved = f"through state_dict() ({e.class_name})" if e.stateful else "as a plain value"
            raise TypeError(
                f"{path}: extra_state {k!r} was saved {saved}, but the target is a {type(cur).__name__}"
            )
        try:
            values[k] = _decode(e.value, k)
        except ValueError as err:
            raise CorruptCheckpointError(path, f"extra_state {k!r}: {err}") from err
        report.loaded_keys.append(REPORT_PREFIX + k)
    report.unexpected_keys.extend(REPORT_PREFIX + k for k in stored if k not in extra_state)
    for field in ("missing_keys", "unexpected_keys", "loaded_keys"):
        getattr(report, field).sort()
    return ExtraStateRestore(extra_state, values)
