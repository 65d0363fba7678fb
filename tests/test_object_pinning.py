"""Loads from object storage read exactly the objects they opened (moto's S3 server on 127.0.0.1):
each shard object is pinned by its first GET (``VersionId`` on a versioned bucket, else ``ETag``),
so an object overwritten or removed between the load's check and its copies is refused before any
target changes (a HEAD at the pinned version) or, later, by the failing ``If-Match`` GET naming
file and tensor; on a versioned bucket the checked version is the one copied."""

from __future__ import annotations

import importlib
import json
import struct

import pytest
import torch

pytest.importorskip("s3fs")
pytest.importorskip("moto")

import checkpoint  # noqa: E402
from checkpoint.errors import CorruptCheckpointError  # noqa: E402
from checkpoint.storage import remote_reader  # noqa: E402
from tests.s3_server import plain_and_versioned  # noqa: E402
from tests.snapshot import Snapshot  # noqa: E402

loading = importlib.import_module("checkpoint.loading")

PLAIN, VERSIONED = "pin", "pinv"  # a bucket without versioning, one with it


@pytest.fixture(scope="module")
def s3():
    yield from plain_and_versioned(PLAIN, VERSIONED)


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(64, dtype=torch.float32).reshape(16, 4), "b": torch.tensor([1.0, 2.0, 3.0])}


def _saved(s3, bucket: str, name: str) -> tuple[str, str]:
    """``(url, shard object name)`` of :func:`_state` saved at ``s3://bucket/name``."""
    url = f"s3://{bucket}/{name}"
    checkpoint.save(_state(), url, storage_options=s3["opts"])
    shards = [p.rsplit("/", 1)[1] for p in s3["fs"].ls(f"{bucket}/{name}", refresh=True) if p.endswith(".safetensors")]
    assert len(shards) == 1
    return url, shards[0]


def _overwrite(s3, url: str, shard: str, delete: bool = False) -> None:
    """Another writer replaces object ``shard`` (same size and header, tensor ``w`` + 100), or
    removes it (``delete``)."""
    fs, path = s3["fs"], f"{url.removeprefix('s3://')}/{shard}"
    if delete:
        fs.rm_file(path)
        return
    raw = bytearray(fs.cat_file(path))
    (n,) = struct.unpack("<Q", raw[:8])
    b, e = json.loads(raw[8 : 8 + n])["w"]["data_offsets"]
    raw[8 + n + b : 8 + n + e] = (_state()["w"] + 100).numpy().tobytes()
    fs.pipe_file(path, bytes(raw))
    fs.invalidate_cache()


def _after(monkeypatch, stage: str, action) -> None:
    """Run ``action`` once in ``checkpoint.load`` right after ``stage``: ``"check"`` (every digest
    checked, no copy yet) or ``"confirm"`` (the copies about to start)."""
    name = {"check": "check_reads", "confirm": "apply_load"}[stage]
    real = getattr(loading, name)

    def hooked(*args, **kwargs):
        if stage == "check":
            out = real(*args, **kwargs)
            action()
            return out
        action()
        return real(*args, **kwargs)

    monkeypatch.setattr(loading, name, hooked)


@pytest.mark.parametrize("delete", [False, True], ids=["overwritten", "removed"])
def test_object_changed_after_the_check_refused_before_any_target_changes(s3, monkeypatch, delete):
    """Every tensor fetched again for its copy (past the staging cap): the object is overwritten
    (or removed) after the check. The HEAD at the pinned ETag refuses the load naming the object;
    not one target changed."""
    url, shard = _saved(s3, PLAIN, f"after-check-{delete}")
    monkeypatch.setattr(remote_reader, "_STAGE_MAX", 0)
    _after(monkeypatch, "check", lambda: _overwrite(s3, url, shard, delete))
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    snap = Snapshot(target)
    with pytest.raises(CorruptCheckpointError) as err:
        checkpoint.load(target, url, storage_options=s3["opts"])
    assert type(err.value) is CorruptCheckpointError and err.value.file == f"{url}/{shard}"  # raised alike on every rank
    assert "changed while being loaded" in str(err.value) and ("removed" if delete else "overwritten") in str(err.value)
    snap.assert_unchanged()


def test_object_overwritten_during_the_copies_refused_naming_file_and_tensor(s3, monkeypatch):
    """Overwritten after the HEAD, before the first copy's GET: that GET (``If-Match``) is
    refused, naming object and tensor; the target it was for is unchanged."""
    url, shard = _saved(s3, PLAIN, "during-copies")
    monkeypatch.setattr(remote_reader, "_STAGE_MAX", 0)
    _after(monkeypatch, "confirm", lambda: _overwrite(s3, url, shard))
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    snap = Snapshot(target)
    with pytest.raises(CorruptCheckpointError) as err:
        checkpoint.load(target, url, storage_options=s3["opts"])
    assert type(err.value) is CorruptCheckpointError and err.value.file == f"{url}/{shard}" and err.value.key in target
    assert f"tensor {err.value.key!r}: changed while being loaded" in str(err.value)
    snap.assert_unchanged()  # the overwrite came before the first copy's GET


def test_shard0_row_block_fetched_again_reads_the_checked_object(s3):
    """A ``Shard(0)`` row block: its chunks are hashed by the check, its bytes fetched again by the
    copy. Overwritten in between: without versioning the block read is refused (object and tensor
    named, the target block untouched); with versioning it returns the checked bytes."""
    w = _state()["w"]
    row = w.nbytes // w.shape[0]
    for bucket in (PLAIN, VERSIONED):
        url, shard = _saved(s3, bucket, "rows")
        with checkpoint.open_checkpoint(url, storage_options=s3["opts"]) as r:
            r.check_first([], {"w": [(0, 8 * row)]})
            _overwrite(s3, url, shard)
            out = torch.full((8, 4), -1.0)
            if bucket == PLAIN:
                with pytest.raises(CorruptCheckpointError) as err:
                    r.copy_into("w", out, [slice(0, 8)])
                assert err.value.file == f"{url}/{shard}" and err.value.key == "w"
                assert "tensor 'w': changed while being loaded" in str(err.value)
                assert torch.equal(out, torch.full((8, 4), -1.0))
            else:
                assert r.copy_into("w", out, [slice(0, 8)]) and torch.equal(out, w[:8])
                assert torch.equal(r.get_slice("w", [slice(0, 16), slice(1, 2)]), w[:, 1:2])  # several ranged GETs
                assert r.verify_file(shard)  # verify hashes the opened version too


@pytest.mark.parametrize("stage", ["check", "confirm"])
def test_versioned_bucket_copies_the_checked_version(s3, monkeypatch, stage):
    """On a versioned bucket an overwrite after the check (or after the HEAD) changes nothing for
    the load under way: the version it opened and checked is the one copied, byte for byte."""
    url, shard = _saved(s3, VERSIONED, f"versioned-{stage}")
    monkeypatch.setattr(remote_reader, "_STAGE_MAX", 0)
    _after(monkeypatch, stage, lambda: _overwrite(s3, url, shard))
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    assert checkpoint.load(target, url, storage_options=s3["opts"]).ok
    assert all(torch.equal(target[k], v) for k, v in _state().items())
    assert s3["fs"].cat_file(f"{url.removeprefix('s3://')}/{shard}") != b""  # the overwrite is there


@pytest.mark.parametrize("bucket", [PLAIN, VERSIONED])
def test_plain_loads_exact_and_every_later_get_names_the_opened_object(s3, monkeypatch, bucket):
    """Untouched checkpoints load exactly (tensors kept from the check, fetched again past the
    cap, a header longer than the first GET, verify), and every GET of a shard object after its
    first names the object that first GET answered (``VersionId``, else ``If-Match``)."""
    import s3fs

    url, shard = _saved(s3, bucket, "plain")
    calls: list[dict] = []
    real = s3fs.S3FileSystem._call_s3

    async def recording(self, method, *args, **kwargs):
        out = await real(self, method, *args, **kwargs)
        if method == "get_object" and kwargs.get("Key", "").endswith(shard):
            calls.append({**kwargs, "answer": (out.get("ETag"), out.get("VersionId"))})
        return out

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", recording)
    for stage_max, head_guess in ((remote_reader._STAGE_MAX, remote_reader._HEAD_GUESS), (0, 16)):
        monkeypatch.setattr(remote_reader, "_STAGE_MAX", stage_max)
        monkeypatch.setattr(remote_reader, "_HEAD_GUESS", head_guess)
        calls.clear()
        target = {k: torch.zeros_like(v) for k, v in _state().items()}
        assert checkpoint.load(target, url, storage_options=s3["opts"]).ok
        assert all(torch.equal(target[k], v) for k, v in _state().items())
        etag, version = calls[0]["answer"]
        assert (version is not None) == (bucket == VERSIONED)
        later = calls[1:]
        assert later  # the rest of the header, the check, and past the cap the copies
        pin = {"VersionId": version} if bucket == VERSIONED else {"IfMatch": etag}
        assert all({k: c.get(k) for k in pin} == pin for c in later), later
    assert checkpoint.verify(url, storage_options=s3["opts"]).ok
