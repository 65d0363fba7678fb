"""Adversarial inputs found by review: each test pins one defect that was fixed (bad input must
raise our specific error naming the file / key, never load wrong values, never hang, and the CLI
must exit 2 with one line). Inputs are crafted in tmp_path per the safetensors / HF index specs.
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

import checkpoint
from checkpoint import CorruptCheckpointError
from checkpoint.cli import main as cli_main

INDEX = "model.safetensors.index.json"


def write_st(p, header_bytes: bytes, data: bytes = b"") -> None:
    """A safetensors file by hand: u64 LE header length, header bytes, data."""
    p.write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + data)


def run_cli(capsys, *argv) -> tuple[int, str]:
    rc = cli_main(list(argv))
    return rc, capsys.readouterr().err


# -- deeply nested JSON ------------------------------------------------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("where", ["index", "header"])
def test_deeply_nested_json_is_corrupt_not_recursion_error(tmp_path, capsys, where):
    path = tmp_path / "ck"
    checkpoint.save({"w": torch.arange(3.0)}, path)
    if where == "index":
        bad = path / INDEX
        bad.write_bytes(b'{"weight_map": ' + DEEP + b"}")
    else:
        os.remove(path / INDEX)
        bad = path / "model.safetensors"
        write_st(bad, b'{"w": ' + DEEP + b"}")
        os.remove(path / "model-00001-of-00001.safetensors")
    target = {"w": torch.zeros(3)}
    with pytest.raises(CorruptCheckpointError) as ei:
        checkpoint.load(target, path)
    assert str(bad) in str(ei.value)
    assert torch.equal(target["w"], torch.zeros(3))
    rep = checkpoint.verify(path)
    assert not rep.ok and str(bad) in rep.problems[0]
    rc, _ = run_cli(capsys, "verify", str(path))
    assert rc == 1


# -- alias groups of the index -----------------------------------------------------------------------


def _rewrite_index(path, fn) -> None:
    p = path / INDEX
    data = json.loads(p.read_text())
    fn(data["metadata"]["fqnckpt"])
    p.write_text(json.dumps(data))


def test_alias_group_never_overrides_a_stored_tensor(tmp_path):
    """An index claiming ``w`` is an alias of ``v`` while ``w`` is stored with its own values must
    not fill ``w`` from ``v`` (it did: a silent wrong load)."""
    path = tmp_path / "ck"
    checkpoint.save({"v": torch.full((3,), 1.0), "w": torch.full((3,), 2.0)}, path)
    _rewrite_index(path, lambda m: m.__setitem__("alias_groups", [["v", "w"]]))
    target = {"v": torch.zeros(3), "w": torch.zeros(3)}
    rep = checkpoint.load(target, path)
    assert torch.equal(target["v"], torch.full((3,), 1.0))
    assert torch.equal(target["w"], torch.full((3,), 2.0))
    assert rep.filled_from == {} and rep.loaded_keys == ["v", "w"]


@pytest.mark.parametrize("groups", [[[]], [["w"]]], ids=["empty", "single"])
def test_alias_group_shorter_than_two_is_corrupt(tmp_path, groups):
    path = tmp_path / "ck"
    checkpoint.save({"w": torch.arange(3.0)}, path)
    _rewrite_index(path, lambda m: m.__setitem__("alias_groups", groups))
    with pytest.raises(CorruptCheckpointError, match="alias_groups") as ei:
        checkpoint.load({"w": torch.zeros(3)}, path)
    assert str(path / INDEX) in str(ei.value)
