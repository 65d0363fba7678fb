"""Exact resume on any number of ranks, with the parallel module and with FSDP2 in the
same spawns: a 2-rank run with dropout over a shuffled dataset (:class:`ResumableSampler`) saves
through :class:`CheckpointManager` (model, AdamW, LR scheduler, sampler; each rank's RNG states by
default) at step K, trains on (the uninterrupted run), and is killed with SIGKILL; then it resumes
from the step-K checkpoint:

- on 2 ranks, dropout drawn from each rank's own torch RNG: losses bit-identical to the
  uninterrupted run (every rank's RNG state came back to that rank);
- on 1 and 4 ranks, dropout keyed by the global sample index (the masks do not depend on which rank
  sees a sample; the manager re-derives each new rank's RNG states): every epoch sees each sample
  exactly once, and the losses match the uninterrupted run within bf16 tolerance (gradients are
  averaged as FSDP2 does, so only the reduction order differs).
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from checkpoint.ranks.launch import RankFailedError, run_ranks

N, GLOBAL_BATCH, STEPS, K = 24, 8, 8, 4  # 3 steps an epoch; saved mid-epoch 1
P = 0.3  # dropout probability
KINDS = ("pmod", "fsdp2")
TOL = 1e-2  # bf16 tolerance, relative


class Net(torch.nn.Module):
    """Linear -> GELU -> dropout (the mask is an input) -> Linear."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 16)
        self.b = torch.nn.Linear(16, 3)

    def init_weights(self):
        self.a.reset_parameters()
        self.b.reset_parameters()

    def forward(self, x, mask):
        return self.b(torch.nn.functional.gelu(self.a(x)) * mask / (1 - P))


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)


def _sample_masks(idx, epoch):
    return torch.stack(
        [torch.rand(16, generator=torch.Generator().manual_seed(1_000_003 * epoch + int(i))) > P for i in idx]
    ).float()


_CAPTURED: dict = {}


def _build(kind, mesh, world):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from autoparallel import AutoParallel

    torch.manual_seed(7)  # the same initial weights for every world size
    if kind == "fsdp2":
        model = Net()
        fully_shard(model, mesh=mesh)
        return model
    if world not in _CAPTURED:  # one capture a process, a fresh parallel module a training
        with torch.device("meta"):
            model = Net()
        example = (torch.zeros(GLOBAL_BATCH, 6), torch.ones(GLOBAL_BATCH, 16))
        autop = AutoParallel(model, lambda: example, mesh).__enter__()
        autop.add_input_constraints([(Shard(0),), (Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        _CAPTURED[world] = (autop, autop.optimize_placement())
    autop, plan = _CAPTURED[world]
    pmod = autop.apply_placement(plan)
    pmod.to_empty(device="cpu")
    pmod.init_weights()
    return pmod


def _gather(obj, world):
    import torch.distributed as dist

    got = [None] * world
    dist.all_gather_object(got, obj)
    return got


def _run(rank, world, root, kind, mode, dropout, mesh):
    """One training of ``kind``; returns ({step: global mean loss}, {step: (epoch, samples)})."""
    import torch.distributed as dist

    from checkpoint import CheckpointManager, ResumableSampler

    x_all, y_all = _data()
    torch.manual_seed(100 + rank)  # ranks seeded apart: per-rank dropout streams
    model = _build(kind, mesh, world)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    sampler = ResumableSampler(N, seed=11, rank=rank, world_size=world)
    # The loader's own generator: each new DataLoader iterator draws a base seed, which would
    # otherwise come from the global RNG and shift the dropout stream of a resumed run.
    loader = torch.utils.data.DataLoader(
        range(N), batch_size=GLOBAL_BATCH // world, sampler=sampler, generator=torch.Generator()
    )
    mgr = CheckpointManager(os.path.join(root, f"{kind}-{dropout}"), async_save=True)
    state = {"step": -1, "sched": sched, "sampler": sampler}
    step = 0
    if mode == "resume":
        assert mgr.load_latest(model, opt, state) == K
        step = state["step"] + 1
    losses, seen = {}, {}
    while step < STEPS:
        epoch = sampler.epoch
        for idx in sampler.track(loader):
            mask = (torch.rand(len(idx), 16) > P).float() if dropout == "rank" else _sample_masks(idx, epoch)
            loss = torch.nn.functional.cross_entropy(model(x_all[idx], mask), y_all[idx])
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            total = loss.detach() * len(idx)
            dist.all_reduce(total)  # the global batch's mean loss: comparable across world sizes
            losses[step] = (total / GLOBAL_BATCH).item()
            seen[step] = (epoch, sorted(i for part in _gather(idx.tolist(), world) for i in part))
            if step == K and mode == "killed":
                state["step"] = step
                mgr.save(step, model, opt, state)
            step += 1
            if step == STEPS:
                break
    mgr.wait()
    return losses, seen


def _train(rank, world, root, mode, dropouts):
    """mode "killed": all steps, saving at K; rank 0 writes the losses to ``root/uninterrupted.pt``,
    then every rank is SIGKILLed (no exit hook, nothing flushed). "resume": from the latest
    checkpoint to the end; returns the losses."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {(kind, d): _run(rank, world, root, kind, mode, d, mesh) for kind in KINDS for d in dropouts}
    if mode == "killed":
        if rank == 0:
            torch.save(out, os.path.join(root, "uninterrupted.pt"))
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    return out


@pytest.mark.slow
def test_resume_on_2_1_4_ranks_pmod_and_fsdp2(tmp_path):
    root = str(tmp_path)
    with pytest.raises(RankFailedError):
        run_ranks(_train, 2, root, "killed", ("rank", "sample"), backend="gloo", timeout=300)
    full = torch.load(os.path.join(root, "uninterrupted.pt"))
    table = {}
    # Same world size, per-rank torch RNG dropout: bit-identical.
    same = run_ranks(_train, 2, root, "resume", ("rank",), backend="gloo", timeout=300)[0]
    for kind in KINDS:
        f_losses, f_seen = full[(kind, "rank")]
        r_losses, r_seen = same[(kind, "rank")]
        assert sorted(r_losses) == list(range(K + 1, STEPS))
        assert {s: f_losses[s] for s in r_losses} == r_losses, kind  # exact floats
        assert {s: f_seen[s] for s in r_seen} == r_seen
        table[(kind, 2)] = 0.0
    # Other world sizes, sample-keyed dropout: each epoch's samples once; losses within bf16 tolerance.
    for world in (1, 4):
        other = run_ranks(_train, world, root, "resume", ("sample",), backend="gloo", timeout=300)[0]
        for kind in KINDS:
            f_losses, f_seen = full[(kind, "sample")]
            r_losses, r_seen = other[(kind, "sample")]
            assert sorted(r_losses) == list(range(K + 1, STEPS))
            by_epoch: dict[int, list[int]] = {}
            for s in range(STEPS):
                e, idx = f_seen[s] if s <= K else r_seen[s]
                by_epoch.setdefault(e, []).extend(idx)
            assert sorted(by_epoch[0]) == list(range(N))
            assert sorted(by_epoch[1]) == list(range(N)), (kind, world)  # interrupted mid-epoch
            assert len(set(by_epoch[2])) == len(by_epoch[2]) == (STEPS - 6) * GLOBAL_BATCH
            assert sorted(by_epoch[2]) == sorted(i for s in (6, 7) for i in f_seen[s][1])
            rel = max(abs(r_losses[s] - f_losses[s]) / abs(f_losses[s]) for s in r_losses)
            assert rel <= TOL, (kind, world, rel)
            table[(kind, world)] = rel
    print("max relative loss difference vs the uninterrupted 2-rank run:", table)
