"""Peak memory of a streaming migration against checkpoint size (not collected by pytest).

Writes a checkpoint of N tensors of T bytes each (safetensors, and a zip pickle for the mmap
path), then migrates it in a fresh subprocess that reports its peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``, bounded by ``VmHWM``) minus its RSS after imports. Prints the peak over
the checkpoint size and over one tensor, measured in the same run.

    python tests/bench/migrate_memory.py [--tensors 24] [--tensor-mb 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, resource, sys
import torch
import checkpoint.migrating, checkpoint.saving  # imports first: the baseline excludes them
from checkpoint.migrating import migrate

def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field))

base = status_kib("VmRSS")
src, dst, shard = sys.argv[1], sys.argv[2], sys.argv[3]
migrate(src, dst, rules=[("^old", "new")], max_shard_size=shard)
# ru_maxrss survives fork+exec (a child of a big pytest process starts at the parent's peak), so
# the peak of this process's own address space, VmHWM, is read too; the smaller is the true one.
peak = min(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, status_kib("VmHWM"))  # KiB
print(json.dumps({"peak_bytes": (peak - base) * 1024}))
"""


def make_checkpoints(d: str, n: int, tensor_bytes: int) -> tuple[str, str]:
    """A safetensors file and a zip pickle, each of ``n`` float32 tensors of ``tensor_bytes``."""
    import torch
    from safetensors.torch import save_file

    numel = tensor_bytes // 4
    sd = {f"old.layer{i}.weight": torch.full((numel,), float(i)) for i in range(n)}
    st, pt = os.path.join(d, "big.safetensors"), os.path.join(d, "big.pt")
    save_file(sd, st)
    torch.save(sd, pt)
    return st, pt


def peak_of_migration(src: str, dst: str, shard: str = "5GB") -> int:
    """Peak RSS growth (bytes) of a subprocess migrating ``src`` to ``dst``."""
    # glibc raises its mmap threshold each time a large mmapped block is freed, so later 8 MiB
    # tensors come from heap arenas that keep freed memory: the peak then varied 17-74 MiB between
    # identical runs (allocator retention, not tensors we hold). A fixed threshold measures what
    # the migration keeps alive (9.8 MiB every run for 8 MiB tensors).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, src, dst, shard],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=24)
    ap.add_argument("--tensor-mb", type=int, default=8)
    a = ap.parse_args()
    tensor_bytes = a.tensor_mb << 20
    size = a.tensors * tensor_bytes
    with tempfile.TemporaryDirectory() as d:
        for src in make_checkpoints(d, a.tensors, tensor_bytes):
            peak = peak_of_migration(src, os.path.join(d, "out-" + os.path.basename(src)))
            print(
                f"{os.path.basename(src):18s} ckpt {size >> 20} MiB, one tensor {a.tensor_mb} MiB: "
                f"peak {peak / 2**20:.1f} MiB = {peak / size:.2f} x ckpt = {peak / tensor_bytes:.1f} x one tensor"
            )


if __name__ == "__main__":
    main()
