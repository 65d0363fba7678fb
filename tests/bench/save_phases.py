"""Single-process save, phase by phase, against ``safetensors.torch.save_file`` + fsync and a raw
write of the same bytes, measured in the same run (not collected by pytest).

    python tests/bench/save_phases.py [--sizes 128,512] [--rounds 7] [--dir /dev/shm/fqnckpt-phases]
        [--sides ours,ours_phases,ours_thread,ours_inline,st,raw]   (a disk: --dir /tmp/fqnckpt-phases)

The state is 8 float32 tensors of ``size`` MiB in all (as tests/bench/checkpoint_bench.py). Sides,
in rotating order, each into a path removed beforehand, after ``os.sync()``:

- ``ours``: ``checkpoint.save(sd, path)``; ``ours_phases``: the same with each phase timed (its
  wrappers cost microseconds a call, so the ratios are taken from ``ours``): preparing the state
  (names, specs), planning (layout, header), the atomic staging (lock, leftovers, staging
  directory), creating the shard file (+ header), the tensor ``pwrite``s, their hashing (each
  1 MiB chunk right after its pwrite, or the wait for the hash thread: ``checkpoint.save`` picks
  the thread when a CPU is idle), starting writeback (disks), the file's fsync, the index
  (record, serialized, written, fsynced) and the commit (renames, directory fsyncs, lock
  release); "other (python)" is the rest of the call;
- ``ours_thread`` / ``ours_inline``: ``ours`` with large tensors hashed always on the hash thread
  beside the pwrite / always on the writing thread (``SequentialFileWriter.HASH_INLINE``);
- ``st``: ``save_file(sd, path)`` then fsync (safetensors 0.8 writes each tensor from its memory
  with one ``write``, into a temporary file renamed into place, without fsync);
- ``raw``: ``os.pwrite`` of every tensor's bytes into one file (8 MiB pieces) then fsync: no
  header, no digests, no commit.

Phases are exclusive (a phase's time excludes the phases it calls: "finish file" is what is left
of it besides its "data fsync"), so they sum to the save's wall time; fsyncs are named by the
phase calling them (data / index / dir). CPU is the process's (every thread).

Printed: median [range] wall and CPU seconds per side and per phase, ratios ``st / ours`` and
``raw / ours`` per round (median [range]), and the load average before and after.
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
from checkpoint.write import pipeline  # noqa: E402
from checkpoint.storage import local_commit as atomic  # noqa: E402
from checkpoint.storage import writer  # noqa: E402
from checkpoint_bench import make_large  # noqa: E402  (tests/bench is the script's directory)


PHASES: dict[str, float] = {}  # phase -> wall seconds spent in it, its sub-phases excluded
CPU: dict[str, float] = {}  # phase -> process CPU seconds (every thread), sub-phases excluded
_STACK: list[list] = []  # [label, wall at entry, cpu at entry, wall of sub-phases, cpu of sub-phases]
TIMING = [False]  # phases timed only in the ``ours_phases`` side: the ratios come from untimed saves


def _timed(label, f, *a, **k):
    """Run ``f`` as phase ``label``: its own time (minus the phases it calls) is added up, so the
    phases of one save sum to its wall time without double counting."""
    if callable(label):
        label = label()
    _STACK.append([label, time.perf_counter(), time.process_time(), 0.0, 0.0])
    try:
        return f(*a, **k)
    finally:
        lab, w0, c0, wsub, csub = _STACK.pop()
        w, c = time.perf_counter() - w0, time.process_time() - c0
        PHASES[lab] = PHASES.get(lab, 0.0) + w - wsub
        CPU[lab] = CPU.get(lab, 0.0) + c - csub
        if _STACK:
            _STACK[-1][3] += w
            _STACK[-1][4] += c


def wrap_timed(phases: dict[str, float], obj, name: str, label) -> None:
    """Replace ``obj.name`` by a wrapper timing it as phase ``label`` (a string, or a function
    returning one when called). ``phases`` is kept for callers of the old signature: the phases go
    into :data:`PHASES` / :data:`CPU` (tests/bench/dist_save.py reads its own dict)."""
    f = getattr(obj, name)
    if phases is not PHASES:  # another bench's dict: plain inclusive timing into it
        def timed_into(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                phases[label] = phases.get(label, 0.0) + time.perf_counter() - t

        setattr(obj, name, timed_into)
        return

    def timed(*a, **k):
        return _timed(label, f, *a, **k) if TIMING[0] else f(*a, **k)

    setattr(obj, name, timed)


def _wrap(obj, name: str, label) -> None:
    wrap_timed(PHASES, obj, name, label)


def _fsync_label() -> str:
    parent = _STACK[-1][0] if _STACK else ""
    return {"finish file": "data fsync", "index write": "index fsync", "commit": "dir fsync", "dir fsync": "dir fsync"}.get(parent, f"fsync ({parent})")


def instrument() -> None:
    """Time each phase of ``checkpoint.save`` (single process): wrappers on the functions that
    make up the save, and on ``os.fsync`` / ``os.rename`` (named by the phase calling them)."""
    _wrap(saving, "prepare_agreed", "prepare state")
    _wrap(pipeline, "plan_parts", "plan (layout, header)")
    _wrap(atomic.StagedCheckpoint, "__enter__", "staging (lock, leftovers, mkdir)")
    _wrap(writer, "create_shard_file", "create file + header")
    _wrap(writer, "pwrite_all", "pwrite")
    _wrap(writer.digest, "xxh3_128_digest", "hash (inline)")
    _wrap(writer.ownership, "settle", "wait for hash thread")
    _wrap(writer.SequentialFileWriter, "finish", "finish file")
    _wrap(writer.writeback, "start_writeback", "start writeback")
    _wrap(pipeline, "make_index", "index record")
    _wrap(pipeline.IndexFile, "to_json_bytes", "index serialize")
    _wrap(atomic.StagedCheckpoint, "write_file", "index write")
    _wrap(atomic.StagedCheckpoint, "commit", "commit")
    _wrap(atomic, "fsync_path", "dir fsync")
    _wrap(os, "fsync", _fsync_label)
    _wrap(os, "rename", "rename")
    _wrap(atomic.StagedCheckpoint, "__exit__", "staging exit (unlock)")


def _rm(p: str) -> None:
    if os.path.isdir(p):
        shutil.rmtree(p, ignore_errors=True)
    elif os.path.exists(p):
        os.unlink(p)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="128,512", help="MiB, comma-separated")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default="/dev/shm/fqnckpt-phases")
    ap.add_argument("--sides", default="ours,ours_phases,ours_thread,ours_inline,st,raw")
    args = ap.parse_args()
    from safetensors.torch import save_file

    instrument()
    os.makedirs(args.dir, exist_ok=True)
    la0 = os.getloadavg()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.dir}; load average {la0[0]:.1f} {la0[1]:.1f} {la0[2]:.1f}")
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

            def ours_phases():
                TIMING[0] = True
                try:
                    checkpoint.save(sd, ours_p)
                finally:
                    TIMING[0] = False

            def forced(inline: bool):
                def run():
                    writer.SequentialFileWriter.HASH_INLINE = inline
                    try:
                        checkpoint.save(sd, ours_p)
                    finally:
                        writer.SequentialFileWriter.HASH_INLINE = None

                return run

            all_sides = {
                "ours": lambda: checkpoint.save(sd, ours_p),
                "ours_phases": ours_phases,
                "ours_thread": forced(False),
                "ours_inline": forced(True),
                "st": lambda: (save_file(sd, st_p), fsync_path(st_p)),
                "raw": raw,
            }
            names = args.sides.split(",")
            sides = {n: all_sides[n] for n in names}
            times: dict[str, list[float]] = {n: [] for n in names}
            cpus: dict[str, list[float]] = {n: [] for n in names}
            phases: dict[str, list[tuple[dict, dict]]] = {n: [] for n in names if n == "ours_phases"}
            for i in range(args.rounds + 1):  # round 0 untimed (first touch)
                for j in range(len(names)):
                    n = names[(i + j) % len(names)]
                    for p in (ours_p, st_p, raw_p):
                        _rm(p)
                    os.sync()
                    PHASES.clear()
                    CPU.clear()
                    c, t = time.process_time(), time.perf_counter()
                    sides[n]()
                    dt, dc = time.perf_counter() - t, time.process_time() - c
                    if i:
                        times[n].append(dt)
                        cpus[n].append(dc)
                        if n in phases:
                            ph, cp = dict(PHASES), dict(CPU)
                            ph["other (python)"] = dt - sum(ph.values())
                            cp["other (python)"] = dc - sum(cp.values())
                            phases[n].append((ph, cp))

            def med(xs, f=".4f"):
                return f"{statistics.median(xs):{f}} [{min(xs):{f}}-{max(xs):{f}}]"

            def ratio(ref, ours):
                r = [a / b for a, b in zip(ref, ours)]
                return f"{statistics.median(r):.2f}x [{min(r):.2f}-{max(r):.2f}]"

            la = os.getloadavg()
            print(f"\n{size} MiB, 8 tensors, {args.rounds} rounds, rotating order (load average {la[0]:.1f} {la[1]:.1f} {la[2]:.1f})")
            for n in names:
                print(f"  {n:12s} wall {med(times[n])} s, cpu {med(cpus[n])} s")
            for n in (x for x in names if x in ("ours", "ours_thread", "ours_inline")):
                for ref in ("st", "raw"):
                    if ref in times:
                        print(f"  {n} vs {'save_file+fsync' if ref == 'st' else 'raw pwrite+fsync'}: {ratio(times[ref], times[n])} (ref/ours)")
            if "st" in times and "raw" in times:
                print(f"  save_file+fsync vs raw: {ratio(times['raw'], times['st'])}")
            for n, runs in phases.items():
                print(f"  phases of {n}: wall median [range] s | cpu median s (exclusive: sub-phases not counted twice)")
                keys = sorted({k for ph, _ in runs for k in ph}, key=lambda k: -statistics.median(ph.get(k, 0.0) for ph, _ in runs))
                for k in keys:
                    print(f"    {k:34s} {med([ph.get(k, 0.0) for ph, _ in runs])} | {statistics.median(cp.get(k, 0.0) for _, cp in runs):.4f}")
            del sd, views
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    la = os.getloadavg()
    print(f"\nload average {la0[0]:.1f} -> {la[0]:.1f} {la[1]:.1f} {la[2]:.1f}")


if __name__ == "__main__":
    main()
