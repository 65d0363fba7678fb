"""Before / after: ``checkpoint.save`` and ``checkpoint.load`` of this tree against another checkout of
fqnckpt (an earlier commit), measured in the same run (not collected by pytest).

Each round runs one fresh process per tree, in rotating order, on the same machine state; a process
saves and loads the same state ``--reps`` times into a fresh directory under ``--dir`` and prints
its median save and load seconds. The ratio per round is ``other / this`` (above 1.0: this tree is
faster); the median and range over the rounds are printed per case.

    git worktree add /tmp/before <commit>
    python tests/bench/ab_trees.py --other /tmp/before [--dir /dev/shm/ab] [--rounds 5] [--reps 3]

Cases: ``large`` (8 float32 tensors, ``--mib`` MiB in all, default 128) and ``many`` (5,000 tensors
of 64x32 float32). Disk saves fsync (as ``save`` always does); loads read the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER = r"""
import json, os, shutil, statistics, sys, time
import torch
import checkpoint
case, mib, reps, where = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
if case == "large":
    n = mib * (1 << 20) // 4 // 8
    state = {f"layer{i}.weight": torch.randn(n) for i in range(8)}
else:
    state = {f"block{i}.weight": torch.randn(64, 32) for i in range(5000)}
target = {k: torch.empty_like(v) for k, v in state.items()}
saves, loads = [], []
for r in range(reps):
    path = os.path.join(where, f"ck{r}")
    os.sync()
    t = time.perf_counter(); checkpoint.save(state, path); saves.append(time.perf_counter() - t)
    t = time.perf_counter(); checkpoint.load(target, path); loads.append(time.perf_counter() - t)
    shutil.rmtree(path)
assert all(torch.equal(target[k], state[k]) for k in state)
print(json.dumps({"save": statistics.median(saves), "load": statistics.median(loads)}))
"""


def run(tree: str, case: str, mib: int, reps: int, where: str) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    d = tempfile.mkdtemp(dir=where)
    try:
        out = subprocess.run([sys.executable, "-c", WORKER, case, str(mib), str(reps), d], env=env, cwd=tree,
                             capture_output=True, text=True, check=True)  # fmt: skip
    finally:
        subprocess.run(["rm", "-rf", d], check=False)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", required=True, help="another checkout of fqnckpt (the 'before')")
    ap.add_argument("--dir", action="append", help="where to save (repeatable; default /dev/shm and /tmp)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mib", type=int, default=128)
    args = ap.parse_args()
    dirs = args.dir or ["/dev/shm", "/tmp"]
    trees = {"this": HERE, "other": os.path.abspath(args.other)}
    print(f"this={HERE} other={trees['other']} load average {os.getloadavg()[0]:.1f}")
    for where in dirs:
        for case in ("large", "many"):
            ratios: dict[str, list[float]] = {"save": [], "load": []}
            for r in range(args.rounds):
                order = ["this", "other"] if r % 2 == 0 else ["other", "this"]
                got = {name: run(trees[name], case, args.mib, args.reps, where) for name in order}
                for op in ratios:
                    ratios[op].append(got["other"][op] / got["this"][op])
            for op, xs in ratios.items():
                print(f"{where:>9} {case:>5} {op}: other/this {statistics.median(xs):.2f}x "
                      f"[{min(xs):.2f}-{max(xs):.2f}] over {len(xs)} rounds")  # fmt: skip
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
