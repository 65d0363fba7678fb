"""fqn.resolve rules: every name form, shape/dtype disambiguation, errors, agreement with identity."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from test_fqn_identity_matrix import MODELS, PATHS, RAISES, capture  # tests/ is on sys.path

import fqn

warnings.filterwarnings("ignore", category=FutureWarning)


class Receiver(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Module()
        self.inner.lin = nn.Linear(4, 4)

    def forward(s, x):  # noqa: N805  dynamo spells the receiver into names: L_s_...
        return s.inner.lin(x)


class Plain(nn.Module):
    """Target without checkpoint_wrapper for names captured through one."""

    def __init__(self):
        super().__init__()
        self.blk = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.out = nn.Linear(4, 4)


# torch 2.13 spellings of Plain's tensors as captured from a checkpoint_wrapper'd `blk`
# (observed names, see shared/reference/capture-names.md), plus the raw dgc code spelling.
WRAPPED_CAPTURE_NAMES = {
    "L_self_modules_blk_dict_modules_checkpoint_wrapped_module_modules_0_parameters_weight_": "blk.0.weight",
    "L__self___blk___dict_____modules_____checkpoint_wrapped_module___0_bias": "blk.0.bias",
    "l__self____export_root_blk___dict_____modules_____checkpoint_wrapped_module___0_weight": "blk.0.weight",
    "p_blk__checkpoint_wrapped_module_0_bias": "blk.0.bias",
    "L__self____export_root_out_weight": "out.weight",
    "l__self____export_root_out_bias": "out.bias",
    "self____modules__out____parameters__weight": "out.weight",
}


class Colliding(nn.Module):
    """``a_b.c`` and ``a.b_c`` flatten alike; ``wide`` decides whether their shapes differ."""

    def __init__(self, wide: bool):
        super().__init__()
        self.a_b = nn.ModuleDict({"c": nn.Linear(4, 8 if wide else 4)})
        self.a = nn.Module()
        self.a.b_c = nn.Linear(4, 4)
        self.register_buffer("x", torch.ones(2))
        self.register_buffer("x_1", torch.ones(3))
        self.register_buffer("rope", torch.ones(2), persistent=False)


def test_receiver_name_and_wrapper_forms_into_unwrapped_model():
    assert fqn.resolve(["L_s_modules_inner_modules_lin_parameters_weight_"], Receiver()) == {
        "L_s_modules_inner_modules_lin_parameters_weight_": "inner.lin.weight"
    }
    for name, eager in WRAPPED_CAPTURE_NAMES.items():  # one at a time: several name one tensor
        assert fqn.resolve([name], Plain()) == {name: eager}


def test_collisions_need_shapes_and_never_guess():
    names = ["L__self___a_b_c_weight", "L__self___a_b_c_weight_0"]
    same = Colliding(wide=False)
    for n in names:
        with pytest.raises(fqn.AmbiguousFQNError) as ei:
            fqn.resolve([n], same)
        assert ei.value.candidates == ["a.b_c.weight", "a_b.c.weight"]
    # Same shapes: shapes cannot help either.
    f32 = torch.float32
    with pytest.raises(fqn.AmbiguousFQNError):
        fqn.resolve(["L__self___a_b_c_weight"], same, {"L__self___a_b_c_weight": ((4, 4), f32)})
    # Different shapes decide, whichever name carries the suffix.
    wide = Colliding(wide=True)
    shapes = {names[0]: ((8, 4), f32), names[1]: ((4, 4), f32)}
    assert fqn.resolve(names, wide, shapes) == {names[0]: "a_b.c.weight", names[1]: "a.b_c.weight"}
    # A shape no candidate has is not silently mapped.
    with pytest.raises(fqn.AmbiguousFQNError):
        fqn.resolve([names[0]], wide, {names[0]: ((3, 3), f32)})


def test_suffix_only_where_the_base_is_shared():
    # `x` is unique, so `L__self___x_1` is the buffer `x_1`, not a collision copy of `x`.
    m = Colliding(wide=False)
    assert fqn.resolve(["L__self___x_1", "L_self_buffers_x_"], m) == {
        "L__self___x_1": "x_1",
        "L_self_buffers_x_": "x",
    }


def test_eager_names_nonpersistent_and_errors():
    m = Colliding(wide=False)
    eager = ["a_b.c.weight", "a.b_c.bias", "x", "rope"]
    assert fqn.resolve(eager, m) == {n: n for n in eager}
    rep = fqn.match_names(["L__self___rope", "a_b.c.bias", "nope.weight"], m)
    assert rep.mapping == {"L__self___rope": "rope", "a_b.c.bias": "a_b.c.bias"}
    assert rep.non_persistent == ["L__self___rope"]
    assert rep.unexpected == ["nope.weight"]
    assert rep.missing == ["a.b_c.bias", "a.b_c.weight", "a_b.c.weight", "x", "x_1"]
    with pytest.raises(KeyError) as ei:  # UnknownNameError is a KeyError
        fqn.resolve(["a_b.c.wieght"], m)
    assert isinstance(ei.value, fqn.UnknownNameError)
    assert ei.value.closest[0] == "a_b.c.weight"
    with pytest.raises(fqn.FQNCollisionError, match="a_b.c.weight"):
        fqn.resolve(["a_b.c.weight", "_orig_mod.a_b.c.weight"], m)
    with pytest.raises(fqn.FlatParamError, match="_flat_param"):
        fqn.resolve(["_fsdp_wrapped_module._flat_param"], m)


@pytest.mark.parametrize("path", PATHS)
def test_resolve_agrees_with_identity_on_real_captures(path):
    """Names from real captures, resolved without the graph, name the same tensor as identity
    does; only the colliding model's equal-shape names are refused (ambiguous), never guessed."""
    ambiguous = 0
    for model_name in MODELS:
        if (model_name, path) in RAISES:
            continue
        model, _, truth, _ = capture(model_name, path)
        eager_tensor = {t.fqn: t.tensor for t in fqn.eager_tensors(model)}
        eager_tensor |= {a: t.tensor for t in fqn.eager_tensors(model) for a in t.aliases}
        for name, eager in truth.items():
            try:
                got = fqn.resolve([name], model)[name]
            except fqn.AmbiguousFQNError as e:
                assert model_name == "colliding" and eager in e.candidates, (name, e.candidates)
                ambiguous += 1
                continue
            assert eager_tensor[got] is eager_tensor[eager], (model_name, name, got, eager)
    if path in ("compile", "aot_compile", "dgc_public"):
        # Placeholder names keep `_modules_` between segments: even the collisions are exact.
        assert ambiguous == 0
    else:
        assert ambiguous > 0  # attribute / export spellings of the colliding pairs
