"""A Meta shard on object storage replaced by one of another size after the listing the copy
sized it by (moto's S3 server, plain and versioned buckets): the copy is exactly the object its
reads are pinned to, whole (sized by that object, not by the listing: a copy cut short, or read
past the new end, was refused naming the private local copy, or as an unsatisfiable range), or
is refused naming the shard, with no local copy left; a shard removed after the listing too."""

from __future__ import annotations

import io
import os

import pytest
import torch

pytest.importorskip("s3fs")
pytest.importorskip("moto")

from checkpoint.convert import catalog  # noqa: E402
from checkpoint.errors import CorruptCheckpointError  # noqa: E402
from checkpoint.storage import objstore  # noqa: E402
from checkpoint.storage.location import resolve  # noqa: E402
from tests.s3_server import plain_and_versioned  # noqa: E402

PLAIN, VERSIONED = "bkmetapin", "bkmetapinv"
SHARD = "consolidated.00.pth"


@pytest.fixture(scope="module")
def s3():
    yield from plain_and_versioned(PLAIN, VERSIONED)


def _pickled(n: int) -> bytes:
    buf = io.BytesIO()
    torch.save({"tok_embeddings.weight": torch.arange(n * 4, dtype=torch.float32).reshape(n, 4)}, buf)
    return buf.getvalue()


@pytest.mark.parametrize("bucket", [PLAIN, VERSIONED])
@pytest.mark.parametrize("rows", [16, 256], ids=["smaller", "larger"])
def test_a_shard_replaced_before_its_first_read_by_another_size(s3, monkeypatch, tmp_path, bucket, rows):
    fs, key = s3["fs"], f"{bucket}/ck-{rows}/{SHARD}"
    old, new = _pickled(64), _pickled(rows)
    assert len(old) != len(new)
    fs.pipe_file(key, old)
    fs.invalidate_cache()
    monkeypatch.setattr(catalog, "_CHUNK", 512)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where the copies go
    store_cls, real = objstore.ObjectStore, objstore.ObjectStore.listing
    stale = real(resolve(f"s3://{bucket}/ck-{rows}", s3["opts"]))
    assert stale[SHARD] == ("file", len(old))
    # Listed at the old size; replaced before the copy reads it.
    monkeypatch.setattr(store_cls, "listing", lambda self: dict(stale) if self.url.endswith(f"ck-{rows}") else real(self))
    fs.pipe_file(key, new)
    fs.invalidate_cache()
    try:
        cat = catalog.open_catalog(f"s3://{bucket}/ck-{rows}", storage_options=s3["opts"])
    except CorruptCheckpointError as e:
        assert e.file == f"s3://{bucket}/ck-{rows}/{SHARD}", str(e)
        assert os.listdir(tmp_path) == []  # no partial copy left
        return
    try:
        got = cat.get("tok_embeddings.weight")
    finally:
        cat.close()
    assert torch.equal(got, torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4))  # the pinned object, whole
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("bucket", [PLAIN, VERSIONED])
def test_a_shard_removed_after_the_listing_is_refused_by_name(s3, monkeypatch, tmp_path, bucket):
    from checkpoint.errors import CheckpointError

    fs, key = s3["fs"], f"{bucket}/ck-gone/{SHARD}"
    fs.pipe_file(key, _pickled(64))
    fs.invalidate_cache()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    store_cls, real = objstore.ObjectStore, objstore.ObjectStore.listing
    stale = real(resolve(f"s3://{bucket}/ck-gone", s3["opts"]))
    monkeypatch.setattr(store_cls, "listing", lambda self: dict(stale) if self.url.endswith("ck-gone") else real(self))
    fs.rm(key)
    fs.invalidate_cache()
    with pytest.raises(CheckpointError) as e:
        catalog.open_catalog(f"s3://{bucket}/ck-gone", storage_options=s3["opts"])
    assert f"s3://{bucket}/ck-gone/{SHARD}" in str(e.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("rows", [16, 256], ids=["smaller", "larger"])
def test_in_memory_a_shard_replaced_after_the_listing_is_copied_whole(monkeypatch, tmp_path, rows):
    import fsspec

    fs, root = fsspec.filesystem("memory"), f"/bk-meta-dl-{rows}/ck"
    fs.pipe_file(f"{root}/{SHARD}", _pickled(64))
    monkeypatch.setattr(catalog, "_CHUNK", 512)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    url, real = f"memory:/{root}", objstore.ObjectStore.listing
    stale = real(resolve(url))
    monkeypatch.setattr(objstore.ObjectStore, "listing", lambda self: dict(stale) if self.url == url else real(self))
    fs.pipe_file(f"{root}/{SHARD}", _pickled(rows))
    try:
        cat = catalog.open_catalog(url)
        try:
            got = cat.get("tok_embeddings.weight")
        finally:
            cat.close()
        assert torch.equal(got, torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4))
        assert os.listdir(tmp_path) == []
    finally:
        fs.rm(f"/bk-meta-dl-{rows}", recursive=True)
