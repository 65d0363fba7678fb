"""Two saves of Meta's layout (``consolidated.NN.pth`` + ``params.json``: fixed object names) into
the same URL at once (``memory://`` and moto's S3 server): the one that commits first keeps its
bytes. The other, which finds that save's objects under the names it is uploading, never
replaces them (each upload is conditional on the object being what it read: absent, or the
previous checkpoint's): it is refused with :class:`~checkpoint.errors.ConcurrentSaveError` and
the committed checkpoint reads back whole. A removal of a Meta checkpoint removes its record
first, only if unchanged since read (an overwrite committed meanwhile stays whole), and leaves no
unedited params.json behind (the record holds its digest), so a new save there is not refused."""

from __future__ import annotations

import io
import itertools

import fsspec
import pytest
import torch

from checkpoint.convert.meta_files import write_meta_checkpoint
from checkpoint.errors import ConcurrentSaveError
from checkpoint.storage import objstore
from checkpoint.storage.layout import TensorSpec
from checkpoint.storage.location import resolve

_ids = itertools.count()


def _meta_write(url: str, t: torch.Tensor, params: bytes, overwrite: bool = False) -> None:
    write_meta_checkpoint(resolve(url), [TensorSpec("tok_embeddings.weight", tuple(t.shape), t.dtype)],
                          lambda spec: t, {"params.json": params}, overwrite=overwrite)  # fmt: skip


def _objects(url: str) -> dict[str, bytes]:
    fs, root = fsspec.filesystem("memory"), "/" + url.removeprefix("memory://")
    return {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in fs.find(root)}


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_meta_save_committed_during_another_into_an_empty_url_keeps_its_bytes(monkeypatch, overwrite):
    url = f"memory://breakit-meta-{next(_ids)}/ck"
    mine, theirs = torch.arange(6, dtype=torch.float32), torch.arange(6, dtype=torch.float32) * 10
    real, done = objstore.ObjectStore.open_writer, []

    def open_writer(self, name, size=None, **conditions):  # the other save runs whole as this one starts uploading
        if not done:
            done.append(name)
            _meta_write(url, theirs, b'{"dim": 60}', overwrite=overwrite)
            done.append(_objects(url))
        return real(self, name, size, **conditions)

    monkeypatch.setattr(objstore.ObjectStore, "open_writer", open_writer)
    with pytest.raises(ConcurrentSaveError) as e:
        _meta_write(url, mine, b'{"dim": 6}', overwrite=overwrite)
    assert e.value.path == url
    monkeypatch.undo()
    committed = done[1]
    assert sorted(committed) == [".fqnckpt-record.json", "consolidated.00.pth", "params.json"]
    assert _objects(url) == committed  # not one of its objects replaced
    shard = torch.load(io.BytesIO(committed["consolidated.00.pth"]), weights_only=True)
    assert list(shard) == ["tok_embeddings.weight"] and torch.equal(shard["tok_embeddings.weight"], theirs)
    assert committed["params.json"] == b'{"dim": 60}'


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("moto")
    import fsspec

    from tests.s3_server import make_bucket, start_moto, storage_options

    server, port = start_moto()
    make_bucket(port, "bkmeta")
    opts = storage_options(port)
    yield {"opts": opts, "fs": fsspec.filesystem("s3", **opts)}
    server.stop()


def _s3_write(s3, url: str, t: torch.Tensor, params: bytes, overwrite: bool) -> None:
    write_meta_checkpoint(resolve(url, s3["opts"]), [TensorSpec("tok_embeddings.weight", tuple(t.shape), t.dtype)],
                          lambda spec: t, {"params.json": params}, overwrite=overwrite)  # fmt: skip


def _s3_objects(s3, url: str) -> dict[str, bytes]:
    fs = s3["fs"]
    fs.invalidate_cache()
    return {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in fs.find(url.removeprefix("s3://"))}


@pytest.mark.parametrize("first", [False, True], ids=["empty", "over_a_meta_checkpoint"])
def test_on_s3_a_meta_save_committed_during_another_keeps_its_bytes(s3, monkeypatch, first):
    url = f"s3://bkmeta/ck-{next(_ids)}"
    if first:  # the overwrite replaces a Meta checkpoint's objects of the same names, unchanged since read
        _s3_write(s3, url, torch.zeros(6), b'{"dim": 0}', overwrite=False)
    mine, theirs = torch.arange(6, dtype=torch.float32), torch.arange(6, dtype=torch.float32) * 10
    real, done = objstore.ObjectStore.open_writer, []

    def open_writer(self, name, size=None, **conditions):
        if not done:
            done.append(name)
            # Another save puts its own objects under the same names (its commit marker follows).
            for n, data in _theirs_objects(theirs).items():
                s3["fs"].pipe_file(f"{url.removeprefix('s3://')}/{n}", data)
            done.append(_s3_objects(s3, url))
        return real(self, name, size, **conditions)

    monkeypatch.setattr(objstore.ObjectStore, "open_writer", open_writer)
    with pytest.raises(ConcurrentSaveError):
        _s3_write(s3, url, mine, b'{"dim": 6}', overwrite=True)
    monkeypatch.undo()
    assert _s3_objects(s3, url) == done[1]  # not one of its objects replaced


def _theirs_objects(t: torch.Tensor) -> dict[str, bytes]:
    buf = io.BytesIO()
    torch.save({"tok_embeddings.weight": t}, buf)
    return {"consolidated.00.pth": buf.getvalue(), "params.json": b'{"dim": 60}'}


def test_a_removed_meta_checkpoint_leaves_nothing_and_a_new_one_saves_there(tmp_path):
    from checkpoint.storage.bytestore import LocalStore
    from checkpoint.storage.commit import remove_checkpoint

    for where, store in ((f"memory://breakit-meta-{next(_ids)}/ck", None), (str(tmp_path / "ck"), LocalStore(str(tmp_path / "ck")))):
        _meta_write(where, torch.zeros(6), b'{"dim": 0}')
        remove_checkpoint(store if store is not None else resolve(where))
        left = _objects(where) if store is None else {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()} if (tmp_path / "ck").exists() else {}
        assert left == {}, sorted(left)
        _meta_write(where, torch.ones(6), b'{"dim": 1}')  # not refused for a params.json left behind


def test_a_params_json_edited_after_the_save_stays_on_removal():
    from checkpoint.storage.commit import remove_checkpoint

    url = f"memory://breakit-meta-{next(_ids)}/ck"
    _meta_write(url, torch.zeros(6), b'{"dim": 0}')
    fsspec.filesystem("memory").pipe_file("/" + url.removeprefix("memory://") + "/params.json", b'{"dim": 7}')
    remove_checkpoint(resolve(url))
    assert _objects(url) == {"params.json": b'{"dim": 7}'}  # a user's edit is never removed


def test_a_meta_overwrite_committed_during_a_removal_stays_whole(monkeypatch):
    from checkpoint.storage import commit

    url = f"memory://breakit-meta-{next(_ids)}/ck"
    _meta_write(url, torch.zeros(6), b'{"dim": 0}')
    real, done = commit.removable, []

    def removable(*args, **kwargs):  # the removal has read the record; an overwrite commits meanwhile
        out = real(*args, **kwargs)
        if not done:
            _meta_write(url, torch.ones(6), b'{"dim": 1}', overwrite=True)
            done.append(_objects(url))
        return out

    monkeypatch.setattr(commit, "removable", removable)
    with pytest.raises(ConcurrentSaveError):
        commit.remove_checkpoint(resolve(url))
    monkeypatch.undo()
    assert sorted(done[0]) == [".fqnckpt-record.json", "consolidated.00.pth", "params.json"]
    assert _objects(url) == done[0]
