"""Exact resume by default: ``CheckpointManager.load_latest(model, optimizer=opt)`` with
no ``extra_state`` restores the RNG states ``save`` kept, so the resumed run draws what the
uninterrupted one drew; torchdata's ``StatefulDataLoader`` state carried as extra state resumes
the batch order exactly (oracle: the uninterrupted run)."""

from __future__ import annotations

import random

import pytest
import torch

import checkpoint


def _draws() -> tuple:
    return torch.rand(3).tolist(), random.random()


def test_load_latest_without_extra_state_restores_rng(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = checkpoint.CheckpointManager(tmp_path / "run")
    torch.manual_seed(7)
    random.seed(7)
    mgr.save(1, model, opt, {"step": 1})  # another entry, left unread by a load without extra_state
    want = _draws()
    torch.manual_seed(99)
    random.seed(99)
    assert mgr.load_latest(model, optimizer=opt) == 1
    assert _draws() == want
    assert mgr.last_report.ok
    # rng_state=False: nothing of the generators changes
    torch.manual_seed(5)
    before = torch.get_rng_state()
    checkpoint.CheckpointManager(tmp_path / "run", rng_state=False).load_latest(model, optimizer=opt)
    assert torch.equal(torch.get_rng_state(), before)


def test_load_latest_rng_refused_leaves_model_unchanged(tmp_path):
    """A saved RNG entry that cannot be restored (damaged) is refused before the model changes."""
    import json

    model = torch.nn.Linear(3, 2)
    mgr = checkpoint.CheckpointManager(tmp_path / "run")
    mgr.save(1, model)
    mgr.wait()
    rank_file = next((tmp_path / "run").glob("*/extra_state.rank-*.json"))
    doc = json.loads(rank_file.read_text())
    rank_file.write_text(json.dumps(doc).replace('"torch"', '"torchx"'))
    other = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(Exception):  # noqa: B017 - checksum or RNG mismatch: either is named
        mgr.load_latest(other)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_stateful_dataloader_resumes_exactly(tmp_path):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    data = list(range(40))

    def loader():
        g = torch.Generator().manual_seed(3)
        return sdl.StatefulDataLoader(data, batch_size=4, shuffle=True, generator=g)

    full = [b.tolist() for b in loader()]  # the uninterrupted run
    model = torch.nn.Linear(1, 1)
    mgr = checkpoint.CheckpointManager(tmp_path / "run")
    dl = loader()
    it = iter(dl)
    seen = [next(it).tolist() for _ in range(3)]
    mgr.save(3, model, extra_state={"dataloader": dl})
    dl2 = loader()
    assert mgr.load_latest(model, extra_state={"dataloader": dl2}) == 3
    assert seen + [b.tolist() for b in dl2] == full


def _ddp_rank(rank, world, root):
    """A DDP module saved through the manager on every rank, each rank seeded apart: after a
    load_latest with no extra_state every rank draws what it drew right after the save."""
    import warnings

    warnings.filterwarnings("ignore")
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = checkpoint.CheckpointManager(root)
    torch.manual_seed(100 + rank)
    random.seed(100 + rank)
    mgr.save(1, model, opt)
    want = _draws()
    mgr.wait()
    torch.manual_seed(7)  # every rank alike: a restore of rank 0's states alone would show
    random.seed(7)
    step = mgr.load_latest(model, optimizer=opt)
    return step, _draws() == want, want


def test_plain_module_on_two_ranks_keeps_each_ranks_rng(tmp_path):
    from checkpoint.ranks.launch import run_ranks

    res = run_ranks(_ddp_rank, 2, str(tmp_path / "run"), backend="gloo", timeout=300)
    assert [(step, same) for step, same, _ in res] == [(1, True), (1, True)]
    assert res[0][2] != res[1][2]  # the ranks' streams differ: each got its own back
