"""The exit-time abort ("terminate called without an active exception", SIGABRT, after every
result was written), without fqnckpt: a process whose interpreter exits while gloo collectives it
issued are not waited. Not a test; run by hand::

    python tests/repro/gloo_exit_unwaited.py nowait 10   # fire-and-forget all_reduces, then sys.exit
    python tests/repro/gloo_exit_unwaited.py wait 10     # the same, barrier + destroy_process_group first

Mechanism: a gloo worker thread (``pt_gloo_runloop``) drops its finished work, holding the
collective's tensors, after marking it complete; where the caller already dropped its Python
references, the last reference goes on that thread, which takes the GIL to free the tensor's
PyObject. Once the main thread is finalizing the interpreter, taking the GIL ends the thread
(``PyThread_exit_thread``: a forced unwind) and the unwind through a ``noexcept`` C++ frame calls
``std::terminate`` with no exception. Upstream: pytorch/pytorch#190489 (gloo, no
``destroy_process_group``), PR #179291 (an atexit ``destroy_process_group``, abandoned).
On the 2-core development machine: ``nowait`` 8 of 20 ranks aborted, ``wait`` 0 of 20.

``destroy_process_group`` alone does not free a group that a ``DeviceMesh`` uses: DTensor's
sharding-propagation and redistribution caches keep the mesh, so its gloo threads run until the
process ends (``mesh`` mode prints each rank's threads after ``destroy_process_group``). They are
harmless once every collective is waited. ``run_ranks`` waits every group's collectives (a
barrier per group), destroys the groups, and its ranks end with ``os._exit`` (forkserver, fork), so
no finalization runs beside the gloo threads; the parallel module waits each collective on CPU.
"""

import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist


def rank_main(rank: int, port: int, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if mode == "mesh":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2,))
        distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]).full_tensor()
        del mesh
    for _ in range(20):
        dist.all_reduce(torch.randn(1 << 16), async_op=True)  # fire and forget
    if mode in ("wait", "mesh"):
        dist.barrier()  # gloo's barrier completes after all earlier work of the group
        dist.destroy_process_group()
    if mode == "mesh":
        import gc

        gc.collect()
        names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
        print(f"rank {rank} threads after destroy_process_group: {names}", flush=True)
    sys.exit(0)  # interpreter finalization


if __name__ == "__main__":
    if len(sys.argv) == 4:
        rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    mode, runs = sys.argv[1], int(sys.argv[2])
    aborted = 0
    for i in range(runs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), mode], stderr=subprocess.PIPE) for r in range(2)]
        for p in procs:
            _, err = p.communicate(timeout=300)
            if p.returncode:
                aborted += 1
                print(f"run {i}: exit {p.returncode}: {err.decode(errors='replace').strip()[-200:]}", flush=True)
    print(f"{mode}: {aborted} of {2 * runs} ranks ended abnormally")
