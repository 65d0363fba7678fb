"""Distributed save at scale, reloaded resharded (not collected by pytest).

8 ranks (gloo, CPU) on a 2x4 mesh save a model of 1,024 DTensors (FSDP2 + TP style placements:
``_StridedShard`` + ``Shard``, ``Shard`` on either dim, uneven, replicated) into the HF layout;
then 2 ranks load it with other placements. Prints the save and load times (slowest rank), that
every byte was written exactly once (bytes written over all ranks == bytes of the shard files),
that each loading rank read exactly the bytes it holds, and that every value equals the full
tensor.

    python tests/bench/dist_scale.py [--tensors 1024] [--rows 96] [--cols 64] [--dir /dev/shm/...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import checkpoint  # noqa: E402
from checkpoint.ranks.launch import run_ranks  # noqa: E402
from checkpoint.storage.writer import stats  # noqa: E402


def full(i: int, rows: int, cols: int) -> torch.Tensor:
    # Rows vary with i so that some tensors shard unevenly; values identify (tensor, element).
    r = rows + (i % 3)
    return torch.arange(r * cols, dtype=torch.float32).reshape(r, cols) + i * 1e6


def placements(i: int, ndim_mesh: int):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if ndim_mesh == 2:  # saving side, 2x4 mesh
        return [
            [_StridedShard(0, split_factor=4), Shard(0)],  # FSDP2 + TP row-wise
            [Shard(0), Shard(1)],
            [Shard(1), Replicate()],
            [Replicate(), Shard(0)],
        ][i % 4]
    return [[Shard(1)], [Shard(0)], [_StridedShard(0, split_factor=2)], [Replicate()]][i % 4]


def model(mesh, n, rows, cols, zero=False):
    from torch.distributed.tensor import distribute_tensor

    out = {}
    for i in range(n):
        t = full(i, rows, cols)
        t = torch.zeros_like(t) if zero else t
        out[f"layers.{i // 8}.mlp.experts.{i % 8}.weight"] = distribute_tensor(
            t, mesh, placements(i, mesh.ndim), src_data_rank=None
        )
    return out


def clock(fn) -> float:
    torch.distributed.barrier()
    os.sync()
    t = time.perf_counter()
    fn()
    torch.distributed.barrier()
    return time.perf_counter() - t


def save_rank(rank, world, path, n, rows, cols):
    from torch.distributed.device_mesh import init_device_mesh

    sd = model(init_device_mesh("cpu", (2, 4)), n, rows, cols)
    stats.reset()
    t = clock(lambda: checkpoint.save(sd, path))
    return {"t": t, "written": stats.bytes_written}


def load_rank(rank, world, path, n, rows, cols):
    from torch.distributed.device_mesh import init_device_mesh

    sd = model(init_device_mesh("cpu", (world,)), n, rows, cols, zero=True)
    stats.reset()
    t = clock(lambda: checkpoint.load(sd, path))
    held = sum(v.to_local().nbytes for v in sd.values())
    ok = all(torch.equal(v.to_local(), model_local(v, i, rows, cols)) for i, v in enumerate(sd.values()))
    return {"t": t, "read": stats.bytes_read, "held": held, "ok": ok}


def model_local(v, i, rows, cols):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full(i, rows, cols), v.device_mesh, v.placements, src_data_rank=None).to_local()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--cols", type=int, default=64)
    ap.add_argument("--dir", default="/dev/shm/fqnckpt-dist-scale")
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    path = os.path.join(a.dir, "ck")
    try:
        t0 = time.perf_counter()
        saved = run_ranks(save_rank, 8, path, a.tensors, a.rows, a.cols, backend="gloo", timeout=1800)
        t_save_total = time.perf_counter() - t0
        with checkpoint.open_checkpoint(path) as r:
            files = r.files
            data = sum(r.spec(k).nbytes for k in r.keys())
        on_disk = sum(os.path.getsize(os.path.join(path, f)) for f in files)
        written = sum(s["written"] for s in saved)
        t0 = time.perf_counter()
        loaded = run_ranks(load_rank, 2, path, a.tensors, a.rows, a.cols, backend="gloo", timeout=1800)
        t_load_total = time.perf_counter() - t0
        print(f"{a.tensors} tensors, {data / 2**20:.1f} MiB of data in {len(files)} files; machine load "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")  # fmt: skip
        print(f"save on 8 ranks (2x4 mesh): {max(s['t'] for s in saved):.2f}s (slowest rank; with spawn "
              f"{t_save_total:.1f}s); bytes written per rank {[s['written'] for s in saved]}")  # fmt: skip
        print(f"  written once: sum {written} == shard files {on_disk}: {written == on_disk}")
        print(f"load resharded on 2 ranks: {max(s['t'] for s in loaded):.2f}s (slowest rank; with spawn "
              f"{t_load_total:.1f}s)")  # fmt: skip
        print(f"  bytes read per rank {[s['read'] for s in loaded]} == bytes held {[s['held'] for s in loaded]}: "
              f"{all(s['read'] == s['held'] for s in loaded)}; values equal the full tensors: "
              f"{all(s['ok'] for s in loaded)}")  # fmt: skip
        print(f"verify: {checkpoint.verify(path).ok}")
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
