"""``load`` of a ``torch.save`` pickle goes through the
one pipeline (same names, value checks, optimizer planner as safetensors / DCP); ``verify``
reads through the plan stage's read check; optimizer state of another optimizer kind is refused
before anything changes, torch's own extras (``initial_lr``, version flags) are not."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from snapshot import Snapshot
from test_dcp_source import Net

import checkpoint
from checkpoint.errors import CheckpointMismatchError, CheckpointNotFoundError, LossyConversionError, UnsupportedFormatError
from checkpoint.optim import OptimizerMismatchError
from tests.helpers import assert_same_state, trained


# -- torch.save pickles through load ---------------------------------------------------------------


@pytest.mark.parametrize("layout", ["state_dict", "compiled", "ddp", "legacy", "model+optimizer"])
def test_load_of_a_torch_save_pickle(tmp_path, layout):
    m, o = trained(Net, steps=2)
    sd = m.state_dict()
    f = tmp_path / "x.pt"
    if layout == "compiled":
        torch.save({f"_orig_mod.{k}": v for k, v in sd.items()}, f)
    elif layout == "ddp":
        torch.save({f"module.{k}": v for k, v in sd.items()}, f)
    elif layout == "legacy":
        torch.save(sd, f, _use_new_zipfile_serialization=False)
    elif layout == "model+optimizer":
        torch.save({"model": sd, "optimizer": o.state_dict()}, f)
    else:
        torch.save(sd, f)
    torch.manual_seed(7)
    m2 = Net()
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    rep = checkpoint.load(m2, f, optimizer=o2 if layout == "model+optimizer" else None)
    assert rep.ok and sorted(rep.loaded_keys) == sorted(sd)
    assert_same_state(m2.state_dict(), sd)
    if layout == "model+optimizer":
        assert rep.optimizer_loaded
        assert_same_state(o2.state_dict(), o.state_dict())
        for mm, oo in ((m, o), (m2, o2)):  # steps on exactly as the saved run
            mm(torch.ones(1, 3)).sum().backward()
            oo.step()
        assert_same_state(m2.state_dict(), m.state_dict())


def _refused(tmp_path, sd: dict, target: nn.Module, exc, match: str, **kw) -> None:
    f = tmp_path / "r.pt"
    torch.save(sd, f)
    snap = Snapshot(target)
    with pytest.raises(exc, match=match) as e:
        checkpoint.load(target, f, **kw)
    snap.assert_unchanged()
    assert "r.pt" in str(e.value) or isinstance(e.value, CheckpointMismatchError)


def test_pickle_load_makes_the_safetensors_value_checks(tmp_path):
    half = nn.Linear(2, 2).half()
    _refused(tmp_path, {"weight": torch.full((2, 2), 1e6), "bias": torch.zeros(2)}, half,
             LossyConversionError, "out of range")  # fmt: skip
    lin = nn.Linear(2, 2)
    _refused(tmp_path, {"weight": torch.ones(2, 2, dtype=torch.complex64), "bias": torch.zeros(2)}, lin,
             LossyConversionError, "imaginary")  # fmt: skip
    emb = nn.Module()
    emb.register_buffer("n", torch.zeros(2, dtype=torch.int32))
    _refused(tmp_path, {"n": torch.tensor([2**40, 1])}, emb, LossyConversionError, "out of range")
    _refused(tmp_path, {"weight": torch.ones(3, 2), "bias": torch.zeros(2)}, lin, CheckpointMismatchError, "shape")
    _refused(tmp_path, {"weight": torch.ones(2, 2)}, lin, CheckpointMismatchError, "missing")
    _refused(tmp_path, {"weight": torch.ones(2, 2), "bias": torch.zeros(2)}, lin, UnsupportedFormatError,
             "no checksums", verify=True)  # fmt: skip
    _refused(tmp_path, torch.optim.SGD(lin.parameters(), lr=0.1).state_dict(), lin, UnsupportedFormatError,
             "optimizer state_dict, not a model")  # fmt: skip
    _refused(tmp_path, {"weight": torch.ones(2, 2), "bias": torch.zeros(2)}, lin, CheckpointNotFoundError,
             "no optimizer state in this checkpoint", optimizer=torch.optim.SGD(lin.parameters(), lr=0.1))  # fmt: skip
    # the same conversion within range loads and is reported, as for safetensors
    f = tmp_path / "ok.pt"
    torch.save({"weight": torch.full((2, 2), 3.0, dtype=torch.float64), "bias": torch.zeros(2)}, f)
    rep = checkpoint.load(lin, f)
    assert [c.key for c in rep.dtype_converted] == ["weight"] and torch.equal(lin.weight, torch.full((2, 2), 3.0))


def test_pickle_optimizer_by_position_must_fit_the_target_groups(tmp_path):
    m, o = trained(Net, steps=2)
    f = tmp_path / "x.pt"
    torch.save({"model": m.state_dict(), "optimizer": o.state_dict()}, f)
    m2 = Net()
    o2 = torch.optim.AdamW([{"params": [m2.enc.weight, m2.enc.bias]}, {"params": list(m2.head.parameters())}], lr=1e-2)
    snap = Snapshot(m2, o2)
    with pytest.raises(OptimizerMismatchError, match=r"by position.*\[4\].*\[2, 2\]"):
        checkpoint.load(m2, f, optimizer=o2)
    snap.assert_unchanged()


def test_verify_reads_through_the_plan_stage_check(tmp_path, monkeypatch):
    """A tensor that reads back as another shape / dtype than recorded is the one problem the
    plan stage names for load and migrate, and verify reports it the same way."""
    from checkpoint.sources.base import Source

    torch.save({"w": torch.ones(2, 2)}, tmp_path / "v.pt")
    assert checkpoint.verify(tmp_path / "v.pt").ok
    m, o = trained(Net, steps=2)
    torch.save({"model": m.state_dict(), "optimizer": o.state_dict()}, tmp_path / "mo.pt")
    rep = checkpoint.verify(tmp_path / "mo.pt")  # the optimizer beside the model is read too
    assert rep.ok and rep.tensors == 4 + 4 * 3 and rep.total_size == 4 * (12 + 4 + 8 + 2) * 3 + 4 * 4
    real = Source.get
    monkeypatch.setattr(Source, "get", lambda self, k: real(self, k).to(torch.float64))
    rep = checkpoint.verify(tmp_path / "v.pt")
    assert not rep.ok and rep.problems == [
        f"{tmp_path / 'v.pt'}: tensor 'w' reads as (2, 2) torch.float64, recorded (2, 2) torch.float32"
    ]


# -- another optimizer kind's state ----------------------------------------------------------------


def _save_both(tmp_path, m, o):
    """The same trained state as fqnckpt's checkpoint and as a torch.save pickle."""
    checkpoint.save(m, tmp_path / "ck", optimizer=o)
    torch.save({"model": m.state_dict(), "optimizer": o.state_dict()}, tmp_path / "ck.pt")
    return [tmp_path / "ck", tmp_path / "ck.pt"]


@pytest.mark.parametrize(
    "saved, target, needle",
    [
        ((torch.optim.AdamW, {}), (torch.optim.SGD, {"momentum": 0.9}), r"lacks \['dampening', 'momentum'\]"),
        ((torch.optim.SGD, {"momentum": 0.9}), (torch.optim.AdamW, {}), r"lacks \['betas', 'eps'\]"),
        ((torch.optim.Adam, {}), (torch.optim.Adagrad, {}), r"lacks \['initial_accumulator_value', 'lr_decay'\]"),
    ],
    ids=["AdamW-into-SGD", "SGD-into-AdamW", "Adam-into-Adagrad"],
)
def test_state_of_another_optimizer_kind_is_refused(tmp_path, saved, target, needle):
    m, o = trained(Net, saved[0], steps=2, **saved[1])
    for path in _save_both(tmp_path, m, o):
        m2 = Net()
        o2 = target[0](m2.parameters(), lr=0.5, **target[1])
        snap = Snapshot(m2, o2)
        with pytest.raises(OptimizerMismatchError, match=needle) as e:
            checkpoint.load(m2, path, optimizer=o2)
        assert target[0].__name__ in str(e.value)
        if path.suffix != ".pt":  # fqnckpt records the saved class
            assert f"state of {saved[0].__name__} does not fit" in str(e.value)
        snap.assert_unchanged()


def test_per_param_state_keys_of_the_target_kind(tmp_path):
    """Group keys alike, state keys not: Adam's group says amsgrad=True (the load installs it)
    but the state has no max_exp_avg_sq, which that Adam keeps (torch would fail on the next
    step); a state key no Adam keeps is named too."""
    m, o = trained(Net, torch.optim.Adam, steps=2)
    sd = o.state_dict()
    sd["param_groups"][0]["amsgrad"] = True
    torch.save({"model": m.state_dict(), "optimizer": sd}, tmp_path / "a.pt")
    sd = o.state_dict()
    sd["state"][1]["momentum_buffer"] = torch.zeros(4)
    torch.save({"model": m.state_dict(), "optimizer": sd}, tmp_path / "b.pt")
    for name, needle in (("a.pt", r"'enc.weight' has saved no \['max_exp_avg_sq'\]"),
                         ("b.pt", r"'enc.bias' has saved state \['momentum_buffer'\], which Adam does not keep")):  # fmt: skip
        m2 = Net()
        o2 = torch.optim.Adam(m2.parameters(), lr=0.5)
        snap = Snapshot(m2, o2)
        with pytest.raises(OptimizerMismatchError, match=needle):
            checkpoint.load(m2, tmp_path / name, optimizer=o2)
        snap.assert_unchanged()


@pytest.mark.parametrize("sched_saved, sched_target", [(True, False), (False, True), (True, True)])
def test_scheduler_initial_lr_is_not_another_kind(tmp_path, sched_saved, sched_target):
    """``initial_lr`` (an LR scheduler's) on either side, and a user's key in the target group,
    are no sign of another optimizer kind."""
    m, o = trained(Net, steps=2, scheduler=sched_saved)[:2]
    for path in _save_both(tmp_path, m, o):
        m2 = Net()
        o2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
        if sched_target:
            torch.optim.lr_scheduler.LambdaLR(o2, lambda e: 0.5**e)
        o2.param_groups[0]["tag"] = "a user's own key"  # not a hyper-parameter of AdamW: no refusal
        checkpoint.load(m2, path, optimizer=o2)
        assert_same_state(o2.state_dict()["state"], o.state_dict()["state"])
        assert o2.param_groups[0]["lr"] == o.param_groups[0]["lr"]


@pytest.mark.parametrize("saved, target", [(torch.optim.Adam, torch.optim.AdamW), (torch.optim.AdamW, torch.optim.Adam)])
def test_adam_and_adamw_share_their_state(tmp_path, saved, target):
    """Decided (docstring of checkpoint.plan.optimizer_kind): same group and state keys, so the
    state loads, and the result is torch's own ``load_state_dict`` of that state: AdamW keeps
    decoupled_weight_decay=True, Adam takes the saved flag; both step exactly as torch's would."""
    m, o = trained(Net, saved, steps=2, weight_decay=0.1)
    for path in _save_both(tmp_path, m, o):
        m2 = Net()
        o2 = target(m2.parameters(), lr=0.5)
        checkpoint.load(m2, path, optimizer=o2)
        assert o2.param_groups[0]["decoupled_weight_decay"] is True  # AdamW's rule / AdamW's saved flag
        ref = Net()
        ref.load_state_dict(m.state_dict())
        ref_o = target(ref.parameters(), lr=0.5)
        ref_o.load_state_dict(copy.deepcopy(o.state_dict()))  # torch's own answer (it shares `step`)
        assert_same_state(o2.state_dict(), ref_o.state_dict())
        for mm, oo in ((ref, ref_o), (m2, o2)):
            mm(torch.ones(1, 3)).sum().backward()
            oo.step()
        assert_same_state(m2.state_dict(), ref.state_dict())
