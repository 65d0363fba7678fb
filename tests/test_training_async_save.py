"""``checkpoint.async_save``: the snapshot is taken at the call (values changed right after are not
saved), the files are byte-identical to ``save``'s, write errors come out of ``result()``,
staging buffers are reused, and on 2 ranks the background collectives do not interleave with the
training loop's (which keeps running all_reduce on the default group meanwhile)."""

from __future__ import annotations

import os

import pytest
import torch

import checkpoint
from checkpoint import CheckpointExistsError
from checkpoint.ranks.launch import run_ranks
from checkpoint.training.async_save import AsyncSaver


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _trained():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    return model, opt


def _files(path):
    return {n: (path / n).read_bytes() for n in sorted(os.listdir(path))}


def test_values_changed_after_the_call_are_not_saved(tmp_path):
    model, opt = _trained()
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
    fresh = _model(1)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    target = {"step": None, "rng": None}
    checkpoint.load(fresh, tmp_path / "ck", optimizer=opt2, extra_state=target)
    assert all(torch.equal(v, old[k]) for k, v in fresh.state_dict().items())
    assert torch.equal(opt2.state[fresh[0].weight]["exp_avg"], old_avg)
    assert target["step"] == 1 and torch.equal(target["rng"], rng_before)


def test_files_are_byte_identical_to_save(tmp_path):
    model, opt = _trained()
    extra = {"step": 7, "lr": [0.1, float("nan")]}
    checkpoint.save(model, tmp_path / "sync", optimizer=opt, extra_state=extra, max_shard_size=1000)
    fut = checkpoint.async_save(model, tmp_path / "async", optimizer=opt, extra_state=extra, max_shard_size=1000)
    fut.result()
    sync, asyn = _files(tmp_path / "sync"), _files(tmp_path / "async")
    assert len([n for n in sync if n.startswith("model-")]) > 1  # several shard files
    assert sync == asyn
    assert checkpoint.verify(tmp_path / "async").ok


def test_write_errors_come_out_of_result_and_bad_input_fails_at_once(tmp_path):
    model, _ = _trained()
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
    assert sorted(os.listdir(tmp_path)) == [".ck.fqnckpt-lock", "ck"]


def test_staging_buffers_are_reused_and_back_to_back_saves_keep_their_values(tmp_path):
    saver = AsyncSaver()
    model, opt = _trained()
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
        got = _model(1)
        checkpoint.load(got, path)
        assert all(torch.equal(v, want[k]) for k, v in got.state_dict().items())


# -- 2 ranks ------------------------------------------------------------------------------------


def _full(step: int):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(8, 6, generator=g), "norm": torch.randn(6, generator=g), "head": torch.randn(4, 6, generator=g)}


def _rank_async(rank, world, root):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    full = _full(0)
    sd = {
        "w": DTensor.from_local(full["w"].chunk(world, 0)[rank].clone(), mesh, [Shard(0)], run_check=False),
        "norm": DTensor.from_local(full["norm"].clone(), mesh, [Replicate()], run_check=False),
        "head": DTensor.from_local(full["head"].chunk(world, 1)[rank].clone(), mesh, [Shard(1)], run_check=False),
    }
    saver = AsyncSaver()
    fut = saver.save(sd, os.path.join(root, "ck"), extra_state={"step": 5, "rank": rank})
    # Training goes on: parameters change in place, collectives run on the default group.
    sums = []
    for i in range(20):
        with torch.no_grad():
            for t in sd.values():
                t.to_local().add_(1)
        x = torch.tensor([float(rank + i)])
        dist.all_reduce(x)
        sums.append(x.item())
    index = fut.result(timeout=120)
    staged = fut.staging_bytes
    fut2 = saver.save(sd, os.path.join(root, "ck2"))  # second save: the background group is reused
    fut2.result(timeout=120)
    return {"sums": sums, "files": sorted(index.files()), "staged": staged}


@pytest.mark.slow
def test_two_ranks_async_save_old_values_and_independent_collectives(tmp_path):
    out = run_ranks(_rank_async, 2, str(tmp_path), backend="gloo", timeout=180)
    assert [o["sums"] for o in out] == [[float(2 * i + 1) for i in range(20)]] * 2
    # Each rank stages only its bytes: its shards, and the replicated norm on rank 0 only.
    assert out[0]["staged"] == (4 * 6 + 6 + 4 * 3) * 4 and out[1]["staged"] == (4 * 6 + 4 * 3) * 4
    full = _full(0)
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    extra = {"step": None, "rank": None}
    checkpoint.load(target, tmp_path / "ck", extra_state=extra)
    assert all(torch.equal(target[k], full[k]) for k in full)
    assert extra == {"step": 5, "rank": 0}  # rank 0's extra state
    checkpoint.load(target, tmp_path / "ck2")
    for t in full.values():
        for _ in range(20):
            t.add_(1)  # as the ranks did
    assert all(torch.equal(target[k], full[k]) for k in full)
    assert checkpoint.verify(tmp_path / "ck").ok and checkpoint.verify(tmp_path / "ck2").ok
