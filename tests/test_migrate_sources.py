"""Every source format migrates by content (not extension); unsafe pickles are refused."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from checkpoint.errors import (
    AmbiguousSourceError,
    CorruptCheckpointError,
    MissingShardError,
    UnsafePathError,
    UnsafePickleError,
)
from checkpoint.migrating import migrate, read_report
from checkpoint.sources import open_source, sniff
from checkpoint.storage.opening import open_checkpoint


def _sd(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "enc.weight": torch.randn(4, 3, generator=g),
        "enc.bias": torch.randn(4, generator=g).to(torch.bfloat16),
        "steps": torch.arange(5, dtype=torch.int64),
    }


def _assert_migrated(dst, expected: dict[str, torch.Tensor]) -> None:
    with open_checkpoint(dst) as r:
        assert set(r.keys()) == set(expected)
        for k, v in expected.items():
            got = r.get(k)
            assert got.dtype == v.dtype and torch.equal(got, v), k


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_pickles_zip_and_legacy(tmp_path, fmt):
    sd = _sd()
    path = tmp_path / "weights.bin"  # extension says nothing: content decides
    torch.save(sd, path, _use_new_zipfile_serialization=(fmt == "zip"))
    assert sniff(path) == ("torch-zip" if fmt == "zip" else "torch-legacy")
    report = migrate(path, tmp_path / "out")
    assert report.mapping == {k: k for k in sd}
    assert report.written and read_report(tmp_path / "out").mapping == report.mapping
    assert any("legacy" in n for n in report.notes) == (fmt == "legacy")
    _assert_migrated(tmp_path / "out", sd)


def test_pickle_of_meta_tensors_is_refused_as_holding_no_values(tmp_path):
    """torch.save of a meta tensor stores its shape and dtype and no bytes: opening it names the
    key and says the values were never saved, and migrate writes nothing."""
    path = tmp_path / "meta.pt"
    torch.save({"enc.weight": torch.empty(4, 3, device="meta")}, path)
    with pytest.raises(CorruptCheckpointError) as e:
        migrate(path, tmp_path / "out")
    assert e.value.key == "enc.weight"
    assert "tensor 'enc.weight' holds no values: it was saved from the meta device" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_nested_containers_key_and_choices(tmp_path):
    sd, ema = _sd(0), _sd(1)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": sd, "ema": ema, "epoch": 3}, path)
    with pytest.raises(AmbiguousSourceError) as e:
        migrate(path, tmp_path / "out", dry_run=True)
    assert e.value.choices == ["model", "ema"]
    report = migrate(path, tmp_path / "out", key="ema")
    assert report.container == "ema"
    _assert_migrated(tmp_path / "out", ema)
    with pytest.raises(AmbiguousSourceError, match="'nope'"):
        migrate(path, tmp_path / "out2", key="nope")
    # One model container beside an optimizer and scalars: picked, and said so.
    torch.save({"state_dict": sd, "optimizer": {"state": {}, "param_groups": []}, "epoch": 3}, path)
    report = migrate(path, tmp_path / "out3", dry_run=True)
    assert report.container == "state_dict" and set(report.mapping) == set(sd)
    assert not (tmp_path / "out3").exists()


def test_safetensors_single_sharded_and_index(tmp_path):
    sd = _sd()
    single = tmp_path / "one.pt"  # a safetensors file with a misleading extension
    save_file(sd, single)
    assert sniff(single) == "safetensors"
    migrate(single, tmp_path / "o1")
    _assert_migrated(tmp_path / "o1", sd)

    shards = tmp_path / "shards"
    shards.mkdir()
    save_file({"enc.weight": sd["enc.weight"]}, shards / "a.safetensors")
    save_file({"enc.bias": sd["enc.bias"], "steps": sd["steps"]}, shards / "b.safetensors")
    assert sniff(shards) == "safetensors-sharded"
    migrate(shards, tmp_path / "o2")  # no index: every file, each key once
    _assert_migrated(tmp_path / "o2", sd)

    weight_map = {"enc.weight": "a.safetensors", "enc.bias": "b.safetensors", "steps": "b.safetensors"}
    (shards / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    save_file({"enc.weight": torch.zeros(4, 3)}, shards / "stray-old.safetensors")  # not in the index
    src = open_source(shards)
    assert src.files == ["a.safetensors", "b.safetensors"]
    src.close()
    migrate(shards, tmp_path / "o3")
    _assert_migrated(tmp_path / "o3", sd)

    (shards / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {**weight_map, "steps": "../outside.safetensors"}})
    )
    with pytest.raises(UnsafePathError, match="outside"):
        open_source(shards)
    (shards / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "gone.safetensors"}})
    )
    with pytest.raises(MissingShardError, match="gone.safetensors"):
        open_source(shards)


def test_lfs_pointer_refused(tmp_path):
    (tmp_path / "src").mkdir()  # a folder of its own: "out" beside it is no folder inside a checkpoint
    p = tmp_path / "src" / "model.safetensors"
    p.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n")
    with pytest.raises(CorruptCheckpointError, match="git lfs pull"):
        migrate(p, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_dcp_directory_and_hf_rank_shards(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageWriter

    sd = _sd()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": sd, "step": 7}, storage_writer=FileSystemWriter(str(tmp_path / "dcp")), no_dist=True
        )
        dcp.save(
            sd,
            storage_writer=HuggingFaceStorageWriter(str(tmp_path / "hf"), save_distributed=True),
            no_dist=True,
        )
    assert sniff(tmp_path / "dcp") == "dcp"
    report = migrate(tmp_path / "dcp", tmp_path / "o1", model=None)
    # A top-level value beside the model is extra state (not "skipped"): it is migrated.
    assert report.skipped == {} and report.extra_state == ["step"] and report.entry_kinds["step"] == "other"
    extra = {"step": None}
    import checkpoint

    checkpoint.load({k: torch.empty_like(v) for k, v in sd.items()}, tmp_path / "o1", extra_state=extra)
    assert extra == {"step": 7}
    # The only container holding tensors is picked, as for a pickle; its keys are the source keys.
    assert report.container == "model" and report.mapping == {k: k for k in sd}
    _assert_migrated(tmp_path / "o1", sd)

    assert sniff(tmp_path / "hf") == "dcp-hf-sharded"
    migrate(tmp_path / "hf", tmp_path / "o2")
    _assert_migrated(tmp_path / "o2", sd)


def test_dcp_metadata_with_foreign_global_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    d = tmp_path / "dcp"
    d.mkdir()
    (d / ".metadata").write_bytes(pickle.dumps(Evil(), protocol=4))
    with pytest.raises(UnsafePickleError, match="system"):
        open_source(d)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(2, 2)


def test_b25_legacy_globals_listed_then_trusted(tmp_path):
    torch.manual_seed(0)
    net = _Net()
    path = tmp_path / "legacy.pth"
    torch.save(
        {"model": net.state_dict(), "args": argparse.Namespace(lr=0.1), "best": np.float64(0.91)}, path
    )
    with pytest.raises(pickle.UnpicklingError) as e:  # our UnsafePickleError is one
        migrate(path, tmp_path / "out", model=_Net())
    assert isinstance(e.value, UnsafePickleError)
    assert e.value.globals == ["argparse.Namespace", "numpy._core.multiarray.scalar", "numpy.dtype"]
    assert "argparse.Namespace" in str(e.value) and str(path) in str(e.value)
    assert not (tmp_path / "out").exists()

    trusted = ["argparse.Namespace", "numpy._core.multiarray.scalar", np.dtype, type(np.dtype(np.float64))]
    report = migrate(path, tmp_path / "out", model=_Net(), trusted_globals=trusted)
    assert [e.target for e in report.entries] == ["conv.weight", "conv.bias", "fc.weight", "fc.bias"]
    assert report.container == "model" and report.skipped == {}
    fresh = _Net()
    with open_checkpoint(tmp_path / "out") as r:
        fresh.load_state_dict({k: r.get(k) for k in r.keys()}, strict=True)
    for k, v in net.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)


class _Payload:
    def __init__(self, canary):
        self.canary = canary

    def __reduce__(self):
        return (open, (self.canary, "w"))


def test_b33_reduce_payload_never_runs(tmp_path):
    canary = tmp_path / "canary"
    path = tmp_path / "model.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "extra": _Payload(str(canary))}, path)
    for trusted in ((), ("argparse.Namespace",)):
        with pytest.raises(UnsafePickleError) as e:
            migrate(path, tmp_path / "out", trusted_globals=trusted)
        assert e.value.globals == ["io.open"]
    assert not canary.exists() and not (tmp_path / "out").exists()
