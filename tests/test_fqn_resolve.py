"""fqn.resolve / fqn.resolve_report: every spelling against the model, never a guess."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import fqn

warnings.filterwarnings("ignore")


class Collide(nn.Module):
    """Flattened-name twins; ``layers_1`` has a different shape so shapes can decide."""

    def __init__(self, same_shapes: bool = True):
        super().__init__()
        self.a_b = nn.ModuleDict({"c": nn.Linear(4, 4)})
        self.a = nn.ModuleDict({"b_c": nn.Linear(4, 4)})
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.layers_1 = nn.Linear(4, 4) if same_shapes else nn.Linear(4, 8)

    def forward(self, x):
        y = self.a_b["c"](x) + self.a["b_c"](x)
        return self.layers[1](self.layers[0](y)).sum() + self.layers_1(y).sum()


def _dgc_names(model):
    from torch._dynamo.functional_export import _dynamo_graph_capture_for_export

    torch._dynamo.reset()
    gm = _dynamo_graph_capture_for_export(model)(torch.randn(2, 4))
    return gm, [n for n in gm.graph.nodes if n.op == "get_attr"]


def test_flattened_names_alone_cannot_redo_the_capture_matrix():
    """What identity maps in the matrix, a flattened-name resolver must refuse (same shapes)."""
    model = Collide()
    gm, nodes = _dgc_names(model)
    fmap = fqn.FQNMap.from_capture(model, gm)
    twins = [n.target for n in nodes if n.target.startswith(("L__self___a_b_c", "L__self___layers_1"))]
    assert len(twins) == 8
    for name in twins:
        with pytest.raises(fqn.AmbiguousFQNError) as ei:
            fqn.resolve([name], Collide())
        assert fmap.to_eager(name) in ei.value.candidates and len(ei.value.candidates) == 2
    # The non-colliding ones resolve and agree with identity.
    plain = [n.target for n in nodes if n.target.startswith("L__self___layers_0")]
    assert fqn.resolve(plain, Collide()) == {n: fmap.to_eager(n) for n in plain}


def test_shapes_disambiguate_only_when_they_differ():
    model = Collide(same_shapes=False)
    shapes = {"p_layers_1_weight": ((4, 4), torch.float32), "p_layers_1_weight_1": ((8, 4), "float32")}
    got = fqn.resolve(list(shapes), model, shapes)
    assert got == {"p_layers_1_weight": "layers.1.weight", "p_layers_1_weight_1": "layers_1.weight"}
    with pytest.raises(fqn.AmbiguousFQNError, match="shape"):
        fqn.resolve(["p_layers_1_weight"], model, {"p_layers_1_weight": ((3, 3), torch.float32)})
    with pytest.raises(fqn.AmbiguousFQNError):  # dtype is part of the evidence
        fqn.resolve(["p_layers_1_weight"], model, {"p_layers_1_weight": ((4, 4), torch.bfloat16)})


def test_eager_names_map_to_themselves_and_non_persistent_is_resolved():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.tied = nn.Linear(2, 2, bias=False)
            self.tied.weight = self.lin.weight
            self.register_buffer("rope", torch.ones(2), persistent=False)

    names = ["lin.weight", "lin.bias", "tied.weight", "rope"]
    assert fqn.resolve(names, M()) == {n: n for n in names}
    rep = fqn.resolve_report(["L__self___rope", "lin.bias"], M())
    assert rep.mapping == {"L__self___rope": "rope", "lin.bias": "lin.bias"}
    assert rep.non_persistent == ["L__self___rope"]
    assert rep.missing == ["lin.weight"]  # tied pair counted once, non-persistent never missing


def test_every_capture_spelling_of_one_model():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    class R(nn.Module):
        def __init__(self):
            super().__init__()
            self.blk = checkpoint_wrapper(nn.Linear(4, 4))
            self.extra_modules = nn.ModuleDict({"o": nn.Linear(4, 4)})
            self.register_buffer("scale", torch.ones(4))

        def forward(s, x):  # the receiver's name is part of dynamo's spelling
            return s.extra_modules["o"](s.blk(x) * s.scale)

    expected = {
        # torch.compile placeholders (and the lower-case node names), receiver ``s``
        "L_s_modules_blk_dict_modules_checkpoint_wrapped_module_parameters_weight_": "blk.weight",
        "l_s_modules_extra_modules_modules_o_parameters_bias_": "extra_modules.o.bias",
        "L_s_buffers_scale_": "scale",
        # dynamo graph attributes, dgc node names and the raw dgc code spelling
        "L__self___blk___dict_____modules_____checkpoint_wrapped_module___bias": "blk.bias",
        "l__self____export_root_extra_modules_o_weight": "extra_modules.o.weight",
        "L__self____export_root_scale": "scale",
        # export placeholders
        "p_blk__checkpoint_wrapped_module_weight": "blk.weight",
        "p_extra_modules_o_bias": "extra_modules.o.bias",
        "b_scale": "scale",
        # older dynamo spellings
        "self____modules__extra_modules____modules__o____parameters__weight": "extra_modules.o.weight",
        "getattr_L__self___extra_modules___o___bias": "extra_modules.o.bias",
        # wrappers, parametrization-free eager names
        "blk._checkpoint_wrapped_module.bias": "blk.bias",
        "_orig_mod.module.extra_modules.o.weight": "extra_modules.o.weight",
    }
    for name, fqn_ in expected.items():
        assert fqn.resolve([name], R()) == {name: fqn_}, name
    # A collision suffix is only read as one where two tensors share the base spelling.
    with pytest.raises(fqn.UnknownNameError):
        fqn.resolve(["p_extra_modules_o_bias_1"], R())
    # Several spellings of one tensor in one call collide on the target.
    with pytest.raises(fqn.FQNCollisionError) as ei:
        fqn.resolve(["b_scale", "L_s_buffers_scale_"], R())
    assert ei.value.target == "scale"


def test_unknown_and_buffer_prefix_kinds():
    model = nn.Sequential(nn.BatchNorm1d(3))
    assert fqn.resolve(["b_0_running_mean"], model) == {"b_0_running_mean": "0.running_mean"}
    with pytest.raises(fqn.UnknownNameError) as ei:  # ``p_`` is for parameters only
        fqn.resolve(["p_0_running_mean"], model)
    assert isinstance(ei.value, KeyError)
    assert "0.running_mean" in ei.value.closest
    with pytest.raises(fqn.UnknownNameError, match="'0.wieght'"):
        fqn.resolve(["0.wieght"], model)


def test_dotted_names_are_never_flattened():
    """``layers_1.weight`` is not ``layers.1.weight``: a dotted name is compared as written."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

    with pytest.raises(fqn.UnknownNameError):
        fqn.resolve(["layers_1.weight"], M())
    assert fqn.resolve(["layers_1_weight"], M()) == {"layers_1_weight": "layers.1.weight"}


def test_flat_param_refused_in_any_spelling():
    model = nn.Linear(2, 2)
    for name in ("_fsdp_wrapped_module._flat_param", "L__self____fsdp_wrapped_module__flat_param"):
        with pytest.raises(fqn.FlatParamError) as ei:
            fqn.resolve_report(["weight", name], model)
        assert ei.value.name == name


def test_ambiguous_container_prefix_is_refused():
    class Twin(nn.Module):
        def __init__(self):
            super().__init__()
            self.left = nn.Linear(2, 2)
            self.right = nn.Linear(2, 2)

    with pytest.raises(fqn.AmbiguousFQNError, match="prefix"):
        fqn.resolve(["weight", "bias"], Twin())
