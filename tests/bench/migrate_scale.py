"""Migration at MoE scale: ``checkpoint.migrate`` of an N-tensor checkpoint against a safetensors
``load_file`` + ``save_file`` of the same file (goal: migrate <= 3x that reference on
20,000 tensors), measured in the same run.

Each pair times both sides, alternating which goes first; ``os.sync()`` before each timed step.
Prints per-side medians and ranges and the median and range of the per-pair ratios. Sources:
``safetensors`` (one file), ``dcp`` (the same tensors written by ``dcp.save``; the reference
stays the safetensors copy, and DCP's own ``dcp.load`` of the same tensors is timed beside it:
DCP unpickles every tensor, a cost any reader going through its FileSystemReader pays; and
``dcp.load`` + ``checkpoint.save``, which writes and fsyncs as ``migrate`` does: like with like).

    python tests/bench/migrate_scale.py [--tensors 20000] [--shape 64 32] [--pairs 5]
        [--sources safetensors,dcp] [--dir DIR ...]

Default dirs: /dev/shm (tmpfs: the software path) when present, and the system temp dir (disk).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import checkpoint  # noqa: E402
# The package imports its operations on first use; import them before timing (as checkpoint_bench).
import checkpoint.loading  # noqa: E402,F401
import checkpoint.migrating  # noqa: E402,F401
import checkpoint.saving  # noqa: E402,F401


def make_source(d: str, kind: str, n: int, shape: tuple[int, ...]) -> str:
    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i // 64}.experts.{i % 64}.w": torch.randn(shape, generator=g) for i in range(n)}
    if kind == "safetensors":
        path = os.path.join(d, "src.safetensors")
        save_file(sd, path)
        return path
    import torch.distributed.checkpoint as dcp

    path = os.path.join(d, "src-dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": sd}, checkpoint_id=path, no_dist=True)
    return path


def timed(fn) -> float:
    os.sync()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def reference(src: str, dst: str) -> None:
    save_file(load_file(src), dst)
    os.remove(dst)


def dcp_read(src: str, out: dict[str, torch.Tensor]) -> None:
    """DCP's own read of the same tensors (``dcp.load`` into the preallocated ``out``): the floor
    for any reader going through torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": out}, checkpoint_id=src, no_dist=True)


def dcp_read_and_save(src: str, out: dict[str, torch.Tensor], dst: str) -> None:
    """Like with like for ``migrate`` (which reads, writes and fsyncs): ``dcp.load`` and then
    ``checkpoint.save`` (fsyncs every file) of the same tensors."""
    dcp_read(src, out)
    checkpoint.save(out, dst)
    shutil.rmtree(dst)


def migration(src: str, dst: str) -> None:
    checkpoint.migrate(src, dst)
    shutil.rmtree(dst)


def fmt(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.3f} (range {min(xs):.3f}-{max(xs):.3f})"


def run(d: str, kind: str, n: int, shape: tuple[int, ...], pairs: int) -> None:
    work = tempfile.mkdtemp(dir=d, prefix="migrate-scale-")
    try:
        st_src = make_source(work, "safetensors", n, shape)
        src = st_src if kind == "safetensors" else make_source(work, kind, n, shape)
        ref_t, mig_t, ratios, dcp_t, dcp_ratios, load_ratios, rw_ratios = [], [], [], [], [], [], []
        out = {k: torch.zeros(shape) for k in load_file(st_src)}  # the same warm targets for both readers
        for i in range(pairs):
            sides = [
                ("ref", lambda: reference(st_src, os.path.join(work, "ref.safetensors"))),
                ("mig", lambda: migration(src, os.path.join(work, "out"))),
            ]
            if kind == "dcp":
                sides.append(("dcp", lambda: dcp_read(src, out)))
                sides.append(("load", lambda: checkpoint.load(out, src)))
                sides.append(("dcp+save", lambda: dcp_read_and_save(src, out, os.path.join(work, "rw"))))
            sides = sides[i % len(sides) :] + sides[: i % len(sides)]  # rotate who goes first
            got = {name: timed(fn) for name, fn in sides}
            ref_t.append(got["ref"])
            mig_t.append(got["mig"])
            ratios.append(got["mig"] / got["ref"])
            if kind == "dcp":
                dcp_t.append(got["dcp"])
                dcp_ratios.append(got["dcp"] / got["mig"])
                load_ratios.append(got["dcp"] / got["load"])
                rw_ratios.append(got["dcp+save"] / got["mig"])
        mb = n * torch.Size(shape).numel() * 4 / 1e6
        print(f"[{d}] source {kind}: {n} tensors of {tuple(shape)} float32 ({mb:.0f} MB), {pairs} pairs")
        print(f"  safetensors load_file + save_file: {fmt(ref_t)} s")
        print(f"  checkpoint.migrate:                {fmt(mig_t)} s")
        print(f"  ratio migrate / reference:         {fmt(ratios)} x  (goal <= 3x)")
        if dcp_t:
            print(f"  dcp.load of the same tensors:      {fmt(dcp_t)} s")
            print(f"  dcp.load / migrate (speed):        {fmt(dcp_ratios)} x  (goal >= 1.0)")
            print(f"  dcp.load / checkpoint.load into the same tensors: {fmt(load_ratios)} x  (goal >= 1.0)")
            print(f"  (dcp.load + checkpoint.save) / migrate, like with like (both write and fsync): "
                  f"{fmt(rw_ratios)} x  (goal >= 1.0)")  # fmt: skip
        print(f"  load average {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=20_000)
    p.add_argument("--shape", type=int, nargs="+", default=[64, 32])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--sources", default="safetensors,dcp")
    p.add_argument("--dir", action="append", default=None)
    a = p.parse_args()
    dirs = a.dir or ([d for d in ("/dev/shm",) if os.path.isdir(d)] + [tempfile.gettempdir()])
    for d in dirs:
        for kind in a.sources.split(","):
            run(d, kind, a.tensors, tuple(a.shape), a.pairs)


if __name__ == "__main__":
    main()
