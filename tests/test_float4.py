"""``float4_e2m1fn_x2`` (safetensors ``F4``: two FP4 values per byte) is stored and read wherever
the other 1-byte dtypes are, as safetensors itself does it: the header's shape counts FP4 values,
so its last dimension is twice torch's (``checkpoint/storage/st_header.py`` ``PACKED``). A 0-dim
tensor (no header shape) and a header whose last dimension does not end in whole bytes are
refused by name, and so is any conversion to or from it (torch has none), before anything is
written or changed."""

from __future__ import annotations

import json
import struct
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file

import checkpoint
from checkpoint.dcp import StorageReader, StorageWriter
from checkpoint.errors import UnsavableTypeError, UnsupportedTensorError
from checkpoint.sources import open_source
from snapshot import Snapshot

F4 = torch.float4_e2m1fn_x2
RAW = torch.tensor([[0x01, 0x23, 0x45, 0x67, 0x89, 0xAB], [0xCD, 0xEF, 0x10, 0x32, 0x54, 0xFF]], dtype=torch.uint8)


class _Quant(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.register_buffer("q", torch.zeros(2, 6, dtype=torch.uint8).view(F4))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _header(path) -> dict:
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def test_save_load_verify_inspect_round_trip_as_safetensors_does(tmp_path, capsys):
    m = _Quant()
    m.q.copy_(RAW.view(F4))
    checkpoint.save(m, tmp_path / "ck")
    shard = next((tmp_path / "ck").glob("model-*.safetensors"))
    assert _header(shard)["q"] == {"dtype": "F4", "shape": [2, 12], "data_offsets": [24, 36]}
    with safe_open(str(shard), "pt") as f:  # safetensors reads what we wrote
        assert f.get_tensor("q").dtype == F4 and torch.equal(_bytes(f.get_tensor("q")), RAW)
    m2 = _Quant()
    checkpoint.load(m2, tmp_path / "ck")
    assert torch.equal(_bytes(m2.q), RAW)
    assert checkpoint.verify(tmp_path / "ck").ok
    with open_source(tmp_path / "ck") as src:
        assert (src.spec("q").shape, src.spec("q").dtype) == ((2, 6), F4) and torch.equal(_bytes(src.get("q")), RAW)
    from checkpoint.cli.main import main

    assert main(["--json", "inspect", str(tmp_path / "ck")]) == 0
    assert json.loads(capsys.readouterr().out)["dtypes"] == {"float32": 2, "float4_e2m1fn_x2": 1}


def test_files_of_safetensors_torch_dcp_and_pickles_read(tmp_path):
    save_file({"q": RAW.view(F4), "lin.weight": torch.ones(2, 2), "lin.bias": torch.ones(2)}, str(tmp_path / "st.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        dcp.save({"q": RAW.view(F4), "lin.weight": torch.ones(2, 2), "lin.bias": torch.ones(2)}, checkpoint_id=str(tmp_path / "dcp"))
        dcp.save({"q": RAW.view(F4)}, storage_writer=StorageWriter(str(tmp_path / "ours")))
    torch.save({"q": RAW.view(F4), "lin.weight": torch.ones(2, 2), "lin.bias": torch.ones(2)}, tmp_path / "c.pt")
    for path in ("st.safetensors", "dcp", "c.pt"):
        m = _Quant()
        checkpoint.load(m, tmp_path / path)
        assert torch.equal(_bytes(m.q), RAW), path
    target = {"q": torch.zeros(2, 6, dtype=torch.uint8).view(F4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=StorageReader(str(tmp_path / "ours")))
    assert torch.equal(_bytes(target["q"]), RAW)
    checkpoint.migrate(tmp_path / "c.pt", tmp_path / "mig")
    shard = next((tmp_path / "mig").glob("model-*.safetensors"))
    assert _header(shard)["q"]["shape"] == [2, 12] and checkpoint.verify(tmp_path / "mig").ok
    checkpoint.save({"q": RAW.view(F4)}, "memory://fqnckpt-f4/ck", overwrite=True)
    back = {"q": torch.zeros(2, 6, dtype=torch.uint8).view(F4)}
    checkpoint.load(back, "memory://fqnckpt-f4/ck")
    assert torch.equal(_bytes(back["q"]), RAW) and checkpoint.verify("memory://fqnckpt-f4/ck").ok


def test_a_0_dim_float4_is_refused_by_name_and_nothing_written(tmp_path):
    z = torch.zeros((), dtype=torch.uint8).view(F4)
    why = ("is a 0-dim float4_e2m1fn_x2, which safetensors cannot store (F4 counts its values along the "
           "last dimension); give it one dimension")  # fmt: skip
    with pytest.raises(UnsavableTypeError) as e:
        checkpoint.save({"z": z}, tmp_path / "a")
    assert str(e.value) == f"saving {tmp_path / 'a'}: 'z': {why}; nothing was written"
    with pytest.raises(BaseException) as e, warnings.catch_warnings():  # inside DCP's CheckpointException
        warnings.simplefilter("ignore")
        dcp.save({"z": z}, storage_writer=StorageWriter(str(tmp_path / "b")))
    assert "tensor 'z': a 0-dim float4_e2m1fn_x2 cannot be stored in safetensors" in str(e.value)
    torch.save({"z": z}, tmp_path / "z.pt")
    with pytest.raises(UnsupportedTensorError) as e:
        checkpoint.migrate(tmp_path / "z.pt", tmp_path / "c")
    assert str(e.value) == f"{tmp_path / 'z.pt'}: tensor 'z': {why}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["z.pt"]


def test_conversions_to_or_from_float4_are_refused_before_anything_changes(tmp_path):
    save_file({"q": RAW.view(F4), "lin.weight": torch.ones(2, 2), "lin.bias": torch.ones(2)}, str(tmp_path / "st.safetensors"))
    path = tmp_path / "st.safetensors"
    m = _Quant()
    m.q = torch.zeros(2, 6)  # a float32 target for the stored F4
    snap = Snapshot(m)
    for lossy in (False, True):
        with pytest.raises(UnsupportedTensorError) as e:
            checkpoint.load(m, path, allow_lossy=lossy)
        assert str(e.value) == (f"{path}: tensor 'q': is float4_e2m1fn_x2, the target is float32: torch has no "
                                "conversion between them (float4_e2m1fn_x2 holds two packed FP4 values); load it "
                                "into a target of the stored dtype")  # fmt: skip
    snap.assert_unchanged()
    target = {"q": torch.zeros(2, 6)}
    with pytest.raises(BaseException) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=StorageReader(str(path)))
    assert "tensor 'q': is float4_e2m1fn_x2, the target is float32: torch has no conversion" in str(e.value)
    assert torch.equal(target["q"], torch.zeros(2, 6))


def test_a_header_not_ending_in_whole_bytes_is_refused_naming_the_tensor(tmp_path):
    raw = json.dumps({"x": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}).encode()
    (tmp_path / "odd.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0\0")
    with pytest.raises(checkpoint.CorruptCheckpointError) as e:
        checkpoint.load({"x": torch.zeros(2, dtype=torch.uint8).view(F4)}, tmp_path / "odd.safetensors")
    assert str(e.value).endswith("tensor 'x': dtype F4 holds 2 elements per byte: shape [3] does not end in whole bytes")


def test_diff_compares_float4_bytes(tmp_path, capsys):
    from checkpoint.cli.main import main

    save_file({"q": RAW.view(F4)}, str(tmp_path / "a.safetensors"))
    other = RAW.clone()
    other[1, 5] = 0
    torch.save({"q": other.view(F4)}, tmp_path / "b.pt")
    assert main(["--json", "diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.pt")]) == 1
    assert json.loads(capsys.readouterr().out)["value_differs"] == ["q"]
    torch.save({"q": RAW.view(F4)}, tmp_path / "c.pt")
    assert main(["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "c.pt")]) == 0
