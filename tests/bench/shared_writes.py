"""Why a distributed save of whole-tensor (HF) shard files cannot match one file per rank on tmpfs,
and whether ordering the writes recovers it (not collected by pytest).

    python tests/bench/shared_writes.py [--procs 2,4] [--mib 256] [--rounds 5] [--dir /dev/shm/fqnckpt-sw]

``procs`` processes each hold ``mib`` MiB and ``pwrite`` them (8 MiB pieces, then fsync) in four
ways, timed from a barrier until every process is done, rotating the order each round:

- ``own``: each into a file of its own (what DCP's ``.distcp`` files and ``raw`` in dist_save.py do);
- ``shared``: all into ONE file, each at its own offsets (a row-sharded tensor of an HF shard file);
- ``files_same``: ``procs`` files, each process writing its slice of every file, every process
  going through the files in the same order (what the save does: one write order for all ranks);
- ``files_rotated``: the same files and bytes, process ``r`` starting at file ``r`` so that at
  any time the processes write different files.

Printed per way: wall seconds (median [range]) and the CPU seconds (user + system) each process
spent. Where the kernel serializes writers of one file (tmpfs: ``shmem_file_write_iter`` holds the
inode lock across the copy) ``shared`` takes about ``procs`` x the CPU time of one process while
each process still spends only its own CPU time: they wait, not work.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import time

PIECE = 8 << 20
WAYS = ("own", "shared", "files_same", "files_rotated")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _child(rank: int, procs: int, nbytes: int, d: str, start, done, q) -> None:
    import numpy as np

    data = memoryview(np.random.default_rng(rank).integers(0, 255, nbytes, dtype=np.uint8))
    slice_ = nbytes // procs  # this process's bytes in each of the `procs` files
    while True:
        way = q.get()
        if way is None:
            return
        start.wait()
        c0, t0 = _cpu(), time.perf_counter()
        jobs = []  # (file, file offset, bytes)
        if way == "own":
            jobs = [(f"own{rank}", 0, data)]
        elif way == "shared":
            jobs = [("shared", rank * nbytes, data)]
        else:
            order = list(range(procs))
            if way == "files_rotated":
                order = order[rank:] + order[:rank]
            jobs = [(f"file{j}", rank * slice_, data[j * slice_ : (j + 1) * slice_]) for j in order]
        for name, at, buf in jobs:
            fd = os.open(os.path.join(d, name), os.O_WRONLY)
            try:
                for lo in range(0, len(buf), PIECE):
                    os.pwrite(fd, buf[lo : lo + PIECE], at + lo)
                os.fsync(fd)
            finally:
                os.close(fd)
        done.put((rank, time.perf_counter() - t0, _cpu() - c0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", default="2,4")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm/fqnckpt-sw")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    print(f"{os.cpu_count()} CPUs, {args.dir}, {args.mib} MiB per process; load average {os.getloadavg()[0]:.1f}")
    for procs in (int(p) for p in args.procs.split(",")):
        nbytes = args.mib << 20
        start, done = ctx.Barrier(procs + 1), ctx.Queue()
        qs = [ctx.Queue() for _ in range(procs)]
        kids = [ctx.Process(target=_child, args=(r, procs, nbytes, args.dir, start, done, qs[r])) for r in range(procs)]
        for k in kids:
            k.start()
        wall: dict[str, list[float]] = {w: [] for w in WAYS}
        cpu: dict[str, list[float]] = {w: [] for w in WAYS}
        try:
            for i in range(args.rounds + 1):  # round 0 untimed (warm-up)
                for j in range(len(WAYS)):
                    way = WAYS[(i + j) % len(WAYS)]
                    shutil.rmtree(args.dir, ignore_errors=True)
                    os.makedirs(args.dir)
                    names = {"own": [f"own{r}" for r in range(procs)], "shared": ["shared"]}.get(
                        way, [f"file{r}" for r in range(procs)]
                    )
                    size = nbytes * procs // len(names)
                    for n in names:
                        fd = os.open(os.path.join(args.dir, n), os.O_WRONLY | os.O_CREAT, 0o644)
                        os.ftruncate(fd, size)
                        os.close(fd)
                    os.sync()
                    for q in qs:
                        q.put(way)
                    start.wait()
                    t0 = time.perf_counter()
                    got = [done.get() for _ in range(procs)]
                    dt = time.perf_counter() - t0
                    if i:
                        wall[way].append(dt)
                        cpu[way].append(statistics.mean(c for _, _, c in got))
        finally:
            for q in qs:
                q.put(None)
            for k in kids:
                k.join()
            shutil.rmtree(args.dir, ignore_errors=True)

        def med(xs):
            return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"

        print(f"\n{procs} processes x {args.mib} MiB, {args.rounds} rounds (load average {os.getloadavg()[0]:.1f})")
        for w in WAYS:
            ratio = [a / b for a, b in zip(wall["own"], wall[w])]
            print(f"  {w:14s} wall {med(wall[w])} s, CPU per process {med(cpu[w])} s; own/this "
                  f"{statistics.median(ratio):.2f}x [{min(ratio):.2f}-{max(ratio):.2f}]")  # fmt: skip


if __name__ == "__main__":
    main()
