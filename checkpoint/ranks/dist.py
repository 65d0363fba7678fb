"""Where ranks talk: every collective of a distributed save / load is here.

All calls use the default process group (every rank of the job takes part), or the group set
for the calling thread with :func:`using_group`. Failures are agreed:
:func:`check_all` gathers each rank's error so one rank's failure fails every rank instead of
leaving the others hanging in the next collective.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointError, CheckpointExistsError, ConcurrentSaveError, CorruptCheckpointError, RankAgreementError

_AGREED = {c.__name__: c for c in (ConcurrentSaveError, CheckpointExistsError, CorruptCheckpointError)}

_local = threading.local()


@contextlib.contextmanager
def using_group(group: Any) -> Iterator[None]:
    """Run this thread's collectives of this module on ``group``: a group of every rank (the gloo
    group of background saves, so they never interleave with the training loop's collectives on
    the default group), or the ranks of a load's DTensor meshes. Messages name default-group
    ranks (:func:`group_ranks`)."""
    prev = getattr(_local, "group", None)
    _local.group = group
    try:
        yield
    finally:
        _local.group = prev


def _group() -> Any:
    return getattr(_local, "group", None)


def current_group() -> Any:
    """The group this thread's collectives run on (:func:`using_group`), None for the default
    group: what a collective of another library (``dcp.load``) is given to stay on the same ranks."""
    return _group()


def active() -> bool:
    """True inside an initialized default process group, of any world size: a group of one rank
    (``torchrun --nproc-per-node 1``, a 1-GPU FSDP2 run) is a world like any other, and every
    collective here works on it."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` of rank ``src`` on every rank (picklable objects only)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_group())
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` of the group in use, indexed by rank in that group
    (:func:`group_ranks` gives each one's rank in the default group)."""
    out: list[Any] = [None] * dist.get_world_size(_group())
    dist.all_gather_object(out, obj, group=_group())
    return out


def group_ranks() -> list[int]:
    """The default-group rank of each rank of the group in use, in group order (the group of
    :func:`using_group`, else every rank)."""
    group = _group()
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _message(error: BaseException | None) -> Any:
    """What a rank sends of its ``error``: its message, and for an error every rank must raise
    alike (a class with ``agreed = True``: ConcurrentSaveError, CheckpointExistsError,
    CorruptCheckpointError) its class name and constructor arguments."""
    if error is None:
        return None
    msg = f"{type(error).__name__}: {error}"
    if getattr(type(error), "agreed", False) and type(error).__name__ in _AGREED:
        return (msg, type(error).__name__, tuple(error.agreed_args()))
    return msg


def _raise_for(what: str, error: BaseException | None, sent: dict[int, Any]) -> None:
    """Raise on this rank: its own ``error``; else the first failed rank's agreed error rebuilt
    (the same class on every rank, the RankAgreementError as its cause); else RankAgreementError."""
    if error is not None:
        raise error
    failures = {r: m if isinstance(m, str) else m[0] for r, m in sent.items()}
    agreement = RankAgreementError(what, failures)
    for r in sorted(sent):
        m = sent[r]
        if not isinstance(m, str) and m[1] in _AGREED:  # only our own classes, by name: nothing else is rebuilt
            path, why, *rest = m[2]
            raise _AGREED[m[1]](path, f"{why} (found on rank {r})", *rest) from agreement
    raise agreement


def check_all(what: str, error: BaseException | None) -> None:
    """Collective: raise on every rank if any rank passes an ``error``.

    The failing rank re-raises its own exception; the others raise :class:`RankAgreementError`
    naming the failed rank(s) and their messages, or, when a rank's error is one every rank must
    raise alike (:class:`~checkpoint.errors.ConcurrentSaveError`,
    :class:`~checkpoint.errors.CheckpointExistsError`), that error (the agreement as its cause).
    """
    # One small all_reduce when every rank is fine (the common case); the messages are gathered
    # (two collectives and pickling) only when some rank failed.
    if not any_true(error is not None):
        return
    msgs = all_gather_object(_message(error))
    failures = {r: m for r, m in zip(group_ranks(), msgs) if m is not None}
    if not failures:
        return
    _raise_for(what, error, failures)


def check_all_gather(what: str, error: BaseException | None, value: Any) -> list[Any]:
    """:func:`check_all` and :func:`all_gather_object` of ``value`` in one exchange (each
    collective costs milliseconds): every rank's ``value`` by rank, or the same raises as
    :func:`check_all` when any rank passes an ``error``."""
    got = all_gather_object((_message(error), None if error is not None else value))
    failures = {r: m for r, (m, _) in zip(group_ranks(), got) if m is not None}
    if not failures:
        return [v for _, v in got]
    _raise_for(what, error, failures)
    raise AssertionError("unreachable")


def any_true(flag: bool) -> bool:
    """Collective: whether ``flag`` is true on any rank. One ``all_reduce`` of one element (a
    barrier that also carries a yes / no), where :func:`check_all` gathers pickled messages (two
    collectives); the tensor lives where the group's backend reduces (CPU for gloo, the current
    accelerator otherwise)."""
    group = _group()
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def collective_device(group: Any = None) -> torch.device:
    """Where a tensor of a collective on ``group`` (None: the default group) lives: the CPU for
    gloo and MPI, else the current accelerator (NCCL takes only its tensors)."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    if acc is None:
        return torch.device("cpu")
    return torch.device(acc.type, torch.accelerator.current_device_index())


def barrier() -> None:
    dist.barrier(group=_group())


__all__ = [
    "active",
    "rank",
    "world_size",
    "broadcast_object",
    "all_gather_object",
    "check_all",
    "check_all_gather",
    "group_ranks",
    "current_group",
    "barrier",
    "any_true",
    "collective_device",
    "using_group",
    "CheckpointError",
]
