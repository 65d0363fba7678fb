"""Benchmark of checkpoint save / load against references measured in the same run (not collected
by pytest). Built to survive a noisy machine: ``os.sync()`` before each timed step, the sides of a
comparison run in rotating order, >= 5 rounds, and every ratio is printed as the median with its
range over the rounds. tmpfs (the software path) and disk (with fsync) are reported separately;
the raw write of the same bytes (``os.pwrite`` into one file + fsync) is the physical limit.

    python tests/bench/checkpoint_bench.py [--quick | --full] [--pairs 5] [--tmpfs /dev/shm/...]
                                           [--disk /tmp/...] [--dist] [--cold]

Cases: ``large`` (float32 in 8 tensors: 128 MiB by default, 512 MiB with ``--full``, 64 MiB with
``--quick``) and ``many`` (tensors of 64x32 float32: 5,000 by default, 20,000 with ``--full``).
Goals: save >= 1.0x ``safetensors.torch.save_file`` (+fsync) and >= 0.9x the raw write;
load >= 1.0x safetensors' ``safe_open`` + ``get_tensor`` + ``copy_`` into the same tensors, and
>= 0.9x a multi-threaded ``copy_`` of the same bytes in memory (the memory-bandwidth limit), on
tmpfs and on disk; with many tensors save and load >= 0.8x safetensors. Load on disk reads from
the page cache (caches are not dropped on a shared machine): it measures the software path too.
Every load side copies into the same warm tensors (no lazy mapping is left unread). The load average is printed per case (the
machine may be shared). ``--dist`` adds the 2-rank comparison with DCP's HF writer / reader and
per-rank load ratios (each rank's own bytes vs its ``safe_open`` + ``copy_`` of its slice);
``--cold`` a cold-cache load on disk (``POSIX_FADV_DONTNEED`` on the files before every step, or
the whole page cache dropped with ``--drop-caches``) against a raw sequential read of the same files.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import checkpoint  # noqa: E402
from checkpoint.storage.local_commit import fsync_path  # noqa: E402
# The package imports its operations on first use (torch.distributed.tensor: 1-2 s here); import
# them before timing, as safetensors is, or the first round of each side times an import.
import checkpoint.loading  # noqa: E402,F401
import checkpoint.saving  # noqa: E402,F401
from checkpoint.storage.format import index_name  # noqa: E402
from checkpoint.storage.writer import pwrite_all, stats, tensor_bytes  # noqa: E402


def load_unchecked(dst, path: str) -> None:
    """``checkpoint.load(dst, path)`` as of a checkpoint without digests (no tensor checked): the
    reference side of the checked-load benches."""
    from checkpoint.storage.reader import CheckpointReader

    due = CheckpointReader.recorded_digest
    CheckpointReader.recorded_digest = lambda self, key: None
    try:
        checkpoint.load(dst, path)
    finally:
        CheckpointReader.recorded_digest = due


def make_large(total_bytes: int, n: int = 8) -> dict[str, torch.Tensor]:
    rows = max(1, total_bytes // (n * 4096 * 4))
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(rows, 4096, generator=g) for i in range(n)}


def make_many(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(n, 64, 32, generator=g)
    return {f"layers.{i // 64}.mlp.experts.{i % 64}.w": flat[i].clone() for i in range(n)}


def peak_rss_mb() -> float:
    # VmHWM is reset on exec (ru_maxrss is not, so spawned ranks would report the parent's peak).
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024




def touch(sd) -> float:
    return float(sum(v.float().sum() for v in sd.values()))


def warm(sd) -> None:
    """Write every page of the destinations: a fresh ``empty_like`` maps the zero page until
    written, so reading it is not enough and the first side to write would pay the page faults."""
    for v in sd.values():
        v.fill_(0)


def rounds(sides: dict, pairs: int, clear=(), before=None) -> dict[str, list[float]]:
    """Time each side ``pairs`` times after one untimed round of each; round i starts at side i
    (rotating order). Before each timed
    step the paths in ``clear`` are removed (every side writes new files: freeing the old pages is
    not part of writing), os.sync() runs, then ``before()`` when given (untimed: a cache drop)."""
    names = list(sides)
    times: dict[str, list[float]] = {n: [] for n in names}
    for n in names:  # one untimed round: a fresh VM's first touch of memory costs up to 10x
        for p in clear:
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.path.exists(p) and os.remove(p)
        sides[n]()
    for i in range(pairs):
        for j in range(len(names)):
            n = names[(i + j) % len(names)]
            for p in clear:
                shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.path.exists(p) and os.remove(
                    p
                )
            os.sync()
            if before is not None:
                before()
            t = time.perf_counter()
            sides[n]()
            times[n].append(time.perf_counter() - t)
    return times


def ratio_line(label: str, ref: list[float], ours: list[float], goal: float | None) -> str:
    # Ratio per round (ref time / our time: > 1 means we are faster), then median and range.
    r = [a / b for a, b in zip(ref, ours)]
    med = statistics.median(r)
    verdict = "" if goal is None else f" (goal >= {goal}: {'met' if med >= goal else 'NOT met'})"
    return f"  {label}: {med:.2f}x [range {min(r):.2f}-{max(r):.2f}]{verdict}"


def gbs(size: int, ts: list[float]) -> str:
    m = statistics.median(ts)
    return f"{size / m / 1e9:.2f} GB/s (median {m:.3f}s, range {min(ts):.3f}-{max(ts):.3f}s)"


def bench_case(
    name: str, sd: dict[str, torch.Tensor], root: str, medium: str, pairs: int, goals: dict
) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    size = sum(v.numel() * v.element_size() for v in sd.values())
    os.makedirs(root, exist_ok=True)
    ours, st_file, raw_file = (
        os.path.join(root, n) for n in (f"ours-{name}", f"st-{name}.safetensors", "raw.bin")
    )
    views = [tensor_bytes(v) for v in sd.values()]

    def st_save():
        save_file(sd, st_file, metadata={"format": "pt"})
        fsync_path(st_file)

    def our_save():
        checkpoint.save(sd, ours, overwrite=True)  # fsyncs every file and the directory

    def raw_write():
        fd = os.open(raw_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            off = 0
            for v in views:
                pwrite_all(fd, v, off)
                off += len(v)
            os.fsync(fd)
        finally:
            os.close(fd)

    print(f"[{medium}] {name}: {len(sd)} tensors, {size / 2**20:.0f} MiB, {pairs} rounds, rotating order; "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    t = rounds({"ours": our_save, "safetensors": st_save, "raw": raw_write}, pairs, (ours, st_file, raw_file))
    print(
        f"  save ours {gbs(size, t['ours'])}; safetensors {gbs(size, t['safetensors'])}; raw {gbs(size, t['raw'])}"
    )
    print(
        ratio_line("save vs safetensors.save_file+fsync", t["safetensors"], t["ours"], goals.get("save_st"))
    )
    print(
        ratio_line("save vs raw pwrite+fsync of the same bytes", t["raw"], t["ours"], goals.get("save_raw"))
    )

    stats.reset()
    our_save()
    st_save()
    files = [f for f in os.listdir(ours) if f.endswith(".safetensors")]
    on_disk = sum(os.path.getsize(os.path.join(ours, f)) for f in files)
    index_bytes = os.path.getsize(os.path.join(ours, index_name()))
    print(f"  bytes written by one save {stats.bytes_written} = shard files {on_disk}: {stats.bytes_written == on_disk}"
          f"; index {index_bytes} bytes = {index_bytes / len(sd):.0f} bytes/tensor")  # fmt: skip

    dst = {k: torch.empty_like(v) for k, v in sd.items()}
    warm(dst)  # first touch of fresh memory is slow: warm the destinations
    flat_src = torch.cat([v.reshape(-1).view(torch.uint8) for v in sd.values()])
    flat_dst = torch.empty_like(flat_src)
    flat_dst.fill_(0)

    def st_open_copy():  # the reference: safe_open + copy_ into the same tensors
        with safe_open(st_file, framework="pt") as f:
            for k in f.keys():
                dst[k].copy_(f.get_tensor(k))

    def memcpy():  # the same bytes copied in memory by torch's intra-op threads
        flat_dst.copy_(flat_src)

    def our_load():
        checkpoint.load(dst, ours)

    shard = os.path.join(ours, files[0])
    with open(shard, "rb") as f:
        data_start = 8 + int.from_bytes(f.read(8), "little")
    flat_view = memoryview(flat_dst.numpy())
    pool = ThreadPoolExecutor(os.cpu_count() or 1)

    def kernel_read():  # the kernel's page-cache copy alone: 4 MiB preadv calls on every CPU
        fd = os.open(shard, os.O_RDONLY)
        try:
            def piece(a):
                v = flat_view[a : a + (4 << 20)]
                done = 0
                while done < len(v):
                    done += os.preadv(fd, [v[done:]], data_start + a + done)
            list(pool.map(piece, range(0, len(flat_view), 4 << 20)))
        finally:
            os.close(fd)

    sides = {"ours": our_load, "safetensors": st_open_copy, "memcpy": memcpy}
    if len(files) == 1 and "load_mem" in goals:  # large tensors: the kernel's copy rate matters
        sides["kernel"] = kernel_read
    t = rounds(sides, pairs)
    print(f"  load ours {gbs(size, t['ours'])}; safe_open + copy_ {gbs(size, t['safetensors'])}; "
          f"memcpy {gbs(size, t['memcpy'])}")  # fmt: skip
    print(ratio_line("load vs safe_open + copy_ into the model", t["safetensors"], t["ours"], goals.get("load_st")))
    print(ratio_line("load vs multi-threaded memcpy of the bytes", t["memcpy"], t["ours"], goals.get("load_mem")))
    if "kernel" in t:
        print(f"  kernel's page-cache copy (raw preadv of the same bytes on {os.cpu_count()} threads) {gbs(size, t['kernel'])}")
        print(ratio_line("load vs that raw preadv (what the kernel allows; no goal)", t["kernel"], t["ours"], None))
        print(ratio_line("raw preadv vs memcpy (the filesystem's ceiling for load vs memcpy)", t["memcpy"], t["kernel"], None))
    pool.shutdown()
    print(f"  load average {os.getloadavg()[0]:.2f} after the case")
    assert all(torch.equal(dst[k], v) for k, v in sd.items())
    shutil.rmtree(ours, ignore_errors=True)
    for p in (st_file, raw_file):
        if os.path.exists(p):
            os.remove(p)


def drop_cache(paths: list[str], whole_machine: bool = False) -> str:
    """Evict ``paths`` from the page cache: ``posix_fadvise(POSIX_FADV_DONTNEED)`` per file (after
    a sync: dirty pages are not evicted), or with ``whole_machine`` ``/proc/sys/vm/drop_caches``
    where writable (it evicts every process's files: not on a shared machine by default).
    Returns the method used."""
    os.sync()
    if whole_machine:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return "drop_caches"
        except OSError:
            pass
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(DONTNEED)"


def bench_cold(name: str, sd: dict[str, torch.Tensor], root: str, pairs: int, whole_machine: bool = False) -> None:
    """Load with a cold page cache (evicted before every timed step) against a raw sequential
    read of the same files (8 MiB ``readinto`` calls into one buffer): the goal is >= 0.9x."""
    ours = os.path.join(root, f"cold-{name}")
    checkpoint.save(sd, ours, overwrite=True)
    files = sorted(os.path.join(ours, f) for f in os.listdir(ours) if f.endswith(".safetensors"))
    size = sum(os.path.getsize(f) for f in files)
    dst = {k: torch.empty_like(v) for k, v in sd.items()}
    warm(dst)
    buf = bytearray(8 << 20)

    def raw_read():
        view = memoryview(buf)
        for p in files:
            with open(p, "rb", buffering=0) as f:
                while f.readinto(view):
                    pass

    sides = {"ours": lambda: checkpoint.load(dst, ours), "raw": raw_read}
    times: dict[str, list[float]] = {n: [] for n in sides}
    method = ""
    for i in range(pairs):
        for n in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            method = drop_cache(files, whole_machine)
            t = time.perf_counter()
            sides[n]()
            times[n].append(time.perf_counter() - t)
    print(f"[disk, cold cache: {method} before each step] {name}: {len(sd)} tensors, {size / 2**20:.0f} MiB, "
          f"{pairs} rounds; load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"  load ours {gbs(size, times['ours'])}; raw sequential read {gbs(size, times['raw'])}")
    print(ratio_line("cold load vs raw sequential read of the same files", times["raw"], times["ours"], 0.9))
    assert all(torch.equal(dst[k], v) for k, v in sd.items())
    shutil.rmtree(ours, ignore_errors=True)


def fqn_map_bytes(n: int) -> None:
    """FQN-map bytes per tensor (``metadata.fqnckpt.fqn_map`` of an index) for a module of ``n``
    parameters named like an MoE's experts."""
    from fqn import FQNMap

    class Layer(torch.nn.Module):
        def __init__(self, k: int):
            super().__init__()
            self.experts = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(1)) for _ in range(k))

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(Layer(min(64, n - i)) for i in range(0, n, 64))
    raw = FQNMap.from_module(model).to_model().model_dump_json()
    print(f"FQN map of {n} parameters: {len(raw)} bytes = {len(raw) / n:.0f} bytes/tensor")


def _dist_rank(rank, world, root, nbytes):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in make_large(nbytes).items()}
    ours, theirs = os.path.join(root, "dist_ours"), os.path.join(root, "dist_dcp")
    out = {}

    def clock(fn):
        torch.distributed.barrier()
        os.sync()
        t = time.perf_counter()
        fn()
        torch.distributed.barrier()
        return time.perf_counter() - t

    stats.reset()
    out["save_ours"] = clock(lambda: checkpoint.save(sd, ours, overwrite=True))
    out["written"] = stats.bytes_written
    if rank == 0:
        shutil.rmtree(theirs, ignore_errors=True)
    writer = HuggingFaceStorageWriter(
        theirs, fqn_to_index_mapping={k: 1 for k in sd}, save_distributed=True, enable_consolidation=True
    )
    out["save_dcp"] = clock(lambda: dcp.save(sd, storage_writer=writer))
    dst = {
        k: torch.distributed.tensor.zeros(v.shape, device_mesh=mesh, placements=[Shard(0)])
        for k, v in sd.items()
    }
    stats.reset()
    out["load_ours"] = clock(
        lambda: (checkpoint.load(dst, ours), touch({k: v.to_local() for k, v in dst.items()}))
    )
    out["read"] = stats.bytes_read
    from safetensors import safe_open

    shards = {os.path.join(ours, f) for f in os.listdir(ours) if f.endswith(".safetensors")}

    def st_own_slices():  # the per-rank reference: safe_open + copy_ of this rank's rows only
        for p in sorted(shards):
            with safe_open(p, framework="pt") as f:
                for k in f.keys():
                    local = dst[k].to_local()
                    rows = -(-dst[k].shape[0] // world)  # torch.chunk sizes, as Shard(0)
                    local.copy_(f.get_slice(k)[rank * rows : rank * rows + local.shape[0]])

    per_rank = {"ours": [], "st": []}
    for i in range(5):  # alternated rounds; each rank times its own load of its own bytes
        for side in (("ours", "st") if i % 2 == 0 else ("st", "ours")):
            torch.distributed.barrier()
            t = time.perf_counter()
            checkpoint.load(dst, ours) if side == "ours" else st_own_slices()
            per_rank[side].append(time.perf_counter() - t)
    out["per_rank"] = [a / b for a, b in zip(per_rank["st"], per_rank["ours"])]
    out["load_dcp"] = clock(
        lambda: (
            dcp.load(dst, storage_reader=HuggingFaceStorageReader(theirs)),
            touch({k: v.to_local() for k, v in dst.items()}),
        )
    )
    out["rss_mb"] = peak_rss_mb()
    return out


def distributed(root: str, nbytes: int, world: int = 2) -> None:
    from checkpoint.ranks.launch import run_ranks

    res = run_ranks(_dist_rank, world, root, nbytes, backend="gloo", timeout=1200)
    t = {k: max(r[k] for r in res) for k in ("save_ours", "save_dcp", "load_ours", "load_dcp")}
    print(f"[{world} ranks, one round] save vs DCP HF writer {t['save_dcp'] / t['save_ours']:.2f}x; "
          f"load vs DCP HF reader {t['load_dcp'] / t['load_ours']:.2f}x; bytes written per rank "
          f"{[r['written'] for r in res]}; read per rank {[r['read'] for r in res]}; "
          f"peak RSS MB {[round(r['rss_mb']) for r in res]}")  # fmt: skip
    for r, rec in enumerate(res):
        print(ratio_line(f"rank {r}: load of its own bytes (DTensor Shard(0)) vs its safe_open + copy_ of "
                         "its slice, 5 rounds", rec["per_rank"], [1.0] * len(rec["per_rank"]), 1.0))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="short run: 64 MiB / 2,000 tensors")
    ap.add_argument("--full", action="store_true", help="the goal's sizes: 512 MiB / 20,000 tensors")
    ap.add_argument("--pairs", type=int, default=5, help="rounds per comparison (>= 3)")
    ap.add_argument("--cases", default="large,many", help="comma-separated: large, many")
    ap.add_argument("--tmpfs", default="/dev/shm/fqnckpt-bench", help="a directory on tmpfs ('' to skip)")
    ap.add_argument("--disk", default="/tmp/fqnckpt-bench", help="a directory on a real disk ('' to skip)")
    ap.add_argument("--dist", action="store_true", help="also the 2-rank comparison with DCP")
    ap.add_argument("--cold", action="store_true", help="also the cold-cache load on disk vs a raw read")
    ap.add_argument("--drop-caches", action="store_true", help="--cold evicts with drop_caches (whole machine)")
    args = ap.parse_args()
    pairs = max(3, args.pairs)
    large, many = (64 << 20, 2_000) if args.quick else (512 << 20, 20_000) if args.full else (128 << 20, 5_000)
    cases = args.cases.split(",")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} "
          "(a busy machine widens the ranges; compare ratios, not GB/s)")  # fmt: skip
    media = ([("tmpfs", args.tmpfs)] if args.tmpfs else []) + ([("disk", args.disk)] if args.disk else [])
    try:
        for medium, root in media:
            shutil.rmtree(root, ignore_errors=True)
            if "large" in cases:
                goals = {"save_st": 1.0, "save_raw": 0.9, "load_st": 1.0, "load_mem": 0.9}
                bench_case("large", make_large(large), root, medium, pairs, goals)
            if "many" in cases:
                bench_case("many", make_many(many), root, medium, pairs, {"save_st": 0.8, "load_st": 0.8})
        if args.cold and args.disk:
            bench_cold("large", make_large(large), args.disk, pairs, args.drop_caches)
        fqn_map_bytes(many)
        print(f"peak RSS: {peak_rss_mb():.0f} MB")
        if args.dist:
            distributed(args.tmpfs, large)
    finally:
        for _, root in media:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
