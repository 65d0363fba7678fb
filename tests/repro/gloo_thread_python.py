"""Python runs on gloo's worker threads in torch 2.13 (a CI crash: a general protection fault
in libpython on a ``pt_gloo_runloop`` thread). No fqnckpt import. Not a test (pytest collects
``test_*.py`` only); run by hand::

    python tests/repro/gloo_thread_python.py            # probe: where do the tensors die?
    python tests/repro/gloo_thread_python.py stress 60  # 60 s of the pattern, 2 ranks (4: stress 60 4)

Mechanism (read in torch 2.13's headers and seen under gdb in the parallel-module spawns):
a gloo ``AsyncWork`` holds the collective's input / output tensors (and, since 2.13, an
``at::ThreadLocalState`` captured on the calling thread, with its Python mode objects). The worker
thread that ran it drops it in ``ProcessGroupGloo::runLoop`` after marking it complete, so when the
caller has already dropped its Python references (a synchronous ``dist.scatter`` inside
``distribute_tensor``, a fire-and-forget ``async_op=True``) the worker makes the last C++ reference
go: ``TensorImpl::decref_pyobject`` (PyObject preservation, refcount 2 -> 1) takes the GIL on that
thread (pybind11 ``gil_scoped_acquire``, a fresh PyThreadState each time) and ``Py_DECREF``s the
tensor's PyObject, which is then deallocated there (``subtype_dealloc`` -> ``THPVariable_clear``,
which releases and retakes the GIL mid-deallocation), its views' bases with it; weakref callbacks
and ``__del__`` run on that thread. The probe prints, per kind of tensor, the thread it died on.

The stress mode repeats the pattern (hundreds of views deallocated on the workers per collective,
the main thread meanwhile in functional collectives' Python autograd kernels, the cyclic GC and
allocation churn); combine with ``PYTHONMALLOC=debug`` or
``MALLOC_CHECK_=3 LD_PRELOAD=/lib/x86_64-linux-gnu/libc_malloc_debug.so.0``. With torch 2.13.0 it
has not crashed (2 and 4 ranks, ~10 CPU-minutes): every such path takes the GIL, so the Python on
the workers is legal, and where the heap corruption comes from is still open.
"""

from __future__ import annotations

import collections
import gc
import os
import socket
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


class _Sub(torch.Tensor):
    pass


def probe(rank: int, world: int, port: int) -> None:
    _init(rank, world, port)
    main = threading.get_ident()
    deaths: collections.Counter = collections.Counter()

    def watch(t: torch.Tensor, kind: str) -> weakref.ref:
        def died(_):  # runs in the deallocation, on whichever thread it happens
            deaths[kind, "main thread" if threading.get_ident() == main else "gloo worker"] += 1

        return weakref.ref(t, died)

    refs = []
    for _ in range(200):
        base = torch.randn(64, 16)
        view = base.narrow(0, 0, 32)
        refs += [watch(base, "base of an async all_reduce's view"), watch(view, "async all_reduce's view")]
        dist.all_reduce(view, async_op=True)  # Work dropped at once
        del view, base
    dist.barrier()
    time.sleep(0.5)
    gc.collect()
    if rank == 0:
        for (kind, where), n in sorted(deaths.items()):
            print(f"{kind:40s} died on the {where}: {n}", flush=True)
    dist.destroy_process_group()


def stress(rank: int, world: int, port: int, seconds: float) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    _init(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    deadline = time.time() + seconds
    rounds, junk = 0, []
    while True:
        flag = torch.tensor([1.0 if time.time() < deadline else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() == 0:
            break
        for k in range(5):
            bases = [torch.randn(4, 8) for _ in range(200)]
            views = [b[1:3] if i % 2 else b.narrow(0, 0, 2).as_subclass(_Sub) for i, b in enumerate(bases)]
            cyc = [views[0]]
            cyc.append(cyc)  # garbage cycle holding a tensor: the GC's tp_clear releases the GIL
            dist.all_reduce_coalesced(views, async_op=True)  # the worker frees the last references
            del bases, views, cyc
            distribute_tensor(torch.randn(8 * world, 16), mesh, (Shard(0),), src_data_rank=0)
            x = torch.randn(16 * world, 8, requires_grad=True)
            y = DTensor.from_local(x, mesh, (Partial("sum"),), run_check=False).redistribute(mesh, (Shard(0),))
            z = DTensor.from_local(y.to_local(), mesh, (Shard(0),), run_check=False).full_tensor()
            z.sum().backward()  # functional collectives through their Python autograd kernels
            junk.append([{"a": object()} for _ in range(50)])
            if len(junk) > 30:
                junk.clear()
            if k % 2 == 0:
                gc.collect()
        rounds += 1
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(f"stress: {rounds} rounds, no crash", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "probe"
    world = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    args = (world, _port()) + ((float(sys.argv[2]) if len(sys.argv) > 2 else 60.0,) if mode == "stress" else ())
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=stress if mode == "stress" else probe, args=(r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    print("exit codes", codes, flush=True)
    sys.exit(1 if any(codes) else 0)
