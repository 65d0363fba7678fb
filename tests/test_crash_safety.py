"""Crash safety of a save: SIGKILLed at every kind of fault point, in 1 process and on 2 gloo
ranks, over a previous checkpoint and over a new path; disk full; concurrent saves. After each,
the path loads as exactly the old or the new values, or "no checkpoint" for a new path, and the
next save leaves no leftovers. Kills come from fault points the save reaches, never from a timer,
so every trial exercises the same step on every machine (``tests/bench/reliability_report.py``
adds kills after random delays). Trial logic lives in ``tests/crash_worker.py``.
"""

from __future__ import annotations

import collections
import errno
import os
import sys

import crash_worker as cw
import pytest
import torch

import checkpoint
from checkpoint import CheckpointWriteError
from checkpoint.testing.faults import POINTS

# The trial driver reads /proc and makes the worker a child subreaper (prctl): Linux only.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="Linux /proc and prctl")]


@pytest.fixture(scope="module")
def zygote():
    with cw.Zygote() as z:
        yield z


def _report(t: cw.Tally) -> str:
    return "\n".join(t.failures[:10])


def _run(z, root, mode, kinds):
    """Run ``kinds`` = [(kill, seed, fault point), ...]; returns (tally, {kill: outcomes}, kills by kind)."""
    t = cw.Tally()
    outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    kills = collections.Counter()
    for kill, seed, point in kinds:
        before = t.killed
        outcomes[kill][cw.crash_trial(z, root, seed, mode, kill, t, point=point)] += 1
        kills[kill] += t.killed - before
    return t, outcomes, kills


def _assert_clean(t: cw.Tally) -> None:
    assert t.failures == [], _report(t)  # each failure names its seed: rerun crash_trial with it
    assert (t.wrong_silently, t.partial_visible, t.leftovers) == (0, 0, 0)
    assert t.loaded_old + t.loaded_new + t.rejected_right == t.tried


def test_single_process_kills(zygote, tmp_path):
    # Every fault point, over a previous checkpoint and (where reachable) over a new path.
    kinds = [("fault", 200 + 2 * i + o, p) for i, p in enumerate(POINTS) for o in (0, 1)]
    t, outcomes, kills = _run(zygote, tmp_path, "single", kinds)
    _assert_clean(t)
    assert kills["fault"] == t.tried == 2 * len(POINTS), (kills, outcomes)  # every fault point kills
    # Kills landed on both sides of the commit, over old checkpoints and new paths.
    assert outcomes["fault"]["old"] > 0 and outcomes["fault"]["new"] > 0 and outcomes["fault"]["absent"] > 0
    assert t.loaded_old > 0 and t.loaded_new > 0 and t.rejected_right > 0


def test_two_rank_kills(zygote, tmp_path):
    points = ["after_lock", "after_file_create", "after_tensor_write", "before_file_fsync", "after_file_fsync",
              "before_index_write", "after_staging_fsync", "after_first_move", "after_commit_rename",
              "before_cleanup"]  # fmt: skip
    kinds = [("fault", 300 + i, p) for i, p in enumerate(points)]
    t, outcomes, kills = _run(zygote, tmp_path, "ranks", kinds)
    _assert_clean(t)
    assert kills["fault"] == t.tried == 10, (kills, outcomes)
    assert outcomes["fault"]["old"] + outcomes["fault"]["absent"] > 0 and outcomes["fault"]["new"] > 0


def test_two_rank_disk_full_and_concurrent_saves(zygote, tmp_path):
    t = cw.Tally()
    cw.disk_full_trial(zygote, tmp_path, 5, "ranks", 3000, t)  # ENOSPC on rank 1 mid-data
    for seed in range(6):
        cw.concurrent_trial(zygote, tmp_path, seed, t, kill_one=seed % 2 == 1)
    assert t.failures == [], _report(t)
    assert t.rejected_right == 1 and t.loaded_old >= 1 and t.tried == 7 and t.leftovers == 0


def _fail_writes_after(monkeypatch, budget):
    real_pwrite, real_write = os.pwrite, os.write
    left = [budget]

    def take(n):
        if left[0] < n:
            raise OSError(errno.ENOSPC, "No space left on device")
        left[0] -= n

    monkeypatch.setattr(os, "pwrite", lambda fd, data, off: (take(len(data)), real_pwrite(fd, data, off))[1])
    monkeypatch.setattr(os, "write", lambda fd, data: (take(len(data)), real_write(fd, data))[1])


def test_disk_full_single_process(tmp_path, monkeypatch):
    old, new = cw.values("old", 7, "single"), cw.values("new", 7, "single")
    path = tmp_path / "ck"
    idx = checkpoint.save(old, path, max_shard_size=cw.SINGLE_SHARD_BYTES)
    files = {p: (path / p).read_bytes() for p in os.listdir(path)}
    shard_bytes = sum(len(files[f]) for f in idx.files())
    # Fail in the first header, in the middle of the data, on the last data byte, in the index.
    budgets = {"header": 10, "data": shard_bytes // 2, "last byte": shard_bytes - 1, "index": shard_bytes}
    for where, budget in budgets.items():
        _fail_writes_after(monkeypatch, budget)
        with pytest.raises(CheckpointWriteError) as ei:
            checkpoint.save(new, path, overwrite=True, max_shard_size=cw.SINGLE_SHARD_BYTES)
        monkeypatch.undo()
        assert isinstance(ei.value, OSError) and str(path) in str(ei.value), where
        assert "No space left" in str(ei.value), where
        assert {p: (path / p).read_bytes() for p in os.listdir(path)} == files, where
    # posix_fallocate reports the full disk before any byte is written.
    monkeypatch.setattr(os, "posix_fallocate", _enospc)
    with pytest.raises(CheckpointWriteError, match="No space left"):
        checkpoint.save(new, path, overwrite=True, max_shard_size=cw.SINGLE_SHARD_BYTES)
    monkeypatch.undo()
    target = {k: torch.zeros_like(v) for k, v in old.items()}
    checkpoint.load(target, path, verify=True)
    assert all(torch.equal(target[k], old[k]) for k in old)
    checkpoint.save(new, path, overwrite=True, max_shard_size=cw.SINGLE_SHARD_BYTES)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    checkpoint.load(target, path)
    assert all(torch.equal(target[k], new[k]) for k in new)


def _enospc(*a):
    raise OSError(errno.ENOSPC, "No space left on device")
