"""Every shape field is checked by one rule (``st_header.shape_problem``): a dimension torch
cannot hold (over 2**63 - 1, or dims whose strides overflow) in a safetensors header, in extra
state or in DCP metadata is a named CorruptCheckpointError on every path, and ``verify`` /
``inspect`` (torch-free) say the same as the torch readers."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
import torch

import checkpoint
from checkpoint.errors import CorruptCheckpointError
from checkpoint.storage.st_header import shape_problem

BAD = [[0, 2**63], [0, 2**62, 2], [2**62, 4, 0], [2**64 + 1]]


def _file(path, shape):
    head = json.dumps({"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]},
                       "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()  # fmt: skip
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"\0\0\x80\x3f")
    return path


def test_the_rule_agrees_with_torch():
    for shape in [[0, 2**63 - 1], [2**62, 1, 0], [3, 4], [], *BAD]:
        try:
            torch.empty(shape)
            holds = True
        except (RuntimeError, TypeError, OverflowError):
            holds = False
        assert (shape_problem(shape) is None) == holds, shape


@pytest.mark.parametrize("shape", BAD)
def test_header_shape_torch_cannot_hold_is_refused_on_every_path(tmp_path, shape):
    from checkpoint.sources import open_source
    from checkpoint.sources.st_headers import open_safetensors_headers

    p = _file(tmp_path / "m.safetensors", shape)
    for open_ in (checkpoint.open_checkpoint, open_source, open_safetensors_headers):
        with pytest.raises(CorruptCheckpointError, match="tensor 'a'|overflow") as e:
            open_(p)
        assert "m.safetensors" in str(e.value)
    assert not checkpoint.verify(p).ok
    if shape != BAD[0]:
        return  # the CLI (two interpreters) once: it goes through the readers above
    cli = [sys.executable, "-m", "checkpoint"]
    v = subprocess.run([*cli, "verify", str(p)], capture_output=True, text=True, timeout=120)
    i = subprocess.run([*cli, "inspect", str(p)], capture_output=True, text=True, timeout=120)
    assert v.returncode == 1 and "m.safetensors" in v.stdout + v.stderr
    assert i.returncode == 2 and "m.safetensors" in i.stdout + i.stderr and "Traceback" not in i.stderr


def test_extra_state_tensor_shape_torch_cannot_hold_is_refused(tmp_path):
    from checkpoint.storage.extra_state import ExtraStateFile, read_extra_state_file

    checkpoint.save({"w": torch.ones(2)}, tmp_path / "c", extra_state={"t": torch.zeros(0, 3)})
    f = tmp_path / "c" / "extra_state.json"
    doc = json.loads(f.read_text())
    text = json.dumps(doc).replace("[0, 3]", f"[0, {2**63}]")
    assert text != json.dumps(doc)
    f.write_text(text)
    with pytest.raises(CorruptCheckpointError, match="torch cannot hold"):
        read_extra_state_file(str(tmp_path / "c"))
    with pytest.raises(CorruptCheckpointError):
        checkpoint.load({"w": torch.zeros(2)}, tmp_path / "c", extra_state={})
    assert ExtraStateFile  # the schema is the one place


def test_dcp_chunk_outside_its_tensor_is_refused(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    from checkpoint.sources.dcp import _check_dcp_shapes
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(4, 2)}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    assert checkpoint.open_checkpoint  # the good checkpoint opens
    from checkpoint.sources import open_source

    open_source(tmp_path / "d").close()
    bad = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 2]),
                                [ChunkStorageMetadata(offsets=torch.Size([3, 0]), sizes=torch.Size([4, 2]))])  # fmt: skip
    with pytest.raises(CorruptCheckpointError, match="'w'.*outside"):
        _check_dcp_shapes(tmp_path / "d", "w", bad)


def test_header_check_of_all_shapes_at_once_agrees_with_the_rule():
    """check_header_shapes decides a whole header at once where it can; every verdict is the
    per-shape rule's (shapes the fast bound cannot clear go through the rule)."""
    from checkpoint.storage.st_header import check_header_shapes

    good = [[3, 4], [], [0, 2**63 - 1], [2**40, 2**20, 1], [1] * 70, [2**31, 2**31]]
    bad = [*BAD, [True, 2], [2, -1], [2.0], "3", [[2]], None]
    for shape in good + bad:
        head = {"__metadata__": {"format": "pt"}, "x": {"shape": [5, 6]}, "a": {"shape": shape}}
        if shape in good:
            assert shape_problem(shape) is None, shape
            check_header_shapes("m.safetensors", head)
            continue
        assert shape_problem(shape) is not None, shape
        with pytest.raises(CorruptCheckpointError, match="tensor 'a'") as e:
            check_header_shapes("m.safetensors", head)
        assert "m.safetensors" in str(e.value)
