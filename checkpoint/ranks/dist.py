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

from ..errors import CheckpointError, RankAgreementError

_local = threading.local()


@contextlib.contextmanager
def using_group(group: Any) -> Iterator[None]:
    """Run this thread's collectives of this module on ``group`` (a group of every rank, e.g. the
    gloo group of background saves, so they never interleave with the training loop's collectives
    on the default group). Ranks are the same as in the default group."""
    prev = getattr(_local, "group", None)
    _local.group = group
    try:
        yield
    finally:
        _local.group = prev


def _group() -> Any:
    return getattr(_local, "group", None)


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
    """Every rank's ``obj``, indexed by rank."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_group())
    return out


def check_all(what: str, error: BaseException | None) -> None:
    """Collective: raise on every rank if any rank passes an ``error``.

    The failing rank re-raises its own exception; the others raise :class:`RankAgreementError`
    naming the failed rank(s) and their messages.
    """
    msg = None if error is None else f"{type(error).__name__}: {error}"
    msgs = all_gather_object(msg)
    failures = {r: m for r, m in enumerate(msgs) if m is not None}
    if not failures:
        return
    if error is not None:
        raise error
    raise RankAgreementError(what, failures)


def check_all_gather(what: str, error: BaseException | None, value: Any) -> list[Any]:
    """:func:`check_all` and :func:`all_gather_object` of ``value`` in one exchange (each
    collective costs milliseconds): every rank's ``value`` by rank, or the same raises as
    :func:`check_all` when any rank passes an ``error``."""
    msg = None if error is None else f"{type(error).__name__}: {error}"
    got = all_gather_object((msg, None if error is not None else value))
    failures = {r: m for r, (m, _) in enumerate(got) if m is not None}
    if not failures:
        return [v for _, v in got]
    if error is not None:
        raise error
    raise RankAgreementError(what, failures)


def any_true(flag: bool) -> bool:
    """Collective: whether ``flag`` is true on any rank. One ``all_reduce`` of one element (a
    barrier that also carries a yes / no), where :func:`check_all` gathers pickled messages (two
    collectives); the tensor lives where the group's backend reduces (CPU for gloo, the current
    accelerator otherwise)."""
    group = _group()
    backend = str(dist.get_backend(group))
    if "gloo" in backend or "mpi" in backend:
        device = torch.device("cpu")
    else:
        acc = torch.accelerator.current_accelerator()
        device = torch.device(acc.type, torch.accelerator.current_device_index()) if acc is not None else torch.device("cpu")
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


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
    "barrier",
    "any_true",
    "using_group",
    "CheckpointError",
]
