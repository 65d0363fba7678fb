"""A heap corruption, without fqnckpt: torch 2.13's functional ``all_gather_into_tensor``
on a gloo group with several collectives in flight (issued, not yet waited), as an FSDP-style
forward issues its bucket all-gathers. Within seconds one rank usually aborts with glibc's
"malloc(): unaligned tcache chunk detected" on a gloo worker thread (in gloo's own
``new UnboundBuffer``: a chunk that thread freed was written after it was freed), or dies by
SIGSEGV, or the pair hangs. With one collective in flight at a time (``INFLIGHT=1``), and with the
same collectives through ``dist.all_gather_into_tensor(..., async_op=True)``, no crash was seen.
Not a test; run by hand::

    python tests/repro/gloo_functional_inflight.py 3000        # 6 in flight
    INFLIGHT=1 python tests/repro/gloo_functional_inflight.py 3000

On 2 cores: 6 in flight crashed 4 of 6 runs of 3,000 iterations (4 of 4 with
``PYTHONMALLOC=debug``; others hung); 2 in flight of 1-2 KiB 1 of 2; one in flight 0 of 4.
fqnckpt's parallel module therefore waits each collective as it issues it on CPU
(``autoparallel/gather.py`` ``Bucket.overlap``).
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def main(rank: int, world: int, port: int, iters: int, inflight: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    group = dist.group.WORLD.group_name
    sizes = [8, 32, 96, 200, 64, 16][:inflight]
    for i in range(iters):
        pending = []
        for n in sizes:
            flat = torch.randn(n)
            pending.append((flat, torch.ops._c10d_functional.all_gather_into_tensor(flat, world, group)))
        for _, out in pending:
            torch.ops._c10d_functional.wait_tensor(out)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(f"{iters} iterations with {len(sizes)} in flight: no crash", flush=True)


if __name__ == "__main__":
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    inflight = int(os.environ.get("INFLIGHT", "6"))
    mp.start_processes(main, args=(2, port, iters, inflight), nprocs=2, start_method="spawn")
