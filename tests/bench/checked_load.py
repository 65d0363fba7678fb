"""Cost of the digest check on load: ``checkpoint.load`` with the index's xxh3-128 digests checked
against the same load unchecked (the check switched off in the reader), measured in the same run,
rotating order, warm page cache (not collected by pytest).

Goal: a checked load >= 0.95x of the unchecked one. The check hashes each tensor read
whole on the read pool thread that read its bytes, right after they landed
(:class:`checkpoint.storage.digest.RunHashes`).

    python tests/bench/checked_load.py [--mib 256] [--many 5000] [--pairs 7] [--dirs /dev/shm/x /tmp/y]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import checkpoint  # noqa: E402
from checkpoint_bench import gbs, load_unchecked, make_large, make_many, ratio_line, rounds, warm  # noqa: E402


def bench(name: str, sd, root: str, pairs: int) -> None:
    path = os.path.join(root, f"checked-{name}")
    checkpoint.save(sd, path, overwrite=True)
    dst = {k: v.clone() for k, v in sd.items()}
    warm(dst)

    def checked():
        checkpoint.load(dst, path)

    def unchecked():
        load_unchecked(dst, path)

    t = rounds({"checked": checked, "unchecked": unchecked}, pairs)
    assert all(v.equal(sd[k]) for k, v in dst.items())
    size = sum(v.nbytes for v in sd.values())
    print(f"{name} ({size / 2**20:.0f} MiB, {len(sd)} tensors) in {root}: checked {gbs(size, t['checked'])}; "
          f"unchecked {gbs(size, t['unchecked'])}")  # fmt: skip
    print(ratio_line("checked load vs unchecked", t["unchecked"], t["checked"], 0.95))
    print(f"  load average {os.getloadavg()}")
    shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--many", type=int, default=5000, help="small tensors (64x32 float32); 0 to skip")
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--dirs", nargs="+", default=["/dev/shm/fqnckpt-checked", "/tmp/fqnckpt-checked"])
    a = ap.parse_args()
    cases = [("large", make_large(a.mib << 20))] + ([("many", make_many(a.many))] if a.many else [])
    for root in a.dirs:
        os.makedirs(root, exist_ok=True)
        try:
            for name, sd in cases:
                bench(name, sd, root, a.pairs)
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
