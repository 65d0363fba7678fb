"""The one rule for work that writes into (or reads from) memory fqnckpt does not own.

fqnckpt reads checkpoint bytes straight into the caller's tensors (``preadv`` from pool threads,
through raw addresses), hashes tensors on a second thread while they are written, stages and
writes snapshots on an async-save thread, and moves bytes to and from object storage on transfer
threads. For all of them (rules 1-4), and for the snapshots async saves take (rule 5):

1. **Finished before the starting call leaves.** Every thread, executor task or kernel call that
   writes into caller memory (or reads memory the caller may free or reuse) has stopped before
   the call that started it returns *or raises*, on every exit path: an error of ours, an OS
   error, and any ``BaseException`` received by the calling thread meanwhile
   (``KeyboardInterrupt`` from Ctrl-C, ``SystemExit``, an async exception). Waiting for them is
   never cut short by such an exception: it is held, the wait goes on, and it is raised once
   every worker stopped (:func:`settle`, :func:`share`). Helpers are told to stop at their next
   piece (a piece of at most :data:`~checkpoint.storage.pread.PIECE` bytes), so this costs at
   most one piece per thread.
2. **Descriptors outlive their readers.** A file descriptor is closed only after the last thread
   reading from it has stopped (rule 1 makes the starting call's ``finally`` a safe place).
3. **Raw views keep their memory alive.** A view over raw memory (a ``ctypes`` array from an
   address, a ``memoryview`` of a tensor's bytes) is held together with the object that owns the
   memory (:class:`~checkpoint.storage.pread.Run` keeps its target tensors, a raw iovec array of
   :mod:`~checkpoint.storage.tensor_read` its target and junk buffer), so no thread ever
   writes into memory that was freed, even while rule 1 is being honoured.
4. **Work that outlives its call owns what it touches.** A deliberately asynchronous task (an
   async save's staging and write, an upload part) holds references to every buffer it reads
   until it finished, and the process waits for it at exit (see
   :mod:`checkpoint.training.async_save`); nothing it touches belongs to a call that returned.
5. **A snapshot is taken at the call, or refused; what that covers.** ``async_save`` copies
   each tensor at the call, except, with ``background_staging``, the host tensors
   ``optimizer.step()`` writes, which its thread copies later while a step pre-hook holds the
   optimizer. For those deferred host (CPU) tensors the staged bytes are the values at the call
   or the save fails with :class:`~checkpoint.SnapshotChangedError` and writes nothing, for
   in-place writes from any Python thread (also through views, ``to_local()``, ``.data``) that
   finished before the last check or changed bytes before the copy was compared: version
   counters before and after, sampled elements, the copy compared with the tensor byte for byte
   (``_stage_deferred`` in :mod:`checkpoint.training.async_save`). Not covered: a write (a
   kernel thread, numpy, a raw pointer) that started before that comparison and is still running
   after it: its later bytes are not in the snapshot, and the snapshot may hold part of it.
   Callers must not write those tensors other than through ``optimizer.step()`` before
   ``wait_staged()``. Accelerator tensors (CUDA and others) are copied at the call,
   ``non_blocking`` on the device's current stream, and the background thread waits on an event
   recorded there after the copies: kernels queued before on that stream are in the snapshot,
   kernels queued later (the next step) run after the copies. Writes on other streams are not
   ordered by fqnckpt: the caller orders them (``wait_stream`` / an event) before the call.

The pools themselves are :mod:`checkpoint.storage.threads`. Exceptions raised by workers are
re-raised in the calling thread after rule 1 is met (the first one; a ``BaseException`` the
calling thread received takes precedence, with the worker error as its context).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from concurrent.futures import Future, wait

from . import threads


def settle(futures: Iterable[Future | None]) -> None:
    """Return once every future in ``futures`` is done (finished, failed or cancelled), whatever
    the calling thread receives meanwhile. A ``BaseException`` received while waiting (Ctrl-C)
    does not cut the wait short: it is raised after the last future is done. Worker results and
    errors are left in the futures (``None`` entries are skipped)."""
    pending = [f for f in futures if f is not None]
    received: BaseException | None = None
    while pending:
        try:
            wait(pending)  # never raises a worker's error; a signal handler's exception, yes
            pending = []
        except BaseException as e:  # noqa: BLE001 - held until every worker stopped (rule 1)
            received = received or e
            pending = [f for f in pending if not f.done()]
    if received is not None:
        raise received


class Crew:
    """Workers sharing one job: the calling thread and up to ``helpers`` threads of pool ``name``
    each run ``work(stop)`` (``stop``: a :class:`threading.Event` set when the call is leaving;
    ``work`` checks it between pieces). :meth:`run` returns or raises only after every ``work``
    that started has returned, and a helper that had not started yet never starts (rule 1)."""

    def __init__(self, name: str, workers: int):
        self.name, self.workers = name, workers
        self.stop = threading.Event()
        self._cond = threading.Condition(threading.Lock())
        self._running = 0
        self._closed = False

    def _helper(self, work: Callable[[threading.Event], None]) -> None:
        with self._cond:
            if self._closed:  # the call already left: never touch its memory
                return
            self._running += 1
        try:
            work(self.stop)
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def run(self, work: Callable[[threading.Event], None], helpers: int) -> None:
        """Run ``work`` on the calling thread and ``helpers`` pool threads; see the class."""
        try:
            pool = threads.pool(self.name, self.workers)
            for _ in range(helpers):
                pool.submit(self._helper, work)
            work(self.stop)
        finally:
            self._close()

    def _close(self) -> None:
        self.stop.set()
        received: BaseException | None = None
        while True:
            try:
                with self._cond:
                    self._closed = True
                    while self._running:
                        self._cond.wait()
                break
            except BaseException as e:  # noqa: BLE001 - held until every worker stopped (rule 1)
                received = received or e
        if received is not None:
            raise received


def share(name: str, workers: int, work: Callable[[threading.Event], None], helpers: int) -> None:
    """:meth:`Crew.run` of a new :class:`Crew` (pool ``name`` of ``workers`` threads)."""
    Crew(name, workers).run(work, helpers)


def share_queue(name: str, workers: int, jobs: Sequence[Any], run: Callable[[Any], None]) -> None:
    """``run(job)`` for every job of ``jobs``, taken from one queue by the calling thread and
    ``workers - 1`` threads of pool ``name`` (:func:`share`); the first error is raised once every
    thread has stopped, and the others stop taking jobs after it."""
    counter = itertools.count()  # next() on a count is atomic under the GIL: one queue, no lock
    errors: list[BaseException] = []

    def work(stop) -> None:
        while not errors and not stop.is_set():
            j = next(counter)
            if j >= len(jobs):
                return
            try:
                run(jobs[j])
            except BaseException as e:  # noqa: BLE001 - re-raised below, after every thread stopped
                errors.append(e)

    share(name, workers, work, min(workers, len(jobs)) - 1)
    if errors:
        raise errors[0]
