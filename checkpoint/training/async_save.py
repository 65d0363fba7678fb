"""``async_save``: snapshot the state into reusable host buffers, then write in the background.

The call builds exactly what :func:`checkpoint.save` writes (same parts, names, optimizer and
extra state), copies every tensor this rank writes into a staging buffer and returns a
:class:`SaveFuture`. A background thread then runs the same write / hash / atomic-commit code as
``save`` on the staged copies, so the format and guarantees are those of ``save``. With
``background_staging`` the host tensors ``optimizer.step()`` writes are copied by that thread
first, while the training loop runs its next forward and backward; a step pre-hook holds the
optimizer until then (see :func:`async_save`).

Staging buffers: one host tensor per saved tensor (per local shard for DTensors this rank writes),
pinned when the source is on CUDA, kept by the :class:`AsyncSaver` and reused by the next save of
the same names, shapes and dtypes; they take as many bytes as this rank writes
(``AsyncSaver.staging_bytes``, ``SaveFuture.staging_bytes``). Accelerator copies are
issued ``non_blocking`` on the current stream and the background thread waits on an event
recorded there, so training kernels queued later on that stream (e.g. the optimizer step) run
after the copies (rule 5 of :mod:`checkpoint.storage.ownership` says what is and is not covered).

Many ranks: a DTensor with ``Partial`` placements is reduced on the calling thread (as ``save``
would); every other collective of the save runs in the background thread on a separate gloo
process group of all ranks, created once with ``torch.distributed.new_group`` on the first call
(torchtitan's async checkpointing does the same), so it never interleaves with the training
loop's collectives on the default group. Every rank must call ``async_save`` (and the first call
creates the group: a collective).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from ..errors import SnapshotChangedError
from ..ranks import dist
from ..saving import agree_prepare_failure, convert_state, convert_through_temporary, many_ranks, prepare_parts
from ..saving import pretrained_layout_for, pretrained_writer
from ..write import layouts_of, refuse_nested, write_checkpoint
from ..write.plan import slots_written_elsewhere, writes_shard
from ..storage.location import local_path, local_target, resolve
from ..storage.format import MODEL_PREFIX, IndexFile, parse_size
from ..storage import ownership, threads
from . import pages
from .. import optim  # noqa: F401 - imported here, not inside the first save (its pydantic models take ~70 ms to build)


class SaveFuture:
    """The outcome of one :func:`async_save`: ``result(timeout)`` returns the model
    :class:`~checkpoint.IndexFile` once committed or raises what ``save`` would have raised;
    ``done()``; ``exception(timeout)``; ``staged()`` / ``wait_staged(timeout)`` (see
    ``background_staging``). ``path``: the checkpoint path; ``staging_bytes``: host bytes the
    snapshot of this save occupies."""

    def __init__(self, future: Future, path: str, staging_bytes: int, staged: threading.Event):
        self._future, self.path, self.staging_bytes = future, path, staging_bytes
        self._staged = staged
        self.seen = False  # the outcome reached the caller (result() / exception() returned or raised)

    def staged(self) -> bool:
        """Whether every value of the snapshot is in the staging buffers (True at once unless
        ``background_staging``; also True once staging gave up on an error, which ``result()`` raises)."""
        return self._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Block until :meth:`staged` (at most ``timeout`` seconds); returns :meth:`staged`. After it,
        every saved tensor may be written by any means."""
        return self._staged.wait(timeout)

    def result(self, timeout: float | None = None) -> IndexFile:
        """Block until committed (at most ``timeout`` seconds: ``TimeoutError``); re-raises the save's error."""
        self._future.exception(timeout)  # TimeoutError: the outcome is not seen yet
        self.seen = True
        return self._future.result()

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        err = self._future.exception(timeout)
        self.seen = True
        return err

    def add_done_callback(self, fn) -> None:
        """``fn(self)`` once the save finished (in the background thread, or now if done)."""
        self._future.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"SaveFuture({self.path!r}, {state}, staging {self.staging_bytes} bytes)"


class _StagingPool:
    """Host buffers keyed by (part prefix, FQN), reused while shape, dtype and pinning match."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, str], torch.Tensor] = {}
        # Buffers whose pages are all faulted in: id -> weak reference (a Tensor's == is elementwise,
        # so no WeakSet); an id reused by a new buffer is told apart by the reference.
        self._touched: dict[int, weakref.ref] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def buffer(self, key: tuple[str, str], like: torch.Tensor) -> torch.Tensor:
        pin = like.device.type == "cuda"
        buf = self.buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype or buf.is_pinned() != pin:
            buf = self.buffers[key] = torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)
        return buf

    def touched(self, buf: torch.Tensor) -> bool:
        """Whether every page of ``buf`` was written once (pinned buffers are, when allocated)."""
        ref = self._touched.get(id(buf))
        return buf.is_pinned() or (ref is not None and ref() is buf)

    def mark_touched(self, buf: torch.Tensor) -> None:
        if len(self._touched) > 2 * len(self.buffers) + 64:  # forget buffers that are gone
            self._touched = {k: r for k, r in self._touched.items() if r() is not None}
        self._touched[id(buf)] = weakref.ref(buf)

    def touch(
        self, bufs: list[torch.Tensor], stop: threading.Event | None = None, cap: int | None = None
    ) -> int:
        """Fault in every page of ``bufs``, one :data:`_PIECE` at a time (no GIL held while the
        kernel works), and mark each buffer done as touched; returns the bytes touched. Stops at
        the next piece once ``stop`` is set or ``cap`` bytes are touched (the rest is faulted in
        by the save that copies into it). The buffers are held by this call until it returns."""
        done = 0
        for buf in bufs:
            flat = buf.reshape(-1).view(torch.uint8)
            n = flat.numel()
            for lo in range(0, n, _PIECE):
                if (stop is not None and stop.is_set()) or (cap is not None and done >= cap):
                    return done
                pages.populate(flat[lo : lo + _PIECE])
                done += min(_PIECE, n - lo)
            self.mark_touched(buf)
        return done


def _touch_cap() -> int | None:
    """Bytes a background touch may fault in: half the physical memory free now (None where the
    OS does not say), so touching ahead never pushes the machine towards running out of memory;
    what is left is faulted in by the save itself."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (AttributeError, ValueError, OSError):
        return None


def _lower_priority() -> None:
    """Initializer of the background-touch thread: nice +10 for this thread only (Linux
    ``setpriority`` takes a thread id), so touching ahead yields the cores to training; a no-op
    where that is not possible (it cannot be undone without privileges, hence a thread of its own)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + 10))
    except (AttributeError, OSError):
        pass


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; host to host as one memcpy through numpy, faster than ``Tensor.copy_``
    of the same bytes (tests/bench/async_save.py). CUDA sources copy
    ``non_blocking`` into pinned ``dst``."""
    src = src.detach()
    if (
        src.device.type == "cpu"
        and src.dtype == dst.dtype
        and src.is_contiguous()
        and not src.is_conj()
        and not src.is_neg()
        and src.numel() > 0
    ):
        np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())
    else:
        dst.copy_(src, non_blocking=src.device.type == "cuda")


_PIECE = 8 << 20  # bytes of fresh staging faulted in per step ahead of the copy


def _stage_copies(pool: _StagingPool, copies: list) -> None:
    """``c.buf.copy_(c.src)`` for each copy (:func:`_copy`), each buffer then marked touched.

    Host buffers whose pages were never touched (the first save without ``prepare``) are faulted
    in ahead of their copy, one :data:`_PIECE` at a time, on a pool thread
    (:func:`pages.populate`: ``MADV_POPULATE_WRITE``, no GIL held), while this thread copies the
    pieces already faulted in. Why: copying into fresh memory takes a page fault per 4 KiB page
    inside the copy, which costs more than populating the pages first and copying into them
    (the copy into populated pages costs what a later save's copy does). With the two overlapped
    the first save blocks about as long as the populate alone.
    The thread touches only the pool's buffers, and has stopped before this returns or raises.
    """
    fresh = {
        id(c)
        for c in copies
        if c.buf.device.type == "cpu" and not pool.touched(c.buf) and _host_bytes_copy(c)
    }
    nbytes = sum(c.buf.numel() * c.buf.element_size() for c in copies if id(c) in fresh)
    if nbytes < 2 * _PIECE or threads.cpus() < 2:
        for c in copies:
            _copy(c.buf, c.src)
            pool.mark_touched(c.buf)
        return
    pieces = [
        (c, lo, min(lo + _PIECE, c.buf.numel() * c.buf.element_size()))
        for c in copies
        if id(c) in fresh
        for lo in range(0, c.buf.numel() * c.buf.element_size(), _PIECE)
    ]
    ready = threading.Condition()
    state = {"done": 0, "stop": False}

    def touch() -> None:
        try:
            for c, lo, hi in pieces:
                if state["stop"]:
                    return
                # (writes the piece's first and last byte: this piece is copied only after)
                pages.populate(c.buf.reshape(-1).view(torch.uint8)[lo:hi])
                with ready:
                    state["done"] += 1
                    ready.notify_all()
        finally:
            with ready:
                state["done"] = len(pieces)  # stopped or failed: the copies fault pages themselves
                ready.notify_all()

    fut = threads.pool("stage-touch", 1).submit(touch)
    try:
        k = 0
        for c in copies:
            if id(c) not in fresh:
                _copy(c.buf, c.src)
                pool.mark_touched(c.buf)
                continue
            dst = c.buf.reshape(-1).view(torch.uint8).numpy()
            src = c.src.detach().reshape(-1).view(torch.uint8).numpy()
            while k < len(pieces) and pieces[k][0] is c:
                _, lo, hi = pieces[k]
                with ready:
                    while state["done"] <= k:
                        ready.wait()
                np.copyto(dst[lo:hi], src[lo:hi])
                k += 1
            pool.mark_touched(c.buf)
    finally:
        state["stop"] = True
        ownership.settle([fut])
    fut.result()  # a populate that raised (it never should: pages.populate falls back to writing)


def _host_bytes_copy(c) -> bool:
    """Whether :func:`_copy` copies ``c`` as one host memcpy (what the piecewise copy repeats)."""
    src = c.src
    return (
        src.device.type == "cpu" and src.dtype == c.buf.dtype and src.is_contiguous()
        and not src.is_conj() and not src.is_neg() and src.numel() > 0
    )  # fmt: skip


def _gathered_for_files(parts, max_shard_size, elsewhere: set[tuple[str, str]]) -> list:
    """Object storage: each file is uploaded by one rank from whole tensors, so every DTensor is
    gathered now (``full_tensor()``, one tensor at a time in file order, on the caller's thread:
    the background thread must not run collectives on the DTensors' groups while training does)
    and kept only by the rank uploading its file (host bytes about the tensors of this rank's
    files); the others keep ``None``, never read."""
    out = []
    for part, layout in zip(parts, layouts_of(parts, max_shard_size, dist.world_size())):
        kept: dict[str, Any] = {}
        for f in layout.files:
            for slot in f.slots:
                t = part.fetch(slot.spec)
                if isinstance(t, DTensor):
                    t = t.full_tensor()
                kept[slot.spec.fqn] = None if (part.prefix, slot.spec.fqn) in elsewhere else t
        out.append(dataclasses.replace(part, fetch=lambda s, d=kept: d[s.fqn]))
    return out


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return (local.device.type, local.untyped_storage().data_ptr())


def _updated_by(optimizer: torch.optim.Optimizer) -> set[tuple[str, int]]:
    """Storages ``optimizer.step()`` writes: its parameters and its per-parameter state tensors."""
    out = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.add(_storage_key(p))
            for v in optimizer.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    out.add(_storage_key(v))
    return out


def _watched(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose version counters show a write to ``t``: a DTensor and its local tensor
    have one counter each (an in-place op on the DTensor bumps the wrapper's; a write through
    ``to_local()`` / ``_local_tensor``, or their views, bumps only the local tensor's)."""
    return [t, t._local_tensor] if isinstance(t, DTensor) else [t]


@dataclasses.dataclass
class _Copy:
    """One tensor to stage: ``src`` into ``buf``; ``watch`` pairs each tensor a writer bumps the
    version counter of (see :func:`_watched`) with its counter at the call."""

    key: tuple[str, str]
    buf: torch.Tensor
    src: torch.Tensor
    watch: list[tuple[torch.Tensor, int]]
    sample: torch.Tensor | None = None  # bytes of a few elements at the call (deferred copies)

    def changed(self) -> bool:
        return any(t._version != v for t, v in self.watch)


_SAMPLES = 64  # elements of a deferred tensor kept at the call (evenly spread)


def _sample(t: torch.Tensor) -> torch.Tensor | None:
    """Bytes of up to :data:`_SAMPLES` evenly spread elements of contiguous CPU tensor ``t`` (a
    copy; None for other tensors): what a write that bypasses the version counter (through
    ``.data``) changes is seen when the staged copy's sample differs (~5 us a tensor)."""
    if not (t.device.type == "cpu" and t.is_contiguous() and t.numel()):
        return None
    flat = t.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // _SAMPLES)][:_SAMPLES].clone().view(torch.uint8)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two contiguous CPU tensors of one dtype (NaN payloads included)."""
    if a.numel() == 0:
        return True
    return bool(np.array_equal(a.reshape(-1).view(torch.uint8).numpy(), b.detach().reshape(-1).view(torch.uint8).numpy()))


def _copy_of(key: tuple[str, str], buf: torch.Tensor, src: torch.Tensor, owner: torch.Tensor) -> _Copy:
    return _Copy(key, buf, src, [(w, w._version) for w in _watched(owner)])


class AsyncSaver:
    """Staging buffers plus one background writer thread; one save in flight at a time (a new
    :meth:`save` first waits for the previous one, whose buffers it reuses). Thread-safe."""

    def __init__(self) -> None:
        _savers.add(self)
        self._pool = _StagingPool()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="fqnckpt-async-save")
        self._pending: Future | None = None
        self._last: SaveFuture | None = None
        self._hook: Any = None  # the optimizer step pre-hook of a background-staged save
        self._group: Any = None
        self._lock = threading.Lock()
        # Background touch (prepare(background=True)): its own low-priority thread, made on first use
        self._toucher: ThreadPoolExecutor | None = None
        self._touching: Future | None = None
        self._stop_touch = threading.Event()
        self._closed = False
        weakref.finalize(self, self._stop_touch.set)  # a saver dropped while touching: stop it

    @property
    def staging_bytes(self) -> int:
        """Host bytes held by the staging buffers now (pinned memory for CUDA sources)."""
        return self._pool.nbytes

    def wait(self) -> None:
        """Block until the save in flight (if any) has finished; its error stays in its future."""
        pending = self._pending
        if pending is not None:
            pending.exception()

    def _halt_touch(self) -> None:
        """Stop the background touch at its next piece (8 MiB: a few ms) and wait for it, so no
        thread faults staging pages while a save or ``prepare`` copies into them (rule 1 of
        :mod:`checkpoint.storage.ownership`, BaseException included)."""
        touching = self._touching
        if touching is None:
            return
        self._stop_touch.set()
        try:
            ownership.settle([touching])
        finally:
            self._touching = None
            self._stop_touch.clear()

    def wait_touched(self) -> None:
        """Block until the background touch of :meth:`prepare` (``background=True``) has
        finished or stopped (the latest one: the touch thread runs them in order)."""
        ownership.settle([self._touching])

    def close(self) -> None:
        """Wait for the save in flight (its error stays in its future), stop a background touch,
        and end this saver's threads (writer and touch); the staging memory is freed with the
        saver. Later :meth:`save` / :meth:`prepare` calls raise ``RuntimeError``. Idempotent."""
        with self._lock:
            self._closed = True
            self._halt_touch()
            self.wait()
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            self._executor.shutdown(wait=True)
            if self._toucher is not None:
                self._toucher.shutdown(wait=True)
                self._toucher = None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this AsyncSaver is closed")

    def _background_group(self) -> Any:
        if self._group is None:
            import torch.distributed as tdist

            self._group = tdist.new_group(backend="gloo")  # collective: every rank is in this call
        return self._group

    def _stage_tensor(
        self, key: tuple[str, str], t: Any, used: set, copies: list, skip: set, reduce: bool = True
    ) -> Any:
        if not isinstance(t, torch.Tensor) or t.is_meta or t.layout != torch.strided:
            return t  # refused by the writer with save's own message, through result()
        if key in skip and not isinstance(t, DTensor):
            return t  # a plain tensor another rank writes: never read here
        owner = t
        if isinstance(t, DTensor):
            if any(isinstance(p, Partial) for p in t.placements):  # reduce here, not in the background
                if not reduce:  # a background prepare runs no collective: the save allocates it
                    return t
                t = t.redistribute(
                    t.device_mesh, [Replicate() if isinstance(p, Partial) else p for p in t.placements]
                )
            if not writes_shard(t):  # the pipeline's rule (checkpoint.write.plan)
                return t  # never read by this rank's writer: nothing to snapshot
            local = t.to_local()
            buf = self._pool.buffer(key, local)
            used.add(key)
            copies.append(_copy_of(key, buf, local, owner))
            return DTensor.from_local(
                buf, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
            )
        buf = self._pool.buffer(key, t)
        used.add(key)
        copies.append(_copy_of(key, buf, t, owner))
        return buf

    def _stage_parts(
        self, parts, distributed: bool, max_shard_size, remote: bool = False, reduce: bool = True
    ) -> tuple[list, list[_Copy], set]:
        """The parts with each tensor this rank writes swapped for its staging buffer (allocated or
        reused here), the copies still to make, and the buffer keys used. Object storage
        (``remote``): each file is uploaded by one rank from whole tensors, so DTensors are gathered
        here, on the caller's thread (see :func:`_gathered_for_files`)."""
        used: set = set()
        copies: list[_Copy] = []
        staged = []
        skip: set = set()
        if distributed and dist.active():
            skip = slots_written_elsewhere(parts, max_shard_size, dist.rank(), dist.world_size(), remote)
            if remote:
                parts = _gathered_for_files(parts, max_shard_size, skip)
        for part in parts:
            by_fqn = {
                s.fqn: self._stage_tensor((part.prefix, s.fqn), part.fetch(s), used, copies, skip, reduce)
                for s in part.specs
            }
            staged.append(dataclasses.replace(part, fetch=lambda s, d=by_fqn: d[s.fqn]))
        return staged, copies, used

    def prepare(
        self,
        obj: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        optimizer: torch.optim.Optimizer | None = None,
        max_shard_size: int | str | None = None,
        background: bool = False,
    ) -> int:
        """Allocate and touch the staging buffers the first :meth:`save` of ``obj`` (and
        ``optimizer``) needs, so that save blocks no longer than later ones (fresh host memory
        costs a page fault per 4 KiB page on its first write; pinned memory a ``cudaHostAlloc``).
        Also creates the background process group on many ranks (call it on every rank) and the
        writer thread. The buffers receive a copy of the current values (nothing is written to
        disk); a later save whose names, shapes or dtypes differ allocates the difference itself. Returns the staging bytes held (as :attr:`staging_bytes`).

        ``background=True``: returns at once, without waiting for a save in flight (allocating maps
        but does not touch host memory), and a thread of this saver at low priority (nice +10)
        then faults in the pages of the buffers not touched yet, 8 MiB at a time (no copy, no
        read of the caller's tensors), at most half the physical memory free when called. The
        next :meth:`save` (or ``prepare``) stops it at its next piece and faults in the rest
        itself: it never waits for the whole touch. No collective runs: buffers of ``Partial``
        DTensors and the background process group are left to the first save. This is what
        :class:`~checkpoint.CheckpointManager` does by itself (see its ``load_latest``).

        Raises: what :meth:`save` raises before writing (``TypeError`` / ``ValueError``)."""
        if max_shard_size is not None:
            parse_size(max_shard_size)
        with self._lock:
            self._check_open()
            if not background:  # a background touch runs beside a save in flight instead
                self._halt_touch()
                self.wait()
            parts, distributed, _ = prepare_parts("(prepare)", obj, optimizer, None)
            with torch.no_grad():
                _, copies, _ = self._stage_parts(parts, distributed, max_shard_size, reduce=not background)
                if background:
                    # Buffers of a save in flight are all touched (its copy wrote every page),
                    # so this thread never writes bytes the writer thread reads.
                    fresh = [c.buf for c in copies if not self._pool.touched(c.buf)]
                    if fresh:
                        if self._toucher is None:
                            self._toucher = ThreadPoolExecutor(
                                1, thread_name_prefix="fqnckpt-pretouch", initializer=_lower_priority
                            )
                        self._touching = self._toucher.submit(self._pool.touch, fresh, self._stop_touch, _touch_cap())
                    return self.staging_bytes
                _stage_copies(self._pool, copies)  # the copy a save makes: touches every page
                if any(c.src.device.type == "cuda" for c in copies):
                    torch.cuda.synchronize()
            if distributed and dist.active():
                self._background_group()
            self._executor.submit(int).result()  # the writer thread exists before the first save
        return self.staging_bytes

    def save(
        self,
        obj: torch.nn.Module | Mapping[str, torch.Tensor],
        path: str | os.PathLike,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        extra_state: Mapping[str, Any] | None = None,
        max_shard_size: int | str | None = None,
        overwrite: bool = False,
        background_staging: bool = False,
        after_commit: Callable[[], None] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        transfer: Any = None,
        layout: str | None = None,
    ) -> SaveFuture:
        """See :func:`async_save`. ``after_commit``: run in the background thread once the checkpoint
        is committed (its error becomes the future's; used for the manager's retention)."""
        path = local_target(resolve(path, storage_options, transfer))  # file:// commits as a local path
        remote = local_path(path) is None  # a byte store: whole objects, gathered in the call
        if max_shard_size is not None:  # None: save's default (checkpoint.storage.layout.default_shard_size)
            parse_size(max_shard_size, str(path))  # a bad size fails here, not in the background
        refuse_nested(path)  # inside another checkpoint: refused here, not in the background
        # What save_pretrained writes (a transformers model whose conversion mapping changes names):
        # the staged tensors converted in the background, as save converts the module's.
        recipe = pretrained_layout_for(obj, path, layout, optimizer, extra_state, None, "async_save")
        with self._lock:
            self._check_open()
            self._halt_touch()  # stopped, never waited for: the copies fault in the rest
            self.wait()
            if self._hook is not None:  # the previous save is staged: its hook is a no-op now
                self._hook.remove()
                self._hook = None
            try:
                parts, distributed, extra_files = prepare_parts(path, obj, optimizer, extra_state)
            except Exception as e:
                if many_ranks(obj):  # peers go on into the background's first exchange: join it
                    group = self._background_group() if dist.active() else None
                    self._pending = self._executor.submit(_agree_failure, path, e, group, background_staging)
                raise
            with torch.no_grad():
                staged, copies, used = self._stage_parts(parts, distributed, max_shard_size, remote)
                deferred: list[_Copy] = []
                if background_staging and optimizer is not None:
                    # Host tensors only optimizer.step() writes are copied by the background thread;
                    # the step pre-hook below holds the next step until they are.
                    mine = _updated_by(optimizer)
                    deferred = [
                        c for c in copies if c.src.device.type == "cpu" and _storage_key(c.src) in mine
                    ]
                    later = {id(c) for c in deferred}
                    copies = [c for c in copies if id(c) not in later]
                    for c in deferred:  # checked by _stage_deferred after its copy
                        c.sample = _sample(c.src)
                _stage_copies(self._pool, copies)
                # Stream order, any accelerator: an event on each source device's current stream
                # after the copies, waited by the background thread (rule 5 of ownership).
                event = [_record_event(d) for d in {c.src.device for c in copies if c.src.device.type != "cpu"}] or None
            for key in set(self._pool.buffers) - used:  # names gone since the last save
                del self._pool.buffers[key]
            group = self._background_group() if distributed and dist.active() else None
            nbytes = sum(c.buf.numel() * c.buf.element_size() for c in copies + deferred)
            staged_event = threading.Event()
            if not deferred:
                staged_event.set()
            else:

                def hold_step(*_args) -> None:  # a step pre-hook must return None
                    staged_event.wait()

                self._hook = optimizer.register_step_pre_hook(hold_step)
            fut = self._executor.submit(
                _write, path, staged, distributed, extra_files, max_shard_size, overwrite, event, group,
                after_commit, background_staging, deferred, staged_event, recipe and (recipe, obj),
            )  # fmt: skip
            self._pending = fut
            self._last = SaveFuture(fut, path, nbytes, staged_event)
            return self._last

    def _finish_at_exit(self) -> tuple[str, BaseException | None]:
        """Wait for the last save: (its path, its error if it failed and the caller never saw it)."""
        last = self._last
        if last is None:
            return "", None
        err = last._future.exception()
        return last.path, None if last.seen else err


def _record_event(device: torch.device) -> torch.Event:
    """An event recorded on ``device``'s current stream (work queued there so far: the staging
    copies) for the background thread to wait on; any accelerator, not only CUDA."""
    ev = torch.Event(device=device)
    ev.record(torch.accelerator.current_stream(device))
    return ev


def _stage_deferred(path: str, deferred: list[_Copy]) -> None:
    """Copy each deferred tensor and prove the copy holds the values at the call, else raise
    :class:`SnapshotChangedError` (nothing is written). The step pre-hook keeps
    ``optimizer.step()`` out until this returns; other writers are caught by four checks:

    1. the version counters before the copy (a write that finished since the call);
    2. the copy's sample against the one taken at the call (writes that bypass the counter,
       through ``.data``, that changed a sampled element);
    3. the copy against the tensor, byte for byte, after the copy (a write overlapping the copy:
       torch bumps the counter only when an in-place kernel *finished*, so a write still running
       when the copy ended shows only as bytes that differ);
    4. the version counters again, after that comparison (a write that finished meanwhile).

    A write that started before the copy ended and is still running, untouched, after the
    comparison (a kernel thread preempted for that long) is the one case left unseen.
    """
    with torch.no_grad():
        for c in deferred:
            torn = c.changed()
            if not torn:
                _copy(c.buf, c.src)
                torn = (
                    (c.sample is not None and not torch.equal(_sample(c.buf), c.sample))
                    or (c.sample is not None and not _same_bytes(c.buf, c.src))
                    or c.changed()
                )
            if torn:
                prefix, fqn = c.key
                raise SnapshotChangedError(fqn if prefix == MODEL_PREFIX else f"{prefix} state {fqn}", path)


def _agree_failure(path: str, error: BaseException, group: Any, background: bool) -> None:
    """Background thread of a rank whose save failed before staging: its side of the peers' first
    exchange in :func:`_write` (``staging`` with background staging, else ``preparing``), so
    every rank's future fails with the agreed error instead of hanging."""
    with dist.using_group(group):
        if background:
            dist.check_all(f"staging {path}", error)
        else:
            agree_prepare_failure(path, error)


def _write(
    path, parts, distributed, extra_files, max_shard_size, overwrite, event, group, after_commit,
    background, deferred, staged_event, convert=None,
) -> IndexFile:  # fmt: skip
    """Background thread: stage the deferred tensors, then the write / hash / commit of ``save``.
    ``convert``: ``(recipe, module)``: the staged model tensors written as ``save_pretrained``
    writes them (single process: converted straight from the staged copies; many ranks: saved in
    the module's own layout into a temporary directory beside ``path``, converted by rank 0)."""
    err: BaseException | None = None
    try:
        _stage_deferred(path, deferred)
    except BaseException as e:  # noqa: BLE001 - raised below (after the ranks agree)
        err = e
    finally:
        staged_event.set()  # also on error: the optimizer step must not wait forever
    for e in event or ():
        e.synchronize()
    if distributed:
        with dist.using_group(group):
            if background:  # same on every rank (an argument of the call): every rank stops if one is torn
                dist.check_all(f"staging {path}", err)
            if convert is None:
                index = write_checkpoint(path, parts, max_shard_size, overwrite, extra_files, distributed=True)[0]
            else:
                recipe, module = convert
                writer, written = pretrained_writer(path, max_shard_size, overwrite)

                def save_memory(ck: str) -> None:
                    write_checkpoint(ck, parts, max_shard_size, False, extra_files, distributed=True)

                index = convert_through_temporary(path, recipe, module, save_memory, writer, written, False, True)
    else:
        if err is not None:
            raise err
        if convert is None:
            index = write_checkpoint(path, parts, max_shard_size, overwrite, extra_files)[0]
        else:
            recipe, module = convert
            index = convert_state(parts[0], path, recipe, module, max_shard_size, overwrite, False)
    if after_commit is not None:
        after_commit()
    return index


# -- interpreter exit ------------------------------------------------------------------------------
# A save in flight when the script ends must not be lost silently. Python joins the writer thread
# at exit anyway, but by then concurrent.futures refuses new work (the writer's hashing pool), so
# the save is finished first, from a threading exit hook: those run before threads are joined, in
# reverse order of registration, so ours (registered after concurrent.futures' own, imported
# above) runs before concurrent.futures shuts its pools. A failure is printed on stderr and makes
# the exit status 1 (from a plain atexit hook registered at import: it runs after those registered
# later; the status of a finished interpreter can only be changed by os._exit).
_savers: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()
_failed_at_exit: list[str] = []


def _finish_saves_at_exit() -> None:
    for saver in list(_savers):  # a background touch is not worth finishing: stop it first
        saver._stop_touch.set()
    for saver in list(_savers):
        path = "a checkpoint"
        try:
            path, err = saver._finish_at_exit()
        except BaseException as e:  # noqa: BLE001 - e.g. KeyboardInterrupt while waiting
            err = e
        if err is not None:
            msg = f"fqnckpt: async save of {path} in flight at interpreter exit failed: {type(err).__name__}: {err}"
            print(msg, file=sys.stderr, flush=True)
            _failed_at_exit.append(msg)


def _exit_status() -> None:
    if _failed_at_exit:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing left to flush
                pass
        os._exit(1)


threading._register_atexit(_finish_saves_at_exit)
atexit.register(_exit_status)

_default: AsyncSaver | None = None
_default_lock = threading.Lock()


def default_saver() -> AsyncSaver:
    """The process-wide :class:`AsyncSaver` used by :func:`async_save`."""
    global _default
    with _default_lock:
        if _default is None:
            _default = AsyncSaver()
        return _default


def prepare_async_save(
    module_or_state: torch.nn.Module | Mapping[str, torch.Tensor],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    max_shard_size: int | str | None = None,
) -> int:
    """Allocate and touch the staging memory of the first :func:`async_save` of this state up
    front (:meth:`AsyncSaver.prepare` of :func:`default_saver`), so that call blocks no longer
    than later ones. Returns the staging bytes held. On many ranks call it on every rank.

    Raises: what ``async_save`` raises before staging (``TypeError`` / ``ValueError``)."""
    return default_saver().prepare(module_or_state, optimizer=optimizer, max_shard_size=max_shard_size)


def async_save(
    module_or_state: torch.nn.Module | Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    extra_state: Mapping[str, Any] | None = None,
    max_shard_size: int | str | None = None,
    overwrite: bool = False,
    background_staging: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    transfer: Any = None,
    layout: str | None = None,
) -> SaveFuture:
    """:func:`checkpoint.save` in the background: returns once a snapshot of the values at the call
    is staged in host memory, so the caller may update parameters, optimizer state and the objects
    in ``extra_state`` right away. Writing, hashing and the atomic commit run in a background
    thread; the checkpoint is the one ``save`` would have written from the values at the call.

    Arguments as :func:`checkpoint.save` (URLs and ``storage_options`` / ``transfer`` included;
    ``layout`` too: a transformers model's tensors alone are written as ``save_pretrained`` writes
    them, converted in the background from the staged copies). If a previous ``async_save`` of this process is still
    writing, this call first waits for it (its staging buffers are reused). On many ranks call it on
    every rank (see the module docstring for how ranks talk).

    ``background_staging=True`` (with ``optimizer``): the host tensors that ``optimizer.step()``
    writes (its parameters and their state) are copied by the background thread instead of in
    the call, which then returns after copying the rest (buffers, other tensors, extra state)
    and registers an ``optimizer`` step pre-hook that holds the next ``step()`` until that copy
    is done. The copy overlaps the next forward and backward, as torchtitan's pinned-memory async
    mode (``maybe_wait_for_staging()`` before ``optimizers.step()``) and DCP's
    ``use_async_staging`` do. Contract: until ``SaveFuture.staged()``, those tensors may be
    written only through ``optimizer.step()``; call ``SaveFuture.wait_staged()`` before writing
    them otherwise. A write that breaks it and bumps the tensor's version counter (any in-place
    op, ``load_state_dict``; for a DTensor, on the DTensor or on its local tensor through
    ``to_local()`` / ``_local_tensor``) fails the save with :class:`~checkpoint.SnapshotChangedError`
    naming the tensor, nothing written; a write through ``.data`` bypasses the counter and cannot
    be seen. Without ``optimizer`` the flag changes nothing.

    Interpreter exit: a save still in flight when the script ends is finished before the process
    exits; if it fails and its error was never read (``result()`` / ``exception()``), the error is
    printed on stderr and the exit status is 1.

    Staging memory: host bytes equal to the tensor bytes this rank writes (model + optimizer
    state), kept between saves (``checkpoint.training.async_save.default_saver().staging_bytes``).

    Wait for the result (or :meth:`AsyncSaver.wait`) before destroying the process group: the
    background thread talks on a group of it.

    Raises now: ``TypeError`` / ``ValueError`` for input ``save`` rejects before writing (non-tensor
    values, a bad ``max_shard_size``, an extra_state value that cannot be saved, an unknown
    ``layout`` or ``layout="pretrained"`` with ``optimizer`` / ``extra_state``). Every write
    error (``CheckpointExistsError``, ``CheckpointWriteError``, ``RankAgreementError``,
    ``SnapshotChangedError``, ...) is raised by ``SaveFuture.result()``.
    """
    return default_saver().save(
        module_or_state,
        path,
        optimizer=optimizer,
        extra_state=extra_state,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        background_staging=background_staging,
        storage_options=storage_options,
        transfer=transfer,
        layout=layout,
    )
