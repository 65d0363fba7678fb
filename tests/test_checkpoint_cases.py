"""Naming and loading situations met in real checkpoints (wrappers, prefixes, parametrizations,
file layouts) as tests of fqnckpt's public API, each input rebuilt here."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file, save_model

import checkpoint
from checkpoint import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    MissingShardError,
    StrayFileWarning,
    TensorNotInShardError,
    open_checkpoint,
)


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(12, 4)
        self.body = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 12, bias=False)
        self.lm_head.weight = self.embed.weight


def write_index(d, weight_map, metadata=None):
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": metadata or {}, "weight_map": weight_map}, f)


def test_b15_tied_saved_once_alias_recorded_reloads(tmp_path):
    torch.manual_seed(0)
    src = TiedLM()
    idx = checkpoint.save(src, tmp_path / "ck")
    assert sorted(idx.weight_map) == ["body.bias", "body.weight", "embed.weight"]  # 3 stored tensors
    assert idx.metadata.fqnckpt.alias_groups == [["embed.weight", "lm_head.weight"]]
    dst = TiedLM()
    rep = checkpoint.load(dst, tmp_path / "ck")
    assert rep.missing_keys == [] and rep.unexpected_keys == []
    assert dst.lm_head.weight is dst.embed.weight
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    # An untied target gets both names filled from the one stored copy.
    untied = TiedLM()
    untied.lm_head.weight = nn.Parameter(torch.zeros(12, 4))
    rep = checkpoint.load(untied, tmp_path / "ck")
    assert rep.filled_from == {"lm_head.weight": "embed.weight"}
    assert torch.equal(untied.lm_head.weight, src.embed.weight)


def test_b15_control_disjoint_views_are_not_aliases(tmp_path):
    w = torch.arange(18.0).reshape(6, 3)
    sd = {"q": w[:2], "k": w[2:4], "v": w[4:]}
    idx = checkpoint.save(sd, tmp_path / "ck")
    assert sorted(idx.weight_map) == ["k", "q", "v"] and idx.metadata.fqnckpt.alias_groups == []
    with open_checkpoint(tmp_path / "ck") as r:
        for k, v in sd.items():
            assert torch.equal(r.get(k), v)


@pytest.mark.parametrize("kept", ["embed.weight", "lm_head.weight"])
def test_b16_file_with_one_alias_loads_strictly(tmp_path, kept):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(12, 4)
            self.norm = nn.LayerNorm(4)
            self.lm_head = nn.Linear(4, 12, bias=False)
            self.lm_head.weight = self.embed.weight

    torch.manual_seed(0)
    src = Tied()
    f = tmp_path / "one.safetensors"
    if kept == "embed.weight":
        save_model(src, str(f))  # safetensors keeps one name of its choice
    else:
        sd = src.state_dict()
        save_file({"lm_head.weight": sd["lm_head.weight"].clone(), "norm.weight": sd["norm.weight"],
                   "norm.bias": sd["norm.bias"]}, str(f))  # fmt: skip
    with open_checkpoint(f) as r:
        assert kept in r.keys() and len(r.keys()) == 3
    dst = Tied()
    rep = checkpoint.load(dst, f, strict=True)
    assert rep.missing_keys == [] and rep.unexpected_keys == []
    assert dst.lm_head.weight is dst.embed.weight
    assert torch.equal(dst.embed.weight, src.embed.weight)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.block = nn.Linear(4, 4)
        self.head = nn.Linear(4, 8)


def _sharded(d, sd, shards):
    wm = {}
    for fname, keys in shards.items():
        save_file({k: sd[k].contiguous() for k in keys}, os.path.join(d, fname))
        wm.update({k: fname for k in keys})
    write_index(d, wm)


def test_b18_missing_shard_raises_before_loading(tmp_path):
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    _sharded(
        tmp_path,
        Net().state_dict(),
        {s1: ["embed.weight", "block.weight", "block.bias"], s2: ["head.weight", "head.bias"]},
    )
    os.remove(tmp_path / s2)
    dst = Net()
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(FileNotFoundError, match=s2) as ei:
        checkpoint.load(dst, tmp_path, strict=False)
    assert isinstance(ei.value, MissingShardError) and ei.value.shards == [s2]
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())  # nothing copied


def test_b19_index_maps_tensor_to_shard_lacking_it(tmp_path):
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    sd = {"trunk.weight": torch.ones(4, 4), "trunk.bias": torch.ones(4), "aux_fc.bias": torch.ones(4)}
    save_file({"trunk.weight": sd["trunk.weight"], "trunk.bias": sd["trunk.bias"]}, str(tmp_path / s1))
    save_file({"aux_fc.bias": sd["aux_fc.bias"]}, str(tmp_path / s2))
    wm = {"trunk.weight": s1, "trunk.bias": s1, "aux_fc.weight": s2, "aux_fc.bias": s2}
    write_index(tmp_path, wm)
    with pytest.raises(TensorNotInShardError) as ei:
        open_checkpoint(tmp_path)
    assert ei.value.key == "aux_fc.weight" and ei.value.shard == s2 and "aux_fc.weight" in str(ei.value)
    # Misplaced: present, but in another shard than indexed (a union check would pass).
    del wm["aux_fc.weight"]
    write_index(tmp_path, dict(wm, **{"trunk.bias": s2}))
    with pytest.raises(TensorNotInShardError) as ei:
        open_checkpoint(tmp_path)
    assert ei.value.key == "trunk.bias" and ei.value.shard == s2 and ei.value.found_in == s1


def test_b21_stray_file_not_in_index_is_not_read(tmp_path):
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({"a.weight": torch.ones(2, 2, dtype=torch.bfloat16)}, str(tmp_path / s1))
    save_file({"b.weight": torch.full((2, 2), 2.0, dtype=torch.bfloat16)}, str(tmp_path / s2))
    save_file({"a.weight": torch.ones(2, 1, dtype=torch.uint8), "a.scales": torch.ones(2, dtype=torch.float16)},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    write_index(tmp_path, {"a.weight": s1, "b.weight": s2})
    with pytest.warns(StrayFileWarning, match="model.safetensors"):
        r = open_checkpoint(tmp_path)
    assert r.files == [s1, s2] and r.keys() == ["a.weight", "b.weight"]
    assert r.get("a.weight").dtype == torch.bfloat16 and torch.equal(
        r.get("b.weight"), torch.full((2, 2), 2.0, dtype=torch.bfloat16)
    )


def mlp(n):
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


def test_b22_full_missing_and_unexpected_report(tmp_path):
    torch.manual_seed(0)
    big, small = mlp(3), mlp(2)
    checkpoint.save(big, tmp_path / "big")
    checkpoint.save(small, tmp_path / "small")
    with pytest.raises(CheckpointMismatchError) as ei:
        checkpoint.load(mlp(2), tmp_path / "big")
    assert ei.value.report.unexpected_keys == ["2.bias", "2.weight"] and ei.value.report.missing_keys == []
    target = mlp(2)
    rep = checkpoint.load(target, tmp_path / "big", strict=False)
    assert rep.unexpected_keys == ["2.bias", "2.weight"] and rep.missing_keys == []
    assert torch.equal(target[0].weight, big[0].weight) and torch.equal(target[1].bias, big[1].bias)
    rep = checkpoint.load(mlp(3), tmp_path / "small", strict=False)
    assert rep.missing_keys == ["2.bias", "2.weight"] and rep.unexpected_keys == []
    with pytest.raises(CheckpointMismatchError, match=r"missing keys \['2.bias', '2.weight'\]"):
        checkpoint.load(mlp(3), tmp_path / "small")


class Rotary(nn.Module):
    def __init__(self, dim=4):
        super().__init__()
        self.register_buffer(
            "freqs", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False
        )


class Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(10, 4)
        self.register_buffer("position_ids", torch.arange(16).expand((1, -1)), persistent=False)


class BufModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings = Embeddings()
        self.rope = Rotary()
        self.out = nn.Linear(4, 4)


def test_b26_nonpersistent_buffers_ignorable_unknown_still_fail(tmp_path):
    m = BufModel()
    idx = checkpoint.save(m, tmp_path / "own")
    assert sorted(idx.weight_map) == ["embeddings.tok.weight", "out.bias", "out.weight"]  # never saved
    sd = dict(m.state_dict())
    sd["rope.freqs"] = m.rope.freqs.clone()
    sd["embeddings.position_ids"] = m.embeddings.position_ids.clone()
    checkpoint.save(sd, tmp_path / "old")
    rep = checkpoint.load(BufModel(), tmp_path / "old", strict=True)
    assert rep.ignorable_keys == ["embeddings.position_ids", "rope.freqs"] and rep.unexpected_keys == []
    checkpoint.save(dict(sd, **{"stray.weight": torch.zeros(1)}), tmp_path / "bad")
    with pytest.raises(CheckpointMismatchError) as ei:
        checkpoint.load(BufModel(), tmp_path / "bad")
    assert ei.value.report.unexpected_keys == ["stray.weight"]
    assert ei.value.report.ignorable_keys == ["embeddings.position_ids", "rope.freqs"]


def _craft(path, header, data):
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def _write(path, raw):
    with open(path, "wb") as f:
        f.write(raw)


def test_b30_header_past_eof_and_lfs_pointer(tmp_path):
    lfs = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 123456\n"
    _write(tmp_path / "lfs.safetensors", lfs)
    with pytest.raises(CorruptCheckpointError, match="git-lfs pointer") as ei:
        open_checkpoint(tmp_path / "lfs.safetensors")
    assert ei.value.file.endswith("lfs.safetensors")
    hdr = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    hdr += b" " * (-len(hdr) % 8)
    _write(tmp_path / "eof.safetensors", struct.pack("<Q", len(hdr) + 4096) + hdr)
    _write(tmp_path / "short.safetensors", struct.pack("<Q", len(hdr)) + hdr + b"\0" * 8)
    for name in ("eof.safetensors", "short.safetensors"):
        with pytest.raises(CorruptCheckpointError, match="header") as ei:
            open_checkpoint(tmp_path / name)
        assert name in str(ei.value)
    # An LFS pointer in place of a shard of an indexed checkpoint is named too.
    d = tmp_path / "ck"
    checkpoint.save({"w": torch.ones(4)}, d)
    _write(d / "model-00001-of-00001.safetensors", lfs)
    with pytest.raises(CorruptCheckpointError, match="model-00001-of-00001.safetensors.*git-lfs"):
        checkpoint.load({"w": torch.zeros(4)}, d)


@pytest.mark.parametrize(
    "header",
    [
        {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
         "c": {"dtype": "F32", "shape": [2], "data_offsets": [24, 32]}},
        {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
         "c": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}},
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [24, 32]}},
    ],
    ids=["partial_overlap", "exact_alias", "hole"],
)  # fmt: skip
def test_b31_overlapping_aliased_gapped_offsets_rejected_on_open(tmp_path, header):
    p = tmp_path / "x.safetensors"
    _craft(p, header, bytes(range(32)))
    with pytest.raises(CorruptCheckpointError, match="x.safetensors"):
        open_checkpoint(p)


@pytest.mark.parametrize(
    "header,data",
    [
        ({"t": {"dtype": "F32", "shape": [1000, 1000], "data_offsets": [0, 4]}}, b"\0" * 4),
        ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 16]}}, b"\0" * 16),
        ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}, b"\0" * 8),
        ({"t": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 4]}}, b"\0" * 4),
    ],
    ids=["shape_bigger_than_span", "span_bigger_than_shape", "end_before_begin", "dim_overflow"],
)
def test_b32_offsets_vs_shape_rejected_on_open(tmp_path, header, data):
    p = tmp_path / "x.safetensors"
    _craft(p, header, data)
    with pytest.raises(CorruptCheckpointError, match="x.safetensors"):
        open_checkpoint(p)
