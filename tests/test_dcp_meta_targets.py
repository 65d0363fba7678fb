"""``dcp.load`` into meta-device targets through our ``StorageReader`` behaves as through torch's
``FileSystemReader``: under a process group DCP's default planner replaces them by tensors on the
group's device and both readers load the same values; without one torch's own planner raises
before any reader runs (both alike). A planner that leaves targets on the meta device would make
every copy a no-op that reports success: ``MetaTargetError`` naming them, before anything is
read (``checkpoint/dcp/reader.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import checkpoint
from checkpoint.dcp import StorageReader

SD = {"w": torch.arange(6.0).reshape(3, 2), "b": torch.tensor([7.0, -1.0])}


def _both(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        dcp.save(SD, checkpoint_id=str(tmp_path / "torch"))
    checkpoint.save(SD, tmp_path / "ours")
    return {"torch": lambda: dcp.FileSystemReader(str(tmp_path / "torch")),
            "ours": lambda: StorageReader(str(tmp_path / "ours"))}  # fmt: skip


def _meta_targets():
    return {"w": torch.empty(3, 2, device="meta"), "b": torch.empty(2, device="meta", dtype=torch.bfloat16)}


def test_meta_targets_load_as_with_torchs_reader_under_a_process_group(tmp_path):
    readers = _both(tmp_path)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        got = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's planner: "_get_pg_default_device will be deprecated"
            for name, reader in readers.items():
                got[name] = _meta_targets()
                dcp.load(got[name], storage_reader=reader())
    finally:
        dist.destroy_process_group()
    for name, sd in got.items():
        assert {k: (v.device.type, v.dtype) for k, v in sd.items()} == {"w": ("cpu", torch.float32), "b": ("cpu", torch.bfloat16)}, name
        assert torch.equal(sd["w"], SD["w"]) and torch.equal(sd["b"], SD["b"].to(torch.bfloat16)), name


def test_without_a_process_group_torchs_planner_refuses_for_both_readers(tmp_path):
    for name, reader in _both(tmp_path).items():
        with pytest.raises(BaseException) as e, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(_meta_targets(), storage_reader=reader())
        assert "Default process group has not been initialized" in str(e.value), name


class _KeepsMeta(DefaultLoadPlanner):
    """A planner that does not materialize meta targets (DefaultLoadPlanner minus _init_state_dict)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.original_state_dict = state_dict
        state_dict, self.mappings = flatten_state_dict(state_dict)
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator


def test_targets_left_meta_by_the_planner_are_refused_by_name(tmp_path):
    reader = _both(tmp_path)["ours"]
    target = {"w": torch.empty(3, 2, device="meta"), "b": torch.zeros(2)}
    b = target["b"]
    with pytest.raises(BaseException) as e, warnings.catch_warnings():  # inside DCP's CheckpointException
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=reader(), planner=_KeepsMeta())
    assert (f"loading {tmp_path / 'ours'}: target tensors ['w'] are on the meta device (no data to copy into); "
            "DCP's default planner replaces meta targets by new tensors only under an initialized process group; "
            "materialize them first (module.to_empty(device=...)) or load with a process group") in str(e.value)  # fmt: skip
    assert target["b"] is b and torch.equal(b, torch.zeros(2)) and target["w"].is_meta  # nothing read
