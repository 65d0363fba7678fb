"""Staging memory touched ahead of the first async save: ``AsyncSaver.prepare(...,
background=True)`` and a ``CheckpointManager`` given the state fault in the staging pages on a
low-priority thread of the saver, at most a byte cap, never writing the caller's tensors; the
next save stops it at its next piece instead of waiting for it, and commits exactly the values at
its call; ``close()`` ends the saver's threads; a process exits without finishing a touch."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint.training import pages
from checkpoint.training.async_save import AsyncSaver

am = importlib.import_module("checkpoint.training.async_save")
ROOT = Path(__file__).resolve().parents[1]
PIECE = 3 * 4096


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(40_000, generator=g),  # 14 pieces
        "b": torch.randn(300, 70, generator=g).double(),  # 14 pieces
        "c": torch.randint(0, 250, (50_001,), generator=g, dtype=torch.uint8),  # 5 pieces
    }


def _files(path: Path) -> dict[str, bytes]:
    return {n: (path / n).read_bytes() for n in sorted(os.listdir(path))}


class _Recorder:
    """Stands in for ``pages.populate``: records (thread name, its nice value, address, bytes) of
    each piece and, at the touch thread's piece ``hold_at``, holds it until ``release`` is set."""

    def __init__(self, hold_at: int | None = None, release: threading.Event | None = None):
        self.calls: list[tuple[str, int, int, int]] = []
        self.real = pages.populate
        self.hold_at, self.release = hold_at, release
        self.reached = threading.Event()
        self.released: bool | None = None

    def __call__(self, buf: torch.Tensor) -> None:
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        self.calls.append((threading.current_thread().name, nice, buf.data_ptr(), buf.numel() * buf.element_size()))
        mine = threading.current_thread().name.startswith("fqnckpt-pretouch")
        if mine and self.hold_at is not None and len(self.touched_by("fqnckpt-pretouch")) == self.hold_at:
            self.reached.set()
            self.released = self.release.wait(20)  # False: nobody asked the touch to stop
        self.real(buf)

    def touched_by(self, prefix: str) -> list[tuple[str, int, int, int]]:
        return [c for c in self.calls if c[0].startswith(prefix)]


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(am, "_PIECE", PIECE)


def _inside(ptr: int, n: int, bufs) -> bool:
    return any(b.data_ptr() <= ptr and ptr + n <= b.data_ptr() + b.numel() * b.element_size() for b in bufs)


@pytest.mark.parametrize("owner", ["saver", "manager"])
def test_a_save_stops_the_touch_at_its_next_piece_and_commits_the_values_at_its_call(
    tmp_path, monkeypatch, small_pieces, owner
):
    sd = _state()
    if owner == "saver":
        saver = AsyncSaver()
        start = lambda: saver.prepare(sd, background=True)  # noqa: E731
        save = lambda: saver.save(sd, tmp_path / "ck")  # noqa: E731
    else:
        mgr = checkpoint.CheckpointManager(tmp_path / "m", rng_state=False)
        saver = mgr._saver
        start = lambda: mgr.load_latest(sd)  # noqa: E731 - nothing to load: starts the touch
        save = lambda: mgr.save(1, sd)  # noqa: E731
    rec = _Recorder(hold_at=3, release=saver._stop_touch)  # held at piece 3 until a save says stop
    monkeypatch.setattr(pages, "populate", rec)
    before = {k: v.clone() for k, v in sd.items()}
    start()
    assert rec.reached.wait(60)
    touching = saver._touching
    assert not touching.done()
    assert all(torch.equal(v, before[k]) for k, v in sd.items())  # the touch never writes the sources
    with torch.no_grad():  # the loop goes on writing the state while the touch runs
        sd["a"].mul_(-2)
        sd["c"].add_(3)
    at_call = {k: v.clone() for k, v in sd.items()}
    fut = save()
    assert rec.released is True  # the save asked the held touch to stop (did not wait it out)
    assert touching.done() and touching.exception() is None and saver._touching is None
    by_touch = rec.touched_by("fqnckpt-pretouch")
    assert len(by_touch) == 3 < 14 + 14 + 5
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert {c[1] for c in by_touch} == {min(19, base + 10)}  # low priority, that thread only
    assert all(_inside(p, n, saver._pool.buffers.values()) for _, _, p, n in by_touch)
    with torch.no_grad():  # written again right after the call: not in the checkpoint
        for v in sd.values():
            v.zero_()
    fut.result(timeout=120)
    ref = tmp_path / "ref"
    checkpoint.save(at_call, ref)
    got = tmp_path / "ck" if owner == "saver" else Path(mgr.path(1))
    if owner == "saver":
        assert _files(got) == _files(ref)  # byte for byte what save writes from the values at the call
    else:  # the manager adds its own index entries: compare the tensors bit for bit
        back = {k: torch.full_like(v, 7) for k, v in at_call.items()}
        checkpoint.load(back, got)
        assert all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in at_call.items())
    # Not all buffers were touched ahead: the save faulted in the rest, and all count as touched now
    assert all(saver._pool.touched(b) for b in saver._pool.buffers.values())


def test_the_touch_stops_at_its_byte_cap_and_the_save_faults_in_the_rest(tmp_path, monkeypatch, small_pieces):
    sd = _state(1)
    rec = _Recorder()
    monkeypatch.setattr(pages, "populate", rec)
    monkeypatch.setattr(am, "_touch_cap", lambda: 2 * PIECE)
    saver = AsyncSaver()
    assert saver.prepare(sd, background=True) == sum(v.numel() * v.element_size() for v in sd.values())
    saver.wait_touched()
    assert [c[3] for c in rec.touched_by("fqnckpt-pretouch")] == [PIECE, PIECE]
    assert not any(saver._pool.touched(b) for b in saver._pool.buffers.values())  # none finished
    saver.save(sd, tmp_path / "ck").result(timeout=120)
    checkpoint.save(sd, tmp_path / "ref")
    assert _files(tmp_path / "ck") == _files(tmp_path / "ref")
    assert all(saver._pool.touched(b) for b in saver._pool.buffers.values())


def test_a_touch_left_running_finishes_undisturbed_and_saves_reuse_its_buffers(tmp_path, monkeypatch, small_pieces):
    sd = _state(2)
    rec = _Recorder()
    monkeypatch.setattr(pages, "populate", rec)
    saver = AsyncSaver()
    saver.prepare(sd, background=True)
    saver.wait_touched()
    by_touch = rec.touched_by("fqnckpt-pretouch")
    assert sum(c[3] for c in by_touch) == sum(v.numel() * v.element_size() for v in sd.values())
    assert len({c[2] for c in by_touch}) == len(by_touch)  # every byte of every buffer, once
    assert all(saver._pool.touched(b) for b in saver._pool.buffers.values())
    ptrs = {k: b.data_ptr() for k, b in saver._pool.buffers.items()}
    rec.calls.clear()
    saver.save(sd, tmp_path / "ck").result(timeout=120)
    assert rec.calls == []  # nothing left to fault in
    assert {k: b.data_ptr() for k, b in saver._pool.buffers.items()} == ptrs
    checkpoint.save(sd, tmp_path / "ref")
    assert _files(tmp_path / "ck") == _files(tmp_path / "ref")


def test_close_ends_the_threads_and_removes_the_hook(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with checkpoint.CheckpointManager(tmp_path / "m", module=model, optimizer=opt, rng_state=False) as mgr:
        saver = mgr._saver
        saver.wait_touched()
        assert mgr._step_hook is not None  # AdamW has no state yet: touched after its first step
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        saver.wait_touched()
        mgr.save(1, model, opt)
        threads = set(saver._executor._threads) | set(saver._toucher._threads)
        assert threads and all(t.is_alive() for t in threads)
    assert not any(t.is_alive() for t in threads)
    assert mgr.steps() == [1]
    with pytest.raises(RuntimeError, match="closed"):
        mgr.save(2, model, opt)
    with pytest.raises(RuntimeError, match="closed"):
        saver.prepare(model, optimizer=opt)
    assert mgr.load_latest(model, opt) == 1  # reading still works; no touch started
    assert saver._touching is None and saver._toucher is None
    mgr.close()  # idempotent

    mgr2 = checkpoint.CheckpointManager(tmp_path / "n", module=model, rng_state=False)
    opt2 = torch.optim.AdamW(model.parameters(), lr=0.1)
    mgr2._prepare_soon(model, opt2)
    assert mgr2._step_hook is not None
    mgr2.close()
    assert mgr2._step_hook is None and not opt2._optimizer_step_post_hooks


def test_a_touch_in_flight_at_exit_is_stopped_not_finished(tmp_path):
    """A manager created just before the script ends: the process exits at once (status 0) with
    the touch stopped at its next piece, not after touching everything."""
    script = f"""
import atexit, importlib, sys, time
import torch, checkpoint
from checkpoint.training import pages
am = importlib.import_module("checkpoint.training.async_save")
am._PIECE = 4096
calls = []
real = pages.populate
pages.populate = lambda b: (calls.append(1), time.sleep(0.01), real(b))
atexit.register(lambda: print("pieces", len(calls), flush=True))
sd = {{"w": torch.zeros(2000 * 1024)}}  # 2000 pieces: 20 s at 10 ms each
mgr = checkpoint.CheckpointManager({str(tmp_path / "m")!r}, module=sd)
while not calls:
    time.sleep(0.01)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert r.returncode == 0, r.stderr
    pieces = int(r.stdout.split("pieces")[-1])
    assert 1 <= pieces < 2000
