"""Cost of the digest check on a load whose targets are not read straight: a float32
checkpoint loaded by ``checkpoint.load`` into float64 targets (dtype conversion) and into strided
float32 targets, each through ``copy_into``'s pieces. Three sides, rotating order, warm page
cache, in the same run (not collected by pytest):

- ``checked``: the load as shipped (every byte checked against the index's xxh3-128 digest);
- ``unchecked``: the same load with the check switched off in the reader (as a checkpoint
  without digests): the reference of the goal, checked >= 0.9x of it;
- ``mapped``: the former path (``safe_open`` per load, ``get_tensor`` + ``copy_``;
  unchecked, and a cut file kills it with SIGBUS), for context.

Ratios are reference time / checked time per round (> 1: checked is faster), median [range].

    flock /work/bench.lock python tests/bench/converting_load.py [--mib 128] [--tensors 8] [--pairs 9] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
from safetensors import safe_open

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import checkpoint  # noqa: E402
from checkpoint_bench import gbs, load_unchecked, ratio_line  # noqa: E402


def rounds(sides: dict, pairs: int) -> dict[str, list[float]]:
    """Each side once untimed, then ``pairs`` rounds, round i starting at side i (rotating
    order). No ``os.sync()`` between steps (a read writes nothing; others' writeback would be
    timed)."""
    names = list(sides)
    for n in names:
        sides[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(pairs):
        for j in range(len(names)):
            n = names[(i + j) % len(names)]
            t = time.perf_counter()
            sides[n]()
            times[n].append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--only", default="", help="run only the targets whose name contains this")
    a = ap.parse_args()
    root = tempfile.mkdtemp(dir=a.dir)
    rows = max(1, (a.mib << 20) // (a.tensors * 4096 * 4))
    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(rows, 4096, generator=g) for i in range(a.tensors)}
    path = os.path.join(root, "ck")
    checkpoint.save(sd, path)
    with checkpoint.open_checkpoint(path) as r:
        shard = os.path.join(path, r.files[0])
    size = sum(v.nbytes for v in sd.values())
    targets = {
        "float64": lambda: {k: torch.zeros(rows, 4096, dtype=torch.float64) for k in sd},
        "strided": lambda: {k: torch.zeros(rows, 8192)[:, ::2] for k in sd},
    }
    try:
        for name, make in targets.items():
            if a.only not in name:
                continue
            dst = make()  # written once: every page mapped before the first timed load

            def checked():
                checkpoint.load(dst, path)

            def unchecked():
                load_unchecked(dst, path)

            def mapped():
                h = safe_open(shard, framework="pt")
                for k, v in dst.items():
                    v.copy_(h.get_tensor(k))

            t = rounds({"checked": checked, "unchecked": unchecked, "mapped": mapped}, a.pairs)
            assert all(torch.equal(v, sd[k].to(v.dtype)) for k, v in dst.items())
            print(f"{name} targets ({size / 2**20:.0f} MiB float32, {len(sd)} tensors) in {a.dir}: "
                  f"checked {gbs(size, t['checked'])}; unchecked {gbs(size, t['unchecked'])}; "
                  f"mapped {gbs(size, t['mapped'])}")  # fmt: skip
            print(ratio_line("checked vs unchecked", t["unchecked"], t["checked"], 0.9))
            print(ratio_line("checked vs mapped (the former path)", t["mapped"], t["checked"], None))
            print(f"  load average {os.getloadavg()}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
