"""Distributed save against references on the same ranks, same bytes, same run (not
collected by pytest).

    python tests/bench/dist_save.py [--worlds 2,4] [--sizes 256,1024] [--rounds 5]
                                    [--disk /var/tmp/fqnckpt-dist] [--tmpfs /dev/shm/fqnckpt-dist]
                                    [--phases] [--plain] [--max-shard-size 5GB]  (default: save's)

Each rank holds its ``Shard(0)`` rows of 8 float32 tensors of ``size`` MiB in all. Sides, each
timed from a barrier to a barrier (the slowest rank), into a path removed beforehand (freeing the
previous step's pages is not part of a save) and after ``os.sync()``:

- ``ours``: ``checkpoint.save`` (full-tensor HF shard files, each byte written once by its owner,
  digests, atomic commit, fsync);
- ``dcp``: ``dcp.save(sd, checkpoint_id=dir)``, DCP's default ``FileSystemWriter`` (one
  ``.distcp`` file per rank + ``.metadata``, fsynced);
- ``raw``: each rank ``pwrite``s its local bytes into a file of its own and fsyncs it (no format,
  no digests, no commit: the parallel write of the same bytes);
- ``raw_shared``: the same raw writes into ONE preallocated file (rank 0 creates it, every rank
  ``pwrite``s its bytes at its own offsets, rank 0 fsyncs): the floor of any format whose files
  hold whole tensors written by several ranks. On tmpfs the kernel serializes writes to one
  file (``shmem_file_write_iter`` holds the inode lock across the copy), so this is about 1/ranks
  of ``raw`` there;
- ``dcp_hf``: DCP's ``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)``
  (per-rank files, then consolidated HF files: every byte written twice; beside, no goal);
- ``ours_one_order``: ours with every rank going through the shard files in the same order (ours
  starts rank ``r`` at file ``r * files // ranks``), to show what the
  rotation gains when ``--max-shard-size`` gives several files.

Goals: ours >= 1.0x ``dcp`` and >= 0.9x ``raw`` (ratios are reference time / our time per round,
printed as median [range] over rounds whose side order rotates), disk and tmpfs, 2 and 4 ranks.
``--phases`` prints, per rank, the median seconds of each phase of ours (layout exchange,
preparing, writes with their own-chunk hashing, straddling chunks read back / fsync, commit;
CPU seconds per rank are printed for every side); ``--plain`` adds a world-of-one comparison of
the same bytes saved as plain tensors and as DTensors on a one-rank mesh (rank 0 only).
The load average is printed before and after each world.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from checkpoint.ranks.launch import preload, run_ranks  # noqa: E402
from checkpoint_bench import make_large  # noqa: E402  (tests/bench is the script's directory)


def _instrument(phases: dict[str, float]) -> None:
    """Wrap the distributed save's steps to add their seconds into ``phases`` (this rank)."""
    from checkpoint.ranks import dist as cdist
    from checkpoint.write import digests, parts, pipeline

    from save_phases import wrap_timed

    def wrap(obj, name, label):
        wrap_timed(phases, obj, name, label)

    wrap(pipeline, "plan_parts", "plan")
    wrap(cdist, "all_gather_object", "exchanges")  # layout / extra-state check, checks
    wrap(parts, "create_shard_file", "create files")
    wrap(parts.BlockWriter, "write", "write")
    wrap(parts, "write_hashed", "write + hash whole tensors")
    wrap(parts, "write_chunked", "write + hash own chunks")
    wrap(digests, "read_back_chunks", "read back straddling chunks (thread)")
    wrap(pipeline, "write_indexes_and_commit", "index + commit")
    real_fsync = digests.os.fsync

    def fsync(fd):
        t = time.perf_counter()
        try:
            real_fsync(fd)
        finally:
            phases["fsync"] = phases.get("fsync", 0.0) + time.perf_counter() - t

    digests.os.fsync = fsync  # os.fsync itself: every fsync of the rank is counted


def _cpu() -> float:
    """CPU seconds (user + system) of this process, every thread: on a shared machine a side's
    CPU cost is steadier than its wall time."""
    import resource

    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _rank(rank: int, world: int, roots: list[tuple[str, str]], sizes: list[int], rounds: int, want_phases: bool,
          only: tuple[str, ...] = (), max_shard_size: str | None = None):
    import torch.distributed as tdist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import checkpoint
    from checkpoint.storage.writer import pwrite_all, stats, tensor_bytes

    phases: dict[str, float] = {}
    if want_phases:
        _instrument(phases)
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    for size in sizes:
        sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in make_large(size << 20).items()}
        for medium, root in roots:
            base = os.path.join(root, f"w{world}-{size}")
            paths = {n: os.path.join(base, n) for n in ("ours", "dcp", "dcp_hf")}
            raw = os.path.join(base, f"raw-{rank}.bin")

            def raw_write():
                fd = os.open(raw, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    at = 0
                    for v in sd.values():
                        data = tensor_bytes(v.to_local())
                        pwrite_all(fd, data, at)
                        at += len(data)
                    os.fsync(fd)
                finally:
                    os.close(fd)

            shared = os.path.join(base, "raw-shared.bin")
            local_total = sum(v.to_local().numel() * v.element_size() for v in sd.values())

            def raw_shared_write():
                if rank == 0:
                    fd = os.open(shared, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.ftruncate(fd, local_total * world)
                    os.close(fd)
                tdist.barrier()
                fd = os.open(shared, os.O_WRONLY)
                try:
                    at = rank * local_total
                    for v in sd.values():
                        data = tensor_bytes(v.to_local())
                        pwrite_all(fd, data, at)
                        at += len(data)
                    tdist.barrier()
                    if rank == 0:
                        os.fsync(fd)
                finally:
                    os.close(fd)

            def ours_one_order():
                # ours with every rank writing the files in one order (no rotation)
                from checkpoint.write import parts

                real = parts.walk_starts
                parts.walk_starts = lambda names, world: [0] * world
                try:
                    checkpoint.save(sd, paths["ours"], max_shard_size=max_shard_size)
                finally:
                    parts.walk_starts = real

            sides = {
                "ours": lambda: checkpoint.save(sd, paths["ours"], max_shard_size=max_shard_size),
                "ours_one_order": ours_one_order,
                "raw_shared": raw_shared_write,
                "dcp": lambda: dcp.save(sd, checkpoint_id=paths["dcp"]),
                "raw": raw_write,
                "dcp_hf": lambda: dcp.save(
                    sd,
                    storage_writer=HuggingFaceStorageWriter(
                        paths["dcp_hf"], fqn_to_index_mapping={k: 1 for k in sd},
                        save_distributed=True, enable_consolidation=True,
                    ),
                ),  # fmt: skip
            }
            names = [n for n in sides if not only or n in only or n == "ours"]
            times: dict[str, list[float]] = {n: [] for n in names}
            cpu: dict[str, list[float]] = {n: [] for n in names}  # this rank's CPU seconds (all threads)
            ph_rounds: list[dict[str, float]] = []
            written = 0
            for i in range(rounds + 1):  # round 0 untimed: first touch of memory and files
                for j in range(len(names)):
                    n = names[(i + j) % len(names)]
                    tdist.barrier()
                    if rank == 0:
                        shutil.rmtree(base, ignore_errors=True)
                        os.makedirs(base)
                        os.sync()
                    tdist.barrier()
                    phases.clear()
                    stats.reset()
                    t, c = time.perf_counter(), _cpu()
                    sides[n]()
                    c = _cpu() - c
                    tdist.barrier()
                    dt = time.perf_counter() - t
                    if i:
                        times[n].append(dt)
                        cpu[n].append(c)
                        if n == "ours":
                            ph_rounds.append(dict(phases))
                            written = stats.bytes_written
            tdist.barrier()
            if rank == 0:
                shutil.rmtree(base, ignore_errors=True)
            out[(size, medium)] = {"times": times, "cpu": cpu, "phases": ph_rounds, "written": written}
        del sd
    return out


def _plain_vs_dtensor(rank: int, world: int, roots, sizes, rounds: int):
    """World of one: the same bytes as plain tensors (single-process streaming save) and as
    DTensors on a one-rank mesh (the distributed path)."""
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import checkpoint

    mesh = init_device_mesh("cpu", (1,))
    out = {}
    for size in sizes:
        plain = make_large(size << 20)
        dt = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in plain.items()}
        for medium, root in roots:
            base = os.path.join(root, f"one-{size}")
            sides = {"plain": lambda: checkpoint.save(plain, base), "dtensor": lambda: checkpoint.save(dt, base)}
            times = {n: [] for n in sides}
            for i in range(rounds + 1):
                for n in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
                    shutil.rmtree(base, ignore_errors=True)
                    os.sync()
                    t = time.perf_counter()
                    sides[n]()
                    if i:
                        times[n].append(time.perf_counter() - t)
            shutil.rmtree(base, ignore_errors=True)
            out[(size, medium)] = times
    tdist.barrier()
    return out


def ratio(ref: list[float], ours: list[float]) -> str:
    r = [a / b for a, b in zip(ref, ours)]
    return f"{statistics.median(r):.2f}x [{min(r):.2f}-{max(r):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--sizes", default="256,1024", help="MiB in all, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--disk", default="/var/tmp/fqnckpt-dist", help="a directory on a real disk ('' to skip)")
    ap.add_argument("--tmpfs", default="/dev/shm/fqnckpt-dist", help="a directory on tmpfs ('' to skip)")
    ap.add_argument("--sides", default="", help="comma-separated subset of ours,raw,raw_shared,dcp,dcp_hf,ours_one_order (default: all)")
    ap.add_argument("--phases", action="store_true", help="per-rank phase times of ours")
    ap.add_argument("--plain", action="store_true", help="also plain tensors vs DTensors, world of one")
    ap.add_argument("--max-shard-size", default="",
                    help="ours' max_shard_size: e.g. 128MB or 5GB (one file for 1 GiB); default: not passed "
                    "(save's default: at least world-size files of >= 64 MiB)")  # fmt: skip
    args = ap.parse_args()
    args.max_shard_size = args.max_shard_size or None
    roots = [(m, r) for m, r in (("disk", args.disk), ("tmpfs", args.tmpfs)) if r]
    for _, r in roots:
        os.makedirs(r, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    preload("checkpoint.saving", "checkpoint.write", "torch.distributed.checkpoint")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, ours with max_shard_size={args.max_shard_size}; ratios = reference time / our time per "
          f"round, median [range] over {args.rounds} rounds, rotating order")  # fmt: skip
    try:
        for world in (int(w) for w in args.worlds.split(",")):
            la = os.getloadavg()[0]
            only = tuple(x for x in args.sides.split(",") if x)
            res = run_ranks(
                _rank, world, roots, sizes, args.rounds, args.phases, only, args.max_shard_size,
                backend="gloo", timeout=3600,
            )  # fmt: skip
            print(f"\n{world} ranks (load average {la:.1f} -> {os.getloadavg()[0]:.1f})")
            for key in res[0]:
                size, medium = key
                times = res[0][key]["times"]  # barrier to barrier: the same on every rank
                ours = times["ours"]
                written = sum(r[key]["written"] for r in res)
                print(f"  {size} MiB, {medium}: ours {statistics.median(ours):.3f}s "
                      f"[{min(ours):.3f}-{max(ours):.3f}] ({(size << 20) / statistics.median(ours) / 1e9:.2f} GB/s, "
                      f"{written / (size << 20):.4f}x the tensor bytes written)")  # fmt: skip
                refs = [
                    ("dcp", "dcp.save (goal >= 1.0)"),
                    ("raw", "raw parallel write, one file per rank (goal >= 0.9)"),
                    ("raw_shared", "raw write of the same bytes into one shared file"),
                    ("dcp_hf", "DCP HF writer + consolidation"),
                    ("ours_one_order", "ours with every rank writing the files in one order"),
                ]
                print("    vs " + "; ".join(f"{label}: {ratio(times[n], ours)}" for n, label in refs if n in times))
                print("    absolute wall s (median): " + ", ".join(f"{n} {statistics.median(v):.3f}" for n, v in times.items()))
                print("    CPU s per rank (median over rounds): " + "; ".join(
                    f"{n} " + "/".join(f"{statistics.median(r[key]['cpu'][n]):.3f}" for r in res) for n in times))
                if "raw" in times and "raw_shared" in times:
                    print(f"    raw_shared time / raw time: {ratio(times['raw_shared'], times['raw'])}")
                if args.phases:
                    for r, rec in enumerate(res):
                        ph = rec[key]["phases"]
                        labels = sorted({k for p in ph for k in p})
                        med = {k: statistics.median(p.get(k, 0.0) for p in ph) for k in labels}
                        print(f"    rank {r} phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))
        if args.plain:
            la = os.getloadavg()[0]
            res = run_ranks(_plain_vs_dtensor, 1, roots, sizes, args.rounds, backend="gloo", timeout=3600)
            print(f"\nworld of one (load average {la:.1f} -> {os.getloadavg()[0]:.1f})")
            for (size, medium), times in res[0].items():
                print(f"  {size} MiB, {medium}: DTensor save vs plain-tensor save of the same bytes: "
                      f"{ratio(times['plain'], times['dtensor'])}")  # fmt: skip
    finally:
        for _, r in roots:
            shutil.rmtree(r, ignore_errors=True)


if __name__ == "__main__":
    main()
