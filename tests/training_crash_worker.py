"""Crash trials of :class:`checkpoint.CheckpointManager` (used by ``tests/test_training_manager.py``).

Run by path with a JSON list of trials: this process imports torch once, then forks one child per
trial. The child saves steps 0, 1, 2 of deterministic values through an async manager
(``keep_latest=2``) and keeps changing the values in place after each save, like a training loop;
step 2's background save is killed either at a fault point (``FQNCKPT_FAULT_POINT``, set only
after step 1 committed) or by this process with SIGKILL after a delay once step 2 is staged.
Prints one JSON line: per trial, how the child ended. The test judges what is left on disk.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

STEPS = 3
MAX_SHARD = 300_000  # several shard files per checkpoint


def values(step: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    sd = {f"layers.{i}.weight": torch.randn(128, 128, generator=g) for i in range(6)}
    sd["embed.weight"] = torch.randn(32, 16, generator=g).to(torch.bfloat16)
    return sd


def _child(trial: dict, wfd: int) -> None:
    import torch

    import checkpoint

    mgr = checkpoint.CheckpointManager(trial["root"], keep_latest=2, async_save=True)
    sd = {k: v.clone() for k, v in values(0).items()}
    for step in range(STEPS):
        if step == STEPS - 1:
            mgr.wait()  # steps before the last are committed; only the last save is killed
            if trial.get("point"):
                os.environ["FQNCKPT_FAULT_POINT"] = trial["point"]
        for k, v in values(step).items():
            sd[k].copy_(v)
        mgr.save(step, sd, extra_state={"step": step, "rng": torch.get_rng_state()}, max_shard_size=MAX_SHARD)
        os.write(wfd, f"{step}\n".encode())
        for v in sd.values():  # training goes on while the save is written
            v.add_(1)
    mgr.wait()


def main(trials: list[dict]) -> list[dict]:
    out = []
    for trial in trials:
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            code = 0
            try:
                _child(trial, wfd)
            except BaseException as e:  # noqa: BLE001
                os.write(2, f"{type(e).__name__}: {e}\n".encode())
                code = 1
            os._exit(code)
        os.close(wfd)
        staged = b""
        if trial.get("delay") is not None:
            while not staged.endswith(f"{STEPS - 1}\n".encode()):
                chunk = os.read(rfd, 64)
                if not chunk:
                    break
                staged += chunk
            time.sleep(trial["delay"])
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status = os.waitpid(pid, 0)
        os.close(rfd)
        out.append({"signaled": os.WIFSIGNALED(status), "exit": os.waitstatus_to_exitcode(status)})
    return out


if __name__ == "__main__":
    import torch  # noqa: F401  - imported once, before forking

    import checkpoint  # noqa: F401
    import checkpoint.loading  # noqa: F401 - `import checkpoint` alone imports them on first use
    import checkpoint.training  # noqa: F401

    print(json.dumps(main(json.loads(sys.argv[1]))))
