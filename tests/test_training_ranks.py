"""Training checkpoints on several ranks (gloo), sharing one 2-rank spawn:

- ``async_save`` of DTensors: each rank stages only its bytes, the saved values are those at the
  call although the ranks keep changing them and keep running all_reduce on the default group
  while the background save talks on its own group;
- resume 2 ranks -> 4 ranks through :class:`checkpoint.CheckpointManager`: a model with Shard(0)
  DTensor weights, AdamW and an LR scheduler (in ``extra_state``) saved at step K on 2 ranks
  continues on 4 ranks with the uninterrupted run's losses (fp32; reduction order differs); the
  save stages the optimizer's DTensor shards in the background (``background_staging``) while the
  next step's forward and backward run.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import checkpoint
from checkpoint import CheckpointManager
from checkpoint.ranks.launch import run_ranks
from checkpoint.training.async_save import AsyncSaver

STEPS, K = 8, 3


def _full(step: int):
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(8, 6, generator=g),
        "norm": torch.randn(6, generator=g),
        "head": torch.randn(4, 6, generator=g),
        "count": torch.arange(3) + step,  # plain (same on every rank): one rank writes it
    }


def _rank_async(rank, world, root):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    full = _full(0)
    sd = {
        "w": DTensor.from_local(full["w"].chunk(world, 0)[rank].clone(), mesh, [Shard(0)], run_check=False),
        "norm": DTensor.from_local(full["norm"].clone(), mesh, [Replicate()], run_check=False),
        "head": DTensor.from_local(
            full["head"].chunk(world, 1)[rank].clone(), mesh, [Shard(1)], run_check=False
        ),
        "count": full["count"].clone(),
    }
    saver = AsyncSaver()
    fut = saver.save(sd, os.path.join(root, "ck"), extra_state={"step": 5, "rank": rank})
    # Training goes on: parameters change in place, collectives run on the default group.
    sums = []
    for i in range(20):
        with torch.no_grad():
            for t in sd.values():
                (t.to_local() if isinstance(t, DTensor) else t).add_(1)
        x = torch.tensor([float(rank + i)])
        dist.all_reduce(x)
        sums.append(x.item())
    index = fut.result(timeout=120)
    staged = fut.staging_bytes
    fut2 = saver.save(sd, os.path.join(root, "ck2"))  # second save: the background group is reused
    fut2.result(timeout=120)
    with warnings.catch_warnings(record=True) as caught:  # rank 0's extra_state is the one saved
        warnings.simplefilter("always")
        checkpoint.save(sd, os.path.join(root, "ck3"), extra_state={"rank": rank})
        checkpoint.save(sd, os.path.join(root, "ck4"), extra_state={"same": 1})
    differ = [str(w.message) for w in caught if "extra_state differs" in str(w.message)]
    return {"sums": sums, "files": sorted(index.files()), "staged": staged, "differ": differ}


DIM, HID, BATCH = 8, 16, 8  # HID and BATCH divide by 2 and 4


def _dist_train(rank, world, root, resume: bool):
    """A 2-layer MLP whose weights are Shard(0) DTensors (gathered for compute, gradients
    reduce-scattered), AdamW + LinearLR; each rank takes its rows of the global batch. Saves at
    step K through the manager (async) or resumes from ``load_latest``; returns {step: global loss}."""
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1 if resume else 0)
    full = {
        "w1": torch.randn(HID, DIM) * 0.3,
        "w2": torch.randn(HID, HID) * 0.3,
        "head": torch.randn(3, HID) * 0.3,
    }
    model = torch.nn.Module()
    for k, v in full.items():
        model.register_parameter(k, torch.nn.Parameter(distribute_tensor(v, mesh, [Shard(0)])))
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.3, total_iters=STEPS)
    mgr = CheckpointManager(root, keep_latest=2, background_staging=True)  # step K+1's opt.step waits
    state = {"step": -1, "sched": sched}
    first = 0
    if resume:
        assert mgr.load_latest(model, opt, state) == K == state["step"]
        first = K + 1

    def w(name):  # the full weight for compute; its gradient is summed over ranks into the shards
        return params[name].redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])

    losses = {}
    for step in range(first, STEPS):
        g = torch.Generator().manual_seed(500 + step)
        x, y = torch.randn(BATCH, DIM, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        h = torch.nn.functional.gelu(xs @ w("w1").T)
        h = torch.nn.functional.gelu(h @ w("w2").T)
        loss = torch.nn.functional.cross_entropy(h @ w("head").T, ys, reduction="sum") / BATCH
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        total = loss.detach().clone()
        tdist.all_reduce(total)
        losses[step] = total.item()
        if step == K and not resume:
            mgr.save(step, model, opt, {"step": step, "sched": sched})
    mgr.wait()
    return losses


def _two_rank_main(rank, world, root):
    return {
        "async": _rank_async(rank, world, os.path.join(root, "async")),
        "train": _dist_train(rank, world, os.path.join(root, "train"), False),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    return {"root": root, "ranks": run_ranks(_two_rank_main, 2, str(root), backend="gloo", timeout=300)}


@pytest.mark.slow
def test_two_ranks_async_save_old_values_and_independent_collectives(two_ranks):
    tmp_path, out = two_ranks["root"] / "async", [r["async"] for r in two_ranks["ranks"]]
    assert [o["sums"] for o in out] == [[float(2 * i + 1) for i in range(20)]] * 2
    # Each rank stages only its bytes: its shards; the replicated norm and the plain count (the
    # first slot of the file: int64 sorts first) on rank 0 only.
    assert out[0]["staged"] == (4 * 6 + 6 + 4 * 3) * 4 + 3 * 8 and out[1]["staged"] == (4 * 6 + 4 * 3) * 4
    full = _full(0)
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    extra = {"step": None, "rank": None}
    checkpoint.load(target, tmp_path / "ck", extra_state=extra)
    assert all(torch.equal(target[k], full[k]) for k in full)
    assert extra == {"step": 5, "rank": 0}  # rank 0's extra state
    # ...and saving extra state that differs between ranks says so, on rank 0, once.
    assert len(out[0]["differ"]) == 1 and "ck3" in out[0]["differ"][0] and "ranks [1]" in out[0]["differ"][0]
    assert out[1]["differ"] == []
    checkpoint.load(target, tmp_path / "ck2")
    for t in full.values():
        for _ in range(20):
            t.add_(1)  # as the ranks did
    assert all(torch.equal(target[k], full[k]) for k in full)
    assert checkpoint.verify(tmp_path / "ck").ok and checkpoint.verify(tmp_path / "ck2").ok


@pytest.mark.slow
def test_resume_two_ranks_on_four(two_ranks):
    two = [r["train"] for r in two_ranks["ranks"]]
    four = run_ranks(_dist_train, 4, str(two_ranks["root"] / "train"), True, backend="gloo", timeout=300)
    assert two[0] == two[1] and all(f == four[0] for f in four)
    full, resumed = two[0], four[0]
    assert sorted(resumed) == list(range(K + 1, STEPS))
    # Same global batches and state; only the reduction order of the sums differs (fp32).
    assert max(abs(full[s] - resumed[s]) for s in resumed) < 1e-5, (full, resumed)
    assert abs(full[STEPS - 1] - full[K + 1]) > 1e-3  # the losses do move: resuming wrong would show
