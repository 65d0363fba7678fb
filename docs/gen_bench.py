"""Generate the benchmarks page: ``docs/benchmarks.md``, its PNG plots and the raw results.

    python docs/gen_bench.py                 # measure (1-3 minutes on 2 busy cores), then render
    python docs/gen_bench.py --render-only   # render again from docs/benchmarks/results.json

It measures, in one process on tmpfs (``/dev/shm`` when present: the software path, no device),
save and load of the same float32 state by

- fqnckpt: ``checkpoint.save`` (sharded safetensors, digests, atomic commit) and
  ``checkpoint.load`` (into the same warm tensors, every tensor's digest checked);
- safetensors: ``save_file`` + fsync and ``safe_open`` + ``get_tensor`` + ``copy_`` into the same
  tensors;
- DCP: ``dcp.save`` / ``dcp.load`` with its default ``FileSystemWriter`` / ``FileSystemReader``
  (``.distcp`` files);
- DCP's Hugging Face storage: ``HuggingFaceStorageWriter`` / ``HuggingFaceStorageReader``;
- for loads, where installed, runai-model-streamer (``SafetensorsStreamer``) and fastsafetensors
  (``SafeTensorsFileLoader`` on CPU) reading the safetensors side's file into the same tensors,

with the timing rules of ``tests/bench/checkpoint_bench.py`` (its ``rounds``: one untimed round
of each side, then rounds in rotating order, ``os.sync()`` before each timed step, every side
writing a fresh path), over a few tensor counts at a fixed total size; the same state as
``Shard(0)`` DTensors on 1, 2 and 4 gloo ranks (fqnckpt against ``dcp.save`` / ``dcp.load``); and
the single-core throughput of the digests a checkpoint could use. Results are medians over the
rounds; the page
shows the machine, the load average while it ran and every setting, so a reader can rerun it.
The longer comparisons (many ranks, object storage, async saves, cold caches) are the scripts in
``tests/bench``; the page lists them.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(HERE, "benchmarks")
RESULTS = os.path.join(OUT, "results.json")
PAGE = os.path.join(HERE, "benchmarks.md")

SIDES = ("fqnckpt", "safetensors", "DCP", "DCP HF storage")


def optional_loaders() -> dict:
    """Loaders of a safetensors file into existing tensors from packages installed here (each
    optional: ``pip install runai-model-streamer fastsafetensors``): ``{name: fn(file, dst)}``."""
    out = {}
    try:
        from runai_model_streamer import SafetensorsStreamer

        def runai(path: str, dst: dict) -> None:
            with SafetensorsStreamer() as s:
                s.stream_file(path)
                for name, t in s.get_tensors():
                    dst[name].copy_(t)

        out["runai-model-streamer"] = runai
    except ImportError:
        pass
    try:
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        def fast(path: str, dst: dict) -> None:
            loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
            try:
                loader.add_filenames({0: [path]})
                fb = loader.copy_files_to_device()
                try:
                    for k, t in dst.items():
                        t.copy_(fb.get_tensor(k))
                finally:
                    fb.close()
            finally:
                loader.close()

        out["fastsafetensors"] = fast
    except ImportError:
        pass
    return out


def machine() -> dict:
    """Where the figures come from: CPU, cores, memory, kernel, Python and library versions."""
    import safetensors
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(line.split()[1] for line in f if line.startswith("MemTotal"))) * 1024
    except (OSError, StopIteration):
        pass
    versions = {}
    for dist_name in ("runai-model-streamer", "fastsafetensors"):
        try:
            versions[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {
        "optional": versions,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
    }


def _gib_s(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def measure_case(root: str, n_tensors: int, total: int, n_rounds: int) -> dict:
    """Save and load ``total`` bytes of float32 in ``n_tensors`` tensors by every side; returns
    ``{"tensors", "bytes", "save": {side: GB/s}, "load": {side: GB/s}}``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from checkpoint_bench import fsync_path, rounds, warm  # tests/bench: the same timing rules
    from safetensors import safe_open
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import (
        FileSystemReader,
        FileSystemWriter,
        HuggingFaceStorageReader,
        HuggingFaceStorageWriter,
    )

    import checkpoint

    numel = total // 4 // n_tensors
    g = torch.Generator().manual_seed(n_tensors)
    sd = {f"layers.{i}.weight": torch.randn(numel, generator=g) for i in range(n_tensors)}
    nbytes = sum(v.nbytes for v in sd.values())
    paths = {s: os.path.join(root, s.replace(" ", "_")) for s in SIDES}
    st_file = os.path.join(paths["safetensors"], "model.safetensors")

    def st_save():
        os.makedirs(paths["safetensors"], exist_ok=True)
        save_file(sd, st_file, metadata={"format": "pt"})
        fsync_path(st_file)

    save_sides = {
        "fqnckpt": lambda: checkpoint.save(sd, paths["fqnckpt"], overwrite=True),
        "safetensors": st_save,
        "DCP": lambda: dcp.save(sd, storage_writer=FileSystemWriter(paths["DCP"])),
        "DCP HF storage": lambda: dcp.save(sd, storage_writer=HuggingFaceStorageWriter(paths["DCP HF storage"])),
    }
    saved = rounds(save_sides, rounds_arg(n_rounds), tuple(paths.values()))
    for side in SIDES:  # leave one copy of each for the loads
        save_sides[side]()

    dst = {k: torch.empty_like(v) for k, v in sd.items()}
    warm(dst)

    def st_load():
        with safe_open(st_file, framework="pt") as f:
            for k in f.keys():
                dst[k].copy_(f.get_tensor(k))

    load_sides = {
        "fqnckpt": lambda: checkpoint.load(dst, paths["fqnckpt"]),
        "safetensors": st_load,
        "DCP": lambda: dcp.load(dst, storage_reader=FileSystemReader(paths["DCP"])),
        "DCP HF storage": lambda: dcp.load(dst, storage_reader=HuggingFaceStorageReader(paths["DCP HF storage"])),
    }
    for name, fn in optional_loaders().items():  # they read the file the safetensors side wrote
        load_sides[name] = lambda fn=fn: fn(st_file, dst)
    loaded = rounds(load_sides, rounds_arg(n_rounds))
    assert all(torch.equal(dst[k], v) for k, v in sd.items())  # the last side loaded every value
    for p in paths.values():
        shutil.rmtree(p, ignore_errors=True)
    return {
        "tensors": n_tensors,
        "bytes": nbytes,
        "save": {s: _gib_s(nbytes, saved[s]) for s in SIDES},
        "load": {s: _gib_s(nbytes, t) for s, t in loaded.items()},
    }


def _rank_case(rank: int, world: int, root: str, total: int, n_tensors: int, n_rounds: int) -> dict:
    """One rank of :func:`measure_ranks`: every rank holds the ``Shard(0)`` rows of the same
    global float32 state; each side is timed from a barrier to a barrier (the slowest rank's time),
    sides in rotating order after one untimed round, each save to a fresh path."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import checkpoint

    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(n_tensors)
    rows = total // 4 // n_tensors // 1024
    sd = {f"layers.{i}.weight": distribute_tensor(torch.randn(rows, 1024, generator=g), mesh, [Shard(0)])
          for i in range(n_tensors)}  # fmt: skip
    dst = {k: distribute_tensor(torch.zeros(v.shape), mesh, [Shard(0)]) for k, v in sd.items()}
    count = [0]

    def fresh(side: str) -> str:
        count[0] += 1
        return os.path.join(root, f"{side}-{count[0]}")

    last = {}

    def save(side: str) -> None:
        last[side] = path = fresh(side.replace(" ", "_"))
        if side == "fqnckpt":
            checkpoint.save(sd, path)
        else:
            dcp.save(sd, storage_writer=FileSystemWriter(path))

    def load(side: str) -> None:
        if side == "fqnckpt":
            checkpoint.load(dst, last[side])
        else:
            dcp.load(dst, storage_reader=FileSystemReader(last[side]))

    sides = ("fqnckpt", "DCP")
    times: dict = {"save": {s: [] for s in sides}, "load": {s: [] for s in sides}}
    for what, fn in (("save", save), ("load", load)):
        for s in sides:  # untimed round
            fn(s)
        for i in range(n_rounds):
            for j in range(len(sides)):
                s = sides[(i + j) % len(sides)]
                dist.barrier()
                t = time.perf_counter()
                fn(s)
                dist.barrier()
                times[what][s].append(time.perf_counter() - t)
    assert all(torch.equal(dst[k].to_local(), v.to_local()) for k, v in sd.items())
    nbytes = sum(v.numel() * 4 for v in sd.values())
    return {"world": world, "bytes": nbytes, **{w: {s: _gib_s(nbytes, t) for s, t in times[w].items()} for w in times}}


def measure_ranks(root: str, worlds: list[int], total: int, n_tensors: int, n_rounds: int) -> list[dict]:
    """Save and load of one ``Shard(0)`` state on each world size: fqnckpt against DCP's default
    storage, through ``checkpoint.save`` / ``load`` and ``dcp.save`` / ``load`` on gloo ranks."""
    from checkpoint.ranks.launch import run_ranks

    out = []
    for world in worlds:
        print(f"{world} ranks, {total >> 20} MiB ...", file=sys.stderr, flush=True)
        here = os.path.join(root, f"ranks-{world}")
        os.makedirs(here, exist_ok=True)
        out.append(run_ranks(_rank_case, world, here, total, n_tensors, rounds_arg(n_rounds), timeout=900)[0])
        shutil.rmtree(here, ignore_errors=True)
    return out


def rounds_arg(n: int) -> int:
    return max(3, n)


def measure_digests(nbytes: int = 64 << 20, repeat: int = 5) -> dict:
    """Single-thread GB/s of the digests a checkpoint could record, and of a plain memory copy."""
    import numpy as np
    import xxhash

    buf = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(buf)
    view = memoryview(buf)
    funcs = {
        "xxh3-128 (recorded)": lambda: xxhash.xxh3_128(view).digest(),
        "zlib.crc32": lambda: zlib.crc32(view),
        "blake2b": lambda: hashlib.blake2b(view).digest(),
        "sha256": lambda: hashlib.sha256(view).digest(),
        "memory copy": lambda: np.copyto(dst, buf),
    }
    out = {}
    for name, fn in funcs.items():
        fn()
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        out[name] = nbytes / statistics.median(times) / 1e9
    return out


def run(total_mib: int, counts: list[int], rounds: int, worlds: list[int]) -> dict:
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tests", "bench"))
    warnings.filterwarnings("ignore")  # DCP warns that no process group is initialized
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="fqnckpt-docs-bench-", dir=base)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        cases = []
        for n in counts:
            print(f"{n} tensors, {total_mib} MiB ...", file=sys.stderr, flush=True)
            cases.append(measure_case(root, n, total_mib << 20, rounds))
        ranks = measure_ranks(root, worlds, total_mib << 20, 8, rounds) if worlds else []
    finally:
        shutil.rmtree(root, ignore_errors=True)
    digests = measure_digests()
    return {
        "machine": machine(),
        "settings": {"total_mib": total_mib, "tensor_counts": counts, "rounds": rounds_arg(rounds), "worlds": worlds,
                     "storage": "tmpfs (/dev/shm)" if base else f"temporary directory ({tempfile.gettempdir()})"},
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "seconds": round(time.perf_counter() - t0, 1),
        "cases": cases,
        "ranks": ranks,
        "digests": digests,
    }  # fmt: skip


def plot(results: dict) -> list[str]:
    """PNG plots under docs/benchmarks/: save and load GB/s against the tensor count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    counts = [c["tensors"] for c in results["cases"]]
    for what in ("save", "load"):
        fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=110)
        for side, marker in zip(results["cases"][0][what], "osD^vP*"):
            ax.plot(counts, [c[what][side] for c in results["cases"]], marker=marker, label=side)
        ax.set_xscale("log")
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.minorticks_off()
        ax.set_xlabel(f"tensors ({results['settings']['total_mib']} MiB of float32 in all)")
        ax.set_ylabel("GB/s (median)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{what} throughput, one process, {results['settings']['storage'].split()[0]}")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        name = f"{what}_gbs.png"
        fig.savefig(os.path.join(OUT, name), metadata={"Software": None})
        plt.close(fig)
        names.append(name)
    if results.get("ranks"):
        worlds = [r["world"] for r in results["ranks"]]
        fig, axes = plt.subplots(1, 2, figsize=(8.0, 3.4), dpi=110)
        for ax, what in zip(axes, ("save", "load")):
            for side, marker in (("fqnckpt", "o"), ("DCP", "D")):
                ax.plot(worlds, [r[what][side] for r in results["ranks"]], marker=marker, label=side)
            ax.set_xticks(worlds, [str(w) for w in worlds])
            ax.set_xlabel("ranks (gloo, one machine)")
            ax.set_title(f"{what}, Shard(0) DTensors")
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
        axes[0].set_ylabel("GB/s of the whole state (median)")
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(os.path.join(OUT, "ranks_gbs.png"), metadata={"Software": None})
        plt.close(fig)
        names.append("ranks_gbs.png")
    fig, ax = plt.subplots(figsize=(6.4, 3.0), dpi=110)
    d = results["digests"]
    ax.barh(list(d), list(d.values()))
    ax.set_xlabel("GB/s, one thread")
    ax.set_title("digest throughput")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "digests_gbs.png"), metadata={"Software": None})
    plt.close(fig)
    names.append("digests_gbs.png")
    return names


def _table(results: dict, what: str) -> list[str]:
    sides = list(results["cases"][0][what])
    rows = [f"| tensors | MiB | {' | '.join(sides)} | fqnckpt / safetensors | fqnckpt / DCP |",
            "|---:|---:|" + "---:|" * len(sides) + "---:|---:|"]  # fmt: skip
    for c in results["cases"]:
        v = c[what]
        cells = " | ".join(f"{v[s]:.2f}" for s in sides)
        rows.append(f"| {c['tensors']:,} | {c['bytes'] / 2**20:.0f} | {cells} | "
                    f"{v['fqnckpt'] / v['safetensors']:.2f}x | {v['fqnckpt'] / v['DCP']:.2f}x |")  # fmt: skip
    return rows


def _ranks_section(results: dict, images: list[str]) -> list[str]:
    if not results.get("ranks"):
        return []
    rows = [
        "## Ranks",
        "",
        f"The same state ({results['ranks'][0]['bytes'] >> 20} MiB of float32 in 8 tensors) held as `Shard(0)` DTensors",
        "on 1, 2 or 4 gloo ranks of this machine: `checkpoint.save` / `checkpoint.load` against",
        "`dcp.save` / `dcp.load` with DCP's default storage; each side timed from a barrier to a barrier",
        "(the slowest rank), GB/s of the whole state. Ranks beyond the cores share them.",
        "",
        "| ranks | save fqnckpt | save DCP | fqnckpt / DCP | load fqnckpt | load DCP | fqnckpt / DCP |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["ranks"]:
        s, ld = r["save"], r["load"]
        rows.append(f"| {r['world']} | {s['fqnckpt']:.2f} | {s['DCP']:.2f} | {s['fqnckpt'] / s['DCP']:.2f}x | "
                    f"{ld['fqnckpt']:.2f} | {ld['DCP']:.2f} | {ld['fqnckpt'] / ld['DCP']:.2f}x |")  # fmt: skip
    return [*rows, "", f"![ranks]({os.path.basename(OUT)}/ranks_gbs.png)", ""]


def render(results: dict) -> str:
    m, s = results["machine"], results["settings"]
    images = plot(results)
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by docs/gen_bench.py: edit the script, not this page. -->",
        "",
        "Save and load throughput of one process, against safetensors and DCP (its default",
        "`.distcp` storage and its Hugging Face storage) and, for loads, runai-model-streamer and",
        "fastsafetensors where they are installed; generated by `python docs/gen_bench.py`.",
        "Every side saves and loads the same float32 state; loads copy into the same warm tensors, and",
        "fqnckpt's load checks every tensor's digest before its first copy. The timing rules are those of",
        "`tests/bench/checkpoint_bench.py`: one untimed round of every side, then rounds in rotating",
        "order, `os.sync()` before each timed step, each save to a fresh path; figures are medians.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        f"| CPU | {m['cpu']}, {m['cores']} cores visible |",
        f"| memory | {m['memory_gib']} GiB |",
        f"| kernel | Linux {m['kernel']} |",
        f"| software | Python {m['python']}, torch {m['torch']}, safetensors {m['safetensors']}"
        + "".join(f", {k} {v}" for k, v in m.get("optional", {}).items()) + " |",
        f"| storage | {s['storage']} |",
        f"| rounds | {s['rounds']} per side and case |",
        f"| load average | {results['load_average'][0]} before, {results['load_average'][1]} after "
        f"({results['seconds']} s in all) |",
        "",
        "A shared machine's load shows in the figures: compare sides within one run, not across runs.",
        "",
        "## Save, GB/s",
        "",
        *_table(results, "save"),
        "",
        f"![save throughput]({os.path.basename(OUT)}/{images[0]})",
        "",
        "## Load, GB/s",
        "",
        *_table(results, "load"),
        "",
        f"![load throughput]({os.path.basename(OUT)}/{images[1]})",
        "",
        *_ranks_section(results, images),
        "## Digests",
        "",
        "Single-thread throughput of the digests a checkpoint could record, next to a plain memory",
        "copy of the same bytes. fqnckpt records xxh3-128: it runs near memory-copy speed, so hashing",
        "each piece while it is in cache costs about one more pass over cached data.",
        "",
        "| digest | GB/s |",
        "|---|---:|",
        *(f"| {k} | {v:.2f} |" for k, v in results["digests"].items()),
        "",
        f"![digest throughput]({os.path.basename(OUT)}/{images[-1]})",
        "",
        "## More benchmarks",
        "",
        "The scripts in `tests/bench` measure what this page does not; each prints medians and ranges",
        "of per-round ratios against references timed in the same run (`--help` for options):",
        "",
        "| script | compares |",
        "|---|---|",
        "| `goals.py` | every speed goal against its reference in one run: a mixed-dtype model's load against `safe_open` + copy (tmpfs, warm and cold disk), a raw multi-threaded `preadv` and the same load unchecked; save against `save_file`; 20,000 small tensors; `dcp.load` against torch's HF reader into `Shard(0)` / `Shard(1)` on 2 and 4 ranks |",
        "| `checkpoint_bench.py` | save / load against safetensors, a raw `pwrite` and a memory copy, on tmpfs and disk; `--cold` against a raw sequential read; `--dist` on 2 ranks |",
        "| `dist_save.py` | a save on 2 and 4 ranks against `dcp.save`, a raw parallel write and DCP's HF writer with consolidation |",
        "| `dcp_storage.py` | `StorageWriter` / `StorageReader` against torch's HF storage through `dcp.save` / `dcp.load`, `Shard(0)` and `Shard(1)` |",
        "| `async_save.py` | the blocking time of `async_save` and `CheckpointManager.save`, and of the first save of a process |",
        "| `checked_load.py` | the cost of checking digests while loading |",
        "| `converting_load.py`, `read_paths.py` | loads that convert dtypes, strided targets, column blocks |",
        "| `migrate_scale.py`, `migrate_memory.py`, `convert_experts.py`, `convert_meta_memory.py` | migration and conversion time and memory |",
        "| `s3_save_load.py` | object storage against DCP's `FsspecWriter` / `FsspecReader` (moto) |",
        "| `cli_startup.py` | `fqnckpt --version`, `--help` and `inspect` start-up time |",
        "| `dist_scale.py`, `shared_writes.py`, `save_phases.py` | many DTensors on 8 ranks; several writers of one file; the phases of a save |",
        "| `capture_cost.py`, `init_cost.py`, `train_step.py` | capture, `init_weights` and a training step of the parallel module |",
        "| `reliability_report.py` | kills and corruptions at random points, and what survives |",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--render-only", action="store_true", help="render from docs/benchmarks/results.json")
    ap.add_argument("--mib", type=int, default=32, help="MiB of float32 per case")
    ap.add_argument("--counts", default="8,64,512,4096", help="tensor counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per side (>= 3)")
    ap.add_argument("--worlds", default="1,2,4", help="world sizes of the ranks case ('' to skip)")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    if args.render_only:
        with open(RESULTS) as f:
            results = json.load(f)
    else:
        worlds = [int(w) for w in args.worlds.split(",") if w]
        results = run(args.mib, [int(c) for c in args.counts.split(",")], args.rounds, worlds)
        with open(RESULTS, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
    with open(PAGE, "w") as f:
        f.write(render(results))
    print(f"wrote {PAGE} and {OUT}/", file=sys.stderr)


if __name__ == "__main__":
    main()
