"""Meta's ``consolidated.NN.pth`` shards read from object storage (moto's S3 server on 127.0.0.1)
are copied in ranged pieces pinned to the object the first piece read, as a load pins a
safetensors shard: an overwrite between two pieces is refused naming the shard on a plain
bucket, and on a versioned bucket the first version is the one copied, whole."""

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
from tests.s3_server import plain_and_versioned  # noqa: E402

PLAIN, VERSIONED = "metapin", "metapinv"
SHARD = "consolidated.00.pth"


@pytest.fixture(scope="module")
def s3():
    yield from plain_and_versioned(PLAIN, VERSIONED)


def _state(add: float = 0.0) -> dict[str, torch.Tensor]:
    return {"tok_embeddings.weight": torch.arange(256, dtype=torch.float32).reshape(64, 4) + add}


def _pickled(sd) -> bytes:
    buf = io.BytesIO()
    torch.save(sd, buf)
    return buf.getvalue()


def _open_overwritten_midway(s3, monkeypatch, tmp_path, bucket: str):
    """Open ``s3://bucket/ck`` (one Meta shard) in 512-byte pieces; another writer replaces the
    shard (same size, other values) right after the first piece was read."""
    fs, key = s3["fs"], f"{bucket}/ck/{SHARD}"
    old, new = _pickled(_state()), _pickled(_state(100.0))
    assert len(old) == len(new) > 1024
    fs.pipe_file(key, old)
    fs.invalidate_cache()
    monkeypatch.setattr(catalog, "_CHUNK", 512)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where the copies go
    real, reads = objstore.ObjectStore.get_range, []

    def get_range(self, name, start, end, pins=None):
        reads.append((name, start))
        out = real(self, name, start, end, pins=pins)
        if len(reads) == 1:
            fs.pipe_file(key, new)
            fs.invalidate_cache()
        return out

    monkeypatch.setattr(objstore.ObjectStore, "get_range", get_range)
    return reads, lambda: catalog.open_catalog(f"s3://{bucket}/ck", storage_options=s3["opts"])


def test_a_meta_shard_overwritten_between_two_reads_is_refused_by_name(s3, monkeypatch, tmp_path):
    reads, opening = _open_overwritten_midway(s3, monkeypatch, tmp_path, PLAIN)
    with pytest.raises(CorruptCheckpointError) as e:
        opening()
    assert isinstance(e.value, objstore.ObjectChangedError)
    assert e.value.file == f"s3://{PLAIN}/ck/{SHARD}"
    assert "changed while being loaded" in str(e.value) and "overwritten" in str(e.value)
    assert reads == [(SHARD, 0), (SHARD, 512)]  # refused at the second piece
    assert os.listdir(tmp_path) == []  # the partial copy is gone


def test_a_versioned_bucket_copies_the_version_the_first_read_pinned(s3, monkeypatch, tmp_path):
    reads, opening = _open_overwritten_midway(s3, monkeypatch, tmp_path, VERSIONED)
    cat = opening()
    try:
        got = cat.get("tok_embeddings.weight")
    finally:
        cat.close()
    assert torch.equal(got, _state()["tok_embeddings.weight"])
    assert len(reads) > 2 and {n for n, _ in reads} == {SHARD}
    assert os.listdir(tmp_path) == []
