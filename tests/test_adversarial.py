"""Adversarial inputs found by review: each test pins one defect that was fixed (bad input must
raise our specific error naming the file / key, never load wrong values, never hang, and the CLI
must exit 2 with one line). Inputs are crafted in tmp_path per the safetensors / HF index specs.
"""

from __future__ import annotations

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
