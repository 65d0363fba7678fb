"""``checkpoint.async_save``: the snapshot is taken at the call (values changed right after are not
saved), the files are byte-identical to ``save``'s, write errors come out of ``result()``,
and staging buffers are reused (2 ranks: tests/test_training_ranks.py)."""

from __future__ import annotations

import importlib
import os
import threading
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint import CheckpointExistsError
from checkpoint.training.async_save import AsyncSaver
from tests.helpers import pools_idle, tiny_model, trained

MLP = (16, 32, 4)  # Linear, ReLU, Linear: keys 0.* and 2.*

ROOT = Path(__file__).resolve().parents[1]


def _files(path):
    return {n: (path / n).read_bytes() for n in sorted(os.listdir(path))}


def test_values_changed_after_the_call_are_not_saved(tmp_path):
    model, opt = trained(tiny_model(*MLP, relu=True), lr=0.1)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    old_avg = opt.state[model[0].weight]["exp_avg"].clone()
    counter = {"step": 1, "rng": torch.get_rng_state()}
    rng_before = counter["rng"].clone()
    fut = checkpoint.async_save(model, tmp_path / "ck", optimizer=opt, extra_state=counter)
    with torch.no_grad():  # the training loop goes on at once
        for p in model.parameters():
            p.mul_(-3).add_(1)
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    counter["step"] = 2
    counter["rng"].zero_()
    fut.result(timeout=120)
    assert fut.done() and fut.exception() is None
    fresh = tiny_model(*MLP, seed=1, relu=True)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    target = {"step": None, "rng": None}
    checkpoint.load(fresh, tmp_path / "ck", optimizer=opt2, extra_state=target)
    assert all(torch.equal(v, old[k]) for k, v in fresh.state_dict().items())
    assert torch.equal(opt2.state[fresh[0].weight]["exp_avg"], old_avg)
    assert target["step"] == 1 and torch.equal(target["rng"], rng_before)


def test_files_are_byte_identical_to_save(tmp_path):
    model, opt = trained(tiny_model(*MLP, relu=True), lr=0.1)
    extra = {"step": 7, "lr": [0.1, float("nan")]}
    checkpoint.save(model, tmp_path / "sync", optimizer=opt, extra_state=extra, max_shard_size=1000)
    fut = checkpoint.async_save(
        model, tmp_path / "async", optimizer=opt, extra_state=extra, max_shard_size=1000
    )
    fut.result()
    sync, asyn = _files(tmp_path / "sync"), _files(tmp_path / "async")
    assert len([n for n in sync if n.startswith("model-")]) > 1  # several shard files
    assert sync == asyn
    assert checkpoint.verify(tmp_path / "async").ok


def test_write_errors_come_out_of_result_and_bad_input_fails_at_once(tmp_path):
    model, _ = trained(tiny_model(*MLP, relu=True), lr=0.1)
    checkpoint.save(model, tmp_path / "ck")
    before = _files(tmp_path / "ck")
    fut = checkpoint.async_save(model, tmp_path / "ck")
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        fut.result()
    assert isinstance(fut.exception(), CheckpointExistsError)
    assert _files(tmp_path / "ck") == before
    with pytest.raises(TypeError, match="'a'"):
        checkpoint.async_save({"a": 1.0}, tmp_path / "other")
    with pytest.raises(ValueError, match="max_shard_size"):
        checkpoint.async_save(model, tmp_path / "other", max_shard_size="lots")
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_staging_buffers_are_reused_and_back_to_back_saves_keep_their_values(tmp_path):
    saver = AsyncSaver()
    model, opt = trained(tiny_model(*MLP, relu=True), lr=0.1)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    f1 = saver.save(model, tmp_path / "a", optimizer=opt)
    ptrs = {k: b.data_ptr() for k, b in saver._pool.buffers.items()}
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    opt_bytes = sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
    )
    assert f1.staging_bytes == saver.staging_bytes == model_bytes + opt_bytes
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    second = {k: v.clone() for k, v in model.state_dict().items()}
    f2 = saver.save(model, tmp_path / "b", optimizer=opt)  # waits for f1, then reuses its buffers
    assert f1.done()
    assert {k: b.data_ptr() for k, b in saver._pool.buffers.items()} == ptrs
    f2.result()
    for path, want in ((tmp_path / "a", first), (tmp_path / "b", second)):
        got = tiny_model(*MLP, seed=1, relu=True)
        checkpoint.load(got, path)
        assert all(torch.equal(v, want[k]) for k, v in got.state_dict().items())


def test_prepare_allocates_and_touches_the_buffers_the_first_save_then_reuses(tmp_path):
    saver = AsyncSaver()
    model, opt = trained(tiny_model(*MLP, relu=True), lr=0.1)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match="'a'"):
        saver.prepare({"a": 1.0})
    assert saver.staging_bytes == 0
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    assert saver.prepare(model, optimizer=opt) == saver.staging_bytes == nbytes
    sources = {("model", k): v for k, v in model.state_dict().items()}
    assert all(torch.equal(saver._pool.buffers[k], v) for k, v in sources.items())  # written, not only reserved
    assert os.listdir(tmp_path) == []  # nothing written
    ptrs = {k: b.data_ptr() for k, b in saver._pool.buffers.items()}
    saver.save(model, tmp_path / "a", optimizer=opt).result()
    assert {k: b.data_ptr() for k, b in saver._pool.buffers.items()} == ptrs  # the first save allocated nothing
    got = tiny_model(*MLP, seed=1, relu=True)
    checkpoint.load(got, tmp_path / "a")
    assert all(torch.equal(v, want[k]) for k, v in got.state_dict().items())
    mgr = checkpoint.CheckpointManager(tmp_path / "m")
    assert mgr.prepare(model, opt) == mgr.staging_bytes == nbytes
    assert checkpoint.CheckpointManager(tmp_path / "s", async_save=False).prepare(model, opt) == 0


def test_background_prepare_touches_fresh_buffers_on_the_touch_thread(tmp_path, monkeypatch):
    from checkpoint.training import pages

    saver = AsyncSaver()
    model, opt = trained(tiny_model(*MLP, relu=True), lr=0.1)
    touched_on = []
    real = pages.populate
    monkeypatch.setattr(pages, "populate", lambda b: touched_on.append(threading.current_thread().name) or real(b))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    nbytes = saver.prepare(model, optimizer=opt, background=True)
    saver.wait_touched()
    assert nbytes == saver.staging_bytes > 0 and len(touched_on) == len(saver._pool.buffers)
    assert set(touched_on) == {n for n in touched_on if n.startswith("fqnckpt-pretouch")}
    assert all(saver._pool.touched(b) for b in saver._pool.buffers.values())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # sources untouched
    ptrs = {k: b.data_ptr() for k, b in saver._pool.buffers.items()}
    touched_on.clear()
    saver.prepare(model, optimizer=opt, background=True)  # already touched: nothing to do
    saver.save(model, tmp_path / "a", optimizer=opt).result()
    assert touched_on == [] and {k: b.data_ptr() for k, b in saver._pool.buffers.items()} == ptrs
    got = tiny_model(*MLP, seed=1, relu=True)
    checkpoint.load(got, tmp_path / "a")
    assert all(torch.equal(v, before[k]) for k, v in got.state_dict().items())
    buf = torch.empty(3 * 4096 + 5, dtype=torch.uint8)[1:]  # pages populate; bytes outside kept
    base = buf._base
    base[0] = 7
    real(buf)
    assert base[0] == 7


@pytest.mark.parametrize("start", ["load_latest", "constructor"])
def test_manager_touches_staging_at_start_and_after_the_first_step(tmp_path, start):
    """No prepare by hand: load_latest (nothing to load yet), or the manager given the module and
    optimizer when created, touches the model's staging in the background; AdamW's state, made by
    its first step, is touched after that step."""
    model = tiny_model(*MLP, relu=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    if start == "constructor":
        mgr = checkpoint.CheckpointManager(tmp_path / "m", module=model, optimizer=opt)
    else:
        mgr = checkpoint.CheckpointManager(tmp_path / "m")
        assert mgr.staging_bytes == 0
        assert mgr.load_latest(model, opt) is None
    mgr._saver.wait_touched()
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert mgr.staging_bytes == model_bytes and mgr._step_hook is not None
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    assert mgr._step_hook is None  # fired once, removed itself
    mgr._saver.wait_touched()
    opt_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    assert mgr.staging_bytes == model_bytes + opt_bytes
    assert all(mgr._saver._pool.touched(b) for b in mgr._saver._pool.buffers.values())
    ptrs = {k: b.data_ptr() for k, b in mgr._saver._pool.buffers.items()}
    mgr.save(1, model, opt)
    mgr.wait()
    assert {k: b.data_ptr() for k, b in mgr._saver._pool.buffers.items()} == ptrs  # none allocated by the save
    want = {k: v.clone() for k, v in model.state_dict().items()}
    got, got_opt = tiny_model(*MLP, seed=1, relu=True), None
    assert checkpoint.CheckpointManager(tmp_path / "m", async_save=False).load_latest(got, got_opt) == 1
    assert all(torch.equal(v, want[k]) for k, v in got.state_dict().items())
    # synchronous saves hold no staging; a state save refuses is refused by the save, not here
    assert checkpoint.CheckpointManager(tmp_path / "s", async_save=False, module=model).staging_bytes == 0
    assert checkpoint.CheckpointManager(tmp_path / "t", module={"w": "not a tensor"}).staging_bytes == 0


class _HeldStaging:
    """Hold the background copy of a ``background_staging`` save until ``release()``, so a test
    sees deterministically what happens before the snapshot is staged."""

    def __init__(self, monkeypatch):
        mod = importlib.import_module("checkpoint.training.async_save")  # the module, not the function

        self.gate, original = threading.Event(), mod._stage_deferred

        def held(path, deferred):
            assert self.gate.wait(60)
            original(path, deferred)

        monkeypatch.setattr(mod, "_stage_deferred", held)

    def release(self):
        self.gate.set()


def test_background_staging_holds_the_next_step_and_saves_the_values_at_the_call(tmp_path, monkeypatch):
    held = _HeldStaging(monkeypatch)
    model, opt = trained(tiny_model(*MLP, relu=True), lr=0.1)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    old_avg = opt.state[model[0].weight]["exp_avg"].clone()
    saver = AsyncSaver()
    fut = saver.save(model, tmp_path / "ck", optimizer=opt, background_staging=True)
    assert not fut.staged() and not fut.done()  # the optimizer's tensors are not copied yet
    model(torch.randn(8, 16)).sum().backward()  # forward and backward run meanwhile
    stepped = threading.Event()
    stepper = threading.Thread(target=lambda: (opt.step(), stepped.set()))
    stepper.start()
    assert not stepped.wait(0.5)  # the step pre-hook holds optimizer.step()
    assert all(torch.equal(v, old[k]) for k, v in model.state_dict().items())
    held.release()
    stepper.join(60)
    assert stepped.is_set() and fut.wait_staged(60)
    fut.result(timeout=120)
    assert not torch.equal(model[0].weight, old["0.weight"])  # the step ran, after the copy
    fresh = tiny_model(*MLP, seed=1, relu=True)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    checkpoint.load(fresh, tmp_path / "ck", optimizer=opt2)
    assert all(torch.equal(v, old[k]) for k, v in fresh.state_dict().items())
    assert torch.equal(opt2.state[fresh[0].weight]["exp_avg"], old_avg)
    # Same bytes as a synchronous save of those values; staging counts every tensor.
    checkpoint.save(fresh, tmp_path / "sync", optimizer=opt2)
    assert _files(tmp_path / "ck") == _files(tmp_path / "sync")
    assert fut.staging_bytes == saver.staging_bytes


@pytest.mark.parametrize("how", ["param", "optimizer_state"])
def test_write_before_staged_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, how):
    model, opt = trained(tiny_model(*MLP, relu=True), lr=0.1)
    checkpoint.save(model, tmp_path / "ck", optimizer=opt)
    before = _files(tmp_path / "ck")
    held = _HeldStaging(monkeypatch)
    fut = AsyncSaver().save(model, tmp_path / "ck", optimizer=opt, overwrite=True, background_staging=True)
    with torch.no_grad():  # breaks the contract: written by other means than optimizer.step()
        if how == "param":
            model[2].bias.mul_(2)
        else:
            opt.state[model[0].weight]["exp_avg_sq"].zero_()
    held.release()
    with pytest.raises(checkpoint.SnapshotChangedError) as e:
        fut.result(timeout=120)
    want = "2.bias" if how == "param" else "optimizer state"
    assert want in str(e.value) and "wait_staged" in str(e.value)
    assert _files(tmp_path / "ck") == before
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_background_staging_without_optimizer_stages_in_the_call(tmp_path):
    model, _ = trained(tiny_model(*MLP, relu=True), lr=0.1)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    fut = AsyncSaver().save(model, tmp_path / "ck", background_staging=True)
    assert fut.staged()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    fut.result(timeout=120)
    got = tiny_model(*MLP, seed=1, relu=True)
    checkpoint.load(got, tmp_path / "ck")
    assert all(torch.equal(v, old[k]) for k, v in got.state_dict().items())


_AT_EXIT = r'''
import os, sys, torch, checkpoint
root, mode = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
m = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
opt = torch.optim.Adam(m.parameters()); m(torch.randn(2, 256)).sum().backward(); opt.step()
torch.save({k: v.clone() for k, v in m.state_dict().items()}, os.path.join(root, "want.pt"))
mgr = checkpoint.CheckpointManager(os.path.join(root, "mgr"))
mgr.save(1, m, opt, {"step": 1})        # in flight at exit: must commit
os.makedirs(os.path.join(root, "taken"))
open(os.path.join(root, "taken", "model.safetensors.index.json"), "w").close()  # a checkpoint there
fut = checkpoint.async_save(m, os.path.join(root, "taken"))  # fails: a checkpoint exists
if mode == "seen":
    try:
        fut.result()
    except checkpoint.CheckpointExistsError:
        print("caller saw it")
    checkpoint.async_save(m, os.path.join(root, "final"))    # in flight at exit: must commit
print("end of script")
'''


@pytest.mark.parametrize("mode", ["unseen", "seen"])
def test_saves_in_flight_at_exit_commit_and_an_unseen_failure_fails_the_process(tmp_path, mode):
    """A script that ends without wait(): every save in flight commits before the process ends; a
    failure the caller never saw is printed on stderr and makes the exit status 1 (a failure it
    saw through result() does not)."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", _AT_EXIT, str(tmp_path), mode], capture_output=True, text=True,
                       timeout=300, env=env)  # fmt: skip
    assert "end of script" in p.stdout
    want = torch.load(tmp_path / "want.pt")
    got = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    assert checkpoint.CheckpointManager(tmp_path / "mgr").load_latest(got) == 1
    assert all(torch.equal(v, want[k]) for k, v in got.state_dict().items())
    assert sorted(os.listdir(tmp_path / "taken")) == ["model.safetensors.index.json"]  # the failed save wrote nothing there
    if mode == "unseen":
        assert p.returncode == 1, p.stderr
        line = [ln for ln in p.stderr.splitlines() if ln.startswith("fqnckpt: async save")]
        assert line and str(tmp_path / "taken") in line[0] and "CheckpointExistsError" in line[0]
    else:
        assert p.returncode == 0 and "caller saw it" in p.stdout and "fqnckpt:" not in p.stderr, p.stderr
        final = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
        checkpoint.load(final, tmp_path / "final")
        assert all(torch.equal(v, want[k]) for k, v in final.state_dict().items())


def _overlapping(monkeypatch, target, during):
    """Patch the background copy: ``target``'s copy is cut in two and ``during(src)`` runs
    between the halves (a write overlapping the copy, deterministic)."""
    mod = importlib.import_module("checkpoint.training.async_save")  # the module, not the function
    real = mod._copy

    def copy(dst, src):
        if src.data_ptr() != target.data_ptr() or threading.current_thread() is threading.main_thread():
            return real(dst, src)
        half = src.numel() // 2
        d, s = dst.view(-1), src.detach().view(-1)
        real(d[:half], s[:half])
        during(src)
        real(d[half:], s[half:])

    monkeypatch.setattr(mod, "_copy", copy)


@pytest.mark.parametrize(
    "write",
    [
        "second_half_running",  # a kernel thread wrote the second half; the first is pending (no bump yet)
        "first_half_running",  # the write runs behind the copy (no bump yet)
        "whole_finished",  # the write finished during the copy (bumps the counter)
        "view_finished",  # through a view of the parameter
        "data_before_copy",  # through .data (never bumps the counter), finished before the copy
    ],
)
def test_write_overlapping_the_background_copy_is_never_committed_torn(tmp_path, monkeypatch, write):
    model, opt = trained(tiny_model(*MLP, relu=True), lr=0.1)
    w = model[0].weight
    at_call = w.detach().clone()
    raw = w.data.view(-1)  # no version bump: a kernel still running
    half = raw.numel() // 2
    def finished(fn):
        def run(src):
            with torch.no_grad():
                fn()

        return run

    actions = {
        "second_half_running": lambda src: raw[half:].add_(1.0),
        "first_half_running": lambda src: raw[:half].add_(1.0),
        "whole_finished": finished(lambda: w.add_(1.0)),
        "view_finished": finished(lambda: w[3:].mul_(2.0)),
        "data_before_copy": None,
    }
    if write == "data_before_copy":
        held = _HeldStaging(monkeypatch)
    else:
        _overlapping(monkeypatch, w, actions[write])
    fut = AsyncSaver().save(model, tmp_path / "ck", optimizer=opt, background_staging=True)
    if write == "data_before_copy":
        w.data.add_(1.0)
        held.release()
    try:
        fut.result(timeout=120)
    except checkpoint.SnapshotChangedError as e:
        assert "0.weight" in str(e)
        assert not (tmp_path / "ck").exists()  # nothing committed
        return
    back = tiny_model(*MLP, seed=1, relu=True)
    checkpoint.load(back, tmp_path / "ck")
    assert torch.equal(back[0].weight, at_call), "a torn or changed tensor was committed"


def test_first_save_faults_fresh_staging_ahead_of_the_copy_piece_by_piece(tmp_path, monkeypatch):
    """The first save (no prepare): fresh staging pages are faulted in on a pool thread one piece
    ahead of the copy, each piece copied only once faulted in; the staged bytes are the sources',
    the buffers count as touched; a copy that fails stops the thread before the call raises."""
    from checkpoint.training import pages

    am = importlib.import_module("checkpoint.training.async_save")
    monkeypatch.setattr(am, "_PIECE", 3 * 4096)
    events, lock = [], threading.Lock()
    real_pop, real_copyto = pages.populate, am.np.copyto

    def pop(b):
        with lock:
            events.append(("pop", b.data_ptr(), threading.current_thread().name))
        real_pop(b)

    def copyto(dst, src):
        with lock:
            events.append(("copy", dst.ctypes.data, threading.current_thread().name))
        real_copyto(dst, src)

    monkeypatch.setattr(pages, "populate", pop)
    monkeypatch.setattr(am.np, "copyto", copyto)
    g = torch.Generator().manual_seed(3)
    sd = {"a": torch.randn(10_000, generator=g), "b": torch.randn(77, 5, generator=g).t(),  # b: not contiguous
          "c": torch.randint(0, 200, (50_001,), generator=g, dtype=torch.uint8)}  # fmt: skip
    saver = AsyncSaver()
    saver.save(sd, tmp_path / "a").result()
    pops = [e for e in events if e[0] == "pop"]
    copies = [e for e in events if e[0] == "copy"]
    assert {e[2] for e in pops} == {"fqnckpt-stage-touch_0"} and {e[2] for e in copies} == {"MainThread"}
    assert len(pops) == len(copies) == -(-40_000 // (3 * 4096)) + -(-50_001 // (3 * 4096))  # a, c piecewise
    for ptr in (e[1] for e in copies):  # each piece copied after it was faulted in
        assert events.index(next(e for e in pops if e[1] == ptr)) < events.index(next(e for e in copies if e[1] == ptr))
    assert all(saver._pool.touched(b) for b in saver._pool.buffers.values())
    assert all(torch.equal(saver._pool.buffers[("model", k)], v) for k, v in sd.items())
    got = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}
    checkpoint.load(got, tmp_path / "a")
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    events.clear()
    saver.save(sd, tmp_path / "b").result()  # buffers touched: plain copies, no thread
    assert [e[0] for e in events] == ["copy", "copy"]

    failed, popped = threading.Event(), []

    def failing(dst, src):
        failed.set()
        raise MemoryError("copy failed")

    def pop_after_first(b):  # pieces after the first are faulted in only once the copy failed
        if popped:
            assert failed.wait(60), "the copy of the first piece never ran"
        popped.append(b)
        pop(b)

    monkeypatch.setattr(am.np, "copyto", failing)
    monkeypatch.setattr(pages, "populate", pop_after_first)
    fresh = AsyncSaver()
    events.clear()
    with pytest.raises(MemoryError, match="copy failed"):
        fresh.save(sd, tmp_path / "c")
    n = len(events)
    pools_idle()  # a touch still going would have touched its remaining pieces by now
    assert len(events) == n < len(pops)  # the thread stopped before the call raised, pieces left
    assert not (tmp_path / "c").exists()
