"""Cost of the digest checks of ``checkpoint.load`` into DTensors on 2 ranks (not collected by
pytest), ``Shard(1)`` (``--dim 1``: each rank reads its column block through whole rows, so one
rank, in turn, hashes the tensor on the way) or ``Shard(0)`` (``--dim 0``: each rank hashes the
digest chunks starting in its rows, reads the rest of the one its rows cut, and the load's
closing agreement gathers the chunk digests). Three sides in the same run, rotating order, warm
page cache, each round's time the slowest rank's (barrier before and after):

- ``unchecked``: no digest compared (the index's digests hidden from the reader);
- ``checked``: the load as it is;
- ``every rank`` (``--dim 1`` only): each rank hashes every tensor it reads through all rows.

    python tests/bench/dtensor_checked_load.py [--dim 1] [--mib 64] [--cols 1024] [--pairs 7] [--dir /dev/shm/x]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402


def _rank(rank: int, world: int, path: str, names: list[str], rows: int, cols: int, pairs: int, dim: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import checkpoint
    from checkpoint import apply
    from checkpoint.storage.reader import CheckpointReader

    mesh = init_device_mesh("cpu", (world,))
    dst = {k: distribute_tensor(torch.zeros(rows, cols), mesh, [Shard(dim)], src_data_rank=None) for k in names}
    due = CheckpointReader.recorded_digest

    def unchecked():
        CheckpointReader.recorded_digest = lambda self, key: None
        try:
            checkpoint.load(dst, path)
        finally:
            CheckpointReader.recorded_digest = due

    def checked():
        checkpoint.load(dst, path)

    split = apply._checker

    def every_rank():
        apply._checker = lambda t, turn: True
        try:
            checkpoint.load(dst, path)
        finally:
            apply._checker = split

    sides = {"unchecked": unchecked, "checked": checked} | ({"every rank": every_rank} if dim == 1 else {})
    order = list(sides)
    times: dict[str, list[float]] = {k: [] for k in order}
    for fn in sides.values():  # one untimed round each
        fn()
    for i in range(pairs):
        for name in order[i % len(order) :] + order[: i % len(order)]:
            dist.barrier()
            t0 = time.perf_counter()
            sides[name]()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=1, choices=(0, 1), help="Shard(dim) targets")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--cols", type=int, default=1024, help="float32 columns (rows of 4 KiB at 1024)")
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--dir", default="/dev/shm/fqnckpt-dtensor-checked")
    a = ap.parse_args()
    import checkpoint
    from checkpoint.ranks.launch import run_ranks

    n = 8
    rows = max(2, (a.mib << 20) // (n * a.cols * 4))
    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(rows, a.cols, generator=g) for i in range(n)}
    path = os.path.join(a.dir, "ck")
    shutil.rmtree(a.dir, ignore_errors=True)
    try:
        checkpoint.save(sd, path)
        res = run_ranks(_rank, 2, path, list(sd), rows, a.cols, a.pairs, a.dim, backend="gloo", timeout=1200)
        # Both ranks waited the same barriers: rank 0's times are the rounds'.
        t = res[0]
        size = sum(v.nbytes for v in sd.values())
        for name, ts in t.items():
            print(f"{name}: median {statistics.median(ts) * 1e3:.1f} ms [{min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}] "
                  f"({size / 2**20:.0f} MiB, {n} tensors, Shard({a.dim}) on 2 ranks)")  # fmt: skip
        for name in [k for k in t if k != "unchecked"]:
            r = [u / c for u, c in zip(t["unchecked"], t[name])]
            print(f"{name} vs unchecked: {statistics.median(r):.3f}x [{min(r):.3f}-{max(r):.3f}] (unchecked time / its time)")
        print(f"load average {os.getloadavg()}")
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
