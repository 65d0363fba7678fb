"""Benchmark: how long ``checkpoint.async_save`` blocks a training loop, against a synchronous
``checkpoint.save`` of the same state measured in the same run (not collected by pytest).

    python tests/bench/async_save.py [--mib 512] [--pairs 7] [--batch 64] [--dir /tmp/fqnckpt-async-bench]
                                     [--first-only] [--first-mib 128] [--first-rounds 3]

Goal: the ``async_save`` call blocks <= 10% of a synchronous save of a 512 MiB state.
The state is a module of 16 float32 ``Linear(4096, n)`` layers and its AdamW state (parameters,
``exp_avg``, ``exp_avg_sq``: ``--mib`` in all). Each round runs, in a rotating order, each to a
fresh path after ``os.sync()``:

- ``save``: ``checkpoint.save(model, optimizer=opt)``;
- ``call``: ``async_save`` staging everything in the call (the default), then one forward and
  backward of the model on a ``--batch`` x 4096 input;
- ``background``: ``async_save(..., background_staging=True)`` followed by one forward and backward
  of the model on a ``--batch`` x 4096 input, then ``wait_staged()`` (where ``optimizer.step()``
  would wait).

Printed: the calls, the wait, and each async side's "loop extra": call + forward/backward (+ wait)
minus a forward/backward without a save in the same round. The background copy, hashing and
writing compete with that compute for cores and memory bandwidth, in both modes.

The async sides' background writes are waited for (untimed) before the next side. One warm-up save
of each kind first allocates the staging buffers (later saves reuse them). Prints medians and
ranges of each time and of the per-round ratios to ``save``, and the staging memory.

First save (goal: the first call blocks <= 2x a later one): each round runs, in a
fresh process (fresh host memory), ``async_save`` calls of one saver: the first, then 3 later
ones, for five sides in rotating order: no preparation, ``AsyncSaver.prepare`` first, a
``CheckpointManager`` with ``prepare`` first, and (``auto``) a ``CheckpointManager``
whose ``load_latest`` at the start of the run (nothing to load) touches the staging memory in the
background by itself, and (``ctor``) a ``CheckpointManager`` given the module and optimizer when
created (it touches the staging in the background from then); every side runs 3 optimizer steps
before its first save. ``--first-only``
runs only this part.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import checkpoint  # noqa: E402
from checkpoint.training.async_save import AsyncSaver  # noqa: E402

N_LAYERS, IN = 16, 4096
STEPS_BEFORE = 3  # first-save part: optimizer steps between building the state and the first save


class Layers(torch.nn.Module):
    def __init__(self, rows: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(IN, rows, bias=False) for _ in range(N_LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x).square().mean() for layer in self.layers)


def make_state(total_bytes: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    rows = max(1, total_bytes // (3 * N_LAYERS * IN * 4))  # parameters + exp_avg + exp_avg_sq
    torch.manual_seed(0)
    model = Layers(rows)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, IN)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _first_child(mode: str, mib: float, root: str) -> None:
    """One process: time the first and 3 later async saves of one saver (``mode``: ``plain``,
    ``prepare``, ``manager``); prints one JSON line."""
    model, opt = make_state(int(mib * 2**20))
    out: dict = {"mode": mode}
    x = torch.randn(8, IN, generator=torch.Generator().manual_seed(1))
    if mode in ("manager", "auto", "ctor"):
        t = time.perf_counter()
        if mode == "ctor":  # given the state when created: staging touched in the background from then
            mgr = checkpoint.CheckpointManager(root, keep_latest=1, module=model, optimizer=opt)
        else:
            mgr = checkpoint.CheckpointManager(root, keep_latest=1)
        if mode == "manager":
            mgr.prepare(model, opt)
        elif mode == "auto":  # what a run does at its start: nothing saved yet; staging touched in the background
            mgr.load_latest(model, opt)
        out["prepare"] = time.perf_counter() - t

        def call(i):
            mgr.save(i, model, opt)
            return mgr.wait
    else:
        saver = AsyncSaver()
        if mode == "prepare":
            t = time.perf_counter()
            saver.prepare(model, optimizer=opt)
            out["prepare"] = time.perf_counter() - t

        def call(i):
            fut = saver.save(model, os.path.join(root, f"ck{i}"), optimizer=opt, overwrite=True)
            return fut.result
    for _ in range(STEPS_BEFORE):  # training steps before the first save, every side alike
        model(x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    times = []
    for i in range(4):
        os.sync()
        t = time.perf_counter()
        done = call(i)
        times.append(time.perf_counter() - t)
        done()  # untimed: the write must not overlap the next call
    out["first"], out["later"] = times[0], statistics.median(times[1:])
    print(json.dumps(out))


def first_vs_later(mib: float, n_rounds: int, root: str) -> None:
    modes = ["plain", "prepare", "manager", "auto", "ctor"]
    res: dict[str, list[dict]] = {m: [] for m in modes}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    load = os.getloadavg()[0]
    for i in range(n_rounds):
        for k in range(len(modes)):
            mode = modes[(i + k) % len(modes)]
            d = os.path.join(root, f"first-{mode}")
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
            argv = [sys.executable, __file__, "--_child", mode, "--mib", str(mib), "--dir", d]
            line = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
            res[mode].append(json.loads(line.strip().splitlines()[-1]))
            shutil.rmtree(d, ignore_errors=True)
    print(f"first async save vs later ones ({mib:g} MiB, {n_rounds} fresh processes per side, rotating; "
          f"load average {load:.2f} -> {os.getloadavg()[0]:.2f})")  # fmt: skip
    for mode, rs in res.items():
        r = [x["first"] / x["later"] for x in rs]
        prep = [x["prepare"] for x in rs if "prepare" in x]
        goal = "" if mode == "plain" else f" (goal <= 2: {'met' if statistics.median(r) <= 2 else 'NOT met'})"
        print(f"  {mode:<8} first {statistics.median([x['first'] for x in rs]) * 1e3:7.1f} ms, later "
              f"{statistics.median([x['later'] for x in rs]) * 1e3:7.1f} ms; first/later {statistics.median(r):.2f}x "
              f"[range {min(r):.2f}-{max(r):.2f}]{goal}"
              + (f"; prepare {statistics.median(prep) * 1e3:.1f} ms" if prep else ""))  # fmt: skip


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=512)
    p.add_argument("--pairs", type=int, default=7, help="rounds (each runs every side once)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dir", default="/tmp/fqnckpt-async-bench")
    p.add_argument("--first-only", action="store_true", help="only the first-save comparison")
    p.add_argument("--first-rounds", type=int, default=3, help="fresh processes per first-save side")
    p.add_argument("--first-mib", type=float, default=128, help="state size of the first-save part")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._child:
        _first_child(a._child, a.first_mib, a.dir)
        return 0
    if a.pairs < 5:
        p.error("--pairs must be >= 5")
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    if a.first_only:
        first_vs_later(a.first_mib, a.first_rounds, a.dir)
        shutil.rmtree(a.dir, ignore_errors=True)
        return 0
    model, opt = make_state(int(a.mib * 2**20))
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    size += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    x = torch.randn(a.batch, IN, generator=torch.Generator().manual_seed(1))
    print(
        f"state: {N_LAYERS} Linear({IN}, {model.layers[0].out_features}) + AdamW, {size / 2**20:.0f} MiB; "
        f"torch threads {torch.get_num_threads()}; forward/backward on a {a.batch} x {IN} input"
    )
    call_saver, bg_saver = AsyncSaver(), AsyncSaver()
    n = 0

    def path() -> str:
        nonlocal n
        n += 1
        return os.path.join(a.dir, f"ck{n}")

    def fwd_bwd() -> None:
        model(x).backward()
        model.zero_grad(set_to_none=True)

    def side_save() -> dict:
        os.sync()
        t = time.perf_counter()
        checkpoint.save(model, path(), optimizer=opt)
        return {"save": time.perf_counter() - t}

    def side_call() -> dict:
        os.sync()
        t0 = time.perf_counter()
        fwd_bwd()
        alone = time.perf_counter() - t0
        t0 = time.perf_counter()
        fut = call_saver.save(model, path(), optimizer=opt)
        t1 = time.perf_counter()
        fwd_bwd()
        t2 = time.perf_counter()
        fut.result()  # untimed: the background write must not overlap the next side
        return {"call": t1 - t0, "call_extra": (t2 - t0) - alone}

    def side_background() -> dict:
        os.sync()
        t0 = time.perf_counter()
        fwd_bwd()
        alone = time.perf_counter() - t0
        t0 = time.perf_counter()
        fut = bg_saver.save(model, path(), optimizer=opt, background_staging=True)
        t1 = time.perf_counter()
        fwd_bwd()
        t2 = time.perf_counter()
        fut.wait_staged()
        t3 = time.perf_counter()
        fut.result()
        return {"bg_call": t1 - t0, "bg_wait": t3 - t2, "bg_extra": (t3 - t0) - alone}

    side_call()
    side_background()
    print(
        f"staging memory: {call_saver.staging_bytes / 2**20:.1f} MiB per saver (pageable host memory, reused)"
    )
    sides = [side_save, side_call, side_background]
    rounds: list[dict] = []
    for i in range(a.pairs):
        r: dict = {}
        for k in range(3):
            r.update(sides[(i + k) % 3]())
        rounds.append(r)
        print(
            f"round {i}: save {r['save'] * 1e3:7.1f} ms | call {r['call'] * 1e3:6.1f} ms, loop extra "
            f"{r['call_extra'] * 1e3:6.1f} ms | background: call "
            f"{r['bg_call'] * 1e3:5.1f} ms, wait {r['bg_wait'] * 1e3:6.1f} ms, loop extra {r['bg_extra'] * 1e3:6.1f} ms"
        )
        for d in os.listdir(a.dir):
            shutil.rmtree(os.path.join(a.dir, d), ignore_errors=True)

    def fmt(key: str, ratio: bool = False) -> str:
        xs = [r[key] / r["save"] if ratio else r[key] * 1e3 for r in rounds]
        unit = "" if ratio else " ms"
        f = "{:.3f}" if ratio else "{:.1f}"
        return (
            f"median {f.format(statistics.median(xs))}{unit} (range {f.format(min(xs))}-{f.format(max(xs))})"
        )

    print(f"synchronous save:                    {fmt('save')}")
    print(f"async_save call (staged in call):    {fmt('call')};  / save: {fmt('call', True)}")
    print(f"  loop extra (call+fwd/bwd - fwd/bwd): {fmt('call_extra')};  / save: {fmt('call_extra', True)}")
    print(f"async_save call (background):        {fmt('bg_call')};  / save: {fmt('bg_call', True)}")
    print(f"  wait before optimizer.step():      {fmt('bg_wait')}")
    print(f"  loop extra (call+fwd/bwd+wait - fwd/bwd): {fmt('bg_extra')};  / save: {fmt('bg_extra', True)}")
    print("goal: the call blocks <= 0.10 of save")
    first_vs_later(a.first_mib, a.first_rounds, a.dir)
    shutil.rmtree(a.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
