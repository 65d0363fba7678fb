"""Every error about a tensor of a DCP checkpoint whose model sits in a container names the key
as DCP stores it, container included (``model.layers.0.weight``), not the name inside the
container (``layers.0.weight``): ``checkpoint.sources.base.Source.stored_key``, used by every
error site of the plan stage (``checkpoint.plan.values.stored_key``) and by ``migrate``."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import checkpoint
from checkpoint.errors import LossyConversionError, UnsupportedTensorError
from fqn.errors import FlatParamError
from snapshot import Snapshot


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])


def _save(path, weight):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        dcp.save({"model": {"layers": {"0": {"weight": weight, "bias": torch.ones(2)}}}, "step": 3},
                 checkpoint_id=str(path))  # fmt: skip


@pytest.mark.parametrize("weight,why", [
    (torch.full((2, 2), 1e300, dtype=torch.float64), "is float64, the target is float32: value 1e+300 at flat index 0 is out of range"),
    (torch.ones(2, 2, dtype=torch.complex64), "is complex64, the target is float32: complex to real drops the imaginary part"),
])  # fmt: skip
def test_lossy_load_names_the_stored_dcp_key(tmp_path, weight, why):
    _save(tmp_path / "c", weight)
    model = _Net()
    snap = Snapshot(model)
    with pytest.raises(LossyConversionError) as e:
        checkpoint.load(model, tmp_path / "c")
    assert e.value.key == "model.layers.0.weight"
    assert str(e.value) == (f"{tmp_path / 'c' / '__0_0.distcp'}: tensor 'model.layers.0.weight' {why} "
                            "(pass allow_lossy=True to convert anyway)")  # fmt: skip
    snap.assert_unchanged()


def test_migrate_refusal_names_the_stored_dcp_key(tmp_path):
    _save(tmp_path / "c", torch.ones(2, 2, dtype=torch.complex128))
    with pytest.raises(UnsupportedTensorError) as e:
        checkpoint.migrate(tmp_path / "c", tmp_path / "out")
    assert e.value.key == "model.layers.0.weight"
    assert str(e.value).startswith(f"{tmp_path / 'c' / '__0_0.distcp'}: tensor 'model.layers.0.weight': dtype complex128")
    assert not (tmp_path / "out").exists()


def test_flat_param_names_the_stored_dcp_key(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"layers": {"0": {"_flat_param": torch.ones(6)}}}}, checkpoint_id=str(tmp_path / "c"))
    model = _Net()
    snap = Snapshot(model)
    with pytest.raises(FlatParamError) as e:
        checkpoint.load(model, tmp_path / "c")
    assert str(e.value).startswith(f"key 'model.layers.0._flat_param' in DCP checkpoint {tmp_path / 'c'} (__0_0.distcp)")
    snap.assert_unchanged()
