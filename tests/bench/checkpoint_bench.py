"""Benchmark of checkpoint save / load (not collected by pytest). Prints ratios against references
measured in the same run, bytes written / read, and peak RSS.

    python tests/bench/checkpoint_bench.py [--gb 1.0] [--dir /tmp/fqnckpt-bench] [--no-dist]

Goals (issue 4): save >= 0.95x safetensors.save_file + fsync; load >= 0.95x safe_open + copy and
>= 3x torch.load; bytes written = checkpoint size; bytes read per rank <= 1.05 x size / world + headers.
Loaded data is touched (summed) before a clock stops: safetensors' mmap is lazy.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import checkpoint  # noqa: E402
from checkpoint.storage.writer import stats  # noqa: E402


def make_state(total_bytes: int) -> dict[str, torch.Tensor]:
    n = 16
    rows = max(1, total_bytes // (n * 4096 * 4))
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(rows, 4096, generator=g) for i in range(n)}


def peak_rss_mb() -> float:
    # VmHWM is reset on exec (ru_maxrss is not, so spawned ranks would report the parent's peak).
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def fsync_tree(path: str) -> None:
    for f in os.listdir(path) if os.path.isdir(path) else [""]:
        fd = os.open(os.path.join(path, f) if f else path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def touch(sd) -> float:
    return float(sum(v.float().sum() for v in sd.values()))


def timed(fn, repeat=2):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def single(root: str, gb: float) -> dict[str, float]:
    from safetensors import safe_open
    from safetensors.torch import save_file

    sd = make_state(int(gb * 1e9))
    size = sum(v.numel() * v.element_size() for v in sd.values())
    print(f"state: {len(sd)} tensors, {size / 1e9:.2f} GB")
    ours, st_file, pt_file = (os.path.join(root, n) for n in ("ours", "st.safetensors", "pt.pt"))

    def st_save():
        save_file(sd, st_file, metadata={"format": "pt"})
        fsync_tree(st_file)

    def our_save():
        checkpoint.save(sd, ours, overwrite=True, max_shard_size="5GB")

    def pt_save():
        torch.save(sd, pt_file)
        fsync_tree(pt_file)

    t_st, t_ours, t_pt = timed(st_save), timed(our_save), timed(pt_save)
    stats.reset()
    our_save()
    written = stats.bytes_written
    on_disk = dir_bytes(ours) - os.path.getsize(os.path.join(ours, "model.safetensors.index.json"))

    dst = {k: torch.empty_like(v) for k, v in sd.items()}
    touch(dst)  # first touch of fresh memory is slow: warm the destinations

    def st_load():
        with safe_open(st_file, "pt") as f:
            for k in f.keys():
                dst[k].copy_(f.get_tensor(k))
        touch(dst)

    def our_load():
        checkpoint.load(dst, ours)
        touch(dst)

    def pt_load():
        loaded = torch.load(pt_file, weights_only=True)
        for k, v in loaded.items():
            dst[k].copy_(v)
        touch(dst)

    l_st, l_ours, l_pt = timed(st_load), timed(our_load), timed(pt_load)
    print(f"save: ours {size / t_ours / 1e9:.2f} GB/s | vs safetensors.save_file+fsync {t_st / t_ours:.2f}x (goal >= 0.95)"
          f" | vs torch.save {t_pt / t_ours:.2f}x")  # fmt: skip
    print(f"load: ours {size / l_ours / 1e9:.2f} GB/s | vs safe_open+copy {l_st / l_ours:.2f}x (goal >= 0.95)"
          f" | vs torch.load {l_pt / l_ours:.2f}x (goal >= 3)")  # fmt: skip
    print(f"bytes written by one save: {written} = shard files {on_disk} bytes: {written == on_disk}"
          f" (data {size}, headers {on_disk - size})")  # fmt: skip
    for p in (st_file, pt_file):
        os.remove(p)
    return {"size": size}


def _dist_rank(rank, world, root, gb, which):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = make_state(int(gb * 1e9))
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    del full
    ours, theirs = os.path.join(root, "dist_ours"), os.path.join(root, "dist_dcp")
    out = {}

    def bar():
        torch.distributed.barrier()

    def clock(fn):
        bar()
        t = time.perf_counter()
        fn()
        bar()
        return time.perf_counter() - t

    stats.reset()
    out["save_ours"] = clock(lambda: checkpoint.save(sd, ours, overwrite=True))
    out["written"] = stats.bytes_written
    if rank == 0:
        shutil.rmtree(theirs, ignore_errors=True)
    fqn_to_index = {k: 1 for k in sd}
    out["save_dcp"] = clock(
        lambda: dcp.save(
            sd, storage_writer=HuggingFaceStorageWriter(
                theirs, fqn_to_index_mapping=fqn_to_index, save_distributed=True, enable_consolidation=True
            ),
        )
    )  # fmt: skip
    dst = {
        k: torch.distributed.tensor.zeros(v.shape, device_mesh=mesh, placements=[Shard(0)])
        for k, v in sd.items()
    }
    stats.reset()
    out["load_ours"] = clock(
        lambda: (checkpoint.load(dst, ours), touch({k: v.to_local() for k, v in dst.items()}))
    )
    out["read"] = stats.bytes_read
    out["load_dcp"] = clock(
        lambda: (
            dcp.load(dst, storage_reader=HuggingFaceStorageReader(theirs)),
            touch({k: v.to_local() for k, v in dst.items()}),
        )
    )
    out["rss_mb"] = peak_rss_mb()
    return out


def distributed(root: str, gb: float, world: int = 2) -> None:
    from checkpoint.ranks.launch import run_ranks

    res = run_ranks(_dist_rank, world, root, gb, "all", backend="gloo", timeout=1200)
    ours = os.path.join(root, "dist_ours")
    with checkpoint.open_checkpoint(ours) as r:
        size = sum(r.spec(k).nbytes for k in r.keys())
        headers = sum(os.path.getsize(os.path.join(ours, f)) for f in r.files) - size
    on_disk = size + headers
    t = {k: max(r[k] for r in res) for k in ("save_ours", "save_dcp", "load_ours", "load_dcp")}
    print(
        f"{world}-rank save: ours vs DCP HF writer (distributed+consolidation) {t['save_dcp'] / t['save_ours']:.2f}x"
    )
    print(f"{world}-rank load: ours vs DCP HuggingFaceStorageReader {t['load_dcp'] / t['load_ours']:.2f}x")
    print(f"{world}-rank bytes written: {sum(r['written'] for r in res)} = shard files {on_disk}: "
          f"{sum(r['written'] for r in res) == on_disk}; per rank {[r['written'] for r in res]}")  # fmt: skip
    bound = 1.05 * size / world + headers
    print(f"{world}-rank bytes read per rank: {[r['read'] for r in res]} (bound 1.05*size/world+headers = {bound:.0f}:"
          f" {all(r['read'] <= bound for r in res)})")  # fmt: skip
    print(f"{world}-rank peak RSS per rank (MB): {[round(r['rss_mb']) for r in res]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (10**9 bytes)")
    ap.add_argument("--dir", default="/tmp/fqnckpt-bench")
    ap.add_argument("--no-dist", action="store_true")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    try:
        single(args.dir, args.gb)
        print(f"single-process peak RSS: {peak_rss_mb():.0f} MB")
        if not args.no_dist:
            distributed(args.dir, args.gb)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
