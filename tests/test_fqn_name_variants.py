"""More variants of each naming kind (wrapper prefixes, heads, dynamo names, parametrizations,
containers), through the public API.

Each test builds the checkpoint as the wrapping / capture / tool really writes it and states the
right outcome as data: exact key maps, missing / unexpected / ignorable reports, values equal.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import checkpoint
import fqn
from checkpoint import CheckpointMismatchError
from models import Base, WithHead
from snapshot import Snapshot


class HasRealModuleChild(nn.Module):
    """A real child literally named ``module`` beside another child."""

    def __init__(self):
        super().__init__()
        self.module = nn.Linear(2, 2)
        self.fc = nn.Linear(2, 1)


# DataParallel(HasRealModuleChild()).state_dict(): the wrapper's `module.` before every key.
DP_OF_REAL_CHILD = {
    "module.module.weight": "module.weight",
    "module.module.bias": "module.bias",
    "module.fc.weight": "fc.weight",
    "module.fc.bias": "fc.bias",
}


def test_dp_prefix_over_real_module_child_canonical_and_resolve():
    dp = nn.DataParallel(HasRealModuleChild())
    assert sorted(dp.state_dict()) == sorted(DP_OF_REAL_CHILD)  # the fixture is what torch writes
    target = HasRealModuleChild()
    assert {k: fqn.canonical_fqn(k, target) for k in DP_OF_REAL_CHILD} == DP_OF_REAL_CHILD
    assert fqn.resolve(list(DP_OF_REAL_CHILD), target) == DP_OF_REAL_CHILD
    # negative control: the eager names stay themselves
    for k in DP_OF_REAL_CHILD.values():
        assert fqn.canonical_fqn(k, target) == k


@pytest.mark.parametrize("as_pickle", [False, True])
def test_dp_prefix_over_real_module_child_loads_strictly(tmp_path, as_pickle):
    torch.manual_seed(0)
    dp = nn.DataParallel(HasRealModuleChild())
    sd = dp.state_dict()
    if as_pickle:
        path = tmp_path / "dp.pt"
        torch.save(sd, path)
    else:
        path = tmp_path / "dp.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items()}, path)
    target = HasRealModuleChild()
    rep = checkpoint.load(target, path)
    assert rep.missing_keys == [] and rep.unexpected_keys == []
    for src, dst in DP_OF_REAL_CHILD.items():
        assert torch.equal(target.state_dict()[dst], sd[src]), dst


def test_wrapper_segment_named_like_real_child_deeper():
    """``_orig_mod`` of a per-block compile where the block also has a real child ``module``."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.proj = nn.Linear(2, 2)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block()])

    src = Net()
    src.layers[1] = nn.DataParallel(src.layers[1])  # DP on one ModuleList entry
    keys = list(src.state_dict())
    assert "layers.1.module.proj.weight" in keys and "layers.1.module.module.weight" in keys
    target = Net()
    got = {k: fqn.canonical_fqn(k, target) for k in keys}
    assert got == {k: k.replace("layers.1.module.", "layers.1.") for k in keys}
    assert sorted(got.values()) == sorted(target.state_dict())


def _write_source(kind, sd, tmp_path, name):
    if kind == "safetensors":
        path = tmp_path / f"{name}.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items()}, path)
    elif kind == "hf-dir":
        path = tmp_path / name
        os.makedirs(path)
        save_file({k: v.contiguous() for k, v in sd.items()}, path / "model.safetensors")
    elif kind == "fqnckpt":
        path = tmp_path / name
        checkpoint.save(dict(sd), path)
    else:
        path = tmp_path / f"{name}.pt"
        torch.save(sd, path)
    return path


SOURCE_KINDS = ["safetensors", "hf-dir", "fqnckpt", "pickle"]


@pytest.mark.parametrize("kind", SOURCE_KINDS)
def test_base_checkpoint_into_model_with_head_every_source(tmp_path, kind):
    """A base checkpoint into a model with a head, for every source kind: one resolver, the same report (prefix added, head missing)."""
    torch.manual_seed(0)
    base = Base()
    path = _write_source(kind, base.state_dict(), tmp_path, "base")
    target = WithHead()
    snap = Snapshot(target)
    with pytest.raises(CheckpointMismatchError) as ei:
        checkpoint.load(target, path)
    snap.assert_unchanged()
    assert ei.value.report.missing_keys == ["classifier.bias", "classifier.weight"]
    assert ei.value.report.unexpected_keys == []
    rep = checkpoint.load(target, path, strict=False)
    assert rep.missing_keys == ["classifier.bias", "classifier.weight"] and rep.unexpected_keys == []
    for k, v in base.state_dict().items():
        assert torch.equal(target.state_dict()["backbone." + k], v)


@pytest.mark.parametrize("kind", SOURCE_KINDS)
def test_head_checkpoint_into_base_model_every_source(tmp_path, kind):
    torch.manual_seed(0)
    head = WithHead()
    path = _write_source(kind, head.state_dict(), tmp_path, "head")
    target = Base()
    rep = checkpoint.load(target, path, strict=False)
    assert rep.missing_keys == [] and rep.unexpected_keys == ["classifier.bias", "classifier.weight"]
    for k, v in target.state_dict().items():
        assert torch.equal(v, head.state_dict()["backbone." + k])


class BufNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(4, 4)
        self.register_buffer("freqs", torch.arange(4.0), persistent=False)


@pytest.mark.parametrize("kind", SOURCE_KINDS)
@pytest.mark.parametrize("prefix", ["model.", "module."])
def test_nonpersistent_buffer_under_prefix_is_ignorable(tmp_path, kind, prefix):
    """A non-persistent buffer under a container / wrapper prefix: still ignorable, never unexpected; a stray key fails."""
    src = BufNet()
    sd = {prefix + k: v for k, v in dict(src.state_dict(), freqs=src.freqs.clone()).items()}
    path = _write_source(kind, sd, tmp_path, "buf")
    rep = checkpoint.load(BufNet(), path)
    assert rep.ignorable_keys == [prefix + "freqs"] and rep.unexpected_keys == [] and rep.missing_keys == []
    bad = _write_source(kind, dict(sd, **{prefix + "stray.weight": torch.zeros(1)}), tmp_path, "bad")
    with pytest.raises(CheckpointMismatchError) as ei:
        checkpoint.load(BufNet(), bad)
    assert ei.value.report.unexpected_keys == [prefix + "stray.weight"]


class _FF(nn.Module):
    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))

    def forward(self, x):
        return self.seq(x)


class _Sampler(nn.Module):
    """Receiver not called ``self``, a ModuleDict, an ``extra_modules`` trap, a checkpoint-wrapped
    block, a top-level parameter and buffer."""

    def __init__(self):
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        self.blocks = nn.ModuleList([_FF(), checkpoint_wrapper(_FF())])
        self.extra_modules = nn.ModuleDict({"proj_in": nn.Linear(4, 4)})
        self.latents = nn.Parameter(torch.randn(4))
        self.register_buffer("pos_scale", torch.ones(4))

    def forward(s, x):  # noqa: N805 - dynamo spells the receiver's name into every Source name
        x = s.extra_modules["proj_in"](x) + s.latents * s.pos_scale
        for b in s.blocks:
            x = b(x)
        return x


def _dynamo_source_names(model):
    """``{Source name: eager FQN}`` by tensor identity, from a real torch.compile backend."""
    seen = {}

    def backend(gm, example_inputs):
        for node, t in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs):
            seen[node.meta["grapharg"].source.name] = t
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(torch.randn(2, 4))
    torch._dynamo.reset()
    by_id = {id(t): n for n, t in model.state_dict(keep_vars=True).items()}
    truth = {k: by_id[id(t)] for k, t in seen.items() if id(t) in by_id}
    return truth, sorted(set(seen) - set(truth))


def test_dynamo_source_names_resolve_by_their_steps(tmp_path):
    torch.manual_seed(0)
    model = _Sampler()
    truth, user_inputs = _dynamo_source_names(model)
    assert user_inputs == ["L['x']"]
    assert len(truth) == len(model.state_dict())  # every tensor was a graph input
    assert any("__dict__['_modules']['_checkpoint_wrapped_module']" in k for k in truth)
    assert all(k.startswith("L['s']") for k in truth)
    # eager target (no checkpoint wrapper): the wrapper step is removed
    eager = _Sampler()
    eager.blocks[1] = _FF()
    want = {k: fqn.canonical_fqn(v) for k, v in truth.items()}
    assert fqn.resolve(list(truth), eager) == want
    # a user input is not model state, and an attribute / index spelling reads the same
    rep = fqn.resolve_report(["L['x']", "L['s'].blocks[0].seq[2].weight"], eager)
    assert rep.unexpected == ["L['x']"] and rep.mapping == {"L['s'].blocks[0].seq[2].weight": "blocks.0.seq.2.weight"}
    # a pickle keyed by Source names loads strictly, values equal
    sd = model.state_dict()
    inv = {v: k for k, v in truth.items()}
    path = tmp_path / "by_source.pt"
    torch.save({inv[k]: v for k, v in sd.items()}, path)
    rep = checkpoint.load(eager, path)
    assert rep.missing_keys == [] and rep.unexpected_keys == []
    for k, v in sd.items():
        assert torch.equal(eager.state_dict()[fqn.canonical_fqn(k)], v)


class _Blk(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.LayerNorm(2)


class _Wide(nn.Module):
    """Many modules, plus ``a_b.c`` / ``a.b_c``: both flatten to ``a_b_c`` (same shapes)."""

    def __init__(self, n):
        super().__init__()
        self.blocks = nn.Sequential(*[_Blk() for _ in range(n)])
        self.a_b = nn.ModuleDict({"c": nn.Linear(2, 2)})
        self.a = nn.ModuleDict({"b_c": nn.Linear(2, 2)})


def test_prefix_and_refusals_resolve_in_one_pass_over_the_model(tmp_path, monkeypatch):
    """A prefixed checkpoint with one ambiguous flattened name: every other key resolves with the
    prefix, the ambiguous one is reported, and the work is linear in keys (it was keys x modules
    prefix tries, and one model index per key once a name was refused: minutes at 800 keys)."""
    import importlib

    res = importlib.import_module("fqn.resolve")  # fqn.resolve the attribute is the function

    calls = {"index": 0, "hits": 0}
    init, hits = res._ModelNames.__init__, res._ModelNames.dotted_hits

    def counting_init(self, *a, **k):
        calls["index"] += 1
        init(self, *a, **k)

    def counting_hits(self, *a, **k):
        calls["hits"] += 1
        return hits(self, *a, **k)

    monkeypatch.setattr(res._ModelNames, "__init__", counting_init)
    monkeypatch.setattr(res._ModelNames, "dotted_hits", counting_hits)
    torch.manual_seed(0)
    model = _Wide(150)
    sd = {"model." + k: v for k, v in model.state_dict().items()}
    sd["a_b_c_weight"] = torch.zeros(2, 2)
    path = tmp_path / "wide.safetensors"
    save_file(sd, path)
    target = _Wide(150)
    snap = Snapshot(target)
    with pytest.raises(CheckpointMismatchError) as ei:
        checkpoint.load(target, path)
    snap.assert_unchanged()
    assert ei.value.report.unexpected_keys == ["a_b_c_weight"] and ei.value.report.missing_keys == []
    rep = checkpoint.load(target, path, strict=False)
    assert rep.unexpected_keys == ["a_b_c_weight"] and rep.missing_keys == []
    assert all(torch.equal(target.state_dict()[k[len("model."):]], v) for k, v in sd.items() if k.startswith("model."))
    n_keys = len(sd)
    assert calls["index"] <= 4, calls  # one model index per resolve, not one per key
    assert calls["hits"] <= 20 * n_keys, (calls, n_keys)
    # the same refusal through fqn's API: reported by name, the others still resolve together
    rep = fqn.resolve_report(list(sd), model, errors="report")
    assert list(rep.refused) == ["a_b_c_weight"] and isinstance(rep.refused["a_b_c_weight"], fqn.AmbiguousFQNError)
    assert rep.prefix == ("strip", "model") and len(rep.mapping) == n_keys - 1
    with pytest.raises(fqn.AmbiguousFQNError):
        fqn.resolve_report(list(sd), model)


class _SN(nn.Module):
    def __init__(self, legacy: bool):
        super().__init__()
        from torch.nn.utils import spectral_norm as legacy_sn
        from torch.nn.utils.parametrizations import spectral_norm as new_sn

        self.conv = (legacy_sn if legacy else new_sn)(nn.Conv1d(3, 4, 3, padding=1))
        self.proj = nn.Linear(4, 2)

    def forward(self, x):
        return self.proj(self.conv(x).mean(-1))


SN_NEW_TO_LEGACY = {
    "conv.parametrizations.weight.original": "conv.weight_orig",
    "conv.parametrizations.weight.0._u": "conv.weight_u",
    "conv.parametrizations.weight.0._v": "conv.weight_v",
    "conv.bias": "conv.bias",
    "proj.weight": "proj.weight",
    "proj.bias": "proj.bias",
}


@pytest.mark.parametrize("kind", ["safetensors", "pickle"])
@pytest.mark.parametrize("legacy_source", [False, True])
def test_spectral_norm_spellings_migrate_to_the_target_spelling(tmp_path, kind, legacy_source):
    """The weight_norm kind for spectral_norm: parametrization names <-> legacy hook names, both ways."""
    torch.manual_seed(0)
    src = _SN(legacy_source).eval()
    x = torch.randn(2, 3, 5)
    src(x)  # eval: no power iteration, u / v as stored
    want = SN_NEW_TO_LEGACY if not legacy_source else {v: k for k, v in SN_NEW_TO_LEGACY.items()}
    assert sorted(src.state_dict()) == sorted(want)  # the fixture is what torch writes
    target = _SN(not legacy_source).eval()
    assert sorted(target.state_dict()) == sorted(want.values())
    assert fqn.resolve(list(want), target) == want
    path = _write_source(kind, src.state_dict(), tmp_path, "sn")
    rep = checkpoint.load(target, path)
    assert rep.missing_keys == [] and rep.unexpected_keys == []
    for k, v in src.state_dict().items():
        assert torch.equal(target.state_dict()[want[k]], v), k
    with torch.no_grad():
        assert torch.allclose(target(x), src(x), atol=1e-6)


class _Symmetric(nn.Module):
    def forward(self, X):
        return X.triu() + X.triu(1).transpose(-1, -2)


class _Param(nn.Module):
    def __init__(self, how: str | None):
        super().__init__()
        import torch.nn.utils.parametrize as P
        from torch.nn.utils.parametrizations import orthogonal

        self.lin = nn.Linear(3, 3)
        if how == "symmetric":
            P.register_parametrization(self.lin, "weight", _Symmetric())
        elif how == "orthogonal":
            orthogonal(self.lin)


@pytest.mark.parametrize("kind", ["safetensors", "pickle"])
@pytest.mark.parametrize("how", ["symmetric", "orthogonal"])
def test_user_parametrization_input_never_loads_as_plain_weight(tmp_path, kind, how):
    """``lin.parametrizations.weight.original`` holds the parametrization's input, not the weight:
    into a plain model it is unexpected (and ``lin.weight`` missing), never silently copied."""
    torch.manual_seed(0)
    src = _Param(how)
    assert not torch.equal(src.lin.weight, src.lin.parametrizations.weight.original)
    path = _write_source(kind, src.state_dict(), tmp_path, "param")
    target = _Param(None)
    snap = Snapshot(target)
    with pytest.raises(CheckpointMismatchError) as ei:
        checkpoint.load(target, path)
    snap.assert_unchanged()
    assert "lin.parametrizations.weight.original" in ei.value.report.unexpected_keys
    assert ei.value.report.missing_keys == ["lin.weight"]
    assert "lin.parametrizations.weight.original" not in fqn.resolve_report(
        list(src.state_dict()), target
    ).mapping
    # control: a target with the same parametrization loads it strictly, weights equal
    same = _Param(how)
    rep = checkpoint.load(same, path)
    assert rep.missing_keys == [] and rep.unexpected_keys == []
    assert torch.equal(same.lin.weight, src.lin.weight)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)


def test_load_takes_the_options_its_pickle_errors_name(tmp_path):
    """Unsafe pickles and container prefixes through ``load``: the refusal names the globals and the containers, and ``load``
    has the options the messages point to (``trusted_globals=``, ``key=``), as ``migrate`` does."""
    import argparse
    import pickle

    from checkpoint.errors import AmbiguousSourceError, UnsafePickleError

    torch.manual_seed(0)
    src, ema = _Tiny(), _Tiny()
    path = tmp_path / "legacy.pth"
    torch.save({"model": src.state_dict(), "ema": ema.state_dict(), "args": argparse.Namespace(lr=0.1)}, path)
    target = _Tiny()
    snap = Snapshot(target)
    with pytest.raises(UnsafePickleError) as ei:
        checkpoint.load(target, path)
    snap.assert_unchanged()
    assert ei.value.globals == ["argparse.Namespace"] and str(path) in str(ei.value)
    assert isinstance(ei.value, pickle.UnpicklingError)
    with pytest.raises(AmbiguousSourceError) as ei:
        checkpoint.load(target, path, trusted_globals=[argparse.Namespace])
    snap.assert_unchanged()
    assert sorted(ei.value.choices) == ["ema", "model"]
    for key, want in (("model", src), ("ema", ema)):
        rep = checkpoint.load(target, path, trusted_globals=["argparse.Namespace"], key=key)
        assert rep.missing_keys == [] and rep.unexpected_keys == []
        assert all(torch.equal(target.state_dict()[k], v) for k, v in want.state_dict().items())
    # key= of a checkpoint with no containers is refused by name, nothing changed
    st = tmp_path / "plain.safetensors"
    save_file(src.state_dict(), st)
    snap = Snapshot(target)
    with pytest.raises(TypeError, match="key="):
        checkpoint.load(target, st, key="model")
    snap.assert_unchanged()


def test_load_key_picks_a_dcp_container(tmp_path):
    import torch.distributed.checkpoint as dcp

    from checkpoint.errors import AmbiguousSourceError

    torch.manual_seed(0)
    src, ema = _Tiny(), _Tiny()
    dcp.save({"model": src.state_dict(), "ema": ema.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    target = _Tiny()
    snap = Snapshot(target)
    with pytest.raises(AmbiguousSourceError) as ei:
        checkpoint.load(target, tmp_path / "dcp")
    snap.assert_unchanged()
    assert sorted(ei.value.choices) == ["ema", "model"]
    for key, want in (("model", src), ("ema", ema)):
        rep = checkpoint.load(target, tmp_path / "dcp", key=key)
        assert rep.missing_keys == [] and rep.unexpected_keys == []
        assert all(torch.equal(target.state_dict()[k], v) for k, v in want.state_dict().items())


@pytest.mark.parametrize("kind", ["safetensors", "pickle"])
def test_fsdp1_flat_param_refused_naming_key_and_file(tmp_path, kind):
    """FSDP1's flat parameters through ``load``: refused by name (key and file), nothing changed;
    never dropped as merely unexpected, also with strict=False."""
    sd = {
        "_fsdp_wrapped_module.fc._fsdp_wrapped_module._flat_param": torch.zeros(6),
        "_fsdp_wrapped_module.head.weight": torch.zeros(2, 2),
    }
    path = _write_source(kind, sd, tmp_path, "flat")
    target = _Tiny()
    snap = Snapshot(target)
    for strict in (True, False):
        with pytest.raises(fqn.FlatParamError) as ei:
            checkpoint.load(target, path, strict=strict)
        snap.assert_unchanged()
        msg = str(ei.value)
        assert "_fsdp_wrapped_module.fc._fsdp_wrapped_module._flat_param" in msg and str(path) in msg
