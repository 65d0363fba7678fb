"""Single-process save / load / verify: layout, dtypes, wrappers, reports, errors, streaming."""

from __future__ import annotations

import dataclasses
import errno
import json
import os

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open

import checkpoint
import fqn
from checkpoint import (
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    DuplicateTensorError,
    TensorSpec,
    UnsafePathError,
    open_checkpoint,
    parse_size,
)
from checkpoint.storage.layout import plan_layout
from tests.helpers import assert_same_state


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.lin(x))


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 16, bias=False)
        self.register_buffer("steps", torch.tensor(7, dtype=torch.int64))
        self.register_buffer("cache", torch.zeros(3), persistent=False)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


EAGER_KEYS = sorted(k for k in Small().state_dict())


def test_parse_size_hf_semantics():
    assert (
        parse_size("5GB") == 5 * 10**9
        and parse_size("20MB") == 20 * 10**6
        and parse_size("2GiB") == 2 * 2**30
    )
    assert parse_size(123) == 123 and parse_size("1.5KB") == 1500
    for bad in ("5 parsecs", 0, -1, "abc", True):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)


def test_layout_split_names_offsets_and_header_validated_by_safetensors(tmp_path):
    specs = [TensorSpec(f"t{i}", (10, 10), torch.float32) for i in range(5)]  # 400 bytes each
    lay = plan_layout(specs, 1000)
    assert [f.name for f in lay.files] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert [[s.spec.fqn for s in f.slots] for f in lay.files] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert lay.total_size == 2000 and all(len(f.header) % 8 == 0 for f in lay.files)
    f0 = lay.files[0]
    assert (
        f0.slots[0].begin == len(f0.header)
        and f0.slots[1].begin == len(f0.header) + 400
        and f0.size == len(f0.header) + 800
    )
    big = plan_layout([TensorSpec("big", (1000,), torch.float32), TensorSpec("s", (1,), torch.int8)], 100)
    assert [[s.spec.fqn for s in f.slots] for f in big.files] == [["big"], ["s"]]  # oversize tensor alone
    with pytest.raises(ValueError, match="duplicated"):
        plan_layout([specs[0], specs[0]], 1000)


def test_roundtrip_layout_and_exact_values_all_dtypes(tmp_path):
    torch.manual_seed(0)
    sd = {
        "f32": torch.randn(5, 3), "f64": torch.randn(2, 2, dtype=torch.float64), "bf16": torch.randn(7, dtype=torch.bfloat16),
        "f16": torch.randn(3, 3, dtype=torch.float16), "i64": torch.arange(-5, 5), "i32": torch.tensor([2**31 - 1], dtype=torch.int32),
        "i8": torch.tensor([-128, 127], dtype=torch.int8), "u8": torch.arange(256, dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
        "f8": torch.randn(4).to(torch.float8_e4m3fn), "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4),
        "noncontig": torch.arange(12.0).reshape(3, 4).t(),
    }  # fmt: skip
    idx = checkpoint.save(sd, tmp_path / "ck", max_shard_size=64)
    files = sorted(os.listdir(tmp_path / "ck"))
    n = len(idx.files())
    assert n > 1 and files == sorted([*idx.files(), "model.safetensors.index.json"])
    raw = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
    assert list(raw["weight_map"]) == sorted(sd) and raw["metadata"]["total_size"] == sum(
        v.numel() * v.element_size() for v in sd.values()
    )
    for fname in idx.files():
        with safe_open(str(tmp_path / "ck" / fname), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():
                assert idx.weight_map[k] == fname
                got = f.get_tensor(k)
                assert_same_state(got, sd[k], where=k)
    assert checkpoint.verify(tmp_path / "ck").ok
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    rep = checkpoint.load(dst, tmp_path / "ck")
    assert rep.loaded_keys == sorted(sd) and rep.dtype_converted == []
    assert_same_state(dst, sd)


def test_non_tensor_value_raises_typeerror_naming_key_and_writes_nothing(tmp_path):
    with pytest.raises(TypeError, match="'step'"):
        checkpoint.save({"w": torch.ones(2), "step": 3}, tmp_path / "ck")
    assert os.listdir(tmp_path) == []


def test_meta_tensor_raises_typeerror_naming_key_and_writes_nothing(tmp_path):
    with pytest.raises(TypeError, match="'w'.*meta device"):
        checkpoint.save({"w": torch.empty(2, device="meta")}, tmp_path / "ck")
    assert [p for p in os.listdir(tmp_path) if not p.startswith(".")] == []


def _wrappers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def ckpt_wrapped():
        m = Small()
        for i, b in enumerate(m.blocks):
            m.blocks[i] = checkpoint_wrapper(b)
        return m

    return {
        "eager": Small,
        "compiled": lambda: torch.compile(Small()),
        "dataparallel": lambda: nn.DataParallel(Small()),
        "checkpoint_wrapper": ckpt_wrapped,
        "compiled_dp": lambda: torch.compile(nn.DataParallel(Small())),
    }


@pytest.mark.parametrize("kind", list(_wrappers()))
def test_wrapped_models_roundtrip_in_eager_names(tmp_path, kind):
    torch.manual_seed(0)
    src = _wrappers()[kind]()
    idx = checkpoint.save(src, tmp_path / "ck")
    assert sorted(idx.weight_map) == EAGER_KEYS  # no _orig_mod. / module. / _checkpoint_wrapped_module.
    eager = Small()
    rep = checkpoint.load(eager, tmp_path / "ck")
    assert rep.ok and rep.loaded_keys == EAGER_KEYS
    with open_checkpoint(tmp_path / "ck") as r:
        for k, v in eager.state_dict().items():
            assert torch.equal(r.get(k), v), k
    # and back into the same kind of wrapper
    torch.manual_seed(1)
    again = _wrappers()[kind]()
    assert checkpoint.load(again, tmp_path / "ck").ok
    # The values are src's (eager was initialized differently), not only self-consistent.
    src_tensors = {t.fqn: t.tensor for t in fqn.eager_tensors(src)}
    for k in EAGER_KEYS:
        assert torch.equal(eager.state_dict()[k], src_tensors[k]), k
    for a, b in zip(
        sorted(eager.state_dict().items()), sorted(checkpoint.state.module_state(again).by_name().items())
    ):
        assert a[0] == b[0] and torch.equal(a[1], b[1].tensor.detach())


def test_ddp_single_rank_roundtrip(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ddp = DDP(Small())
        idx = checkpoint.save(ddp, tmp_path / "ck")
        assert sorted(idx.weight_map) == EAGER_KEYS
        eager = Small()
        assert checkpoint.load(eager, tmp_path / "ck").ok
        for k, v in ddp.module.state_dict().items():
            assert torch.equal(eager.state_dict()[k], v)
        ddp2 = DDP(Small())
        assert checkpoint.load(ddp2, tmp_path / "ck").ok
        assert torch.equal(ddp2.module.head.weight, ddp.module.head.weight)
    finally:
        dist.destroy_process_group()


def test_report_shapes_dtypes_and_dtype_option(tmp_path):
    torch.manual_seed(0)
    src = Small()
    checkpoint.save(src, tmp_path / "ck")
    other = Small()
    other.head = nn.Linear(8, 17, bias=False)
    with pytest.raises(CheckpointMismatchError, match="head.weight") as ei:
        checkpoint.load(other, tmp_path / "ck")
    sm = ei.value.report.shape_mismatched
    assert [(m.key, m.checkpoint_shape, m.target_shape) for m in sm] == [("head.weight", [16, 8], [17, 8])]
    rep = checkpoint.load(other, tmp_path / "ck", strict=False)
    assert "head.weight" not in rep.loaded_keys and torch.equal(other.emb.weight, src.emb.weight)
    half = Small()
    rep = checkpoint.load(half, tmp_path / "ck", dtype=torch.bfloat16)
    assert half.emb.weight.dtype == torch.bfloat16 and half.steps.dtype == torch.int64
    conv = {c.key: (c.checkpoint_dtype, c.target_dtype) for c in rep.dtype_converted}
    assert (
        conv["emb.weight"] == ("float32", "bfloat16")
        and "steps" not in conv
        and len(conv) == len(EAGER_KEYS) - 1
    )
    assert torch.equal(half.emb.weight, src.emb.weight.to(torch.bfloat16))


def test_exists_overwrite_and_files_beside(tmp_path):
    checkpoint.save({"w": torch.ones(2)}, tmp_path / "ck")
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        checkpoint.save({"w": torch.zeros(2)}, tmp_path / "ck")
    with pytest.raises(FileExistsError):
        checkpoint.save({"w": torch.zeros(2)}, tmp_path / "ck")
    checkpoint.save({"v": torch.zeros(3)}, tmp_path / "ck", overwrite=True)
    with open_checkpoint(tmp_path / "ck") as r:
        assert r.keys() == ["v"]
    # A directory of other files is no checkpoint (as an object-store prefix is not): a save goes
    # in beside them and keeps them; a file it would replace that no record names is refused.
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    (tmp_path / "home" / "extra_state.json").write_text("also mine")
    with pytest.raises(CheckpointExistsError, match=r"\['extra_state.json'\] exist there and no record"):
        checkpoint.save({"w": torch.ones(2)}, tmp_path / "home", overwrite=True, extra_state={"step": 1})
    assert sorted(os.listdir(tmp_path / "home")) == ["extra_state.json", "notes.txt"]
    # Without overwrite, a part another run left there (extra state, an optimizer) is refused by name
    # rather than left where readers of an unrecorded checkpoint would take it for the new one's.
    with pytest.raises(CheckpointExistsError, match=r"\['extra_state.json'\] exist there and no record"):
        checkpoint.save({"w": torch.ones(2)}, tmp_path / "home")
    checkpoint.save({"w": torch.ones(2)}, tmp_path / "home", overwrite=True)
    with pytest.raises(CheckpointMismatchError, match="extra_state.step"):  # the record names no extra state
        checkpoint.load({"w": torch.zeros(2)}, tmp_path / "home", extra_state={"step": 0})
    assert (tmp_path / "home" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "home" / "extra_state.json").read_text() == "also mine"
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):  # a checkpoint now
        checkpoint.save({"w": torch.ones(2)}, tmp_path / "home")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointExistsError, match="not a checkpoint"):
        checkpoint.save({"w": torch.ones(2)}, tmp_path / "file", overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["ck", "file", "home"]


def test_verify_reports_flipped_byte_with_its_file(tmp_path):
    torch.manual_seed(0)
    idx = checkpoint.save(Small(), tmp_path / "ck", max_shard_size=400)
    rep = checkpoint.verify(tmp_path / "ck")
    assert rep.ok and len(rep.files) == len(idx.files()) > 1 and rep.total_size == idx.metadata.total_size
    victim = idx.files()[1]
    p = tmp_path / "ck" / victim
    data = bytearray(p.read_bytes())
    data[-3] ^= 0x01  # one data bit
    p.write_bytes(bytes(data))
    rep = checkpoint.verify(tmp_path / "ck")
    assert not rep.ok and rep.bad_files == [victim] and len(rep.problems) == 1 and victim in rep.problems[0]
    with open_checkpoint(tmp_path / "ck") as r, pytest.raises(checkpoint.ChecksumMismatchError, match=victim):
        r.verify_file(victim)
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at"):
        checkpoint.verify(tmp_path / "nothing")


def test_unsafe_index_entries_refused(tmp_path):
    outside = tmp_path / "outside.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(outside))
    d = tmp_path / "ck"
    d.mkdir()
    for entry, why in [("../outside.safetensors", "'..'"), (str(outside), "absolute")]:
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {"w": entry}})
        )
        with pytest.raises(UnsafePathError, match=why):
            checkpoint.load({"w": torch.zeros(2)}, d)
    os.symlink(outside, d / "link.safetensors")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"w": "link.safetensors"}})
    )
    with pytest.raises(UnsafePathError, match="symlink"):
        open_checkpoint(d)


def test_duplicate_tensor_and_corrupt_index(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.zeros(2), "v": torch.ones(1)}, str(tmp_path / "b.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"w": "a.safetensors", "v": "b.safetensors"}})
    )
    with pytest.raises(DuplicateTensorError) as ei:
        open_checkpoint(tmp_path)
    assert ei.value.key == "w" and ei.value.files == ["a.safetensors", "b.safetensors"]
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="model.safetensors.index.json.*not JSON"):
        open_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": 3}}))
    with pytest.raises(CorruptCheckpointError, match="schema"):
        open_checkpoint(tmp_path)
    with pytest.raises(CheckpointNotFoundError):
        checkpoint.load({"w": torch.ones(2)}, tmp_path / "absent")


def test_hf_single_file_dir_layout(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.arange(4.0)}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    dst = {"w": torch.zeros(4)}
    assert checkpoint.load(dst, tmp_path).loaded_keys == ["w"] and torch.equal(dst["w"], torch.arange(4.0))


def test_save_streaming_contract(tmp_path):
    specs = [TensorSpec("b.weight", (4, 4), torch.float32), TensorSpec("a.bias", (4,), torch.bfloat16)]
    calls = []

    def fetch(spec):
        calls.append(spec.fqn)
        return torch.full(spec.shape, float(len(calls)), dtype=spec.dtype)

    idx = checkpoint.save_streaming(
        tmp_path / "ck", specs, fetch, max_shard_size="64B", alias_groups=[["b.weight", "c.weight"]],
        extra_files={"migration_report.json": b'{"ok": true}'},
    )  # fmt: skip
    assert sorted(calls) == ["a.bias", "b.weight"] and len(calls) == 2
    assert (tmp_path / "ck" / "migration_report.json").read_bytes() == b'{"ok": true}'
    assert idx.metadata.fqnckpt.alias_groups == [["b.weight", "c.weight"]] and len(idx.files()) == 2
    with open_checkpoint(tmp_path / "ck") as r:
        assert r.spec("a.bias") == specs[1] and r.get("a.bias").dtype == torch.bfloat16
        assert torch.equal(r.get("b.weight"), torch.full((4, 4), float(calls.index("b.weight") + 1)))
    with pytest.raises(ValueError, match="'x'"):
        checkpoint.save_streaming(
            tmp_path / "bad", [TensorSpec("x", (2,), torch.float32)], lambda s: torch.zeros(3)
        )
    assert not (tmp_path / "bad").exists()


def test_disk_full_is_write_error_and_previous_checkpoint_intact(tmp_path, monkeypatch):
    checkpoint.save({"w": torch.ones(4)}, tmp_path / "ck")
    before = {p: (tmp_path / "ck" / p).read_bytes() for p in os.listdir(tmp_path / "ck")}

    def full(fd, data, off):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(CheckpointWriteError, match="No space left") as ei:
        checkpoint.save({"w": torch.zeros(4)}, tmp_path / "ck", overwrite=True)
    assert isinstance(ei.value, OSError)
    monkeypatch.undo()
    assert {p: (tmp_path / "ck" / p).read_bytes() for p in os.listdir(tmp_path / "ck")} == before
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # staging removed


def test_tensor_spec_checks_and_its_trusted_form():
    """TensorSpec refuses what safetensors cannot store; ``TensorSpec.trusted`` (shapes of a
    validated header) builds an equal spec with the same sizes."""
    import numpy as np

    s = TensorSpec("w", [np.int64(3), 4], torch.bfloat16)
    assert s.shape == (3, 4) and type(s.shape[0]) is int and s.numel == 12 and s.nbytes == 24
    t = TensorSpec.trusted("w", (3, 4), torch.bfloat16)
    assert t == s and hash(t) == hash(s) and (t.numel, t.nbytes) == (12, 24)
    with pytest.raises(ValueError, match="tensor 'w': negative dimension"):
        TensorSpec("w", (3, -1), torch.float32)
    with pytest.raises(TypeError, match="tensor 'w': dtype torch.qint8 cannot be stored"):
        TensorSpec("w", (3,), torch.qint8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.fqn = "v"


def test_state_dict_entries_group_only_exact_aliases():
    """A flat state_dict's names of one tensor (same address, shape, strides, dtype) are one entry
    with aliases, in key order; a view at the same address in another shape or dtype, a view at
    another address and an empty tensor are entries of their own."""
    from checkpoint.state import dict_state

    t = torch.arange(16, dtype=torch.float32)
    sd = {"a": t, "c": t.view(2, 8), "b": t, "d": t.view(torch.int32), "e": t[1:], "f": t,
          "z": torch.empty(0), "y": torch.empty(0), "g": t.view(2, 8)}  # fmt: skip
    state = dict_state(sd)
    got = [(e.fqn, e.aliases, e.module_names) for e in state.entries]
    assert got == [("a", ["b", "f"], ["a", "b", "f"]), ("c", ["g"], ["c", "g"]), ("d", [], ["d"]), ("e", [], ["e"]),
                   ("z", [], ["z"]), ("y", [], ["y"])]  # fmt: skip
    assert state.by_name() == {n: e for e in state.entries for n in e.names}
    assert list(state.by_name()) == ["a", "b", "f", "c", "g", "d", "e", "z", "y"]
