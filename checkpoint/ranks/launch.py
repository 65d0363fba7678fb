"""Spawn N ranks on a free 127.0.0.1 port: the one launcher used by tests, examples and ``fqnckpt demo``.

Each rank runs ``fn(rank, world_size, *args)`` inside an initialized default process group and
sends its return value (must be picklable) back to the parent. Written by hand because
``torch.multiprocessing.spawn`` neither returns values nor bounds the wait.

Ranks start from multiprocessing's forkserver where the platform has one: the server imports torch
and torch.distributed once (plus what :func:`preload` names), and each rank is a fork of it, so a
spawn no longer pays those imports per rank (seconds a rank on a busy machine). The server is
a fresh interpreter, never the caller, so no caller state (threads, CUDA, heap) is forked.

Crash evidence: each rank writes faulthandler's stack of every thread to its own file when a
signal kills it (abort, segfault, bus error), and with ``FQNCKPT_KEEP_CORE=1`` raises its core-size
limit to the hard limit (a core is kept where the machine's ``core_pattern`` allows). A rank killed by a signal, before or
after sending its result, fails the run with :class:`RankFailedError` whose message holds that
stack and the file's path; the file is kept (``FQNCKPT_CRASH_DIR``, default the temporary
directory). Files of ranks that exited cleanly are removed, and so are empty ones (a signal
faulthandler cannot catch, such as SIGKILL, leaves nothing to keep).

Native stacks too: faulthandler shows Python frames only, and in torch 2.13 gloo's
worker threads (``pt_gloo_runloop``) run CPython C-API code with no Python frame (they take the GIL
to drop the last reference to a finished collective's tensors, and deallocate them). Each rank
turns on c10's fatal-signal handler (``torch._C._set_print_stack_traces_on_fatal_signal``), which
prints every thread's C++ stack to the rank's stderr after faulthandler has written its file (on a
corrupted heap c10's report, which allocates, may die first: faulthandler's file is kept). Under the
forkserver (the default) a rank's stderr is a pipe the caller drains on a thread: every byte is
forwarded to the caller's stderr as it comes, and the last :data:`_ERR_TAIL` bytes are kept, so a
killed rank's native stacks also go into the failure's message and its kept file.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import re
import selectors
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing import reduction


class RankFailedError(RuntimeError):
    """A spawned rank raised, died, or did not finish within the timeout (seconds).

    ``signals``: ``{rank: signal number}`` of ranks killed by a signal (abort, segfault), before
    or after sending a result; empty when every rank exited or raised. ``stacks``: ``{rank: path
    of the file holding its faulthandler stack}`` for those ranks (kept as evidence)."""

    def __init__(self, message: str, signals: dict[int, int] | None = None, stacks: dict[int, str] | None = None):
        super().__init__(message)
        self.signals = dict(signals or {})
        self.stacks = dict(stacks or {})


def _crash_file(rank: int, port: int) -> str:
    where = os.environ.get("FQNCKPT_CRASH_DIR") or tempfile.gettempdir()
    return os.path.join(where, f"fqnckpt-rank{rank}-pid{os.getpid()}-port{port}.stack")


def _allow_core() -> None:
    """With ``FQNCKPT_KEEP_CORE=1``: raise this process's core-size limit to its hard limit (best
    effort: a core where the machine's ``core_pattern`` allows). Opt-in: a rank's core is hundreds
    of MB, written into its working directory under the default pattern."""
    if os.environ.get("FQNCKPT_KEEP_CORE") != "1":
        return
    try:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_CORE)
        resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


def _has_stack(path: str) -> bool:
    """Whether faulthandler wrote into ``path``: a signal it cannot catch (SIGKILL, as tests and
    timeouts send) leaves the file empty, and an empty file is no evidence worth keeping."""
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False


def _evidence(dead: dict[int, int], files: dict[int, str], tee: _ErrTee | None = None) -> str:
    """The faulthandler stacks of the ranks in ``dead`` (rank -> signal), read from their files,
    and their native stacks (c10's report, from ``tee``), which are also appended to the files."""
    out = []
    for r, sig in sorted(dead.items()):
        try:
            with open(files[r], errors="replace") as f:
                text = f.read()[-20000:]
        except OSError as e:
            text = f"(no stack file: {e})"
        native = tee.native_stacks(r) if tee is not None else ""
        if native:
            native = f"\n--- native stacks of every thread (c10's fatal-signal report):\n{native}"
            try:
                with open(files[r], "a") as f:
                    f.write(native)
            except OSError:
                pass
        out.append(
            f"--- rank {r} killed by signal {sig}; faulthandler stack (kept in {files[r]}):\n{text}{native[-40000:]}"
        )
    return "\n".join(out)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, then release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the forkserver; every rank forks from it. Library modules only: importing them
# starts no thread that a fork would lose mid-work.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "checkpoint.ranks.launch",
]
_START_METHODS = ("forkserver", "spawn", "fork")


def preload(*modules: str) -> None:
    """Have the forkserver import ``modules`` (dotted names) before it forks ranks, so every rank
    of every later :func:`run_ranks` in this process finds them imported.

    Takes effect only before the first :func:`run_ranks` of the process starts the server; a
    module that fails to import there is imported by each rank instead (multiprocessing's rule).
    """
    for m in modules:
        if m not in _PRELOAD:
            _PRELOAD.append(m)


def default_backend() -> str:
    """``"nccl"`` where CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


class _CallerStdio:
    """The caller's stdout and ``err`` (an fd: the write end of the rank's stderr pipe, see
    :class:`_ErrTee`), as they are at the call, handed to a forkserver rank (whose own are the
    server's, fixed when it started) by multiprocessing's fd passing."""

    def __init__(self, err: int = 2):
        self.err = err

    def __reduce__(self):
        return (tuple, ((reduction.DupFd(1), reduction.DupFd(self.err)),))


_ERR_TAIL = 256 << 10  # bytes of each rank's stderr kept for the evidence of a rank killed by a signal
_NATIVE = re.compile(rb"^(SIG[A-Z]+)\(\d+\), PID: \d+, Thread \d+:", re.M)  # c10's fatal-signal report


class _ErrTee:
    """Each rank's stderr through a pipe: a thread forwards what it reads to the caller's fd 2 at
    once and keeps each rank's last :data:`_ERR_TAIL` bytes. Hand-written (a pipe and a reader
    thread) because multiprocessing offers no per-child stderr capture."""

    def __init__(self, world_size: int):
        self.fds = [os.pipe() for _ in range(world_size)]
        self.tails = [bytearray() for _ in range(world_size)]
        self.ended = [threading.Event() for _ in range(world_size)]
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Close this process's write ends (each rank holds its copy) and start draining."""
        for _, w in self.fds:
            os.close(w)
        self._thread = threading.Thread(target=self._drain, name="rank-stderr", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        sel = selectors.DefaultSelector()
        for r, (rd, _) in enumerate(self.fds):
            sel.register(rd, selectors.EVENT_READ, r)
        while sel.get_map():
            for key, _ in sel.select():
                try:
                    chunk = os.read(key.fd, 65536)
                except OSError:  # never leave a rank blocked on a full pipe: treat as its end
                    chunk = b""
                if not chunk:  # every holder of the write end (the rank, its children) is gone
                    sel.unregister(key.fd)
                    os.close(key.fd)
                    self.ended[key.data].set()
                    continue
                tail = self.tails[key.data]
                tail += chunk
                del tail[:-_ERR_TAIL]
                try:
                    os.write(2, chunk)
                except OSError:
                    pass
        sel.close()

    def finish(self, timeout: float = 5.0) -> None:
        """Wait (at most ``timeout`` s: a rank's own child may still hold its stderr) for the
        ranks' stderr to end."""
        if self._thread is not None:
            self._thread.join(timeout)

    def native_stacks(self, rank: int, timeout: float = 5.0) -> str:
        """The C++ stacks c10's fatal-signal handler printed for ``rank`` ("" when none); waits (at
        most ``timeout`` s) for the rank's stderr to end first."""
        self.ended[rank].wait(timeout)
        tail = bytes(self.tails[rank])
        hit = _NATIVE.search(tail)
        return tail[hit.start() :].decode(errors="replace") if hit else ""


def _stdio(tee: _ErrTee | None, rank: int) -> _CallerStdio | None:
    return _CallerStdio(tee.fds[rank][1]) if tee is not None else None


def _take_stdio(stdio) -> None:
    if stdio is None:
        return
    for target, handle in zip((1, 2), stdio):
        fd = handle.detach()
        os.dup2(fd, target)
        os.close(fd)


def _worker(rank, world_size, port, backend, timeout_s, fn, args, queue, environ, stdio, crash_file=None):
    _take_stdio(stdio)
    # A rank killed by a signal (abort, segfault) writes every thread's stack to its crash file
    # (the parent puts it in the failure's message and keeps the file), else to stderr.
    # c10's handler (every thread's C++ stack, to stderr) is installed first so that it runs
    # second: faulthandler writes with write() alone, while c10's report allocates (opendir,
    # symbolizing), which on a corrupted heap aborts again and would lose faulthandler's file.
    if hasattr(torch._C, "_set_print_stack_traces_on_fatal_signal"):
        torch._C._set_print_stack_traces_on_fatal_signal(True)
    stack_out = open(crash_file, "w") if crash_file else None  # noqa: SIM115 - open until the process dies
    faulthandler.enable(file=stack_out or __import__("sys").stderr, all_threads=True)
    _allow_core()
    # A forkserver child has the server's environment: take the caller's, as spawn would.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
        try:
            out = fn(rank, world_size, *args)
            _wait_collectives()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            gc.collect()  # groups held in reference cycles are freed here, on this thread
        # Plain pickle bytes: torch's queue reducers would send tensors as shared-memory handles
        # that die with the rank.
        queue.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - report every failure, including SystemExit
        queue.put((rank, False, traceback.format_exc()))


def _wait_collectives() -> None:
    """Wait every collective this rank issued, on every process group it is a member of, before
    the groups are destroyed (after ``fn`` returned on every rank; a peer that failed exits and
    its closed connections end the wait with an error, ignored here: the peer reports its own).

    A barrier on a gloo group completes only after all earlier work on that group
    (``ProcessGroupGloo::barrier`` waits the work in progress and queued); groups are visited in
    the order of their names, the same on every rank, so no two ranks wait for each other in
    opposite orders. Functional collectives never waited (``wait_tensor``) stay in c10d's work
    registry: no API waits them without their tensors.

    Why: an interpreter that finalizes while gloo still holds a collective's tensors aborts
    ("terminate called without an active exception", tests/repro/gloo_exit_unwaited.py); after the
    barriers no gloo worker holds any, and the rank ends with ``os._exit`` (forkserver, fork).
    """
    if not dist.is_initialized():
        return
    from torch.distributed.distributed_c10d import _world

    def order(item):
        name = item[1]
        return (0, int(name), "") if name.isdigit() else (1, 0, name)

    try:
        for pg, _ in sorted(_world.pg_names.items(), key=order):
            dist.barrier(group=pg)
    except Exception:  # noqa: BLE001 - a failed peer closed its connections; it reports itself
        pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = 300.0,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes; return per-rank results.

    ``fn`` must be importable (module level). ``backend`` defaults to :func:`default_backend`;
    collectives time out after ``timeout`` seconds and the whole run is bounded by the same.
    ``start_method``: ``"forkserver"`` (default where the platform has it, see the module
    docstring), ``"spawn"`` (default elsewhere), or ``"fork"`` (only for a caller that is itself a
    fresh fork made for this, e.g. a test zygote's child: it copies the caller). Each rank gets the
    caller's ``os.environ`` as it is at this call, whatever the method.

    Raises:
        RankFailedError: a rank raised (its traceback is in the message), exited without a result
            (any exit code), timed out, sent a result that does not unpickle here, or after sending
            its result was killed by a signal or exited with a code other than 0.
        ValueError: an unknown ``start_method``.
    """
    backend = backend or default_backend()
    ctx = _context(start_method)
    environ = dict(os.environ)
    tee = _ErrTee(world_size) if ctx.get_start_method() == "forkserver" else None
    queue = ctx.SimpleQueue()
    port = free_port()
    files = {r: _crash_file(r, port) for r in range(world_size)}
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, timeout, fn, args, queue, environ, _stdio(tee, r), files[r]),
            daemon=False,
        )
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
    finally:
        if tee is not None:
            tee.start()  # the ranks started hold their write ends now; a rank not started gives EOF
    results: dict[int, Any] = {}
    errors: list[str] = []
    reported: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        while len(reported) < world_size:
            if time.monotonic() > deadline:
                raise RankFailedError(
                    f"ranks did not finish within {timeout:.0f} s (world size {world_size})"
                )
            if queue.empty():
                # A rank writes its report before it exits (SimpleQueue.put is a blocking pipe
                # write), so one that exited, even with code 0 (os._exit), and sent nothing never will.
                silent = [i for i, p in enumerate(procs) if p.exitcode is not None and i not in reported]
                if silent:
                    time.sleep(0.2)
                    if queue.empty():
                        dead = [(i, procs[i].exitcode) for i in silent]
                        killed = {i: -code for i, code in dead if code < 0}
                        raise RankFailedError(
                            f"rank(s) died without a result: {dead}\n{_evidence(killed, files, tee)}",
                            killed,
                            {i: files[i] for i in killed if _has_stack(files[i])},
                        )
                time.sleep(0.02)
                continue
            rank, ok, payload = queue.get()
            reported.add(rank)
            if not ok:
                errors.append(f"rank {rank}:\n{payload}")
                continue
            try:
                results[rank] = pickle.loads(payload)  # our own child's result, not a file
            except Exception as e:  # noqa: BLE001 - e.g. a class whose __reduce__ fails here
                errors.append(f"rank {rank}: its result could not be unpickled here: {type(e).__name__}: {e}")
        if errors:
            raise RankFailedError("\n".join(errors))
    finally:
        ours = set()  # ranks this launcher killed (hung past the wait): not crash evidence
        for r, p in enumerate(procs):
            p.join(timeout=10)
            if p.is_alive():
                ours.add(r)
                p.kill()
                p.join()
        if tee is not None:
            tee.finish()  # every byte of the ranks' stderr forwarded before returning
        killed = {
            r: -p.exitcode for r, p in enumerate(procs) if p.exitcode is not None and p.exitcode < 0 and r not in ours
        }
        for r in range(world_size):
            if r not in killed or not _has_stack(files[r]):
                try:
                    os.remove(files[r])
                except OSError:
                    pass
    if killed:  # after sending its result (e.g. in interpreter teardown): a crash all the same
        raise RankFailedError(
            f"rank(s) killed by a signal after sending their results: {killed}\n{_evidence(killed, files, tee)}",
            killed,
            {r: files[r] for r in killed if _has_stack(files[r])},
        )
    codes = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode and r not in ours}
    if codes:  # a clean rank exits 0: anything else after its result is a failed teardown
        raise RankFailedError(f"rank(s) exited with a nonzero code after sending their results: {codes}")
    return [results[r] for r in range(world_size)]


def _context(start_method: str | None):
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if start_method not in _START_METHODS:
        raise ValueError(f"start_method {start_method!r}: expected one of {_START_METHODS}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(_PRELOAD))  # read when the server starts (first use)
    return ctx
