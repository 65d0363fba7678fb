"""Single-process save, phase by phase, against ``safetensors.torch.save_file`` + fsync and a raw
write of the same bytes, measured in the same run (issue 35; not collected by pytest).

    python tests/bench/save_phases.py [--sizes 128,512] [--rounds 7] [--dir /dev/shm/fqnckpt-phases]

The state is 8 float32 tensors of ``size`` MiB in all (as tests/bench/checkpoint_bench.py). Sides,
in rotating order, each into a path removed beforehand, after ``os.sync()``:

- ``ours``: ``checkpoint.save(sd, path)``, with each phase timed: preparing the state (names,
  specs), planning, the atomic staging (lock, leftovers, staging directory), creating the shard
  file, the tensor writes (``pwrite`` while the hash thread reads the same memory, waiting for it
  at each tensor's end), the file's fsync, the index (serialized, written, fsynced) and the commit
  (renames, directory fsyncs, lock release); "other" is the rest of the call;
- ``st``: ``save_file(sd, path)`` then fsync;
- ``raw``: ``os.pwrite`` of every tensor's bytes into one file (8 MiB pieces) then fsync: no
  header, no digests, no commit.

Printed: median [range] seconds per side and per phase, ratios ``st / ours`` and ``raw / ours`` per
round (median [range]), and the load average before and after.
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
import checkpoint.saving as saving  # noqa: E402
from checkpoint import atomic  # noqa: E402
from checkpoint.storage import writer  # noqa: E402
from checkpoint_bench import make_large  # noqa: E402  (tests/bench is the script's directory)


PHASES: dict[str, float] = {}


def wrap_timed(phases: dict[str, float], obj, name: str, label: str) -> None:
    """Replace ``obj.name`` by a wrapper adding its seconds into ``phases[label]`` (also when it raises)."""
    f = getattr(obj, name)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            phases[label] = phases.get(label, 0.0) + time.perf_counter() - t

    setattr(obj, name, timed)


def _wrap(obj, name: str, label: str) -> None:
    wrap_timed(PHASES, obj, name, label)


def instrument() -> None:
    _wrap(saving, "prepare_agreed", "prepare state")
    _wrap(saving, "_plan_checked", "plan")
    _wrap(atomic.StagedCheckpoint, "__enter__", "staging (lock, dir)")
    _wrap(writer, "create_shard_file", "create file")
    _wrap(writer.SequentialFileWriter, "write", "write + hash")
    _wrap(writer.SequentialFileWriter, "_flush", "write + hash")
    real_fsync = writer.os.fsync

    def fsync(fd):
        t = time.perf_counter()
        try:
            real_fsync(fd)
        finally:
            PHASES["data fsync"] = PHASES.get("data fsync", 0.0) + time.perf_counter() - t

    writer.os.fsync = fsync  # the writer module's os only: the data file's fsync
    _wrap(atomic.StagedCheckpoint, "write_file", "index write + fsync")
    _wrap(atomic.StagedCheckpoint, "commit", "commit (renames, dir fsyncs)")
    _wrap(atomic.StagedCheckpoint, "__exit__", "staging exit (lock release)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="128,512", help="MiB, comma-separated")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default="/dev/shm/fqnckpt-phases")
    args = ap.parse_args()
    from safetensors.torch import save_file

    instrument()
    os.makedirs(args.dir, exist_ok=True)
    la0 = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.dir}; load average {la0:.1f}")
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            sd = make_large(size << 20)
            views = [writer.tensor_bytes(v) for v in sd.values()]
            ours_p, st_p, raw_p = (os.path.join(args.dir, n) for n in ("ours", "st.safetensors", "raw.bin"))

            def fsync_path(p):
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

            def raw():
                fd = os.open(raw_p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    at = 0
                    for v in views:
                        for lo in range(0, len(v), 8 << 20):
                            writer.pwrite_all(fd, v[lo : lo + (8 << 20)], at + lo)
                        at += len(v)
                    os.fsync(fd)
                finally:
                    os.close(fd)

            sides = {
                "ours": lambda: checkpoint.save(sd, ours_p),
                "st": lambda: (save_file(sd, st_p), fsync_path(st_p)),
                "raw": raw,
            }
            names = list(sides)
            times: dict[str, list[float]] = {n: [] for n in names}
            phases: list[dict[str, float]] = []
            for i in range(args.rounds + 1):  # round 0 untimed (first touch)
                for j in range(len(names)):
                    n = names[(i + j) % len(names)]
                    for p in (ours_p, st_p, raw_p):
                        shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else (os.path.exists(p) and os.unlink(p))
                    os.sync()
                    PHASES.clear()
                    t = time.perf_counter()
                    sides[n]()
                    dt = time.perf_counter() - t
                    if i:
                        times[n].append(dt)
                        if n == "ours":
                            ph = dict(PHASES)
                            ph["other"] = dt - sum(ph.values())
                            phases.append(ph)

            def med(xs):
                return f"{statistics.median(xs):.4f} [{min(xs):.4f}-{max(xs):.4f}]"

            def ratio(ref, ours):
                r = [a / b for a, b in zip(ref, ours)]
                return f"{statistics.median(r):.2f}x [{min(r):.2f}-{max(r):.2f}]"

            print(f"\n{size} MiB, 8 tensors, {args.rounds} rounds (load average {os.getloadavg()[0]:.1f})")
            for n in names:
                print(f"  {n:5s} {med(times[n])} s")
            print(f"  ours vs save_file+fsync (goal >= 1.0): {ratio(times['st'], times['ours'])}; "
                  f"vs raw write: {ratio(times['raw'], times['ours'])}; save_file vs raw: "
                  f"{ratio(times['raw'], times['st'])}")  # fmt: skip
            print("  phases of ours (median [range] s):")
            for k in sorted({k for p in phases for k in p}, key=lambda k: -statistics.median(p.get(k, 0) for p in phases)):
                print(f"    {k:32s} {med([p.get(k, 0.0) for p in phases])}")
            del sd, views
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    print(f"\nload average {la0:.1f} -> {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
