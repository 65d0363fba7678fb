"""Exact resume on any number of ranks: FSDP2 training with dropout over a shuffled dataset, saved
by a CheckpointManager, resumed on the same and on other world sizes.

Run from anywhere: ``python examples/resume_any_world_size.py`` (spawns its own gloo ranks on
CPU; writes only to a temporary directory). It

1. trains a small MLP with dropout under FSDP2 (``fully_shard``) on 2 ranks for 9 steps, AdamW and an
   LR schedule; data order from :class:`checkpoint.ResumableSampler` (one seeded permutation per
   epoch, each rank a slice by global position); the manager saves model, optimizer, scheduler,
   sampler and, by default, every rank's RNG states at step 4;
2. resumes from that checkpoint on 2 ranks: same samples, same dropout masks (each rank's RNG
   state came back to it), losses bit-identical to the uninterrupted run;
3. resumes on 1 and 4 ranks: the sampler continues the epoch with exactly the samples not yet
   seen; each new rank gets an RNG stream re-derived from the saved ones (RNGState.reshard), so
   dropout masks differ from the uninterrupted run's and the losses agree only statistically.
   Keying dropout by sample index instead (see tests/test_training_resume_ranks.py) makes them
   agree to float precision on any world size.

Prints one table of losses per step and run.
"""

from __future__ import annotations

import os
import tempfile

import torch

from checkpoint import CheckpointManager, ResumableSampler
from checkpoint.ranks.launch import run_ranks

N, GLOBAL_BATCH, STEPS, SAVE_AT = 48, 8, 9, 4


def train(rank, world, root, resume):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    x_all, y_all = torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)

    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 32), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 3)
    )
    fully_shard(model, mesh=mesh)  # gradients averaged over the ranks
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    torch.manual_seed(1000 + rank)  # ranks seeded apart: their own dropout masks

    sampler = ResumableSampler(N, seed=7)  # rank and world size from torch.distributed
    # generator=: a new DataLoader iterator draws a seed; keep that draw off the global RNG
    loader = torch.utils.data.DataLoader(
        range(N), batch_size=GLOBAL_BATCH // world, sampler=sampler, generator=torch.Generator()
    )
    mgr = CheckpointManager(root, keep_latest=2)  # async saves; RNG states per rank by default
    state = {"step": -1, "sched": sched, "sampler": sampler}
    step = 0
    if resume:
        mgr.load_latest(model, opt, state)  # strict; every check before anything changes
        step = state["step"] + 1
    losses = {}
    while step < STEPS:
        for idx in sampler.track(loader):  # counts what the loop received, not the prefetch
            loss = torch.nn.functional.cross_entropy(model(x_all[idx]), y_all[idx])
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            total = loss.detach() * len(idx)
            dist.all_reduce(total)
            losses[step] = (total / GLOBAL_BATCH).item()
            if step == SAVE_AT and not resume:
                state["step"] = step
                mgr.save(step, model, opt, state)
            step += 1
            if step == STEPS:
                break
    mgr.wait()
    return losses


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "run")
        runs = {"2 ranks, uninterrupted": run_ranks(train, 2, root, False, backend="gloo")[0]}
        for world in (2, 1, 4):
            runs[f"resumed on {world}"] = run_ranks(train, world, root, True, backend="gloo")[0]
    names = list(runs)
    print("step  " + "  ".join(f"{n:>22}" for n in names))
    for s in range(STEPS):
        print(f"{s:>4}  " + "  ".join(f"{runs[n][s]:>22.7f}" if s in runs[n] else f"{'':>22}" for n in names))
    same = all(runs["resumed on 2"][s] == runs[names[0]][s] for s in runs["resumed on 2"])
    print(f"resumed on 2 ranks: {'bit-identical' if same else 'DIFFERENT'} to the uninterrupted run")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
