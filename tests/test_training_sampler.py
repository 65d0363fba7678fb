"""ResumableSampler: one global order per epoch, resumed on 1, 2 and 4 ranks without a sample lost
or repeated; DataLoader workers' prefetch does not move the saved position."""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from checkpoint.training.sampler import ResumableSampler


def _run(n, world, steps_per_rank, state=None, seed=3, drop_last=False):
    """Every rank's first ``steps_per_rank`` samples (or all of the epoch when None) and rank 0's state."""
    seen, out_state = {}, None
    for r in range(world):
        s = ResumableSampler(n, seed=seed, rank=r, world_size=world, drop_last=drop_last)
        if state is not None:
            s.load_state_dict(state)
        it, got = iter(s), []
        for _ in range(len(s) if steps_per_rank is None else steps_per_rank):
            got.append(next(it))
        seen[r] = got
        if r == 0:
            out_state = s.state_dict()
    return seen, out_state


def test_matches_distributed_sampler_order():
    # the anchor: same permutation and the same rank slices as torch's DistributedSampler
    for world, n in ((1, 12), (2, 12), (4, 10), (4, 12)):
        for r in range(world):
            ours = list(ResumableSampler(n, seed=5, rank=r, world_size=world))
            ref = DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=5)
            assert ours == list(ref)


@pytest.mark.parametrize("after", [1, 2, 4])
def test_resume_other_world_sees_rest_exactly_once(after):
    n = 50  # 40 left after the first 10: no padded tail on 1, 2 or 4 ranks
    first, state = _run(n, 2, 5)  # 2 ranks, 5 samples each, then "killed"
    assert state["consumed"] == 10 and state["epoch"] == 0
    rest, _ = _run(n, after, None, state=state)
    seen = [i for r in first.values() for i in r] + [i for r in rest.values() for i in r]
    assert sorted(seen) == list(range(n))  # every sample once, none twice
    # the continuation is the rest of the same global order
    order = torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist()
    merged = [rest[p % after][p // after] for p in range(n - 10)]
    assert merged == order[10:]


def test_epoch_advances_and_set_epoch_keeps_position():
    s = ResumableSampler(8, seed=1, rank=0, world_size=2)
    e0 = list(s)
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["consumed"] == 0
    e1 = list(s)
    assert e0 != e1
    s2 = ResumableSampler(8, seed=1, rank=0, world_size=2)
    it = iter(s2)
    next(it)
    st = s2.state_dict()
    s3 = ResumableSampler(8, seed=1, rank=0, world_size=2)
    s3.load_state_dict(st)
    s3.set_epoch(0)  # same epoch: position kept
    assert list(s3) == e0[1:]


def test_ragged_tail_pads_or_drops_like_distributed_sampler():
    for drop_last in (False, True):
        for r in range(4):
            ours = list(ResumableSampler(10, seed=0, rank=r, world_size=4, drop_last=drop_last))
            ref = DistributedSampler(range(10), num_replicas=4, rank=r, seed=0, drop_last=drop_last)
            assert ours == list(ref)


def test_load_state_dict_refuses_another_run():
    st = ResumableSampler(8, seed=1, rank=0, world_size=1).state_dict()
    for key, bad in (("seed", 2), ("seed", True), ("num_samples", 9), ("shuffle", False), ("shuffle", 1),
                     ("drop_last", True)):
        s = ResumableSampler(8, seed=1, rank=0, world_size=1)
        before = s.state_dict()
        with pytest.raises(ValueError, match=key):
            s.load_state_dict({**st, key: bad})
        assert s.state_dict() == before
    s = ResumableSampler(8, seed=1, rank=0, world_size=1)
    for bad in ({**st, "consumed": -1}, {**st, "consumed": 99}, {**st, "epoch": "x"}, {**st, "consumed": True}):
        before = s.state_dict()
        with pytest.raises(ValueError):
            s.load_state_dict(bad)
        assert s.state_dict() == before  # a refused state changes nothing


class _Ids(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.tensor(i)


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_track_ignores_prefetch(workers):
    ds = _Ids()
    s = ResumableSampler(ds, seed=7, rank=1, world_size=2)
    loader = DataLoader(ds, batch_size=4, sampler=s, num_workers=workers)
    got = []
    for k, batch in enumerate(s.track(loader)):
        got += batch.tolist()
        if k == 1:
            break  # "killed" after two batches: the workers have prefetched more than that
    state = s.state_dict()
    assert state["consumed"] == 2 * 4 * 2
    s2 = ResumableSampler(ds, seed=7, rank=1, world_size=2)
    s2.load_state_dict(state)
    rest = [i for b in s2.track(DataLoader(ds, batch_size=4, sampler=s2, num_workers=workers)) for i in b.tolist()]
    assert got + rest == list(ResumableSampler(ds, seed=7, rank=1, world_size=2))
    assert s2.state_dict()["epoch"] == 1 and s2.state_dict()["consumed"] == 0
