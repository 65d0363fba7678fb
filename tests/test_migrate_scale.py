"""Linear in the tensor count, pinned by counting work, never by timing: each
safetensors header is parsed once per file however many tensors are read; DCP is read in
batches, not one ``dcp.load`` per tensor; a 5,000-tensor migration keeps every tensor.
Speed itself is measured by tests/bench/migrate_scale.py."""

from __future__ import annotations

import math
import os
import warnings

import torch
from safetensors.torch import save_file

import checkpoint
from checkpoint.sources import dcp as dcp_source
from checkpoint.sources import open_source
from checkpoint.storage import reader as st_reader


def test_one_header_parse_per_file(tmp_path, monkeypatch):
    # Each header is validated once, by the one safetensors reader (CheckpointReader), however
    # many tensors are read; data is read with preadv at the validated byte ranges.
    opened: list[str] = []
    real_open = st_reader.open_safetensors_with_header
    monkeypatch.setattr(st_reader, "open_safetensors_with_header",
                        lambda p, *a, **k: opened.append(os.path.basename(p)) or real_open(p, *a, **k))  # fmt: skip
    d = tmp_path / "shards"
    d.mkdir()
    want = {}
    for f in range(3):
        sd = {f"f{f}.w{i}": torch.full((2,), float(i)) for i in range(1500)}
        save_file(sd, str(d / f"part{f}.safetensors"))
        want.update(sd)
    with open_source(d) as src:
        got = {k: src.get(k) for k in src.keys()}
    assert sorted(opened) == ["part0.safetensors", "part1.safetensors", "part2.safetensors"]
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())


def test_dcp_read_in_batches(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    n = 600
    sd = {f"layers.{i}.w": torch.full((16,), float(i)) for i in range(n)}  # 64 bytes each
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    calls = []
    real = dcp_source._DCPReader.load
    monkeypatch.setattr(
        dcp_source._DCPReader, "load", lambda self, keys: calls.append(len(keys)) or real(self, keys)
    )
    monkeypatch.setattr(dcp_source, "READ_BATCH_BYTES", 64 * 100)
    checkpoint.migrate(tmp_path / "dcp", tmp_path / "out")
    assert sum(calls) == n and len(calls) == math.ceil(n / 100)
    with checkpoint.open_checkpoint(tmp_path / "out") as r:
        assert r.keys() == sorted(sd) and all(torch.equal(r.get(k), v) for k, v in sd.items())


def test_many_tensor_migration_keeps_every_tensor(tmp_path):
    n = 5_000  # the 20,000-tensor round trip and timings: tests/bench/migrate_scale.py
    sd = {f"layers.{i // 64}.experts.{i % 64}.w": torch.full((1,), float(i)) for i in range(n)}
    save_file(sd, str(tmp_path / "moe.safetensors"))
    report = checkpoint.migrate(tmp_path / "moe.safetensors", tmp_path / "out")
    assert report.ok and len(report.entries) == n
    with checkpoint.open_checkpoint(tmp_path / "out") as r:
        assert r.keys() == sorted(sd)
        assert all(r.get(k).item() == v.item() for k, v in sd.items())
