"""Exact resume through :class:`checkpoint.CheckpointManager`: a model with dropout trains with
AdamW and an LR scheduler on batches drawn from torch's global RNG; the manager saves (async) at
step K with the scheduler, step and RNG state in ``extra_state``. A fresh process resumes with
``load_latest``: the losses of the remaining steps are bit-identical to an uninterrupted run's.
Both runs are spawned processes (the shared ``run_ranks`` harness, one rank); 2 ranks -> 4 ranks
is in tests/test_training_ranks.py."""

from __future__ import annotations

import pytest
import torch

from checkpoint import CheckpointManager
from checkpoint.ranks.launch import run_ranks

STEPS, K = 8, 3


def _setup(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 3)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=STEPS)
    return model, opt, sched


def _train(rank, world, root, resume: bool):
    """Train steps 0..STEPS-1 (saving at K), or resume after K; returns {step: loss bytes}."""
    model, opt, sched = _setup(seed=1 if resume else 0)
    mgr = CheckpointManager(root, keep_latest=1)
    state = {"step": -1, "rng": torch.get_rng_state(), "sched": sched}
    first = 0
    if resume:
        loaded = mgr.load_latest(model, opt, state)
        assert loaded == K == state["step"]
        torch.set_rng_state(state["rng"])
        first = state["step"] + 1
    losses = {}
    for step in range(first, STEPS):
        x = torch.randn(16, 12)  # data from the global RNG too
        y = torch.randint(0, 3, (16,))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses[step] = loss.detach().reshape(1).view(torch.uint8).tolist()  # exact bits
        if step == K and not resume:
            mgr.save(step, model, opt, {"step": step, "rng": torch.get_rng_state(), "sched": sched})
    mgr.wait()
    return losses


@pytest.mark.slow
def test_resume_in_a_fresh_process_is_bit_identical(tmp_path):
    (full,) = run_ranks(_train, 1, str(tmp_path), False, backend="gloo", timeout=180)
    (resumed,) = run_ranks(_train, 1, str(tmp_path), True, backend="gloo", timeout=180)
    assert sorted(resumed) == list(range(K + 1, STEPS))
    assert {s: full[s] for s in resumed} == resumed
    assert len({bytes(v) for v in full.values()}) == STEPS  # the losses do change step to step
