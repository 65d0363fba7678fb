"""Round 7's hostile inputs against the rules added this round (H5): each test failed before its
fix. A bare query token (``s3://b/ck?<token>``) never reaches a message; (numpy numbers for the hyper-parameter
kind rule: tests/test_optimizer_hyper_types.py); DCP's ``.metadata`` beside ``pytorch_model.bin`` (what
transformers reads when there is no ``model.safetensors``) is refused like beside
``model.safetensors``; an fsspec chained URL (``simplecache::s3://...``) is never a local path."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import checkpoint
from checkpoint.errors import AmbiguousSourceError, UnsupportedStorageError, UnsupportedURLError
from checkpoint.sources import sniff
from snapshot import Snapshot, dir_snapshot


@pytest.mark.parametrize("url,shown,parts", [
    ("memory://r7/ck?s3cr3tT0ken", "memory://r7/ck?***", "a query"),
    ("memory://r7/ck?versionId=1&s3cr3tT0ken", "memory://r7/ck?versionId=***&***", "query keys ['versionId']"),
])  # fmt: skip
def test_a_bare_query_token_is_not_shown_as_a_key(url, shown, parts):
    with pytest.raises(UnsupportedURLError) as e:
        checkpoint.save(torch.nn.Linear(2, 2), url)
    assert "s3cr3t" not in str(e.value) and "s3cr3t" not in repr(e.value.parts)
    assert (e.value.url, e.value.parts) == (shown, [parts])


@pytest.mark.parametrize("entry", ["pytorch_model.bin", "pytorch_model.bin.index.json"])
def test_dcp_metadata_beside_pytorch_model_bin_is_refused(tmp_path, entry):
    d = tmp_path / "mixed"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        dcp.save({"weight": torch.ones(2, 2), "bias": torch.ones(2)}, checkpoint_id=str(d))
    torch.save({"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, d / "pytorch_model.bin")
    if entry.endswith(".json"):
        (d / entry).write_text('{"metadata": {}, "weight_map": {"weight": "pytorch_model.bin", "bias": "pytorch_model.bin"}}')
    present = [entry, "pytorch_model.bin"] if entry.endswith(".json") else [entry]
    want = (f"{d}: holds both a DCP checkpoint (.metadata) and a pickle checkpoint ({entry}); "
            "DCP and Hugging Face readers would read different checkpoints from it: remove one of them "
            f"or move it to a directory of its own; choices for the path: {['.metadata', *present]}")  # fmt: skip
    model = torch.nn.Linear(2, 2)
    snap, before = Snapshot(model), dir_snapshot(d)
    for call in (lambda: checkpoint.load(model, d), lambda: checkpoint.verify(d), lambda: sniff(d),
                 lambda: checkpoint.migrate(d, tmp_path / "out")):  # fmt: skip
        with pytest.raises(AmbiguousSourceError) as e:
            call()
        assert str(e.value) == want and e.value.choices == [".metadata", *present]
    snap.assert_unchanged()
    assert dir_snapshot(d) == before and not (tmp_path / "out").exists()
    os.remove(d / ".metadata")  # the pickle alone: read
    for f in d.glob("*.json"):
        f.unlink()
    checkpoint.load(model, d)
    assert torch.equal(model.weight, torch.zeros(2, 2))


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
