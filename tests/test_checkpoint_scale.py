"""Many tensors (MoE checkpoints hold 10^4 to 10^5): a 20,000-tensor checkpoint round-trips
exactly, across several files, verifies, and its index stays small per tensor. Speed is checked by
tests/bench/checkpoint_bench.py, not here (no timed assertions); this test runs in seconds."""

from __future__ import annotations

import os

import torch

import checkpoint
from checkpoint.storage.format import index_name

N = 20_000


def test_20000_tensors_round_trip(tmp_path):
    base = torch.arange(N * 8, dtype=torch.float32).reshape(N, 8)
    sd = {f"layers.{i // 64}.experts.{i % 64}.w": base[i].clone() for i in range(N)}
    sd["layers.0.norm"] = torch.full((3,), 0.5, dtype=torch.bfloat16)  # a second dtype in the files
    idx = checkpoint.save(sd, tmp_path / "ck", max_shard_size=200_000)
    assert len(idx.files()) == 4 and set(idx.weight_map) == set(sd)
    assert idx.metadata.total_size == N * 32 + 6
    assert set(idx.metadata.fqnckpt.tensor_digests()) == set(sd)
    # Index bytes per tensor: weight_map entry + per-tensor digest (each ~60 bytes for these names).
    index_bytes = os.path.getsize(tmp_path / "ck" / index_name())
    assert index_bytes < 130 * (N + 1), index_bytes / (N + 1)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    rep = checkpoint.load(out, tmp_path / "ck")
    assert rep.ok and len(rep.loaded_keys) == N + 1
    assert all(torch.equal(out[k], v) for k, v in sd.items())
    assert checkpoint.verify(tmp_path / "ck").ok
