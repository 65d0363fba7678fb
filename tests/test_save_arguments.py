"""Edges where fqnckpt decides alone: a URL's path is normalised as a local path is (no object
written under a literal ``/`` or ``.`` segment), a save or migrate into a folder inside another
checkpoint is refused as DCP's StorageWriter refuses it, and ``max_shard_size`` takes an int or
a size string only (a float is refused by name, not truncated to bytes)."""

from __future__ import annotations

import os

import pytest
import torch

import checkpoint
from checkpoint.errors import NestedCheckpointError
from checkpoint.storage.urls import normalize_url
from tests.helpers import tiny_model


def _tree(root) -> dict[str, bytes]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


@pytest.mark.parametrize("url, want", [
    ("s3://b//ck", "s3://b/ck"),
    ("s3://b/./run//step-1/", "s3://b/run/step-1"),
    ("memory:///x//y", "memory:///x/y"),
    ("file:///tmp//ck", "file:///tmp/ck"),
    ("simplecache::s3://b//ck", "simplecache::s3://b/ck"),
    ("s3://b/ck", "s3://b/ck"),
    ("/local//path", "/local//path"),  # not a URL: the OS normalises it
])
def test_normalize_url(url, want):
    assert normalize_url(url) == want


def test_url_keys_are_normalised_as_local_paths_are():
    # s3://b//ck (and memory://) writes under "b/ck/...", never under "b/" + "/ck/..." (a folder
    # named "" that `s3://b/ck` does not read).
    import fsspec

    fs = fsspec.filesystem("memory")
    m = tiny_model()
    checkpoint.save(m, "memory://trusta-keys//run/./ck")
    keys = sorted(fs.find("/trusta-keys"))
    assert keys and all("//" not in k and "/./" not in k for k in keys), keys
    assert all(k.startswith("/trusta-keys/run/ck/") for k in keys), keys
    back = tiny_model(seed=1)
    assert checkpoint.load(back, "memory://trusta-keys/run/ck").ok
    assert all(torch.equal(back.state_dict()[k], v) for k, v in m.state_dict().items())
    fs.rm("/trusta-keys", recursive=True)


@pytest.mark.parametrize("how", ["save", "async_save", "migrate"])
def test_a_save_into_a_folder_inside_another_checkpoint_is_refused(tmp_path, how):
    # save and migrate refuse it as the DCP StorageWriter does: nothing is written inside the
    # outer checkpoint's folder.
    outer = tmp_path / "outer"
    checkpoint.save(tiny_model(), outer)
    src = tmp_path / "src"
    checkpoint.save(tiny_model(seed=2), src)
    before = _tree(outer)
    inner = outer / "sub" / "inner"
    with pytest.raises(NestedCheckpointError) as e:
        if how == "save":
            checkpoint.save(tiny_model(seed=1), inner)
        elif how == "async_save":
            checkpoint.async_save(tiny_model(seed=1), inner).result()
        else:
            checkpoint.migrate(src, inner)
    assert e.value.path == str(inner) and e.value.outer == str(outer)
    assert _tree(outer) == before and not (outer / "sub").exists()


def test_dcp_writer_and_save_share_the_nested_rule(tmp_path):
    import torch.distributed.checkpoint as dcp

    from checkpoint.dcp import StorageWriter

    outer = tmp_path / "outer"
    checkpoint.save(tiny_model(), outer)
    before = _tree(outer)
    with pytest.raises(BaseException) as e:  # DCP raises the writer's error as CheckpointException
        dcp.save(tiny_model(seed=1).state_dict(), storage_writer=StorageWriter(str(outer / "inner")))
    assert "NestedCheckpointError" in repr(e.value) or isinstance(e.value, NestedCheckpointError)
    assert _tree(outer) == before


@pytest.mark.parametrize("size", [1.5, 2.0, "1.5", True])
def test_max_shard_size_takes_an_int_or_a_size_string_only(tmp_path, size):
    # Refused by name: 1.5 (or "1.5") taken as 1 byte would write one file per tensor, without a word.
    with pytest.raises(ValueError, match="max_shard_size") as e:
        checkpoint.save(tiny_model(), tmp_path / "ck", max_shard_size=size)
    if not isinstance(size, str):
        assert f"got {type(size).__name__} {size!r}" in str(e.value)
    assert not (tmp_path / "ck").exists()
    from checkpoint.dcp import StorageWriter

    with pytest.raises(ValueError, match="max_shard_size"):
        StorageWriter(str(tmp_path / "dcp"), max_shard_size=size)


def test_max_shard_size_sizes_are_exact(tmp_path):
    import numpy as np

    from checkpoint.storage.format import parse_size

    assert parse_size("1.1GB") == 1_100_000_000 and parse_size("2.5GiB") == 5 * 2**29
    assert parse_size(np.int64(48)) == 48
    checkpoint.save(tiny_model(), tmp_path / "ck", max_shard_size=np.int64(48))
    assert len([n for n in os.listdir(tmp_path / "ck") if n.endswith(".safetensors")]) > 1
