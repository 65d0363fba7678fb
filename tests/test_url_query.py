"""URLs as entry points take them: a URL with a query (``?versionId=...``, a presigned signature,
any key) or a fragment is refused by every entry point with the same ``UnsupportedURLError`` naming
the URL (values masked, a bare token never shown) and what it carries, before any object is read or
written (``checkpoint/storage/urls.py`` ``check_url``, called by
``checkpoint.storage.location.resolve``); an fsspec chained URL (``simplecache::s3://...``) is a
URL, never a local path."""

from __future__ import annotations

import json
import os
import warnings

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

import checkpoint
from checkpoint.cli.main import EXIT_BAD_INPUT, main
from checkpoint.dcp import StorageReader, StorageWriter
from checkpoint.errors import UnsupportedStorageError, UnsupportedURLError
from snapshot import Snapshot

WHY = ("which a checkpoint URL cannot: it is a prefix of objects read and written by their plain names, so a "
       "query (an object version, a signature) or fragment cannot apply to them and a save could not "
       "honour it; give the URL without '?...' and '#...' (filesystem settings go in storage_options)")  # fmt: skip
CASES = [
    ("s3://bucket/ck?versionId=3", "s3://bucket/ck?versionId=***", "query keys ['versionId']"),
    ("memory://urlq/ck?versionId=3&x=1", "memory://urlq/ck?versionId=***&x=***", "query keys ['versionId', 'x']"),
    ("memory://urlq/ck#frag", "memory://urlq/ck#***", "a fragment"),
    ("memory://urlq/ck?", "memory://urlq/ck?", "an empty query '?'"),
    ("s3://bucket/ck?X-Amz-Signature=s3cr3tsig#v", "s3://bucket/ck?X-Amz-Signature=***",
     "query keys ['X-Amz-Signature'] and a fragment"),
]  # fmt: skip


def _memory_objects() -> dict:
    return {k: bytes(v.getbuffer()) for k, v in fsspec.filesystem("memory").store.items()}


@pytest.mark.parametrize("url,shown,parts", CASES)
def test_every_entry_point_refuses_a_url_with_query_or_fragment(tmp_path, capsys, url, shown, parts):
    checkpoint.save(torch.nn.Linear(2, 2), "memory://urlq/ck", overwrite=True)  # what the URL would name
    want = f"{shown} carries {parts}, {WHY}"
    model = torch.nn.Linear(2, 2)
    snap, before = Snapshot(model), _memory_objects()
    calls = [
        lambda: checkpoint.save(model, url),
        lambda: checkpoint.save(model, url, overwrite=True),
        lambda: checkpoint.load(model, url),
        lambda: checkpoint.verify(url),
        lambda: checkpoint.open_checkpoint(url),
        lambda: checkpoint.migrate(url, tmp_path / "out"),
        lambda: checkpoint.migrate(tmp_path / "none.pt", url),
        lambda: checkpoint.CheckpointManager(url),
    ]
    for call in calls:
        with pytest.raises(UnsupportedURLError) as e:
            call()
        assert str(e.value) == want and isinstance(e.value, UnsupportedStorageError)
        assert (e.value.url, e.value.file, e.value.parts) == (shown, shown, parts.split(" and "))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to ... in a single process"
        for io in (lambda: dcp.save(model.state_dict(), storage_writer=StorageWriter(url)),
                   lambda: dcp.load(model.state_dict(), storage_reader=StorageReader(url))):  # fmt: skip
            with pytest.raises(BaseException) as e:  # ours, or inside DCP's CheckpointException
                io()
            assert want in str(e.value)
    for argv in (["inspect", url], ["verify", url], ["diff", url, url]):
        rc = main(["--json", *argv])
        out = capsys.readouterr()
        assert rc == EXIT_BAD_INPUT, (argv, out)
        data = json.loads(out.out)
        assert (data["error"], data["file"], data["message"]) == ("UnsupportedURLError", shown, want)
        assert "s3cr3tsig" not in out.out + out.err
    snap.assert_unchanged()
    assert _memory_objects() == before
    assert not (tmp_path / "out").exists()


def test_a_plain_url_still_saves_and_loads():
    m = torch.nn.Linear(2, 2)
    checkpoint.save(m, "memory://urlq-plain/ck", overwrite=True)
    m2 = torch.nn.Linear(2, 2)
    checkpoint.load(m2, "memory://urlq-plain/ck")
    assert torch.equal(m2.weight, m.weight) and torch.equal(m2.bias, m.bias)


@pytest.mark.parametrize("url,shown,parts", [
    ("memory://r7/ck?s3cr3tT0ken", "memory://r7/ck?***", "a query"),
    ("memory://r7/ck?versionId=1&s3cr3tT0ken", "memory://r7/ck?versionId=***&***", "query keys ['versionId']"),
])  # fmt: skip
def test_a_bare_query_token_is_not_shown_as_a_key(url, shown, parts):
    with pytest.raises(UnsupportedURLError) as e:
        checkpoint.save(torch.nn.Linear(2, 2), url)
    assert "s3cr3t" not in str(e.value) and "s3cr3t" not in repr(e.value.parts)
    assert (e.value.url, e.value.parts) == (shown, [parts])


def test_a_chained_fsspec_url_is_not_a_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for url in ("simplecache::memory://r7chain/ck", "blockcache::s3://bucket/ck"):
        with pytest.raises(UnsupportedStorageError) as e:
            checkpoint.save(torch.nn.Linear(2, 2), url)
        assert url.split("://")[0] in str(e.value)
        with pytest.raises(UnsupportedStorageError):
            checkpoint.load(torch.nn.Linear(2, 2), url)
    assert os.listdir(tmp_path) == []  # nothing written locally
    local = tmp_path / "a::b"  # "::" without "://" stays a local name
    checkpoint.save(torch.nn.Linear(2, 2), local)
    assert (local / "model.safetensors.index.json").is_file()
