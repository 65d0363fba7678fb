"""Load validates, then mutates: meta targets; names never
changed by string alone; exact optimizer values. Every rejection is checked with one bit-exact
snapshot of model and optimizer (tests/snapshot.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import checkpoint
from checkpoint import CheckpointMismatchError, CheckpointNotFoundError, TiedValuesMismatchError
from checkpoint.errors import (
    LoadError,
    LossyConversionError,
    MetaTargetError,
    OverlappingTargetsError,
    UnwritableTargetError,
)
from checkpoint.optim import OptimizerMismatchError
from tests.snapshot import Snapshot
from tests.helpers import assert_same_state


class Net(nn.Module):
    def __init__(self, expanded: bool = False):
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.register_buffer("b", torch.zeros(1).expand(4) if expanded else torch.zeros(4))


def saved_net(tmp_path, optimizer=False):
    torch.manual_seed(0)
    src = Net()
    src.b.copy_(torch.arange(4.0))
    opt = torch.optim.Adam(src.parameters(), lr=0.5) if optimizer else None
    if opt is not None:
        src.a.weight.sum().backward()
        opt.step()
    checkpoint.save(src, tmp_path / "ck", optimizer=opt)
    return src, tmp_path / "ck"


def fresh_with_optimizer():
    torch.manual_seed(1)
    m = Net()
    opt = torch.optim.Adam(m.parameters(), lr=0.25)
    m.a.weight.sum().backward()
    opt.step()  # non-empty state, so a change would show
    return m, opt


# -- 1. validate, then mutate --------------------------------------------------------------------


REJECTIONS = {
    "not found": lambda d: (d.parent / "absent", {}, CheckpointNotFoundError),
    "shape": lambda d: (d, {"_target": "shape"}, CheckpointMismatchError),
    "unexpected key": lambda d: (d, {"_target": "fewer"}, CheckpointMismatchError),
    "optimizer groups": lambda d: (d, {"_opt": "groups"}, OptimizerMismatchError),
    "optimizer missing": lambda d: (d, {"_opt": "absent"}, CheckpointNotFoundError),
    "lossy int target": lambda d: (d, {"_target": "int"}, LossyConversionError),
}


class Shape(Net):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 5)


class Fewer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)


@pytest.mark.parametrize("kind", sorted(REJECTIONS))
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["same-dtype", "dtype=bf16"])
def test_rejected_load_leaves_model_and_optimizer_bit_identical(tmp_path, kind, dtype):
    """With or without dtype= / optimizer=, every rejection happens before any change."""
    _, d = saved_net(tmp_path, optimizer=kind != "optimizer missing")
    path, kw, exc = REJECTIONS[kind](d)
    target = kw.pop("_target", None)
    torch.manual_seed(1)
    m = {"shape": Shape, "fewer": Fewer}.get(target, Net)()
    if target == "int":
        m.b = torch.zeros(4, dtype=torch.int64)  # an int buffer: float -> int is lossy
    opt_kind = kw.pop("_opt", "plain")
    params = list(m.parameters())
    groups = [{"params": params[:1]}, {"params": params[1:]}] if opt_kind == "groups" else params
    opt = torch.optim.Adam(groups, lr=0.25)
    m.a.weight.sum().backward()
    opt.step()
    snap = Snapshot(m, opt)
    with pytest.raises(exc):
        checkpoint.load(m, path, optimizer=opt, dtype=dtype, **kw)
    snap.assert_unchanged()


def test_dtype_option_applies_after_checks_and_converts(tmp_path):
    src, d = saved_net(tmp_path)
    m = Net()
    rep = checkpoint.load(m, d, dtype=torch.bfloat16)
    assert m.a.weight.dtype == torch.bfloat16 and m.b.dtype == torch.bfloat16
    assert torch.equal(m.a.weight, src.a.weight.to(torch.bfloat16)) and torch.equal(
        m.b, src.b.to(torch.bfloat16)
    )
    assert sorted(c.key for c in rep.dtype_converted) == ["a.bias", "a.weight", "b"]
    with pytest.raises(TypeError, match="floating point or complex"):
        checkpoint.load(Net(), d, dtype=torch.int32)


def _inference_net():
    with torch.inference_mode():
        return Net()


@pytest.mark.parametrize(
    "make, key, needle",
    [
        (lambda: Net(expanded=True), "b", "share memory"),
        (_inference_net, "a.weight", "inference tensor"),
    ],
    ids=["expanded-buffer", "inference-mode-model"],
)
def test_target_that_cannot_take_the_copy_is_refused_before_any_copy(tmp_path, make, key, needle):
    """Found in the plan, named, nothing copied (a.weight and a.bias come before b)."""
    _, d = saved_net(tmp_path)
    m = make()
    snap = Snapshot(m)
    with pytest.raises(UnwritableTargetError, match=needle) as ei:
        checkpoint.load(m, d)
    assert ei.value.key == key and str(d) in str(ei.value)
    snap.assert_unchanged()


def test_overlapping_strides_target_refused_and_inference_model_loads_in_inference_mode(tmp_path):
    d = tmp_path / "ck"
    checkpoint.save({"w": torch.arange(4.0).reshape(2, 2)}, d)
    target = {"w": torch.zeros(3).as_strided((2, 2), (1, 1))}  # w[0,1] and w[1,0] are one element
    snap = Snapshot(target)
    with pytest.raises(UnwritableTargetError, match="'w'"):
        checkpoint.load(target, d)
    snap.assert_unchanged()
    src, d2 = saved_net(tmp_path / "n")
    m = _inference_net()
    with torch.inference_mode():
        checkpoint.load(m, d2)
    assert torch.equal(m.a.weight, src.a.weight) and torch.equal(m.b, src.b)


def test_targets_sharing_memory_need_agreeing_values(tmp_path):
    """Distinct views of one buffer: loaded when the checkpoint agrees on the shared elements
    (also interleaved views whose byte ranges intersect), refused when one would overwrite the other."""
    d = tmp_path / "ck"
    checkpoint.save({"x": torch.tensor([1.0, 2.0, 3.0]), "y": torch.tensor([3.0, 4.0, 5.0])}, d)
    buf = torch.zeros(5)
    target = {"x": buf[0:3], "y": buf[2:5]}
    checkpoint.load(target, d)
    assert buf.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    checkpoint.save(
        {"x": torch.tensor([1.0, 2.0, 9.0]), "y": torch.tensor([3.0, 4.0, 5.0])}, d, overwrite=True
    )
    buf.zero_()
    snap = Snapshot(target)
    with pytest.raises(OverlappingTargetsError) as ei:
        checkpoint.load(target, d)
    assert set(ei.value.keys) == {"x", "y"}
    snap.assert_unchanged()
    inter = torch.zeros(6)
    target = {"x": inter[0::2], "y": inter[1::2]}
    checkpoint.load(target, d)
    assert inter.tolist() == [1.0, 3.0, 2.0, 4.0, 9.0, 5.0]


@pytest.mark.parametrize(
    "stored, target, why",
    [
        (torch.tensor([1 + 2j]), torch.zeros(1), "imaginary"),
        (torch.tensor([1.5]), torch.zeros(1, dtype=torch.int64), "fraction"),
        (torch.tensor([2]), torch.zeros(1, dtype=torch.bool), "zero / non-zero"),
        (torch.tensor([1e5]), torch.zeros(1, dtype=torch.float16), "out of range"),
        (torch.tensor([2**40]), torch.zeros(1, dtype=torch.int32), "out of range"),
        (torch.tensor([-1], dtype=torch.int16), torch.zeros(1, dtype=torch.uint8), "out of range"),
        # Same width, other signedness: a round trip through the target type cannot see these.
        (torch.tensor([200], dtype=torch.uint8), torch.zeros(1, dtype=torch.int8), "out of range"),
        (torch.tensor([-1], dtype=torch.int8), torch.zeros(1, dtype=torch.uint8), "out of range"),
    ],
    ids=["complex-real", "float-int", "int-bool", "f32-f16-overflow", "i64-i32", "i16-u8", "u8-i8", "i8-u8"],
)
@pytest.mark.filterwarnings("ignore:Casting complex values to real")
def test_lossy_conversion_refused_unless_allowed(tmp_path, stored, target, why):
    d = tmp_path / "ck"
    checkpoint.save({"ok": torch.ones(2), "w": stored}, d)
    sd = {"ok": torch.zeros(2), "w": target.clone()}
    snap = Snapshot(sd)
    with pytest.raises(LossyConversionError, match=why) as ei:
        checkpoint.load(sd, d)
    assert ei.value.key == "w" and str(d / "model-00001-of-00001.safetensors") in str(ei.value)
    snap.assert_unchanged()
    rep = checkpoint.load(sd, d, allow_lossy=True)
    assert [c.key for c in rep.dtype_converted] == ["w"] and torch.equal(sd["ok"], torch.ones(2))


def test_conversions_within_range_load_and_are_reported(tmp_path):
    d = tmp_path / "ck"
    vals = {"f": torch.tensor([1.0, -2.5, 6e4]), "i": torch.tensor([7, -3]), "b": torch.tensor([True, False])}
    checkpoint.save(vals, d)
    sd = {
        "f": torch.zeros(3, dtype=torch.float16),
        "i": torch.zeros(2, dtype=torch.int8),
        "b": torch.zeros(2),
    }
    rep = checkpoint.load(sd, d)
    assert (
        sd["f"].tolist() == [1.0, -2.5, 60000.0]
        and sd["i"].tolist() == [7, -3]
        and sd["b"].tolist() == [1.0, 0.0]
    )
    assert {c.key for c in rep.dtype_converted} == {"f", "i", "b"}


def test_error_from_torch_while_copying_is_ours_naming_key_and_file(tmp_path, monkeypatch):
    _, d = saved_net(tmp_path)
    from checkpoint.storage.reader import CheckpointReader

    real = CheckpointReader.get

    def broken(self, key):
        if key == "b":
            raise RuntimeError("simulated read failure")
        return real(self, key)

    real_view = CheckpointReader._target_view

    def broken_view(self, key, out):
        if key == "b":
            raise OSError("simulated pread failure")
        return real_view(self, key, out)

    # Both read paths: through safetensors (get) and straight into the target (read_many).
    for attr, fn in (("get", broken), ("_target_view", broken_view)):
        with monkeypatch.context() as m:
            m.setattr(CheckpointReader, attr, fn)
            if attr == "get":
                m.setattr(CheckpointReader, "_target_view", lambda self, key, out: None)
                # The windowed copy path fails the same way (it reads with preadv, as get does).
                m.setattr(CheckpointReader, "copy_into", lambda self, key, out, sl=None, check=False: key == "b" and broken(self, key))
            with pytest.raises(LoadError, match="simulated") as ei:
                checkpoint.load(Net(), d)
            assert ei.value.key == "b" and ei.value.file.endswith(".safetensors") and str(d) in ei.value.file


# -- 2. meta targets -----------------------------------------------------------------------------


class TiedMeta(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(4, 3)
        self.head = nn.Linear(3, 4, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.frozen = nn.Parameter(torch.zeros(2), requires_grad=False)


def test_meta_target_refused_unless_assign(tmp_path):
    torch.manual_seed(0)
    src = TiedMeta()
    src.steps.fill_(7)
    src.frozen.data.fill_(3.0)
    checkpoint.save(src, tmp_path / "ck")
    with torch.device("meta"):
        m = TiedMeta()
    snap = Snapshot(m)
    with pytest.raises(MetaTargetError, match="assign=True") as ei:
        checkpoint.load(m, tmp_path / "ck")
    assert ei.value.keys == ["emb.weight", "frozen", "steps"]
    snap.assert_unchanged()
    rep = checkpoint.load(m, tmp_path / "ck", assign=True)
    assert rep.ok and rep.loaded_keys == ["emb.weight", "frozen", "steps"]
    assert not any(t.is_meta for t in m.state_dict().values())
    assert isinstance(m.emb.weight, nn.Parameter) and m.head.weight is m.emb.weight  # tie kept
    assert m.emb.weight.requires_grad and not m.frozen.requires_grad
    for k, v in src.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k


def test_assign_keeps_optimizer_working(tmp_path):
    torch.manual_seed(0)
    src = nn.Linear(2, 2)
    opt = torch.optim.SGD(src.parameters(), lr=0.1, momentum=0.9)
    src(torch.ones(1, 2)).sum().backward()
    opt.step()
    checkpoint.save(src, tmp_path / "ck", optimizer=opt)
    with torch.device("meta"):
        m = nn.Linear(2, 2)
    opt2 = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
    rep = checkpoint.load(m, tmp_path / "ck", optimizer=opt2, assign=True)
    assert rep.optimizer_loaded
    assert [id(p) for p in opt2.param_groups[0]["params"]] == [id(m.weight), id(m.bias)]
    assert torch.equal(opt2.state[m.weight]["momentum_buffer"], opt.state[src.weight]["momentum_buffer"])


# -- 3. names never changed by string alone --------------------------------------------------------


class HasModuleChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.module = nn.Linear(2, 2)


def test_plain_state_dict_saved_with_keys_as_given(tmp_path):
    """A real child named ``module``, a key that is exactly ``module``, wrapper-looking
    segments anywhere: stored as given, and the state_dict loads back strictly into the model."""
    m = HasModuleChild()
    idx = checkpoint.save(m.state_dict(), tmp_path / "a")
    assert sorted(idx.weight_map) == ["module.bias", "module.weight"]
    other = HasModuleChild()
    assert checkpoint.load(other, tmp_path / "a").ok
    assert torch.equal(other.module.weight, m.module.weight)
    sd = {"module": torch.ones(1), "x._orig_mod.y": torch.zeros(1), "_fsdp_wrapped_module.z": torch.ones(2)}
    idx = checkpoint.save(sd, tmp_path / "b")
    assert sorted(idx.weight_map) == sorted(sd)
    target = {k: torch.full_like(v, 5) for k, v in sd.items()}
    assert checkpoint.load(target, tmp_path / "b").ok  # a state_dict target matches keys exactly
    assert all(torch.equal(target[k], v) for k, v in sd.items())


def test_wrapper_keys_resolved_only_through_the_model(tmp_path):
    """``_orig_mod.`` stored as given; the module says the segment is no child of it -> loads."""
    torch.manual_seed(0)
    eager = nn.Linear(2, 2)
    checkpoint.save({f"_orig_mod.{k}": v for k, v in eager.state_dict().items()}, tmp_path / "ck")
    m = nn.Linear(2, 2)
    rep = checkpoint.load(m, tmp_path / "ck")
    assert rep.ok and rep.filled_from == {"bias": "_orig_mod.bias", "weight": "_orig_mod.weight"}
    assert torch.equal(m.weight, eager.weight)
    with pytest.raises(CheckpointMismatchError):  # a state_dict target does not guess
        checkpoint.load({"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, tmp_path / "ck")


@pytest.mark.parametrize(
    "keys",
    [("weight", "module.weight"), ("_orig_mod.weight", "module.weight"), ("_orig_mod.weight", "weight")],
)
def test_two_spellings_of_one_tensor_refused_when_values_differ(tmp_path, keys):
    """Refused naming both keys and the file; equal values load strictly."""
    p = tmp_path / "c.safetensors"
    save_file(
        {keys[0]: torch.full((2, 2), 1.0), keys[1]: torch.full((2, 2), 2.0), "bias": torch.zeros(2)}, str(p)
    )
    m = nn.Linear(2, 2)
    snap = Snapshot(m)
    with pytest.raises(TiedValuesMismatchError) as ei:
        checkpoint.load(m, p)
    assert (
        sorted(ei.value.keys) == sorted(keys)
        and ei.value.files == ["c.safetensors"]
        and str(p) in str(ei.value)
    )
    snap.assert_unchanged()
    save_file(
        {keys[0]: torch.full((2, 2), 2.0), keys[1]: torch.full((2, 2), 2.0), "bias": torch.zeros(2)}, str(p)
    )
    rep = checkpoint.load(m, p)
    assert rep.ok and rep.unexpected_keys == [] and torch.equal(m.weight, torch.full((2, 2), 2.0))


def test_aliases_only_when_every_view_property_matches(tmp_path):
    """Same storage and offset but another dtype, shape, stride or the conj bit is another tensor."""
    x = torch.tensor([1.0, -2.0, 3.0, 4.0])
    c = torch.tensor([1 + 1j, 2 - 3j])
    sd = {
        "x": x, "x_again": x.view(4), "as_int": x.view(torch.int32), "as_2x2": x.view(2, 2),
        "strided": x[::2], "c": c, "c_conj": c.conj(),
    }  # fmt: skip
    idx = checkpoint.save(sd, tmp_path / "ck")
    assert idx.metadata.fqnckpt.alias_groups == [["x", "x_again"]]
    with checkpoint.open_checkpoint(tmp_path / "ck") as r:
        for k, v in sd.items():
            got = r.get(k if k != "x_again" else "x")
            assert got.dtype == v.dtype and torch.equal(got, v.resolve_conj()), k


# -- 4. exact optimizer values -------------------------------------------------------------------


def _model(sparse=False):
    torch.manual_seed(0)
    if sparse:
        return nn.Sequential(nn.Embedding(5, 3, sparse=True))
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2, bias=False))


OPTIMIZERS = {
    "Adadelta": {}, "Adagrad": {}, "Adam": {"amsgrad": True}, "Adamax": {}, "AdamW": {}, "ASGD": {},
    "LBFGS": {"history_size": 3}, "NAdam": {}, "RAdam": {}, "RMSprop": {"centered": True, "momentum": 0.5},
    "Rprop": {}, "SGD": {"momentum": 0.9, "nesterov": True}, "SparseAdam": {}, "Adafactor": {}, "Muon": {},
}  # fmt: skip


def _step(opt, m, sparse):
    x = torch.tensor([0, 2, 4]) if sparse else torch.ones(2, 3)

    def closure():
        opt.zero_grad()
        loss = m(x).pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_torch_optimizer_round_trips_exactly(tmp_path, name):
    """Defaults (plus a few non-defaults), one step, save, load into a fresh optimizer with other
    hyper-parameters: state_dict equal incl. types (ints stay ints, tuples stay tuples)."""
    cls = getattr(torch.optim, name)
    sparse = name == "SparseAdam"
    m = _model(sparse)
    params = [p for p in m.parameters() if name != "Muon" or p.dim() == 2]
    opt = cls(params, **OPTIMIZERS[name])
    _step(opt, m, sparse)
    _step(opt, m, sparse)
    checkpoint.save(m, tmp_path / "ck", optimizer=opt)
    m2 = _model(sparse)
    params2 = [p for p in m2.parameters() if name != "Muon" or p.dim() == 2]
    opt2 = cls(params2, lr=0.123)
    rep = checkpoint.load(m2, tmp_path / "ck", optimizer=opt2)
    assert rep.optimizer_loaded
    a, b = opt.state_dict(), opt2.state_dict()
    assert a["state"].keys() == b["state"].keys()
    assert_same_state(a["param_groups"], b["param_groups"], where="param_groups")
    assert_same_state(a["state"], b["state"], where="state")


def test_edge_hyper_parameters_round_trip_exactly(tmp_path):
    """Inf, -inf, nan, -0.0, huge ints, tensor lr, tensor betas, None, bool, str, tuple,
    nested dict, all exact; the stored index is plain JSON (no NaN / Infinity tokens)."""
    m = nn.Linear(2, 2)
    opt = torch.optim.Adam(
        [
            {"params": [m.weight], "lr": torch.tensor(0.01), "betas": (torch.tensor(0.9), torch.tensor(0.99)),
             "clip": float("inf"), "floor": float("-inf"), "neg0": -0.0, "big": 2**70, "tag": "x",
             "sched": {"warmup": 10, "decay": (0.5, None)}},
            {"params": [m.bias], "lr": float("nan"), "weight_decay": 0, "foreach": None},
        ]
    )  # fmt: skip
    m(torch.ones(1, 2)).sum().backward()
    opt.param_groups[1]["lr"] = 0.5
    opt.step()
    opt.param_groups[1]["lr"] = float("nan")
    checkpoint.save(m, tmp_path / "ck", optimizer=opt)
    raw = (tmp_path / "ck" / "optimizer.safetensors.index.json").read_text()
    json.loads(raw, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in the index"))
    opt2 = torch.optim.Adam([{"params": [m.weight], "lr": torch.tensor(1.0)}, {"params": [m.bias]}])
    snap_types = type(opt2.param_groups[0]["lr"])
    checkpoint.load(m, tmp_path / "ck", optimizer=opt2)
    assert_same_state(opt.state_dict()["param_groups"], opt2.state_dict()["param_groups"], where="param_groups")
    assert snap_types is torch.Tensor and math.isnan(opt2.param_groups[1]["lr"])


def test_previous_optimizer_encoding_still_loads(tmp_path):
    """Checkpoints of value_encoding 1 (plain JSON hyper-parameters, tuples as lists) load."""
    torch.manual_seed(0)
    m = nn.Linear(2, 2)
    opt = torch.optim.Adam(m.parameters(), lr=0.01, betas=(0.8, 0.9))
    m(torch.ones(1, 2)).sum().backward()
    opt.step()
    checkpoint.save(m, tmp_path / "ck", optimizer=opt)
    p = tmp_path / "ck" / "optimizer.safetensors.index.json"
    data = json.loads(p.read_text())
    o = data["metadata"]["fqnckpt"]["optimizer"]
    o.pop("value_encoding")
    o.pop("state_values", None)
    for g in o["param_groups"]:  # as encoding 1 wrote them: tuples as lists, None dropped
        g["betas"] = g["betas"]["$tuple"]
        for k in [k for k, v in g.items() if v == {"$none": True}]:
            del g[k]
    p.write_text(json.dumps(data))
    opt2 = torch.optim.Adam(m.parameters(), lr=1.0)
    checkpoint.load(m, tmp_path / "ck", optimizer=opt2)
    assert_same_state(opt.state_dict()["param_groups"], opt2.state_dict()["param_groups"], where="param_groups")
    assert_same_state(opt.state_dict()["state"], opt2.state_dict()["state"], where="state")


def test_corrupt_optimizer_value_is_named_and_changes_nothing(tmp_path):
    _, d = saved_net(tmp_path, optimizer=True)
    p = d / "optimizer.safetensors.index.json"
    data = json.loads(p.read_text())
    data["metadata"]["fqnckpt"]["optimizer"]["param_groups"][0]["lr"] = {"$float": "huge"}
    p.write_text(json.dumps(data))
    m, opt = fresh_with_optimizer()
    snap = Snapshot(m, opt)
    with pytest.raises(checkpoint.CorruptCheckpointError, match="'lr'"):
        checkpoint.load(m, d, optimizer=opt)
    snap.assert_unchanged()


class WithNonPersistent(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))
        self.register_buffer("inv_freq", torch.zeros(3), persistent=False)


def test_wrapper_spelling_of_a_non_persistent_buffer_is_ignorable(tmp_path):
    checkpoint.save({"_orig_mod.w": torch.ones(2), "_orig_mod.inv_freq": torch.ones(3)}, tmp_path / "ck")
    m = WithNonPersistent()
    rep = checkpoint.load(m, tmp_path / "ck")
    assert rep.ok and rep.ignorable_keys == ["_orig_mod.inv_freq"] and rep.unexpected_keys == []
    assert torch.equal(m.w, torch.ones(2)) and torch.equal(m.inv_freq, torch.zeros(3))


def test_uninitialized_lazy_parameter_is_a_named_refusal(tmp_path):
    checkpoint.save(nn.Linear(3, 2), tmp_path / "ck")
    m = nn.LazyLinear(2)
    snap = Snapshot(m)
    with pytest.raises(UnwritableTargetError, match="lazy") as ei:
        checkpoint.load(m, tmp_path / "ck")
    assert ei.value.key == "weight"
    snap.assert_unchanged()
    m(torch.ones(1, 3))  # initialized: loads
    assert checkpoint.load(m, tmp_path / "ck").ok


def test_snapshot_helper_sees_every_kind_of_change():
    """The helper every rejection test relies on must fail on any change it promises to see."""
    changes = {
        "one bit": lambda m, o: m.a.weight.data.view(torch.int32)[0, 0].bitwise_xor_(1),
        "dtype": lambda m, o: setattr(m.a.bias, "data", m.a.bias.data.double()),
        "stride": lambda m, o: setattr(m.a.weight, "data", m.a.weight.data.t().contiguous().t()),
        "storage": lambda m, o: setattr(m.a.bias, "data", m.a.bias.data.clone()),
        "buffer object": lambda m, o: m.register_buffer("b", m.b.clone()),
        "requires_grad": lambda m, o: m.a.bias.requires_grad_(False),
        "optimizer lr": lambda m, o: o.param_groups[0].__setitem__("lr", 0.5000001),
        "optimizer state": lambda m, o: o.state[m.a.weight]["exp_avg"][0, 0].copy_(
            torch.nextafter(o.state[m.a.weight]["exp_avg"][0, 0], torch.tensor(1.0))
        ),  # one ulp
        "optimizer step type": lambda m, o: o.state[m.a.weight].__setitem__("step", 1),
    }
    for name, change in changes.items():
        m, opt = fresh_with_optimizer()
        snap = Snapshot(m, opt)
        snap.assert_unchanged()
        change(m, opt)
        assert snap.differences(), name
        with pytest.raises(AssertionError, match="changed"):
            snap.assert_unchanged()


def test_targets_sharing_memory_are_found_among_many_and_through_another_storage(tmp_path):
    """The overlap sweep runs by address over every target (no storage asked of the
    10^4 targets that share nothing): views of one buffer amid many other tensors, and a view
    made through another storage object of the same memory (``torch.from_numpy``)."""
    d = tmp_path / "ck"
    others = {f"n.{i}": torch.full((2,), float(i)) for i in range(50)}
    checkpoint.save({"x": torch.tensor([1.0, 2.0, 9.0]), **others, "y": torch.tensor([3.0, 4.0, 5.0]),
                     "z": torch.tensor([7.0])}, d)  # fmt: skip
    buf = torch.zeros(6)
    target = {"x": buf[0:3], **{k: torch.zeros(2) for k in others}, "y": buf[2:5]}
    target["z"] = torch.from_numpy(buf.numpy())[5:6]  # disjoint from x and y: loads
    snap = Snapshot(target)
    with pytest.raises(OverlappingTargetsError) as ei:  # x[2] = 9 against y[0] = 3
        checkpoint.load(target, d)
    assert set(ei.value.keys) == {"x", "y"}
    snap.assert_unchanged()
    target["y"] = torch.from_numpy(buf.numpy())[2:5]  # the same clash through another storage
    snap = Snapshot(target)
    with pytest.raises(OverlappingTargetsError) as ei:
        checkpoint.load(target, d)
    assert set(ei.value.keys) == {"x", "y"}
    snap.assert_unchanged()
    target["y"] = buf[3:6]
    target["z"] = torch.zeros(1)
    checkpoint.save({"x": torch.tensor([1.0, 2.0, 9.0]), **others, "y": torch.tensor([3.0, 4.0, 5.0]),
                     "z": torch.tensor([7.0])}, d, overwrite=True)  # fmt: skip
    checkpoint.load(target, d)  # x and y side by side: nothing shared
    assert buf.tolist() == [1.0, 2.0, 9.0, 3.0, 4.0, 5.0] and all(torch.equal(target[k], v) for k, v in others.items())


def test_shared_memory_through_a_view_of_another_start_and_conj_neg_views_are_checked(tmp_path):
    """Targets sharing memory through a storage object that starts elsewhere in the buffer
    (``torch.from_numpy(buf.numpy()[2:5])``) are compared too, and conjugate / negative views are
    compared as ``copy_`` writes into them (``conj(src)`` / ``-src``): agreeing values load,
    clashing ones raise with the targets unchanged."""
    d = tmp_path / "ck"
    checkpoint.save({"a": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([9.0, 4.0, 5.0])}, d)
    buf = torch.zeros(6)
    target = {"a": buf[0:3], "b": torch.from_numpy(buf.numpy()[2:5])}  # b[0] is a[2]
    snap = Snapshot(target)
    with pytest.raises(OverlappingTargetsError) as ei:
        checkpoint.load(target, d)
    assert set(ei.value.keys) == {"a", "b"}
    snap.assert_unchanged()

    z = torch.tensor([1 + 2j, 3 - 1j])
    checkpoint.save({"a": z, "b": z.conj().resolve_conj(), "c": -z}, tmp_path / "ok")
    checkpoint.save({"a": z, "b": z.clone(), "c": z.clone()}, tmp_path / "bad")
    buf = torch.zeros(2, dtype=torch.complex64)
    target = {"a": buf, "b": buf.conj(), "c": buf._neg_view()}
    checkpoint.load(target, tmp_path / "ok")
    assert torch.equal(buf, z) and torch.equal(target["b"].resolve_conj(), z.conj())
    buf.zero_()
    snap = Snapshot(target)
    with pytest.raises(OverlappingTargetsError) as ei:
        checkpoint.load(target, tmp_path / "bad")
    assert set(ei.value.keys) == {"a", "b", "c"}
    snap.assert_unchanged()


def test_internal_overlap_of_strided_targets_is_exact_and_linear_in_dims():
    """target_problem's overlap test: the stride-sorted reach check answers strided views torch
    calls TooHard (x[::2] of 10^7 elements: seconds through the element count) and agrees
    with counting every element's offset on random as_strided views."""
    import itertools
    import random

    from checkpoint.plan.values import _has_internal_overlap

    def exact(t):
        offs = [sum(i * s for i, s in zip(idx, t.stride())) for idx in itertools.product(*map(range, t.shape))]
        return len(set(offs)) < len(offs)

    rnd = random.Random(0)
    base = torch.zeros(4096)
    for _ in range(300):
        nd = rnd.randint(1, 3)
        shape = [rnd.randint(1, 5) for _ in range(nd)]
        stride = [rnd.randint(0, 7) for _ in range(nd)]
        t = torch.as_strided(base, shape, stride)
        assert _has_internal_overlap(t) == exact(t), (shape, stride)
    big = torch.zeros(2 << 20)[::2]
    real = torch.unique
    torch.unique = lambda *a, **k: pytest.fail("the element count ran")  # O(ndim), no per-element work
    try:
        assert not _has_internal_overlap(big)
    finally:
        torch.unique = real


def test_shape_mismatch_error_gives_both_shapes(tmp_path):
    """A strict load refused for shapes names each key with its checkpoint and target shapes, and
    the checkpoint; the target is unchanged."""
    from checkpoint import CheckpointMismatchError

    checkpoint.save(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), tmp_path / "ck")
    target = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as err:
        checkpoint.load(target, tmp_path / "ck")
    assert str(err.value) == (
        f"checkpoint {tmp_path / 'ck'} does not match the target: shape-mismatched keys "
        "'1.weight' checkpoint (2, 4), target (3, 4); '1.bias' checkpoint (2,), target (3,)"
    )
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
