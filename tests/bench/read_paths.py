"""Benchmark of the read paths that moved from safetensors' mapping to ``preadv`` (
no SIGBUS on a cut file): the load path of targets not read straight (``copy_into``: dtype
conversion, strided targets, a ``Shard(1)`` block), ``CheckpointReader.get`` (whole tensors; the
migration source goes through it), ``get_slice`` of a row block (``Shard(0)``), of a column block
(``Shard(1)``: the direct-run path) and of a narrow column block (the windowed-rows path), each
against the former path (reconstructed): a reader's ``safe_open``
handle opened per load (a fresh mapping, faults counted, as each load's reader had) and
``get_tensor`` / ``get_slice`` of the same bytes, copied into the same warm targets. Not collected
by pytest. Sides alternate order every round; ratios are reference / new time, median
[min-max] over the rounds (>1: faster than before). ``get`` three ways: + ``copy_`` into a warm
target (the old side's tensor is a lazy mapped view: one pass against the new side's two, and
unchecked against checked), then like with like: both sides returning a tensor of their own,
both unchecked, then both checked against the index's xxh3-128 digest.

    flock /work/bench.lock python tests/bench/read_paths.py [--mib 256] [--rounds 7] [--only NAME] [--dir /tmp/...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from safetensors import safe_open

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import checkpoint  # noqa: E402
from checkpoint.storage import digest  # noqa: E402
from checkpoint.storage.reader import CheckpointReader  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(dir=a.dir)
    rows = (a.mib << 20) // (8 * 4096 * 4)
    g = torch.Generator().manual_seed(0)
    sd = {f"w{i}": torch.randn(rows, 4096, generator=g) for i in range(8)}
    path = os.path.join(tmp, "c")
    checkpoint.save(sd, path)
    r = checkpoint.open_checkpoint(path)
    shard = os.path.join(path, r.files[0])
    keys = list(sd)

    def old(fn):  # the old path: each load's reader opened its own handle (a fresh mapping)
        return lambda: fn(safe_open(shard, framework="pt"))

    due = CheckpointReader.recorded_digest

    def unchecked(fn):  # as a checkpoint without digests
        CheckpointReader.recorded_digest = lambda self, key: None
        try:
            return fn()
        finally:
            CheckpointReader.recorded_digest = due

    def checked_copy(t, k):  # the old path plus the check the new one does
        out = t.clone()
        if digest.tensor_hexdigest(out.numpy(), r.digest_chunk) != r.recorded_digest(k):  # (format 3: chunked)
            raise AssertionError(k)
        return out

    half = rows // 2
    # Each side copies its result into the same warm targets, as a load does (safetensors' tensors
    # are lazy mappings: untouched, they would cost nothing).
    whole = {k: torch.empty(rows, 4096) for k in keys}
    top = {k: torch.empty(half, 4096) for k in keys}
    cols = {k: torch.empty(rows, 2048) for k in keys}
    narrow = {k: torch.empty(rows, 64) for k in keys}
    wide = {k: torch.empty(rows, 4096, dtype=torch.float64) for k in keys}
    half_p = {k: torch.empty(rows, 4096, dtype=torch.bfloat16) for k in keys}
    strided = {k: torch.empty(rows, 8192)[:, ::2] for k in keys}
    cases = {
        "load path: copy_into float64": (
            lambda: [r.copy_into(k, wide[k]) for k in keys],
            old(lambda h: [wide[k].copy_(h.get_tensor(k)) for k in keys]),
        ),
        "load path: copy_into bfloat16": (
            lambda: [r.copy_into(k, half_p[k]) for k in keys],
            old(lambda h: [half_p[k].copy_(h.get_tensor(k)) for k in keys]),
        ),
        "load path: copy_into strided": (
            lambda: [r.copy_into(k, strided[k]) for k in keys],
            old(lambda h: [strided[k].copy_(h.get_tensor(k)) for k in keys]),
        ),
        "load path: copy_into cols (Shard(1))": (
            lambda: [r.copy_into(k, cols[k], [slice(0, rows), slice(0, 2048)]) for k in keys],
            old(lambda h: [cols[k].copy_(h.get_slice(k)[0:rows, 0:2048]) for k in keys]),
        ),
        # get + copy_: the old side's get_tensor is a lazy view of the mapping (no copy, no
        # check), so this is one pass against two: what a caller copying a got tensor sees.
        "get (whole) + copy_ (old: mapped view)": (
            lambda: [whole[k].copy_(r.get(k)) for k in keys],
            old(lambda h: [whole[k].copy_(h.get_tensor(k)) for k in keys]),
        ),
        # Like with like: both sides return tensors of their own (the old one copied out of
        # the mapping), neither checked, then both checked (xxh3-128 of the stored bytes).
        "get (whole) owned, unchecked": (
            lambda: unchecked(lambda: [r.get(k) for k in keys]),
            old(lambda h: [h.get_tensor(k).clone() for k in keys]),
        ),
        "get (whole) owned, checked": (
            lambda: [r.get(k) for k in keys],
            old(lambda h: [checked_copy(h.get_tensor(k), k) for k in keys]),
        ),
        "get_slice rows (Shard(0))": (
            lambda: [top[k].copy_(r.get_slice(k, [slice(0, half)])) for k in keys],
            old(lambda h: [top[k].copy_(h.get_slice(k)[0:half]) for k in keys]),
        ),
        "get_slice cols (Shard(1))": (
            lambda: [cols[k].copy_(r.get_slice(k, [slice(0, rows), slice(0, 2048)])) for k in keys],
            old(lambda h: [cols[k].copy_(h.get_slice(k)[0:rows, 0:2048]) for k in keys]),
        ),
        "get_slice narrow cols (1/64)": (
            lambda: [narrow[k].copy_(r.get_slice(k, [slice(0, rows), slice(0, 64)])) for k in keys],
            old(lambda h: [narrow[k].copy_(h.get_slice(k)[0:rows, 0:64]) for k in keys]),
        ),
    }
    for name, (new, ref) in cases.items():
        if a.only not in name:
            continue
        new(), ref()  # warm
        ratios = []
        for i in range(a.rounds):
            times = {}
            order = [("new", new), ("ref", ref)] if i % 2 == 0 else [("ref", ref), ("new", new)]
            for side, fn in order:
                t0 = time.perf_counter()
                out = fn()
                times[side] = time.perf_counter() - t0
                del out
            ratios.append(times["ref"] / times["new"])
        print(f"{name:40s} preadv / safe_open: {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
              f" over {a.rounds} rounds, load avg {os.getloadavg()[0]:.1f}")
    r.close()
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
