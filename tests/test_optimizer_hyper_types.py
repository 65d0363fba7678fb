"""A hyper-parameter whose kind changed between the saved and the target optimizer (saved
``lr=0.1``, the target's ``lr="fast"``; ``betas`` a tuple then a float) is refused like every
other param-group mismatch, ``OptimizerMismatchError`` naming group, key, both values, before
anything changes, from every source (fqnckpt, pickle, DCP); int / float / bool / 0-dim tensor
numbers and None (unset: ``foreach``) fit each other and the saved value is restored, as before
(``checkpoint/plan/optimizer_kind.py`` ``group_values_problem``)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import checkpoint
from checkpoint.optim import OptimizerMismatchError
from snapshot import Snapshot


def _saved(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.ones(1, 2)).sum().backward()
    opt.step()
    checkpoint.save(m, tmp_path / "ours", optimizer=opt)
    torch.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "c.pt")
    msd, osd = get_state_dict(m, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"))
    return {"fqnckpt": (tmp_path / "ours", tmp_path / "ours" / "optimizer.safetensors.index.json"),
            "pickle": (tmp_path / "c.pt", tmp_path / "c.pt"), "dcp": (tmp_path / "dcp", f"DCP checkpoint {tmp_path / 'dcp'}")}  # fmt: skip


@pytest.mark.parametrize("key,value,saved", [("lr", "fast", "float 0.1"), ("betas", 0.9, "tuple (0.9, 0.999)")])
def test_a_hyper_parameter_of_another_kind_is_refused(tmp_path, key, value, saved):
    for name, (path, where) in _saved(tmp_path).items():
        target = torch.nn.Linear(2, 2)
        opt = torch.optim.Adam(target.parameters(), lr=0.2)
        opt.param_groups[0][key] = value
        snap = Snapshot(target, opt)
        with pytest.raises(OptimizerMismatchError) as e:
            checkpoint.load(target, path, optimizer=opt)
        kind = {"lr": "number", "betas": "sequence"}[key]
        assert str(e.value) == (
            f"{where}: the saved state does not fit the target Adam: param group 0: hyper-parameter {key!r} "
            f"was saved as {saved}, the target's is {type(value).__name__} {value!r}; give the target's group "
            f"a {kind} (the saved value is then restored) or load without optimizer="
        ), name
        snap.assert_unchanged()


@pytest.mark.parametrize(
    "key,value",
    # a one-element tensor lr of any shape is a number, as torch.optim takes it ("Tensor lr must
    # be 1-element"); before, torch.tensor([0.5]) was refused as "tensor" against the saved float
    [("lr", 1), ("lr", torch.tensor(0.5)), ("lr", torch.tensor([0.5])), ("lr", torch.tensor([[0.5]])), ("foreach", True), ("amsgrad", 0)],
)
def test_numbers_and_unset_values_fit_and_the_saved_value_is_restored(tmp_path, key, value):
    for name, (path, _) in _saved(tmp_path).items():
        target = torch.nn.Linear(2, 2)
        opt = torch.optim.Adam(target.parameters(), lr=0.2)
        opt.param_groups[0][key] = value
        checkpoint.load(target, path, optimizer=opt)
        assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["betas"] == (0.9, 0.999), name
        assert opt.param_groups[0]["foreach"] is None and opt.param_groups[0]["amsgrad"] is False, name


@pytest.mark.parametrize("key,value", [("lr", np.float32(0.5)), ("lr", np.int64(1)), ("weight_decay", np.float32(0))])
def test_numpy_numbers_fit_saved_numbers(tmp_path, key, value):
    # torch takes numpy numbers as hyper-parameters: they fit the saved Python numbers, no
    # "saved as float, the target's is float32" refusal.
    saved = _saved(tmp_path)
    weight = torch.load(tmp_path / "c.pt")["model"]["weight"]
    for name, (path, _) in saved.items():
        target = torch.nn.Linear(2, 2)
        opt = torch.optim.Adam(target.parameters(), lr=0.2)
        opt.param_groups[0][key] = value
        checkpoint.load(target, path, optimizer=opt)
        g = opt.param_groups[0]
        assert (g["lr"], g["weight_decay"]) == (0.1, 0) and type(g["lr"]) is float, name
        assert torch.equal(target.weight, weight), name
        opt.param_groups[0][key] = "fast"  # a real change of kind is still refused
        with pytest.raises(OptimizerMismatchError):
            checkpoint.load(target, path, optimizer=opt)


def test_a_saved_one_element_tensor_lr_fits_a_float_and_a_two_element_one_does_not(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(m.parameters(), lr=torch.tensor([0.1]))
    m(torch.ones(1, 2)).sum().backward()
    opt.step()
    checkpoint.save(m, tmp_path / "t", optimizer=opt)
    target = torch.nn.Linear(2, 2)
    topt = torch.optim.Adam(target.parameters(), lr=0.2)
    checkpoint.load(target, tmp_path / "t", optimizer=topt)
    got = topt.param_groups[0]["lr"]
    assert isinstance(got, torch.Tensor) and torch.equal(got, torch.tensor([0.1]))  # restored as saved
    topt.param_groups[0]["lr"] = torch.tensor([0.1, 0.2])  # not a number: still refused
    snap = Snapshot(target, topt)
    with pytest.raises(OptimizerMismatchError, match="hyper-parameter 'lr' was saved as Tensor"):
        checkpoint.load(target, tmp_path / "t", optimizer=topt)
    snap.assert_unchanged()
