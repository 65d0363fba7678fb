"""Atomic commit: a SIGKILL at every fault point leaves the old or the new checkpoint, never a mix."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

import checkpoint
from checkpoint import atomic, open_checkpoint
from checkpoint._faults import POINTS

OLD = {f"t{i}": torch.full((64,), float(i)) for i in range(4)}
NEW = {f"t{i}": torch.full((64,), 100.0 + i) for i in range(4)}
SINGLE_POINTS = [p for p in POINTS if p != "after_aside_rename"]


def _killed_save(path, point, exchange=True, sd=NEW):
    """Fork a child that saves with ``FQNCKPT_FAULT_POINT=point``; returns the child's wait status."""
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.environ["FQNCKPT_FAULT_POINT"] = point
            if not exchange:
                atomic._renameat2_exchange = lambda a, b: False
            checkpoint.save(sd, path, overwrite=True, max_shard_size=600)
        except BaseException:  # noqa: BLE001
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def _content(path):
    with open_checkpoint(path) as r:
        return {k: r.get(k) for k in r.keys()}


def _is(sd, other):
    return sorted(sd) == sorted(other) and all(torch.equal(sd[k], other[k]) for k in sd)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "fallback"])
def test_kill_at_every_point_leaves_old_or_new(tmp_path, exchange):
    path = tmp_path / "ck"
    checkpoint.save(OLD, path, max_shard_size=600)
    assert len(os.listdir(path)) == 3  # 2 shards + index
    points = SINGLE_POINTS + ([] if exchange else ["after_aside_rename"])
    seen = set()
    for point in points:
        checkpoint.save(OLD, path, overwrite=True, max_shard_size=600)
        status = _killed_save(path, point, exchange)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, point
        got = _content(path)  # load recovers an interrupted fallback commit
        assert _is(got, OLD) or _is(got, NEW), point
        assert checkpoint.verify(path).ok, point
        seen.add((point, "new" if _is(got, NEW) else "old"))
    # Before the commit rename: old; from the rename on: new.
    assert ("before_commit_rename", "old") in seen and ("after_commit_rename", "new") in seen
    assert ("after_index_write", "old") in seen and ("before_cleanup", "new") in seen
    # Leftovers carry hidden names, are never a checkpoint, and the next save removes them.
    checkpoint.save(NEW, path, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == [".ck.fqnckpt-lock", "ck"]


def test_kill_on_new_path_leaves_nothing(tmp_path):
    for point in ("after_tensor_write", "after_index_write", "before_commit_rename"):
        status = _killed_save(tmp_path / "fresh", point)
        assert os.WIFSIGNALED(status), point
        assert not (tmp_path / "fresh").exists()
        with pytest.raises(checkpoint.CheckpointNotFoundError):
            open_checkpoint(tmp_path / "fresh")
    status = _killed_save(tmp_path / "fresh", "after_commit_rename")
    assert _is(_content(tmp_path / "fresh"), NEW)


def test_concurrent_saves_never_interleave(tmp_path):
    path = tmp_path / "ck"
    sds = [{f"t{i}": torch.full((4096,), float(w)) for i in range(8)} for w in range(4)]
    errors = []

    def run(sd):
        try:
            for _ in range(3):
                checkpoint.save(sd, path, overwrite=True, max_shard_size=20000)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(sd,)) for sd in sds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)  # a hung save would otherwise pass unnoticed
    assert errors == []
    got = _content(path)
    assert any(_is(got, sd) for sd in sds) and checkpoint.verify(path).ok
    assert sorted(os.listdir(tmp_path)) == [".ck.fqnckpt-lock", "ck"]
