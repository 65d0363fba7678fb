"""Distributed save / load of DTensors (gloo, 127.0.0.1): each byte written once, by its owner;
a single process reads the result; loading reshards to other meshes and placements."""

from __future__ import annotations

import os

import torch

import checkpoint
from checkpoint import open_checkpoint
from checkpoint.launch import run_ranks


def reference_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "even": torch.randn(8, 6, generator=g),
        "uneven": torch.randn(7, 5, generator=g),
        "rep": torch.randn(3, 4, generator=g),
        "ints": torch.randint(-1000, 1000, (9, 2), generator=g),
        "flags": torch.rand(5, generator=g) > 0.5,
        "bf16": torch.randn(6, 10, generator=g).to(torch.bfloat16),
        "plain": torch.randn(4, generator=g),
        "scalar": torch.tensor(2.5),
    }


PLACEMENTS_1D = {"even": "S0", "uneven": "S0", "rep": "R", "ints": "S1", "flags": "S0", "bf16": "S1"}
PLACEMENTS_2D = {
    "even": ("S0", "S1"), "uneven": ("S1", "S0"), "rep": ("R", "R"), "ints": ("R", "S0"),
    "flags": ("S0", "R"), "bf16": ("S0", "S0"),
}  # fmt: skip
# Loading side: other placements than the ones saved (resharding).
LOAD_1D = {"even": "S1", "uneven": "R", "rep": "S0", "ints": "S0", "flags": "R", "bf16": "S0"}
LOAD_2D = {
    "even": ("S1", "R"), "uneven": ("S0", "S1"), "rep": ("S0", "S1"), "ints": ("S1", "R"),
    "flags": ("R", "S0"), "bf16": ("R", "S1"),
}  # fmt: skip


def _pl(code):
    from torch.distributed.tensor import Replicate, Shard

    codes = code if isinstance(code, tuple) else (code,)
    return [Replicate() if c == "R" else Shard(int(c[1])) for c in codes]


def _dtensors(mesh, placements, zero=False):
    from torch.distributed.tensor import distribute_tensor

    ref = reference_tensors()
    out = {}
    for k, v in ref.items():
        src = torch.zeros_like(v) if zero else v
        out[k] = distribute_tensor(src, mesh, _pl(placements[k])) if k in placements else src.clone()
    return out


def _worker(rank, world, path, save_pl, load_pl, mesh_shape):
    from torch.distributed.device_mesh import init_device_mesh

    from checkpoint.writer import stats

    mesh = init_device_mesh("cpu", mesh_shape)
    sd = _dtensors(mesh, save_pl)
    stats.reset()
    checkpoint.save(sd, path, max_shard_size=200)
    written = stats.bytes_written
    # Existing path without overwrite fails on every rank (no hang).
    try:
        checkpoint.save(sd, path)
        again = "no error"
    except checkpoint.CheckpointError as e:
        again = type(e).__name__
    target = _dtensors(mesh, load_pl, zero=True)
    stats.reset()
    rep = checkpoint.load(target, path)
    read = stats.bytes_read
    ref = reference_tensors()
    ok = {
        k: bool(torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, ref[k]))
        for k, v in target.items()
    }
    return {"written": written, "read": read, "again": again, "ok": ok, "loaded": rep.loaded_keys}


def _check(tmp_path, world, save_pl, load_pl, mesh_shape):
    path = str(tmp_path / "ck")
    res = run_ranks(_worker, world, path, save_pl, load_pl, mesh_shape, backend="gloo", timeout=120)
    ref = reference_tensors()
    for r in res:
        assert r["ok"] == {k: True for k in ref}, r["ok"]
        assert r["loaded"] == sorted(ref)
    assert res[0]["again"] == "CheckpointExistsError"
    assert all(r["again"] == "RankAgreementError" for r in res[1:])
    # A single process reads the plain HF layout with exact values.
    with open_checkpoint(path) as rd:
        assert rd.keys() == sorted(ref)
        assert all(torch.equal(rd.get(k), v) for k, v in ref.items())
        files = rd.files
    assert checkpoint.verify(path).ok and len(files) > 1
    # Each byte written exactly once: bytes written over all ranks == bytes of all shard files.
    on_disk = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    assert sum(r["written"] for r in res) == on_disk
    return res


def test_dtensor_save_load_2_ranks_1d_mesh(tmp_path):
    res = _check(tmp_path, 2, PLACEMENTS_1D, LOAD_1D, (2,))
    assert all(r["written"] > 0 for r in res)


def test_dtensor_save_load_4_ranks_2x2_mesh(tmp_path):
    res = _check(tmp_path, 4, PLACEMENTS_2D, LOAD_2D, (2, 2))
    assert all(r["written"] > 0 for r in res)
