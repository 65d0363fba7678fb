"""Commit protocol (checkpoint.storage.local_commit): a SIGKILL at every fault point leaves the old or the new
checkpoint, whole, never a mix; user files beside the shards survive; nothing but the checkpoint
remains after the next save."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
import torch

import checkpoint
from checkpoint import open_checkpoint
from checkpoint.testing.faults import POINTS
from checkpoint.cli.main import main as cli_main
from checkpoint.storage.bytestore import LocalStore
from checkpoint.storage.commit import leftovers
from tests.snapshot import dir_snapshot as snapshot

OLD = {f"t{i}": torch.full((64,), float(i)) for i in range(4)}
NEW = {f"t{i}": torch.full((64,), 100.0 + i) for i in range(4)}
# OLD in 2 shards, NEW in 4: the new save has other shard names, so the old ones are stale.
OLD_SHARD, NEW_SHARD = 600, 300
OLD_FILES = [
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
]
NEW_FILES = [f"model-0000{k}-of-00004.safetensors" for k in range(1, 5)] + ["model.safetensors.index.json"]
USER = {"config.json": b'{"model_type": "x"}', "tokenizer/vocab.txt": b"a\nb\n"}
# Before the commit point the old checkpoint is visible; from it on, the new one.
NEW_FROM = {"after_commit_rename", "after_first_move", "before_cleanup"}


def _killed_save(path, point, sd=NEW):
    """Fork a child that saves with ``FQNCKPT_FAULT_POINT=point``; returns the child's wait status."""
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.environ["FQNCKPT_FAULT_POINT"] = point
            checkpoint.save(sd, path, overwrite=True, max_shard_size=NEW_SHARD)
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


def _add_user_files(path):
    for rel, data in USER.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)


def _visible(path):
    """Names in the checkpoint directory that are not fqnckpt's hidden work entries."""
    return sorted(n for n in os.listdir(path) if not n.startswith("."))


@pytest.mark.parametrize("point", POINTS)
def test_kill_at_every_point_leaves_old_or_new(tmp_path, point, capsys):
    path = tmp_path / "ck"
    checkpoint.save(OLD, path, max_shard_size=OLD_SHARD)
    _add_user_files(path)
    status = _killed_save(path, point)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, point
    if point in NEW_FROM:  # decided, interrupted while moving files in: readers refuse and write nothing
        before = snapshot(tmp_path)
        with pytest.raises(checkpoint.InterruptedCommitError, match="fqnckpt recover"):
            _content(path)
        with pytest.raises(checkpoint.InterruptedCommitError):
            checkpoint.verify(path)
        assert cli_main(["verify", str(path)]) == 2
        assert snapshot(tmp_path) == before
        assert cli_main(["recover", str(path)]) == 0  # a writer completes it
    got = _content(path)
    want, files = (NEW, NEW_FILES) if point in NEW_FROM else (OLD, OLD_FILES)
    assert _is(got, want), point
    assert checkpoint.verify(path).ok, point
    assert {rel: (path / rel).read_bytes() for rel in USER} == USER
    assert _visible(path) == sorted(files + ["config.json", "tokenizer"])
    # inspect lists the killed save's staging directory (the same leftovers() as object storage)
    staged = point not in ("after_lock", *NEW_FROM)
    assert len(leftovers(LocalStore(str(path)))["staging"]) == staged, point
    capsys.readouterr()
    assert cli_main(["inspect", str(path), "--json"]) == 0
    assert ("leftovers" in json.loads(capsys.readouterr().out)) == staged, point
    # Leftovers carry hidden names, are never a checkpoint, and the next save removes them.
    checkpoint.save(NEW, path, overwrite=True, max_shard_size=NEW_SHARD)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert sorted(os.listdir(path)) == sorted(NEW_FILES + ["config.json", "tokenizer"])


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

    def run(w, sd):
        try:
            for _ in range(3):
                checkpoint.save(sd, path, overwrite=True, max_shard_size=20000 * (1 + w % 2))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(w, sd)) for w, sd in enumerate(sds)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)  # a hung save would otherwise pass unnoticed
    assert errors == []
    got = _content(path)
    assert any(_is(got, sd) for sd in sds) and checkpoint.verify(path).ok
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    with open_checkpoint(path) as r:  # exactly the files of the last save: no stale shard
        assert sorted(os.listdir(path)) == sorted(r.files + ["model.safetensors.index.json"])
