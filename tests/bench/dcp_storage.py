"""checkpoint.dcp's StorageWriter / StorageReader against torch's HF storage and DCP's default
``.distcp`` storage, through ``dcp.save`` / ``dcp.load`` (not collected by pytest).

On 2 and 4 ranks (gloo, CPU) a state_dict of float32 DTensors (``Shard(0)`` on a 1-D mesh) is
saved by each side, then loaded into ``Shard(0)`` targets (a resume) and ``Shard(1)`` targets
(resharding: each rank's block is a column range, not one range of the file):

- ours: ``StorageWriter(path)`` / ``StorageReader(path)``: HF layout, each byte written once;
- torch HF: ``HuggingFaceStorageWriter(path, save_distributed=True, enable_consolidation=True)``
  (torchtitan's HF export: per-rank files, then a consolidation pass) / ``HuggingFaceStorageReader``;
- DCP default: ``FileSystemWriter`` / ``FileSystemReader`` (``.distcp`` files, not HF).

Each round saves with the three sides in rotating order (a time is the slowest rank's, from a
barrier to a barrier; ``os.sync`` before each save and once before the round's loads), then times
``--repeat`` loads of each kind per side, the sides interleaved load by load in an order rotating
with the round and the repeat, so each comparison is of loads a few tenths of a second apart on
2 shared cores (one load is ~50 ms, easily hit by another process); a round's load time is the
median of its ``--repeat`` loads. Equal work: torch's reader checks nothing, ours checks every
byte it loads against the index's digests before any copy (each tensor or digest chunk hashed by
one rank, the outcomes agreed between the ranks), so ``ours-unchecked`` (the same checkpoint read
without that check and its exchange: a bench-only subclass) is timed beside it. Printed per world
size, with the load average before and after: each reference's time over ours per round (> 1:
ours is faster), as median and range. Values are checked after every load.

    python tests/bench/dcp_storage.py [--mib 64] [--tensors 8] [--rounds 5] [--repeat 5] [--dir /dev/shm/x] [--worlds 2 4]
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

from checkpoint.ranks.launch import run_ranks  # noqa: E402

SIDES = ("ours", "torch-hf", "dcp-distcp")  # savers, and readers of what each saved
READERS = ("ours", "ours-unchecked", "torch-hf", "dcp-distcp")  # ours-unchecked reads ours' save


def full(i: int, rows: int, cols: int) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + i


def _writer(side: str, path: str):
    from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageWriter

    from checkpoint.dcp import StorageWriter

    if side == "ours":
        return StorageWriter(path)
    if side == "torch-hf":
        return HuggingFaceStorageWriter(path, save_distributed=True, enable_consolidation=True)
    return FileSystemWriter(path)


def _reader(side: str, path: str):
    from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader

    from checkpoint.dcp import StorageReader

    if side == "ours":
        return StorageReader(path)
    if side == "ours-unchecked":
        return _Unchecked(path)
    if side == "torch-hf":
        return HuggingFaceStorageReader(path)
    return FileSystemReader(path)


def _unchecked_class():
    from checkpoint.dcp import StorageReader

    class Unchecked(StorageReader):
        """Ours without the check before the copies (no digest hashed, no exchange between the
        ranks): the same reads as torch's reader (which checks nothing), to show what the checks
        cost. Bench only."""

        def _check_first(self, *args, **kwargs):
            return None

        def _read(self, src, plan, planner):
            from dataclasses import replace

            return super()._read(src, replace(plan, storage_data=frozenset()), planner)

    return Unchecked


def _Unchecked(path: str):
    return _unchecked_class()(path)


def worker(rank, world, root, n, rows, cols, rounds, repeat, sides=SIDES, readers=READERS):
    """One rank's saves and loads (see the module docstring); ``sides`` save, ``readers`` load
    (``ours-unchecked`` reads what ``ours`` saved). Returns ``{reader: {kind: [seconds per round]}}``,
    a time being the slowest rank's."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {f"layers.{i}.weight": distribute_tensor(full(i, rows, cols), mesh, [Shard(0)], src_data_rank=None)
          for i in range(n)}  # fmt: skip
    targets = {
        what: {k: distribute_tensor(torch.zeros(rows, cols), mesh, [Shard(d)], src_data_rank=None) for k in sd}
        for what, d in (("load Shard(0)", 0), ("load Shard(1)", 1))
    }
    kinds = ("save", *targets)
    times: dict[str, dict[str, list[float]]] = {s: {w: [] for w in kinds} for s in readers}

    def timed(fn, sync: bool) -> float:
        if sync and rank == 0:
            os.sync()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        el = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(el, op=dist.ReduceOp.MAX)
        return float(el)

    def rotated(seq, k):
        return seq[k % len(seq):] + seq[: k % len(seq)]

    def path_of(side: str, r: int) -> str:
        return os.path.join(root, f"{'ours' if side == 'ours-unchecked' else side}-{r}")

    for r in range(-1, rounds):  # round -1 warms every side up (imports, first touches); not kept
        for side in rotated(list(sides), r):
            times[side]["save"].append(timed(lambda: dcp.save(sd, storage_writer=_writer(side, path_of(side, r))), True))
        if rank == 0:
            os.sync()  # the saves' dirty pages written back before any load is timed
        for what, target in targets.items():
            took: dict[str, list[float]] = {s: [] for s in readers}
            for rep in range(repeat):  # the sides interleaved load by load, order rotating
                for side in rotated(list(readers), r + rep):
                    for v in target.values():
                        v.to_local().zero_()
                    took[side].append(timed(lambda: dcp.load(target, storage_reader=_reader(side, path_of(side, r))), False))
                    for i, (k, v) in enumerate(target.items()):
                        if not torch.equal(v.full_tensor(), full(i, rows, cols)):
                            raise AssertionError(f"{side}: {k} loaded wrong values ({what})")
            for side in readers:  # this round's time: the median of its loads
                times[side][what].append(statistics.median(took[side]))
        dist.barrier()
        if rank == 0:
            for side in sides:
                shutil.rmtree(path_of(side, r), ignore_errors=True)
        if r < 0:
            for side in readers:
                for ts in times[side].values():
                    if ts:
                        ts.pop()
    return times


def ratio_line(label: str, ref: list[float], ours: list[float]) -> str:
    r = [a / b for a, b in zip(ref, ours)]
    return f"  {label:<44} {statistics.median(r):5.2f}x  (range {min(r):.2f}-{max(r):.2f}; ref median {statistics.median(ref):.3f}s, ours {statistics.median(ours):.3f}s)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="MiB of float32 in all")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=5, help="loads per round and side (their median is the round's time)")
    ap.add_argument("--dir", default="/dev/shm/fqnckpt-dcp-bench")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    a = ap.parse_args()
    cols = 256
    rows = max(8, (a.mib << 20) // (4 * cols * a.tensors) // 8 * 8)
    size = a.tensors * rows * cols * 4
    for world in a.worlds:
        before = os.getloadavg()
        shutil.rmtree(a.dir, ignore_errors=True)
        os.makedirs(a.dir)
        try:
            res = run_ranks(worker, world, a.dir, a.tensors, rows, cols, a.rounds, a.repeat, backend="gloo", timeout=1800)[0]
        finally:
            shutil.rmtree(a.dir, ignore_errors=True)
        after = os.getloadavg()
        print(
            f"{world} ranks, {a.tensors} tensors, {size / 2**20:.0f} MiB float32, {a.rounds} rounds ({a.repeat} "
            f"interleaved loads each), rotating order, {a.dir}; load average before {before[0]:.2f}, after "
            f"{after[0]:.2f} (1 min; 5 min {after[1]:.2f})"
        )
        for side in ("torch-hf", "dcp-distcp"):
            for what in res[side]:
                print(ratio_line(f"{side} {what} / ours", res[side][what], res["ours"][what]))
                if what != "save":
                    print(ratio_line(f"{side} {what} / ours-unchecked", res[side][what], res["ours-unchecked"][what]))


if __name__ == "__main__":
    main()
