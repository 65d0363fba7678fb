"""Benchmark: how long ``checkpoint.async_save`` blocks the caller, against a synchronous
``checkpoint.save`` of the same state measured in the same run (not collected by pytest).

    python tests/bench/async_save.py [--mib 512] [--pairs 7] [--dir /tmp/fqnckpt-async-bench] [--device cpu]

Goal (issue 14): the ``async_save`` call blocks <= 10% of a synchronous save of a 512 MiB state.
Each pair runs both, alternating which goes first, each to a fresh path after ``os.sync()``; the
async side's background write is waited for (untimed) before the next step. One warm-up async
save first allocates the staging buffers (reported separately: later saves reuse them).
Prints per-side median and range, the per-pair ratio's median and range, and the staging memory.
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

import checkpoint  # noqa: E402
from checkpoint.training.async_save import AsyncSaver  # noqa: E402


def make_state(total_bytes: int, device: str) -> dict[str, torch.Tensor]:
    n = 16
    rows = max(1, total_bytes // (n * 4096 * 4))
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(rows, 4096, generator=g).to(device) for i in range(n)}


def _sync_device(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=512)
    p.add_argument("--pairs", type=int, default=7)
    p.add_argument("--dir", default="/tmp/fqnckpt-async-bench")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    if a.pairs < 5:
        p.error("--pairs must be >= 5")
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    sd = make_state(int(a.mib * 2**20), a.device)
    size = sum(v.numel() * v.element_size() for v in sd.values())
    print(
        f"state: {len(sd)} tensors, {size / 2**20:.0f} MiB on {a.device}; torch threads {torch.get_num_threads()}"
    )
    saver = AsyncSaver()
    n = 0

    def path() -> str:
        nonlocal n
        n += 1
        return os.path.join(a.dir, f"ck{n}")

    def sync_save() -> float:
        os.sync()
        _sync_device(a.device)
        t = time.perf_counter()
        checkpoint.save(sd, path())
        return time.perf_counter() - t

    def async_call() -> float:
        os.sync()
        _sync_device(a.device)
        t = time.perf_counter()
        fut = saver.save(sd, path())
        blocked = time.perf_counter() - t
        fut.result()  # untimed: the background write must not overlap the other side
        return blocked

    first = async_call()
    print(f"first async_save call (allocates staging buffers): {first * 1e3:.1f} ms")
    print(
        f"staging memory: {saver.staging_bytes / 2**20:.1f} MiB ({'pinned' if a.device.startswith('cuda') else 'pageable'} host memory, reused)"
    )
    syncs, asyncs, ratios = [], [], []
    for i in range(a.pairs):
        if i % 2 == 0:
            s = sync_save()
            b = async_call()
        else:
            b = async_call()
            s = sync_save()
        syncs.append(s)
        asyncs.append(b)
        ratios.append(b / s)
        print(f"pair {i}: save {s * 1e3:8.1f} ms   async_save call {b * 1e3:7.1f} ms   ratio {b / s:.3f}")
        for d in os.listdir(a.dir):
            shutil.rmtree(os.path.join(a.dir, d), ignore_errors=True)

    def fmt(xs, scale=1e3, unit="ms"):
        return f"median {statistics.median(xs) * scale:.1f} {unit} (range {min(xs) * scale:.1f}-{max(xs) * scale:.1f})"

    print(f"synchronous save:      {fmt(syncs)}")
    print(f"async_save blocking:   {fmt(asyncs)}")
    print(
        f"ratio blocking / save: median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}); goal <= 0.10"
    )
    shutil.rmtree(a.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
