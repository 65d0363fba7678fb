"""One symlink rule for every reader: load, verify, migrate, inspect and diff follow a
symlink only into the checkpoint directory or, for a Hugging Face hub-cache snapshot, into its
cached repository; anything else is UnsafePathError naming the file."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import checkpoint
from checkpoint.errors import CheckpointError, UnsafePathError
from tests.helpers import run_cli


def _to_hub_cache(src: Path, cache: Path, repo: str = "models--org--tiny", rev: str = "0123abc") -> Path:
    """Move ``src``'s files into a hub-cache repository laid out as huggingface_hub lays it out:
    ``blobs/<sha256>`` plus ``snapshots/<rev>/<file>`` symlinks made by its own helper."""
    from huggingface_hub.file_download import _create_symlink

    blobs, snap = cache / repo / "blobs", cache / repo / "snapshots" / rev
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.move(f, blob)
        _create_symlink(str(blob), str(snap / f.name), new_blob=True)
    assert all(os.path.islink(p) for p in snap.iterdir())
    assert os.readlink(next(snap.iterdir())).startswith("../../blobs/")
    return snap


@pytest.fixture(scope="module")
def tiny_bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return cfg, BertModel(cfg)


def test_hub_cache_snapshot_of_save_pretrained_readable_everywhere(tmp_path, tiny_bert, capsys):
    from transformers import BertModel

    cfg, model = tiny_bert
    model.save_pretrained(tmp_path / "src", max_shard_size="8KB")  # several shards + index
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "src", copy)
    snap = _to_hub_cache(tmp_path / "src", tmp_path / "hub")
    want = model.state_dict()

    target = BertModel(cfg)
    report = checkpoint.load(target, snap)
    assert report.ok and all(torch.equal(target.state_dict()[k], v) for k, v in want.items())

    rep = checkpoint.migrate(snap, tmp_path / "migrated", model=BertModel(cfg))
    assert rep.ok
    again = BertModel(cfg)
    checkpoint.load(again, tmp_path / "migrated")
    assert all(torch.equal(again.state_dict()[k], v) for k, v in want.items())

    code, out, _ = run_cli("inspect", "--json", str(snap), capsys=capsys)
    data = json.loads(out)
    assert code == 0 and data["format"] == "safetensors-sharded"
    assert sum(f["tensors"] for f in data["per_file"].values()) == data["tensors"] == len(want)

    code, out, _ = run_cli("diff", "--json", str(snap), str(copy), capsys=capsys)
    assert code == 0 and json.loads(out)["same"] is True

    # verify reads the snapshot (no fqnckpt checksums in a save_pretrained index: that is all it says)
    vr = checkpoint.verify(snap)
    assert len(vr.files) > 1 and vr.tensors == len(want)
    assert all("symlink" not in p and "UnsafePath" not in p for p in vr.problems)


def test_hub_cache_snapshot_of_fqnckpt_checkpoint_verifies(tmp_path):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    checkpoint.save(model, tmp_path / "src", max_shard_size=300)
    snap = _to_hub_cache(tmp_path / "src", tmp_path / "hub")
    vr = checkpoint.verify(snap)
    assert vr.ok and len(vr.files) > 1 and vr.problems == []
    fresh = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    checkpoint.load(fresh, snap)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def _outside(tmp_path: Path) -> Path:
    d = tmp_path / "elsewhere"
    d.mkdir()
    save_file({"weight": torch.full((2, 2), 42.0), "bias": torch.zeros(2)}, str(d / "x.safetensors"))
    return d / "x.safetensors"


def _layout(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A checkpoint whose file ``name`` is a symlink leading outside where it may lead."""
    outside = _outside(tmp_path)
    if kind == "single":  # directory with one model.safetensors, no index
        d = tmp_path / "ck"
        d.mkdir()
        os.symlink(outside, d / "model.safetensors")
        return d, "model.safetensors"
    if kind == "no-index":  # shards without an index
        d = tmp_path / "ck"
        d.mkdir()
        os.symlink(outside, d / "a.safetensors")
        return d, "a.safetensors"
    if kind == "indexed":
        d = tmp_path / "ck"
        checkpoint.save(nn.Linear(2, 2), d)
        shard = "model-00001-of-00001.safetensors"
        os.remove(d / shard)
        os.symlink(outside, d / shard)
        return d, shard
    # hub cache: a snapshot symlink leading out of the cached repository
    src = tmp_path / "src"
    checkpoint.save(nn.Linear(2, 2), src)
    snap = _to_hub_cache(src, tmp_path / "hub")
    shard = "model-00001-of-00001.safetensors"
    os.remove(snap / shard)
    os.symlink(os.path.relpath(outside, snap), snap / shard)
    return snap, shard


@pytest.mark.parametrize("kind", ["single", "no-index", "indexed", "hub-cache-escape"])
def test_symlink_leading_outside_refused_by_every_reader(tmp_path, kind, capsys):
    d, name = _layout(tmp_path, kind)
    m = nn.Linear(2, 2)
    before = {k: v.clone() for k, v in m.state_dict().items()}

    if kind != "no-index":  # load reads model.safetensors / the index only
        with pytest.raises(UnsafePathError, match=name):
            checkpoint.load(m, d)
        assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
        vr = checkpoint.verify(d)
        assert not vr.ok and any("UnsafePathError" in p and name in p for p in vr.problems)
    with pytest.raises(UnsafePathError, match=name):
        checkpoint.migrate(d, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    for argv in (["inspect", str(d)], ["diff", str(d), str(d)]):
        code, out, err = run_cli(*argv, capsys=capsys)
        assert code == 2 and name in err and "symlink" in err, (argv, err)


def test_symlinks_inside_the_checkpoint_followed(tmp_path):
    d = tmp_path / "ck"
    (d / "real").mkdir(parents=True)
    save_file({"weight": torch.full((2, 2), 7.0), "bias": torch.ones(2)}, str(d / "real" / "w.safetensors"))
    os.symlink("real/w.safetensors", d / "model.safetensors")  # relative, stays inside
    m = nn.Linear(2, 2)
    assert checkpoint.load(m, d).ok and torch.equal(m.weight, torch.full((2, 2), 7.0))
    rep = checkpoint.migrate(d, tmp_path / "out")
    assert set(rep.mapping) == {"weight", "bias"}


@pytest.mark.parametrize(
    "entry", ["sub/w.safetensors", "../ck/w.safetensors", "/abs/w.safetensors", "..", "w\x00.safetensors"]
)
def test_index_entry_must_be_a_plain_file_name(tmp_path, entry):
    d = tmp_path / "ck"
    (d / "sub").mkdir(parents=True)
    save_file({"w": torch.ones(2)}, str(d / "sub" / "w.safetensors"))  # inside, but not a plain name
    save_file({"w": torch.ones(2)}, str(d / "w.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {"w": entry}}))
    for call in (
        lambda: checkpoint.load({"w": torch.zeros(2)}, d),
        lambda: checkpoint.migrate(d, tmp_path / "out"),
    ):
        with pytest.raises(CheckpointError) as e:
            call()
        assert isinstance(e.value, UnsafePathError) and repr(entry) in str(e.value)
