"""CLI start-up: wall time of ``fqnckpt --version`` / ``--help`` / ``inspect`` against the goals
(< 0.3 s, < 0.3 s, < 1 s), with the floors measured in the same run: an empty
``python -c pass`` and ``python -c "import torch"`` (what inspect of a safetensors checkpoint does
not pay: its headers and index are read without torch). Not collected by pytest.

    python tests/bench/cli_startup.py [--rounds 3]

Each command runs as ``python -m checkpoint ...`` (the console script's pyenv shim, if any, is the
environment's cost, not ours), the sides in rotating order; median and range per side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_bench import rounds  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*argv: str):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return lambda: subprocess.run([sys.executable, *argv], env=env, check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3, help="rounds (>= 3; 3 runs in about a minute)")
    args = ap.parse_args()
    import torch
    from safetensors.torch import save_file

    import checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        sd = {f"layers.{i}.weight": torch.randn(64, 64) for i in range(16)}
        save_file(sd, os.path.join(tmp, "model.safetensors"))
        checkpoint.save(sd, os.path.join(tmp, "ckpt"), max_shard_size=4 * 64 * 64 * 4)  # 4 shard files + index
        sides = {
            "python -c pass (floor)": _run("-c", "pass"),
            "python -c 'import torch' (not paid by inspect)": _run("-c", "import torch"),
            "fqnckpt --version": _run("-m", "checkpoint", "--version"),
            "fqnckpt --help": _run("-m", "checkpoint", "--help"),
            "fqnckpt inspect FILE.safetensors": _run("-m", "checkpoint", "inspect", f"{tmp}/model.safetensors"),
            "fqnckpt inspect CKPT_DIR": _run("-m", "checkpoint", "inspect", f"{tmp}/ckpt"),
        }
        goals = {"fqnckpt --version": 0.3, "fqnckpt --help": 0.3}
        goals |= {k: 1.0 for k in sides if k.startswith("fqnckpt inspect")}
        load = os.getloadavg()
        t = rounds(sides, max(3, args.rounds))
    print(f"{os.cpu_count()} CPUs, load average {load[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; "
          f"{max(3, args.rounds)} rounds, rotating order")  # fmt: skip
    for name, ts in t.items():
        med = statistics.median(ts)
        goal = goals.get(name)
        verdict = "" if goal is None else f"  goal < {goal} s: {'met' if med < goal else 'NOT met'}"
        print(f"  {name:<46} {med:.3f} s [range {min(ts):.3f}-{max(ts):.3f}]{verdict}")
    floor = list(t["python -c 'import torch' (not paid by inspect)"])
    for name in (k for k in t if k.startswith("fqnckpt inspect")):
        r = [b / a for a, b in zip(t[name], floor)]  # same round: same machine load
        print(f"  {name}: import torch alone takes {statistics.median(r):.1f}x as long "
              f"[range {min(r):.1f}-{max(r):.1f}]")  # fmt: skip


if __name__ == "__main__":
    main()
