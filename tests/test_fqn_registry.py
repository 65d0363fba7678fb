"""FQNMap records, lookups and JSON schema; canonical_fqn; parametrization naming."""

from __future__ import annotations

import json

import pydantic
import pytest
import torch
import torch.nn as nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import orthogonal, weight_norm

import fqn


class Cast(nn.Module):
    _fqnckpt_transparent = True

    def forward(self, w):
        return w.to(torch.bfloat16)


class UserScale(nn.Module):  # a parametrization the user owns: not transparent
    def forward(self, w):
        return w * 2


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.cast = nn.Linear(4, 4)
        parametrize.register_parametrization(self.cast, "weight", Cast(), unsafe=True)
        self.wn = weight_norm(nn.Linear(4, 4))
        self.orth = orthogonal(nn.Linear(4, 4))
        self.user = nn.Linear(4, 4)
        parametrize.register_parametrization(self.user, "weight", UserScale())
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("pb", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("nb", torch.ones(2), persistent=False)


def test_records_kinds_shapes_dtypes_aliases():
    fmap = fqn.FQNMap.from_module(Model())
    assert fmap.eager_fqns() == [
        "emb.weight",
        "cast.bias",
        "cast.weight",
        "wn.bias",
        "wn.parametrizations.weight.original0",
        "wn.parametrizations.weight.original1",
        "orth.bias",
        "orth.parametrizations.weight.original",
        "user.bias",
        "user.parametrizations.weight.original",
        "pb",
        "nb",
        "orth.parametrizations.weight.0.base",  # orthogonal's own buffer, real name kept
    ]
    assert fmap.alias_groups() == [["emb.weight", "head.weight"]]
    assert fmap.to_eager("head.weight") == "emb.weight"
    assert fmap.record("cast.weight").dtype == "float32"  # the stored original, not the cast
    assert fmap.record("pb").model_dump(include={"kind", "shape", "dtype"}) == {
        "kind": fqn.TensorKind.persistent_buffer,
        "shape": [3],
        "dtype": "int64",
    }
    assert fmap.record("nb").kind == fqn.TensorKind.non_persistent_buffer
    assert fmap.record("wn.parametrizations.weight.original0").shape == [4, 1]


def test_transparent_parametrization_only():
    """fqnckpt's cast is named ``X.W``; weight_norm / orthogonal / user ones keep real names."""
    model = Model()
    eager = {t.fqn: t for t in fqn.eager_tensors(model)}
    assert eager["cast.weight"].tensor is model.cast.parametrizations.weight.original
    assert eager["cast.weight"].module_names == ["cast.parametrizations.weight.original"]
    assert "cast.parametrizations.weight.original" not in eager
    assert fqn.is_transparent_parametrization(model.cast.parametrizations.weight)
    for owner in (model.wn, model.orth, model.user):
        assert not fqn.is_transparent_parametrization(owner.parametrizations.weight)
    assert "orth.weight" not in eager and "user.weight" not in eager
    # The same rule against a model, from the stored key of a transparent parametrization.
    assert fqn.resolve(["cast.parametrizations.weight.original"], Model()) == {
        "cast.parametrizations.weight.original": "cast.weight"
    }


def test_unknown_name_lists_closest():
    fmap = fqn.FQNMap.from_module(Model())
    with pytest.raises(KeyError) as ei:
        fmap.to_eager("cast.wieght")
    err = ei.value
    assert isinstance(err, fqn.UnknownNameError)
    assert err.closest[0] == "cast.weight"
    assert "cast.wieght" in str(err) and "cast.weight" in str(err)
    with pytest.raises(fqn.UnknownNameError):
        fmap.to_captured("nope")


def test_to_captured_and_collisions():
    fmap = fqn.FQNMap.from_module(Model())
    fmap.add_captured("emb.weight", "L__self___emb_weight")
    fmap.add_captured("head.weight", "p_head_weight")  # via the alias
    assert fmap.to_captured("head.weight") == ["L__self___emb_weight", "p_head_weight"]
    assert fmap.to_eager("p_head_weight") == "emb.weight"
    with pytest.raises(fqn.CaptureMismatchError, match="L__self___emb_weight"):
        fmap.add_captured("cast.bias", "L__self___emb_weight")
    with pytest.raises(fqn.FQNCollisionError):
        fmap.add_alias("cast.bias", "emb.weight")


def test_json_round_trip_exact_and_versioned():
    fmap = fqn.FQNMap.from_module(Model())
    fmap.add_captured("emb.weight", "L__self___emb_weight")
    text = fmap.to_json(indent=2)
    doc = json.loads(text)
    assert doc["version"] == fqn.FQN_MAP_SCHEMA_VERSION == 1
    back = fqn.FQNMap.from_json(text)
    assert back == fmap
    assert back.to_json(indent=2) == text
    assert back.to_eager("L__self___emb_weight") == "emb.weight"
    assert back.to_eager("head.weight") == "emb.weight"
    for bad in ({**doc, "version": 2}, {k: v for k, v in doc.items() if k != "version"} | {"version": "1"}):
        with pytest.raises(pydantic.ValidationError):
            fqn.FQNMap.from_json(json.dumps(bad))
    doc["records"][0]["extra"] = 1
    with pytest.raises(pydantic.ValidationError):
        fqn.FQNMap.from_json(json.dumps(doc))


def test_json_of_a_capture_round_trips():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ep = torch.export.export(model, (torch.randn(2, 4),))
    fmap = fqn.FQNMap.from_exported_program(ep, model)
    back = fqn.FQNMap.from_json(fmap.to_json())
    assert (
        back.captured_to_eager()
        == fmap.captured_to_eager()
        == {
            "p_0_weight": "0.weight",
            "p_0_bias": "0.bias",
            "p_1_weight": "1.weight",
            "p_1_bias": "1.bias",
        }
    )
    assert {r.provenance for r in back} == {fqn.Provenance.export_signature}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("_orig_mod.layers.0.w", "layers.0.w"),
        ("layers.0._orig_mod.attn.w", "layers.0.attn.w"),
        ("module._orig_mod._fsdp_wrapped_module.a._checkpoint_wrapped_module.b.w", "a.b.w"),
        ("_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.attn.weight", "blocks.0.attn.weight"),
        ("plain.name", "plain.name"),
    ],
)
def test_canonical_fqn_without_model(name, expected):
    assert fqn.canonical_fqn(name) == expected


def test_canonical_fqn_with_model_keeps_real_module_child():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.blocks = nn.ModuleList([torch.compile(nn.Linear(2, 2))])

    model = Holder()
    assert fqn.canonical_fqn("module.weight", model) == "module.weight"
    assert fqn.canonical_fqn("module.module.weight", model) == "module.weight"
    assert fqn.canonical_fqn("blocks.0._orig_mod.weight", model) == "blocks.0.weight"
    assert fqn.canonical_fqn("_orig_mod.blocks.0.weight", model) == "blocks.0.weight"
    dp = nn.DataParallel(model)
    assert fqn.canonical_fqn("module.module.weight", dp) == "module.weight"
    assert [t.fqn for t in fqn.eager_tensors(dp)] == [
        "module.weight",
        "module.bias",
        "blocks.0.weight",
        "blocks.0.bias",
    ]
    with pytest.raises(fqn.FlatParamError, match="_flat_param"):
        fqn.canonical_fqn("_fsdp_wrapped_module._flat_param")


def test_no_distributed_import_in_fqn():
    import pathlib

    root = pathlib.Path(fqn.__file__).parent
    offenders = [p.name for p in root.glob("*.py") if "torch.distributed" in p.read_text()]
    assert offenders == []
