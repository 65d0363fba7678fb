"""An overwrite into Meta's layout (``consolidated.NN.pth`` + ``params.json``) on object storage
commits as fqnckpt's layout does there: the previous checkpoint's commit marker (its model index,
or the record of a Meta checkpoint) is removed only if it is still the one the overwrite read, and
a save that committed there meanwhile is never removed, even in part: the overwrite is refused
with :class:`~checkpoint.errors.ConcurrentSaveError` and the other checkpoint stays whole."""

from __future__ import annotations

import itertools

import fsspec
import pytest
import torch

import checkpoint
from checkpoint.convert.meta_files import write_meta_checkpoint
from checkpoint.errors import ConcurrentSaveError
from checkpoint.storage import objstore
from checkpoint.storage.layout import TensorSpec
from checkpoint.storage.location import resolve

_ids = itertools.count()


def _meta_write(url: str) -> None:
    t = torch.arange(6, dtype=torch.float32)
    write_meta_checkpoint(resolve(url), [TensorSpec("tok_embeddings.weight", (6,), torch.float32)],
                          lambda spec: t, {"params.json": b'{"dim": 6}'}, overwrite=True)  # fmt: skip


def _objects(url: str) -> dict[str, bytes]:
    fs, root = fsspec.filesystem("memory"), "/" + url.removeprefix("memory://")
    return {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in fs.find(root)}


def _while_uploading(monkeypatch, action) -> None:
    """Run ``action`` once, when the Meta writer opens its first object for upload."""
    real, done = objstore.ObjectStore.open_writer, []

    def open_writer(self, name, size=None, **conditions):
        if not done:
            done.append(name)
            action()
        return real(self, name, size, **conditions)

    monkeypatch.setattr(objstore.ObjectStore, "open_writer", open_writer)


def test_a_save_committed_during_a_meta_overwrite_stays_whole(monkeypatch):
    url = f"memory://meta-overwrite-{next(_ids)}/ck"
    checkpoint.save({"w": torch.zeros(4)}, url)  # the checkpoint the overwrite replaces
    other = {"w": torch.arange(4.0), "b": torch.ones(2)}
    _while_uploading(monkeypatch, lambda: checkpoint.save(other, url, overwrite=True))
    with pytest.raises(ConcurrentSaveError) as e:
        _meta_write(url)
    assert e.value.path == url
    monkeypatch.undo()
    after = _objects(url)
    assert not any(n.startswith("consolidated.") or n in ("params.json", ".fqnckpt-record.json") for n in after), sorted(after)
    assert checkpoint.verify(url).ok
    with checkpoint.open_checkpoint(url) as ck:
        assert sorted(ck.keys()) == ["b", "w"] and all(torch.equal(ck.get(k), v) for k, v in other.items())


def test_a_meta_overwrite_of_a_meta_checkpoint_replaced_meanwhile_is_refused(monkeypatch):
    url = f"memory://meta-overwrite-{next(_ids)}/ck"
    _meta_write(url)
    # Another writer replaces the record it read (a save of fqnckpt's layout, then a Meta one again).
    before_fs = {}

    def replace() -> None:
        fs, root = fsspec.filesystem("memory"), "/" + url.removeprefix("memory://")
        fs.pipe_file(f"{root}/.fqnckpt-record.json", b'{"format": "fqnckpt-record-1", "objects": ["consolidated.00.pth", "params.json", "x"]}')
        before_fs.update(_objects(url))

    real = objstore.ObjectStore.get_tagged

    def get_tagged(self, name):
        out = real(self, name)
        if name == ".fqnckpt-record.json" and not before_fs:
            replace()
        return out

    monkeypatch.setattr(objstore.ObjectStore, "get_tagged", get_tagged)
    with pytest.raises(ConcurrentSaveError):
        _meta_write(url)
    monkeypatch.undo()
    assert _objects(url) == before_fs  # refused before anything changed


def test_a_local_meta_overwrite_and_removal_wait_for_the_writer_lock(tmp_path, monkeypatch):
    # Locally Meta's layout commits through the same StagedCheckpoint / writer lock as fqnckpt's:
    # with the lock held elsewhere, a non-blocking lock attempt shows that each of them asks for it
    # before touching anything (a blocking one would wait there).
    import fcntl
    import os

    from checkpoint.storage import bytestore
    from checkpoint.storage.bytestore import LocalStore, checkpoint_lock
    from checkpoint.storage.commit import remove_checkpoint

    ck = tmp_path / "ck"
    _meta_write(str(ck))

    def tree() -> dict[str, bytes]:
        return {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    real = fcntl.flock
    monkeypatch.setattr(bytestore.fcntl, "flock", lambda fd, op: real(fd, op | fcntl.LOCK_NB if op == fcntl.LOCK_EX else op))
    with checkpoint_lock(str(ck)):
        before = tree()
        for write in (lambda: _meta_write(str(ck)), lambda: checkpoint.save({"w": torch.ones(2)}, ck, overwrite=True),
                      lambda: remove_checkpoint(LocalStore(str(ck)))):  # fmt: skip
            with pytest.raises(OSError) as e:  # fqnckpt's save names it CheckpointWriteError
                write()
            assert isinstance(e.value, BlockingIOError) or isinstance(e.value.__cause__, BlockingIOError)
            assert tree() == before
    assert sorted(os.listdir(ck)) == [".fqnckpt-record.json", "consolidated.00.pth", "params.json"]
