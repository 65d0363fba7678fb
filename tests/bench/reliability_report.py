"""Reliability figures: run the crash trials of ``tests/crash_worker.py`` (the same logic as the
pytest crash suite) at full size and print one table.

    python tests/bench/reliability_report.py --trials 50

Rows: SIGKILL after a random delay / at a random fault point, in 1 process and on 2 gloo ranks
(half of the trials over a previous checkpoint), ENOSPC after a random number of bytes (2 ranks:
``trials // 5`` of them, each costs a spawn), two
concurrent saves to one path (one of them killed in half), and pickles carrying a ``__reduce__``
payload. Columns: trials, saves that never completed (killed / failed), loads of exactly the old
or new values, rejections with the right error ("no checkpoint" for a new path, the write error
for a full disk, the unsafe-pickle error), and the three counts that must be 0 (wrong values
loaded silently, a partial checkpoint visible, code executed from a file), plus leftovers found
after the next save (must be 0). Failures are listed with the seed that reproduces them.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[2]), str(HERE.parents[1])]  # repo root, tests/

import crash_worker as cw  # noqa: E402


class _SystemPayload:
    def __init__(self, canary):
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


class _OpenPayload(_SystemPayload):
    def __reduce__(self):
        return (open, (self.canary, "w"))


def pickle_trial(root: Path, seed: int, t: cw.Tally) -> None:
    """A ``__reduce__`` payload in one of 4 forms goes through ``migrate`` and ``load``: both must
    refuse it (UnsafePickleError / CorruptCheckpointError) and the canary file must never appear."""
    import pickle

    import torch

    import checkpoint
    from checkpoint.errors import UnsafePickleError
    from checkpoint.migrating import migrate

    d = root / f"pickle-{seed}"
    d.mkdir(parents=True)
    canary = d / "canary"
    payload = (_SystemPayload if seed % 2 else _OpenPayload)(str(canary))
    obj = {"w": torch.zeros(2), "x": payload}
    form = ("zip", "legacy", "raw", "disguised")[seed % 4]
    p = d / ("model.safetensors" if form == "disguised" else "model.pt")
    if form == "raw":
        with open(p, "wb") as f:
            pickle.dump(obj, f, protocol=2)
    else:
        torch.save(obj, p, _use_new_zipfile_serialization=form != "legacy")
    t.tried += 1
    right = 0
    try:
        migrate(p, d / "out")
        t.failures.append(f"seed={seed} pickle {form}: migrate accepted a payload")
    except UnsafePickleError:
        right += 1
    except Exception as e:  # noqa: BLE001
        t.failures.append(f"seed={seed} pickle {form}: migrate raised {type(e).__name__}: {e}")
    if form == "disguised":
        ck = d / "ck"
        ck.mkdir()
        os.replace(p, ck / "model.safetensors")
        try:
            checkpoint.load({"w": torch.zeros(2)}, ck)
            t.failures.append(f"seed={seed} pickle {form}: load accepted a pickle")
        except checkpoint.CorruptCheckpointError:
            pass
        except Exception as e:  # noqa: BLE001
            right = 0
            t.failures.append(f"seed={seed} pickle {form}: load raised {type(e).__name__}: {e}")
    t.rejected_right += right
    if canary.exists():
        t.code_executed += 1
        t.failures.append(f"seed={seed} pickle {form}: the payload ran")


COLUMNS = ("tried", "killed", "loaded_old", "loaded_new", "rejected_right", "wrong_silently",
           "partial_visible", "code_executed", "leftovers")  # fmt: skip
HEADS = ("cases tried", "killed", "loaded old", "loaded new", "rejected (right error)",
         "loaded wrong silently", "partial visible", "code executed", "leftovers")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=50, help="trials per row (default 50)")
    ap.add_argument("--seed", type=int, default=0, help="first seed (trial i uses seed + i)")
    ap.add_argument("--skip-ranks", action="store_true", help="leave out the 2-rank rows")
    args = ap.parse_args()
    n, s0 = args.trials, args.seed
    rows: list[tuple[str, cw.Tally, float]] = []
    with tempfile.TemporaryDirectory(prefix="fqnckpt-reliability-") as tmp, cw.Zygote() as z:
        root = Path(tmp)

        def row(name, fn, count=n):
            t, t0 = cw.Tally(), time.perf_counter()
            for i in range(count):
                fn(s0 + i, t)
            rows.append((name, t, time.perf_counter() - t0))
            print(f"  {name}: {t.tried} trials in {rows[-1][2]:.0f} s", file=sys.stderr, flush=True)

        modes = ["single"] + ([] if args.skip_ranks else ["ranks"])
        label = {"single": "1 process", "ranks": "2 ranks"}
        for mode in modes:
            for kill, what in (("delay", "random delay"), ("fault", "fault point")):
                row(f"{label[mode]}, {what}",
                    lambda seed, t, m=mode, k=kill: cw.crash_trial(z, root, seed, m, k, t))  # fmt: skip
        row("1 process, disk full",
            lambda seed, t: cw.disk_full_trial(z, root, seed, "single", _budget("single", seed), t))  # fmt: skip
        if not args.skip_ranks:
            row(
                "2 ranks, disk full",
                lambda seed, t: cw.disk_full_trial(z, root, seed, "ranks", _budget("ranks", seed), t),
                max(1, n // 5),  # ~5 s of rank imports per trial; the kill rows are the full-size ones
            )
        row(
            "2 concurrent saves",
            lambda seed, t: cw.concurrent_trial(z, root, seed, t, kill_one=seed % 2 == 1),
        )
        row("pickle payloads", lambda seed, t: pickle_trial(root, seed, t))
    total = cw.Tally()
    for _, t, _ in rows:
        total.add(t)
    width = max(len(r[0]) for r in rows) + 2
    print(f"| {'case'.ljust(width)} | " + " | ".join(HEADS) + " |")
    print("|" + "-" * (width + 2) + "|" + "|".join("-" * (len(h) + 2) for h in HEADS) + "|")
    for name, t, _ in [*rows, ("total", total, 0)]:
        cells = [str(getattr(t, c)).rjust(len(h)) for c, h in zip(COLUMNS, HEADS)]
        print(f"| {name.ljust(width)} | " + " | ".join(cells) + " |")
    for f in total.failures:
        print("FAILURE:", f)
    bad = total.wrong_silently + total.partial_visible + total.code_executed + total.leftovers
    return 1 if bad or total.failures else 0


def _budget(mode: str, seed: int) -> int:
    """Bytes written before ENOSPC, spread over headers, data and (1 process) the index: all below
    what the failing process writes, so every trial hits a full disk."""
    import random

    from checkpoint.storage.layout import TensorSpec, plan_layout

    sd = cw.values("new", 0, mode)
    shard = cw.SINGLE_SHARD_BYTES if mode == "single" else cw.RANKS_SHARD_BYTES
    files = sum(f.size for f in plan_layout([TensorSpec.of(k, v) for k, v in sd.items()], shard).files)
    if mode == "ranks":  # a rank writes about half the data; rank 0 also the headers and index
        return random.Random(seed).choice([0, 8, 1000, files // 8, files // 3])
    return random.Random(seed).choice([0, 8, 1000, files // 3, files // 2, files - 1, files, files + 100])


if __name__ == "__main__":
    sys.exit(main())
