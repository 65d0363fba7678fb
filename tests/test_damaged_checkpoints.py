"""Damaged checkpoints: every broken checkpoint is built in tmp_path (a valid ``checkpoint.save``
then damaged byte by byte, or crafted with struct + json per the safetensors spec), and every
rejected load must raise the specific error, name the file (and key where there is one) and leave
the target module's values exactly as they were.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import warnings
import zipfile

import pytest
import torch
import torch.nn as nn
import xxhash

import checkpoint
from checkpoint import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DuplicateTensorError,
    MissingShardError,
    StrayFileWarning,
    TensorNotInShardError,
    TiedValuesMismatchError,
    UnsafePathError,
)
from checkpoint.errors import UnsafePickleError, UnsupportedFormatError
from checkpoint.migrating import migrate
from tests.snapshot import Snapshot

INDEX = "model.safetensors.index.json"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


class Net(nn.Module):
    """Two Linear layers: 4 tensors, 236 bytes of f32 data, two shard files at 200 bytes."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


def saved(tmp_path, seed: int = 1):
    """A valid 2-shard checkpoint of ``Net(seed)`` at tmp_path/ck; returns (path, index)."""
    path = tmp_path / "ck"
    idx = checkpoint.save(Net(seed), path, max_shard_size=200)
    assert idx.files() == [SHARD1, SHARD2]
    return path, idx


def snapshot(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def assert_unchanged(m: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = m.state_dict()
    assert sorted(after) == sorted(before)
    for k, v in before.items():
        assert torch.equal(after[k], v), f"{k} changed by a rejected load"


def rejected(path, exc, *needles, target=None, **kw):
    """``checkpoint.load`` into a fresh ``Net(99)`` must raise ``exc`` whose message contains every
    needle; the module's values must be unchanged. Returns the exception."""
    target = target if target is not None else Net(99)
    snap = Snapshot(target)  # bytes, dtype, strides, storage and object identity of every tensor
    with pytest.raises(exc) as ei:
        checkpoint.load(target, path, **kw)
    msg = str(ei.value)
    for n in needles:
        assert str(n) in msg, f"{n!r} not in message: {msg}"
    snap.assert_unchanged()
    return ei.value


def read_st(p):
    """(header dict, data bytes) of a safetensors file."""
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_st(p, header, data, pad=True):
    """Write a safetensors file by hand: u64 LE header length, JSON header, data (spec layout)."""
    h = json.dumps(header).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    p.write_bytes(struct.pack("<Q", len(h)) + h + data)


def first_key(header):
    return next(k for k in header if k != "__metadata__")


# -- safetensors files ------------------------------------------------------------------------------


def test_truncated_shard(tmp_path):
    path, _ = saved(tmp_path)
    p = path / SHARD2
    head, _ = read_st(p)
    last = max((k for k in head if k != "__metadata__"), key=lambda k: head[k]["data_offsets"])
    p.write_bytes(p.read_bytes()[:-10])
    rejected(path, CorruptCheckpointError, p, f"tensor {last!r}", "out of range")


def test_header_length_past_end_of_file(tmp_path):
    path, _ = saved(tmp_path)
    p = path / SHARD1
    raw = p.read_bytes()
    p.write_bytes(struct.pack("<Q", len(raw) + 4096) + raw[8:])
    rejected(path, CorruptCheckpointError, p)


def test_git_lfs_pointer_saved_as_safetensors(tmp_path):
    path, _ = saved(tmp_path)
    p = path / SHARD2
    p.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"ab" * 32 + b"\nsize 5000\n")
    rejected(path, CorruptCheckpointError, p, "git-lfs pointer", "git lfs pull")


def test_invalid_json_header(tmp_path):
    path, _ = saved(tmp_path)
    p = path / SHARD1
    raw = bytearray(p.read_bytes())
    raw[8:12] = b"{{]!"  # same length, not JSON
    p.write_bytes(bytes(raw))
    rejected(path, CorruptCheckpointError, p)


def test_unknown_dtype(tmp_path):
    path, _ = saved(tmp_path)
    p = path / SHARD1
    head, data = read_st(p)
    key = first_key(head)
    head[key]["dtype"] = "F33"
    write_st(p, head, data)
    rejected(path, CorruptCheckpointError, p, repr(key), "'F33'")


@pytest.mark.parametrize("damage", ["overlap", "out_of_range", "too_short", "shape_overflow"])
def test_bad_data_offsets_and_shapes(tmp_path, damage):
    path, _ = saved(tmp_path)
    p = path / SHARD1
    head, data = read_st(p)
    keys = sorted((k for k in head if k != "__metadata__"), key=lambda k: head[k]["data_offsets"])
    assert len(keys) >= 2
    k0, k1 = keys[0], keys[1]
    if damage == "overlap":  # second tensor starts 4 bytes inside the first
        bad = k1
        b, e = head[k1]["data_offsets"]
        head[k1]["data_offsets"] = [b - 4, e - 4]
    elif damage == "out_of_range":  # last tensor ends past the data
        bad = keys[-1]
        b, e = head[bad]["data_offsets"]
        head[bad]["data_offsets"] = [b, e + 4096]
    elif damage == "too_short":  # span shorter than shape x dtype
        bad = k0
        head[k0]["shape"] = [head[k0]["shape"][0] + 1, *head[k0]["shape"][1:]]
    else:  # element count overflows u64
        bad = k0
        head[k0]["shape"] = [2**62, 2**62]
    write_st(p, head, data)
    needle = {
        "overlap": "overlap",
        "out_of_range": "out of range",
        "too_short": "needs",
        "shape_overflow": "overflows",
    }
    rejected(path, CorruptCheckpointError, p, f"tensor {bad!r}", needle[damage])


def test_flipped_data_byte_caught_by_verify_and_load_verify(tmp_path):
    path, idx = saved(tmp_path)
    p = path / SHARD2
    raw = bytearray(p.read_bytes())
    raw[-2] ^= 0x10
    p.write_bytes(bytes(raw))
    rep = checkpoint.verify(path)
    assert not rep.ok and rep.bad_files == [SHARD2]
    assert SHARD2 in rep.problems[0] and idx.metadata.fqnckpt.files[SHARD2].digest in rep.problems[0]
    e = rejected(path, ChecksumMismatchError, p, verify=True)
    assert e.expected == idx.metadata.fqnckpt.files[SHARD2].digest and e.actual != e.expected
    # The intact checkpoint passes the same check and loads exact values.
    path2, _ = saved(tmp_path / "ok")
    m = Net(99)
    checkpoint.load(m, path2, verify=True)
    assert_unchanged(m, snapshot(Net(1)))


# -- index ------------------------------------------------------------------------------------------


def rewrite_index(path, fn):
    p = path / INDEX
    data = json.loads(p.read_text())
    fn(data)
    p.write_text(json.dumps(data))


def retarget(data, old, new):
    data["weight_map"] = {k: (new if v == old else v) for k, v in data["weight_map"].items()}
    files = data["metadata"]["fqnckpt"]["files"]
    files[new] = files.pop(old)


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink_file", "symlink_dir"])
def test_index_entry_leading_outside(tmp_path, kind):
    path, _ = saved(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.replace(path / SHARD2, outside / SHARD2)
    entry = {
        "dotdot": f"../outside/{SHARD2}",
        "absolute": str(outside / SHARD2),
        "symlink_file": "link.safetensors",
        "symlink_dir": f"sub/{SHARD2}",
    }[kind]
    if kind == "symlink_file":
        os.symlink(outside / SHARD2, path / "link.safetensors")
    if kind == "symlink_dir":
        os.symlink(outside, path / "sub")
    rewrite_index(path, lambda d: retarget(d, SHARD2, entry))
    rejected(path, UnsafePathError, entry, path)


def test_named_file_missing(tmp_path):
    path, _ = saved(tmp_path)
    os.remove(path / SHARD2)
    e = rejected(path, MissingShardError, SHARD2, path)
    assert e.shards == [SHARD2]


def test_tensor_missing_from_its_file(tmp_path):
    path, idx = saved(tmp_path)
    key = next(k for k, f in idx.weight_map.items() if f == SHARD2)
    rewrite_index(path, lambda d: d["weight_map"].__setitem__(key, SHARD1))
    e = rejected(path, TensorNotInShardError, key, SHARD1, SHARD2)
    assert (e.key, e.shard, e.found_in) == (key, SHARD1, SHARD2)
    # A tensor the index names but no file holds.
    path, _ = saved(tmp_path / "2")
    rewrite_index(path, lambda d: d["weight_map"].__setitem__("ghost.weight", SHARD1))
    rejected(path, TensorNotInShardError, "ghost.weight", SHARD1)


def test_tensor_in_two_files(tmp_path):
    path, idx = saved(tmp_path)
    key = next(k for k, f in idx.weight_map.items() if f == SHARD2)
    head, data = read_st(path / SHARD1)
    src_head, src_data = read_st(path / SHARD2)
    b, e = src_head[key]["data_offsets"]
    n = len(data)
    head[key] = {**src_head[key], "data_offsets": [n, n + e - b]}
    write_st(path / SHARD1, head, data + src_data[b:e])
    # The index records the edited header's digest (else that mismatch is refused first): the
    # duplicate itself is what is refused here.
    raw = (path / SHARD1).read_bytes()
    new = xxhash.xxh3_128_hexdigest(raw[: 8 + struct.unpack("<Q", raw[:8])[0]])
    rewrite_index(path, lambda d: d["metadata"]["fqnckpt"]["files"][SHARD1].__setitem__("header", new))
    err = rejected(path, DuplicateTensorError, key, SHARD1, SHARD2)
    assert err.files == [SHARD1, SHARD2]


def test_total_size_disagrees_with_files(tmp_path):
    path, idx = saved(tmp_path)
    declared = idx.metadata.total_size
    assert declared == 4 * (6 * 5 + 5 + 5 * 4 + 4)
    rewrite_index(path, lambda d: d["metadata"].__setitem__("total_size", declared + 4))
    rejected(path, CorruptCheckpointError, path / INDEX, "total_size", declared + 4, declared)
    assert any("total_size" in p for p in checkpoint.verify(path).problems)


def test_stray_files_ignored_with_warning(tmp_path):
    path, _ = saved(tmp_path)
    write_st(path / "model-00001-of-00001.safetensors", {"a.weight": _f32_entry((5, 6), 0)}, b"\0" * 120)
    m = Net(99)
    with pytest.warns(StrayFileWarning, match="model-00001-of-00001.safetensors"):
        checkpoint.load(m, path)
    assert_unchanged(m, snapshot(Net(1)))  # values from the indexed files only


def _f32_entry(shape, begin):
    n = 4
    for d in shape:
        n *= d
    return {"dtype": "F32", "shape": list(shape), "data_offsets": [begin, begin + n]}


@pytest.mark.parametrize(
    "content,exc,needle",
    [
        (b"", CorruptCheckpointError, "not JSON"),
        (b"{}", CorruptCheckpointError, "schema"),
        (b"\x00\x01binary", CorruptCheckpointError, "not JSON"),
        (b'{"weight_map": ["a.weight"]}', CorruptCheckpointError, "schema"),
        (b'{"weight_map": {}}', CorruptCheckpointError, "fqnckpt"),
        (None, CheckpointNotFoundError, "no model.safetensors.index.json"),
    ],
    ids=["empty_file", "empty_object", "binary", "wrong_types", "empty_weight_map", "missing"],
)
def test_empty_missing_or_non_json_index(tmp_path, content, exc, needle):
    path, idx = saved(tmp_path)
    p = path / INDEX
    if content is None:
        os.remove(p)
    elif content == b'{"weight_map": {}}':
        data = json.loads(p.read_text())
        data["weight_map"] = {}
        content = json.dumps(data).encode()
        p.write_bytes(content)
    else:
        p.write_bytes(content)
    rejected(path, exc, path, needle)


# -- pickles ----------------------------------------------------------------------------------------


class _OpenPayload:
    """Unpickling it would create the canary file."""

    def __init__(self, canary):
        self.canary = canary

    def __reduce__(self):
        return (open, (self.canary, "w"))


class _SystemPayload(_OpenPayload):
    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


@pytest.mark.parametrize("form", ["zip", "legacy", "raw_pickle", "disguised_safetensors"])
def test_reduce_payload_never_runs(tmp_path, form):
    canary = tmp_path / "canary"
    obj = {"w": torch.zeros(2), "x": _SystemPayload(str(canary)), "y": _OpenPayload(str(canary))}
    (tmp_path / "src").mkdir()  # a folder of its own: "out" beside it is no folder inside a checkpoint
    p = tmp_path / "src" / ("model.safetensors" if form == "disguised_safetensors" else "model.pt")
    if form == "raw_pickle":
        with open(p, "wb") as f:
            pickle.dump(obj, f, protocol=2)
    else:
        torch.save(obj, p, _use_new_zipfile_serialization=form != "legacy")
    with pytest.raises(UnsafePickleError) as ei:
        migrate(p, tmp_path / "out")
    assert ei.value.globals == ["io.open", "posix.system"] and str(p) in str(ei.value)
    assert not (tmp_path / "out").exists()
    if form == "disguised_safetensors":  # the loader never unpickles: it is not a safetensors file
        d = tmp_path / "ck"
        d.mkdir()
        os.replace(p, d / "model.safetensors")
        rejected(d, CorruptCheckpointError, d / "model.safetensors", target=_WNet())
    assert not canary.exists()


class _WNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.arange(2.0))


def test_unsafe_globals_listed(tmp_path):
    import argparse
    import pathlib

    p = tmp_path / "train.pt"
    obj = {
        "model": {"w": torch.ones(3)},
        "args": argparse.Namespace(lr=1.0),
        "out": pathlib.PurePosixPath("x"),
    }
    torch.save(obj, p)
    with pytest.raises(UnsafePickleError) as ei:
        migrate(p, tmp_path / "out")
    assert ei.value.globals == ["argparse.Namespace", "pathlib.PurePosixPath"]
    assert "argparse.Namespace" in str(ei.value) and "pathlib.PurePosixPath" in str(ei.value)
    assert str(p) in str(ei.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["wrong_magic", "not_torch_zip", "truncated_zip"])
def test_damaged_zip(tmp_path, damage):
    p = tmp_path / "model.pt"
    torch.save({"w": torch.ones(3)}, p)
    raw = p.read_bytes()
    assert raw[:4] == b"PK\x03\x04"
    if damage == "wrong_magic":
        p.write_bytes(b"PK\x05\x06" + raw[4:])
        exc = UnsupportedFormatError
    elif damage == "not_torch_zip":
        p.unlink()
        with zipfile.ZipFile(p, "w") as z:
            z.writestr("notes.txt", "hello")
        exc = CorruptCheckpointError
    else:
        p.write_bytes(raw[: len(raw) // 2])
        exc = CorruptCheckpointError
    with pytest.raises(exc) as ei:
        migrate(p, tmp_path / "out")
    assert str(p) in str(ei.value)
    assert not (tmp_path / "out").exists()


# -- values -----------------------------------------------------------------------------------------


def test_non_tensor_in_state_dict(tmp_path):
    with pytest.raises(TypeError, match="'step'"):
        checkpoint.save({"w": torch.ones(2), "step": 3}, tmp_path / "ck")
    assert os.listdir(tmp_path) == []  # refused before touching the disk
    checkpoint.save({"w": torch.arange(2.0)}, tmp_path / "ck")
    target = {"w": torch.zeros(2), "step": 3}
    with pytest.raises(TypeError, match="'step'"):
        checkpoint.load(target, tmp_path / "ck")
    assert torch.equal(target["w"], torch.zeros(2)) and target["step"] == 3


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight


def test_tied_group_with_two_different_values_refused(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "ck"
    d.mkdir()
    emb, head = torch.randn(5, 3), torch.randn(5, 3)
    save_file({"emb.weight": emb, "head.weight": head}, str(d / "model.safetensors"))
    target = Tied()
    e = rejected(d, TiedValuesMismatchError, "emb.weight", "head.weight", d, target=target)
    assert e.keys == ["emb.weight", "head.weight"] and e.files == ["model.safetensors"]
    assert target.head.weight is target.emb.weight
    # Control: the same two names holding equal values load.
    save_file({"emb.weight": emb, "head.weight": emb.clone()}, str(d / "model.safetensors"))
    rep = checkpoint.load(target, d)
    assert torch.equal(target.emb.weight, emb) and torch.equal(target.head.weight, emb) and rep.ok


class OtherArch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 7)
        self.b = nn.Linear(7, 4)


def test_other_architecture_shape_report_nothing_copied(tmp_path):
    path, _ = saved(tmp_path)
    target = OtherArch()
    e = rejected(path, CheckpointMismatchError, "shape-mismatched", path, target=target)
    shapes = {m.key: (m.checkpoint_shape, m.target_shape) for m in e.report.shape_mismatched}
    assert shapes == {
        "a.weight": ([5, 6], [7, 6]),
        "a.bias": ([5], [7]),
        "b.weight": ([4, 5], [4, 7]),
    }
    assert e.report.missing_keys == [] and e.report.unexpected_keys == []
    assert e.report.loaded_keys == ["b.bias"]  # would match, but a strict failure copies nothing


def test_all_rejections_in_one_load_leave_values(tmp_path):
    """A load with strict=False still copies nothing when the checkpoint itself is broken."""
    path, _ = saved(tmp_path)
    os.remove(path / SHARD1)
    rejected(path, MissingShardError, SHARD1, strict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path2, _ = saved(tmp_path / "ok")
        m = Net(99)
        checkpoint.load(m, path2, strict=False)
        assert_unchanged(m, snapshot(Net(1)))
