"""The speed goals of the read and write paths, each against its reference measured in the same
run, with every check on (digests checked on load, fsync and atomic commit on save). Not
collected by pytest.

Timing rules are :func:`checkpoint_bench.rounds`' (one untimed round of every side, then rounds
in rotating order, ``os.sync()`` before each timed step, saves to fresh paths); every ratio is
reference time / our time per round (> 1: ours is faster), printed as median and [min-max] over
the rounds. The load average is printed before and after each block: the machine may be shared.

Blocks (``--blocks``, comma-separated):

- ``load``: a model of ``--mib`` MiB (a few hundred float32 / bfloat16 tensors of an LLM's
  shapes: :func:`make_model`) loaded by ``checkpoint.load`` into preallocated tensors, against
  safetensors' ``safe_open`` + ``get_tensor`` + ``copy_`` into the same tensors (a mapped copy),
  from tmpfs and from disk with a warm page cache; beside them a raw ``os.preadv`` of the same
  bytes into the same targets on as many threads as ours (:class:`RawPreadv`: adjacent tensors in
  one call, large ones cut in ``pread.PIECE`` pieces, no check), and ours unchecked
  (:func:`checkpoint_bench.load_unchecked`: what the digest checks cost).
  Beside them the two bounds of a checked load (:class:`CheckedBound`): every byte hashed, then
  copied, from a mapping (what a check before any target changes costs at least) and ``preadv``
  with each piece hashed right after it lands (targets written before their check).
  Goals: >= 1.0x safetensors (tmpfs), >= 0.95x the raw ``preadv`` (warm page cache).
- ``cold``: the same load from disk with a cold cache: before every timed step the files are
  evicted with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (after a sync), or with ``--drop-caches``
  the machine's whole page cache (``/proc/sys/vm/drop_caches``). Goal: >= 1.0x safetensors.
- ``save``: ``checkpoint.save`` of that model against ``safetensors.torch.save_file`` + fsync of
  the file, on tmpfs and on disk; beside them the bounds of a write of the same bytes
  (:func:`raw_write`): ``os.pwrite`` of every tensor's bytes into one file + fsync (what
  ``save_file`` does, less its header), and the same with each 1 MiB digest chunk hashed with
  xxh3-128 right after its pwrite (the least a save that digests every byte costs on one thread).
  Goal: >= 1.0x.
- ``many``: ``--many`` tensors of 64x32 float32: save against ``save_file`` + fsync and load
  against ``safe_open`` + ``copy_`` into the same tensors, on tmpfs and on disk (page cache).
  Goal: >= 1.0x each.
- ``dcp``: ``dcp.load`` through ``checkpoint.dcp.StorageReader`` against torch's
  ``HuggingFaceStorageReader`` into ``Shard(0)`` and ``Shard(1)`` DTensors on gloo ranks
  (``--worlds``) at each of ``--dcp-mib`` sizes, with :func:`dcp_storage.worker` (each side
  reads what its own writer saved; a time is the slowest rank's; loads interleaved and values
  checked after every load), and ours unchecked beside them (the same checkpoint read without
  the check before the copies and its exchange between the ranks: what the checks cost). Goal:
  >= 1.0x. On 4 ranks or more a size is capped at
  ``--dcp-cap-4`` MiB (default 256: 512 MiB on 4 ranks did not finish in 10 minutes on 2 busy cores).

    python tests/bench/goals.py [--mib 512] [--many 20000] [--rounds 5] [--blocks load,cold,save,many,dcp]
                                [--tmpfs /dev/shm/x] [--disk /tmp/x] [--drop-caches]
                                [--dcp-mib 64 512] [--worlds 2 4] [--dcp-cap-4 256] [--dcp-rounds 3] [--dcp-repeat 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import struct
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import checkpoint  # noqa: E402
import checkpoint.loading  # noqa: E402,F401  (imported before timing, as safetensors is)
import checkpoint.saving  # noqa: E402,F401
from checkpoint.storage import pread  # noqa: E402
from checkpoint.storage.writer import tensor_bytes  # noqa: E402
from checkpoint_bench import drop_cache, fsync_path, gbs, load_unchecked, make_many, ratio_line, rounds, warm  # noqa: E402


def make_model(total: int, d: int = 768) -> dict[str, torch.Tensor]:
    """About ``total`` bytes in a decoder's shapes: bfloat16 embedding and head (a fifth of the
    bytes), then layers of bfloat16 attention projections, float32 MLP and float32 norms (8
    tensors a layer: ~280 tensors at 512 MiB)."""
    g = torch.Generator().manual_seed(0)
    vocab = max(64, total // 10 // (2 * d))
    per_layer = 2 * (2 * d * d + 2 * (d // 4) * d) + 4 * (2 * (2 * d) * d) + 4 * 2 * d
    layers = max(1, (total - 2 * 2 * vocab * d) // per_layer)

    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    sd = {"model.embed_tokens.weight": t(vocab, d, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = t(d)
        for n, rows in (("q", d), ("k", d // 4), ("v", d // 4), ("o", d)):
            sd[p + f"self_attn.{n}_proj.weight"] = t(rows, d, dtype=torch.bfloat16)
        sd[p + "post_attention_layernorm.weight"] = t(d)
        sd[p + "mlp.up_proj.weight"] = t(2 * d, d)
        sd[p + "mlp.down_proj.weight"] = t(d, 2 * d)
    sd["model.norm.weight"] = t(d)
    sd["lm_head.weight"] = t(vocab, d, dtype=torch.bfloat16)
    return sd


def size_of(sd) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def load_avg(what: str) -> None:
    a = os.getloadavg()
    print(f"  load average {what}: {a[0]:.2f} (5 min {a[1]:.2f})", flush=True)


def shard_files(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))


def tensor_ranges(files: list[str]) -> list[tuple[str, str, int, int]]:
    """``(file, key, begin, end)`` of every tensor of safetensors ``files``, in file order
    (absolute byte offsets, from each file's header)."""
    out = []
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        for k, v in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            b, e = v["data_offsets"]
            out.append((f, k, 8 + n + b, 8 + n + e))
    return out


class RawPreadv:
    """A raw multi-threaded ``os.preadv`` of the tensor bytes of ``files`` into ``dst`` (same
    targets as a load): jobs of adjacent tensors up to ``pread.PIECE`` bytes in one call, tensors
    of 2 pieces or more cut in pieces, taken from one queue by the calling thread and
    ``pread._THREADS - 1`` pool threads (the thread count of ours). No check, no Python per
    tensor at read time: the bound the kernel's page-cache copy sets."""

    def __init__(self, files: list[str], dst: dict[str, torch.Tensor]):
        self.threads = pread._THREADS
        self.pool = ThreadPoolExecutor(max(1, self.threads - 1))
        self.files = files
        self.jobs: list[tuple[str, int, list[memoryview]]] = []
        cur: list = []
        for f, k, b, e in tensor_ranges(files):
            v = tensor_bytes(dst[k])
            assert len(v) == e - b, k
            if len(v) >= 2 * pread.PIECE:
                self.jobs += [(f, b + a, [v[a : a + pread.PIECE]]) for a in range(0, len(v), pread.PIECE)]
                continue
            if cur and cur[0] == f and cur[2] == b and cur[3] + len(v) <= pread.PIECE:
                cur[2], cur[3] = e, cur[3] + len(v)
                cur[4].append(v)
                continue
            if cur:
                self.jobs.append((cur[0], cur[1], cur[4]))
            cur = [f, b, e, len(v), [v]]
        if cur:
            self.jobs.append((cur[0], cur[1], cur[4]))

    def __call__(self) -> None:
        fds = {f: os.open(f, os.O_RDONLY) for f in self.files}
        counter = itertools.count()

        def work() -> None:
            while (j := next(counter)) < len(self.jobs):
                f, off, views = self.jobs[j]
                want = sum(len(v) for v in views)
                if os.preadv(fds[f], views, off) != want:
                    raise OSError(f"short read of {f} at {off}")

        try:
            futs = [self.pool.submit(work) for _ in range(self.threads - 1)]
            work()
            for fu in futs:
                fu.result()
        finally:
            for fd in fds.values():
                os.close(fd)

    def close(self) -> None:
        self.pool.shutdown()


class CheckedBound:
    """What a checked load cannot beat, measured with the same jobs as :class:`RawPreadv` and no
    Python per byte: ``mode="two-pass"`` (the bound of a check before any target changes) maps
    every file, hashes every tensor's bytes in ``digest.TENSOR_CHUNK`` chunks with xxh3-128, then
    copies every job from the mapping with one ``memmove`` per target (no lease, no planning);
    ``mode="single-pass"`` (the bound of hashing bytes just read, targets written before their
    check) reads each job with ``preadv`` into its targets and hashes each piece right after,
    from cache. Both on ``pread._THREADS`` threads taking jobs from one queue."""

    def __init__(self, raw: RawPreadv, mode: str):
        import ctypes

        self.raw, self.mode = raw, mode
        self.memmove = ctypes.memmove
        from checkpoint.storage.digest import TENSOR_CHUNK

        self.chunk = TENSOR_CHUNK

    def _run(self, fn, n: int) -> None:
        counter = itertools.count()

        def work() -> None:
            while (j := next(counter)) < n:
                fn(j)

        futs = [self.raw.pool.submit(work) for _ in range(self.raw.threads - 1)]
        work()
        for fu in futs:
            fu.result()

    def __call__(self) -> None:
        import ctypes
        import mmap

        import numpy as np
        import xxhash

        jobs, chunk = self.raw.jobs, self.chunk
        fds = {f: os.open(f, os.O_RDONLY) for f in self.raw.files}
        try:
            if self.mode == "single-pass":

                def one(j: int) -> None:
                    f, off, views = jobs[j]
                    os.preadv(fds[f], views, off)
                    for v in views:
                        for a in range(0, len(v), chunk):
                            xxhash.xxh3_128(v[a : a + chunk]).digest()

                self._run(one, len(jobs))
                return
            maps = {f: mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ) for f, fd in fds.items()}
            bases = {}
            for f, m in maps.items():
                a = np.frombuffer(m, dtype=np.uint8)
                bases[f] = a.ctypes.data
                del a
            mvs = {f: memoryview(m) for f, m in maps.items()}

            def hash_one(j: int) -> None:
                f, off, views = jobs[j]
                mv = mvs[f]
                for v in views:
                    for a in range(0, len(v), chunk):
                        xxhash.xxh3_128(mv[off + a : off + min(len(v), a + chunk)]).digest()
                    off += len(v)

            def copy_one(j: int) -> None:
                f, off, views = jobs[j]
                src = bases[f] + off
                for v in views:
                    self.memmove(ctypes.addressof(ctypes.c_char.from_buffer(v)), src, len(v))
                    src += len(v)

            self._run(hash_one, len(jobs))
            self._run(copy_one, len(jobs))
            mvs.clear()
            for m in maps.values():
                m.close()
        finally:
            for fd in fds.values():
                os.close(fd)


def st_load(st_file: str, dst: dict) -> None:
    """safetensors' reference load: ``safe_open`` + ``get_tensor`` + ``copy_`` into ``dst``."""
    from safetensors import safe_open

    with safe_open(st_file, framework="pt") as f:
        for k in f.keys():
            dst[k].copy_(f.get_tensor(k))


def st_save(sd: dict, st_file: str) -> None:
    """safetensors' reference save: ``save_file`` + fsync of the file."""
    from safetensors.torch import save_file

    save_file(sd, st_file, metadata={"format": "pt"})
    fsync_path(st_file)


def raw_write(views: list, path: str, hashed: bool) -> None:
    """The bound of a save: every view ``os.pwrite``-n into one new file at consecutive offsets in
    1 MiB pieces, then fsync; with ``hashed`` each piece's xxh3-128 is taken right after its
    pwrite (from cache), as the digest chunks of a save are. No header, index or commit."""
    import xxhash

    piece = 1 << 20
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        at = 0
        for v in views:
            for lo in range(0, len(v), piece):
                chunk = v[lo : lo + piece]
                os.pwrite(fd, chunk, at + lo)
                if hashed:
                    xxhash.xxh3_128_digest(chunk)
            at += len(v)
        os.fsync(fd)
    finally:
        os.close(fd)


def check(dst: dict, sd: dict, what: str) -> None:
    bad = [k for k, v in sd.items() if not torch.equal(dst[k], v)]
    if bad:
        raise AssertionError(f"{what}: {len(bad)} tensors loaded wrong, first {bad[0]!r}")


def load_unmapped(dst, path: str) -> None:
    """``checkpoint.load(dst, path)`` with every read through ``preadv`` (no leased mapping)."""
    from checkpoint.storage import leased

    leased.enabled = False
    try:
        checkpoint.load(dst, path)
    finally:
        leased.enabled = True


def prepared(sd: dict, root: str) -> tuple[str, str, dict]:
    """Our checkpoint and safetensors' file of ``sd`` under ``root``, and warm targets."""
    os.makedirs(root, exist_ok=True)
    ours, st_file = os.path.join(root, "ours"), os.path.join(root, "st.safetensors")
    checkpoint.save(sd, ours, overwrite=True)
    st_save(sd, st_file)
    dst = {k: torch.empty_like(v) for k, v in sd.items()}
    warm(dst)
    return ours, st_file, dst


def block_load(sd: dict, media: list[tuple[str, str]], n: int) -> None:
    size = size_of(sd)
    for medium, root in media:
        ours, st_file, dst = prepared(sd, root)
        raw = RawPreadv(shard_files(ours), dst)
        print(f"[load, {medium} ({root}), warm page cache] {len(sd)} tensors (float32/bfloat16), "
              f"{size / 2**20:.0f} MiB, {n} rounds; raw preadv on {raw.threads} threads", flush=True)  # fmt: skip
        load_avg("before")
        try:
            t = rounds({"ours": lambda: checkpoint.load(dst, ours), "safetensors": lambda: st_load(st_file, dst),
                        "raw": raw, "unchecked": lambda: load_unchecked(dst, ours),
                        "unmapped": lambda: load_unmapped(dst, ours), "two-pass": CheckedBound(raw, "two-pass"),
                        "single-pass": CheckedBound(raw, "single-pass")}, n)  # fmt: skip
        finally:
            raw.close()
        check(dst, sd, "load")
        print(f"  ours {gbs(size, t['ours'])}\n  safetensors {gbs(size, t['safetensors'])}\n"
              f"  raw preadv {gbs(size, t['raw'])}")  # fmt: skip
        print(ratio_line("load vs safe_open + copy_ (mapped copy)", t["safetensors"], t["ours"], 1.0))
        print(ratio_line("load vs raw multi-threaded preadv", t["raw"], t["ours"], 0.95))
        print(ratio_line("load vs the same load unchecked (what the digests cost)", t["unchecked"], t["ours"], None))
        print(ratio_line("unchecked load vs raw multi-threaded preadv", t["raw"], t["unchecked"], None))
        print(ratio_line("load vs the same load without leased mappings (preadv only)", t["unmapped"], t["ours"], None))
        print(ratio_line("bound: hash all, then copy, from a mapping, vs raw preadv", t["raw"], t["two-pass"], None))
        print(ratio_line("bound: preadv + hash of each piece just read, vs raw preadv", t["raw"], t["single-pass"], None))
        print(ratio_line("load vs its bound (hash all, then copy, from a mapping)", t["two-pass"], t["ours"], None))
        load_avg("after")
        shutil.rmtree(root, ignore_errors=True)


def block_cold(sd: dict, root: str, n: int, whole_machine: bool) -> None:
    size = size_of(sd)
    ours, st_file, dst = prepared(sd, root)
    files = [*shard_files(ours), st_file]
    method = []
    evict = lambda: method.append(drop_cache(files, whole_machine))  # noqa: E731
    print(f"[load, disk ({root}), cold cache] {len(sd)} tensors, {size / 2**20:.0f} MiB, {n} rounds", flush=True)
    load_avg("before")
    t = rounds({"ours": lambda: checkpoint.load(dst, ours), "safetensors": lambda: st_load(st_file, dst)}, n,
               before=evict)  # fmt: skip
    check(dst, sd, "cold load")
    print(f"  evicted with {method[-1]} before every timed step")
    print(f"  ours {gbs(size, t['ours'])}\n  safetensors {gbs(size, t['safetensors'])}")
    print(ratio_line("cold load vs safe_open + copy_", t["safetensors"], t["ours"], 1.0))
    load_avg("after")
    shutil.rmtree(root, ignore_errors=True)


def block_save(sd: dict, media: list[tuple[str, str]], n: int, label: str, bounds: bool = True) -> None:
    """``bounds``: also time :func:`raw_write` (a bound for large tensors only: a raw pwrite per
    small tensor is a syscall each, slower than a save that writes them in one buffer)."""
    size = size_of(sd)
    for medium, root in media:
        os.makedirs(root, exist_ok=True)
        ours, st_file, raw_file = (os.path.join(root, n) for n in ("ours", "st.safetensors", "raw.bin"))
        views = [tensor_bytes(v) for v in sd.values()]
        print(f"[save, {medium} ({root})] {label}: {len(sd)} tensors, {size / 2**20:.0f} MiB, {n} rounds", flush=True)
        load_avg("before")
        sides = {
            "ours": lambda: checkpoint.save(sd, ours, overwrite=True),
            "safetensors": lambda: st_save(sd, st_file),
        }
        if bounds:
            sides["raw"] = lambda: raw_write(views, raw_file, False)
            sides["raw_hashed"] = lambda: raw_write(views, raw_file, True)
        t = rounds(sides, n, (ours, st_file, raw_file))
        print(f"  ours {gbs(size, t['ours'])}\n  safetensors {gbs(size, t['safetensors'])}")
        print(ratio_line("save vs save_file + fsync", t["safetensors"], t["ours"], 1.0))
        if bounds:
            print(f"  raw pwrite {gbs(size, t['raw'])}\n  raw pwrite + xxh3 {gbs(size, t['raw_hashed'])}")
            print(ratio_line("save_file + fsync vs raw pwrite + fsync", t["raw"], t["safetensors"], None))
            bound = "raw pwrite + xxh3 inline vs save_file + fsync (a hashed save's bound on one thread)"
            print(ratio_line(bound, t["safetensors"], t["raw_hashed"], None))
            print(ratio_line("save vs raw pwrite + xxh3 inline", t["raw_hashed"], t["ours"], None))
        load_avg("after")
        shutil.rmtree(root, ignore_errors=True)


def block_many_load(sd: dict, media: list[tuple[str, str]], n: int) -> None:
    size = size_of(sd)
    for medium, root in media:
        ours, st_file, dst = prepared(sd, root)
        print(f"[load, {medium} ({root}), page cache] {len(sd)} tensors of 64x32 float32, {size / 2**20:.0f} MiB, "
              f"{n} rounds", flush=True)  # fmt: skip
        load_avg("before")
        t = rounds({"ours": lambda: checkpoint.load(dst, ours), "safetensors": lambda: st_load(st_file, dst)}, n)
        check(dst, sd, "many load")
        print(f"  ours {gbs(size, t['ours'])}\n  safetensors {gbs(size, t['safetensors'])}")
        print(ratio_line("load vs safe_open + copy_", t["safetensors"], t["ours"], 1.0))
        load_avg("after")
        shutil.rmtree(root, ignore_errors=True)


def block_dcp(root: str, sizes: list[int], worlds: list[int], n: int, repeat: int, tensors: int, cap4: int) -> None:
    from dcp_storage import ratio_line as dcp_ratio
    from dcp_storage import worker

    from checkpoint.ranks.launch import run_ranks

    cols = 256
    for asked in sizes:
        for world in worlds:
            mib = min(asked, cap4) if world >= 4 and cap4 else asked
            if mib != asked:
                print(f"[dcp.load, {world} ranks] {asked} MiB capped at {mib} MiB (--dcp-cap-4: too heavy for a few cores)")
            rows = max(8, (mib << 20) // (4 * cols * tensors) // 8 * 8)
            print(f"[dcp.load, {world} gloo ranks, {root}] {tensors} float32 tensors {rows}x{cols}, "
                  f"{tensors * rows * cols * 4 / 2**20:.0f} MiB, {n} rounds of {repeat} interleaved loads", flush=True)  # fmt: skip
            load_avg("before")
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
            try:
                res = run_ranks(worker, world, root, tensors, rows, cols, n, repeat, ("ours", "torch-hf"),
                                ("ours", "ours-unchecked", "torch-hf"), backend="gloo", timeout=1800)[0]  # fmt: skip
            finally:
                shutil.rmtree(root, ignore_errors=True)
            for what in ("load Shard(0)", "load Shard(1)"):
                print(dcp_ratio(f"torch HF reader / ours, {what}", res["torch-hf"][what], res["ours"][what]))
                print(dcp_ratio(f"torch HF reader / ours unchecked, {what}", res["torch-hf"][what], res["ours-unchecked"][what]))
            print(dcp_ratio("torch HF writer (+consolidation) / ours, save", res["torch-hf"]["save"], res["ours"]["save"]))
            load_avg("after")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="MiB of the model (load, cold, save)")
    ap.add_argument("--many", type=int, default=20_000, help="small tensors (many)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", default="load,cold,save,many,dcp")
    ap.add_argument("--tmpfs", default="/dev/shm/fqnckpt-goals", help="a directory on tmpfs ('' to skip)")
    ap.add_argument("--disk", default="/tmp/fqnckpt-goals", help="a directory on a disk ('' to skip)")
    ap.add_argument("--drop-caches", action="store_true", help="cold: drop the whole page cache, not our files'")
    ap.add_argument("--dcp-mib", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dcp-rounds", type=int, default=3)
    ap.add_argument("--dcp-repeat", type=int, default=3)
    ap.add_argument("--dcp-tensors", type=int, default=8)
    ap.add_argument("--dcp-cap-4", type=int, default=256, help="MiB at most on 4 ranks or more (0: no cap)")
    a = ap.parse_args()
    blocks = set(a.blocks.split(","))
    media = ([("tmpfs", a.tmpfs)] if a.tmpfs else []) + ([("disk", a.disk)] if a.disk else [])
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, read threads {pread._THREADS}", flush=True)
    load_avg("at start")
    try:
        if blocks & {"load", "cold", "save"}:
            sd = make_model(a.mib << 20)
            if "load" in blocks:
                block_load(sd, media, a.rounds)
            if "cold" in blocks and a.disk:
                block_cold(sd, a.disk, a.rounds, a.drop_caches)
            if "save" in blocks:
                block_save(sd, media, a.rounds, "model")
            del sd
        if "many" in blocks:
            sd = make_many(a.many)
            block_save(sd, media, a.rounds, "many small tensors", bounds=False)
            block_many_load(sd, media, a.rounds)
            del sd
        if "dcp" in blocks:
            block_dcp(os.path.join(a.tmpfs or a.disk, "dcp"), a.dcp_mib, a.worlds, a.dcp_rounds, a.dcp_repeat,
                      a.dcp_tensors, a.dcp_cap_4)  # fmt: skip
    finally:
        for _, root in media:
            shutil.rmtree(root, ignore_errors=True)
    load_avg("at end")


if __name__ == "__main__":
    main()
