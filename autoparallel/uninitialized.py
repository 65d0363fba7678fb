"""Refuse to compute with memory that ``to_empty`` allocated and nothing wrote since.

``to_empty`` records, per state tensor, the ``_version`` counters of the DTensor and of its local
tensor. In-place writes bump them, whichever code does them: ``init_weights`` (in-place inits,
``copy_``, reassignment copies), ``checkpoint.load`` / ``load_state_dict`` (``copy_`` into the
DTensor or its local tensor), or a write through the module. A tensor replaced in its slot counts as
written. One gap is closed by hand: a write through ``dtensor.data[...]`` bumps neither counter
(``.data`` gets its own counter, and DTensor runs the local op below autograd, where no counter is
bumped), so :class:`NoteWrites`, active in :func:`autoparallel.init_weights.dtensor_init_context`,
reports the storage of every DTensor an in-place op writes. Written by hand: torch has no notion of
"allocated, never written".
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import UninitializedStateError

_SHOWN = 8  # FQNs named in the message


def storage_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose ``_version`` in-place writes bump: a DTensor's local tensor, else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


class NoteWrites(TorchDispatchMode):
    """Report the local storage of every DTensor an in-place op writes to the pending
    :class:`FreshState` records (see module doc); free when none is pending."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _PENDING and func._schema.is_mutable:
            for arg, value in zip(func._schema.arguments, args):
                if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, DTensor):
                    note_written(value)
        return out


def note_written(t: DTensor) -> None:
    """Report an in-place write to ``t``'s local storage to the pending :class:`FreshState` records
    (for writers that bypass :class:`NoteWrites`, such as the mesh-independent random fills)."""
    if _PENDING:
        ptr = t._local_tensor.untyped_storage().data_ptr()
        for fresh in list(_PENDING):
            fresh.note_storage_written(ptr)


# FreshState records with tensors still pending (weak: a dropped module drops its record).
_PENDING: weakref.WeakSet = weakref.WeakSet()


def _versions(t: torch.Tensor) -> tuple[int, int]:
    return t._version, storage_tensor(t)._version


class FreshState:
    """The state tensors (by eager FQN) materialized by ``to_empty`` and not written since."""

    def __init__(self, current: Callable[[str], torch.Tensor], fqns: Iterable[str]):
        self._current = current
        self._pending: dict[str, tuple[weakref.ref, weakref.ref, tuple[int, int]]] = {}
        self._by_storage: dict[int, list[str]] = {}
        for fqn in fqns:
            t = current(fqn)
            local = storage_tensor(t)
            if local.numel() == 0:
                continue  # nothing to initialize
            self._pending[fqn] = (weakref.ref(t), weakref.ref(local), _versions(t))
            self._by_storage.setdefault(local.untyped_storage().data_ptr(), []).append(fqn)
        if self._pending:
            _PENDING.add(self)

    def note_storage_written(self, data_ptr: int) -> None:
        """The storage at ``data_ptr`` was written: its tensors are initialized."""
        for fqn in self._by_storage.pop(data_ptr, ()):
            self._pending.pop(fqn, None)
        if not self._pending:
            _PENDING.discard(self)

    def never_written(self) -> list[str]:
        """FQNs still holding what ``to_empty`` left (written ones are forgotten: the check gets free)."""
        for fqn, (ref, local_ref, versions) in list(self._pending.items()):
            t = self._current(fqn)
            if ref() is not t or local_ref() is not storage_tensor(t) or _versions(t) != versions:
                del self._pending[fqn]
        if not self._pending:
            _PENDING.discard(self)
        return list(self._pending)

    def check(self) -> None:
        """Raises :class:`UninitializedStateError` naming the never-written tensors, if any."""
        if not self._pending:
            return
        names = self.never_written()
        if names:
            shown = ", ".join(names[:_SHOWN]) + (
                f", ... ({len(names)} in all)" if len(names) > _SHOWN else ""
            )
            raise UninitializedStateError(
                f"{len(names)} tensor(s) hold the uninitialized memory that to_empty() allocated: {shown}. "
                "Call init_weights() (it also computes non-persistent buffers, which checkpoints do not "
                "hold) and/or checkpoint.load() before forward",
                names,
            )
