"""The capture matrix (7 models x 8 paths), ground truth by tensor identity computed here.

Paths: ``torch.compile`` (backend inputs), the public
``torch._dynamo.functional_export.dynamo_graph_capture_for_export`` (state as graph inputs) and
precompile (``torch.compile(fullgraph=True).forward.aot_compile``, i.e. ``torch._dynamo.aot_compile``;
backend inputs), the private dgc raw and after ``_restore_state_dict``, ``_export_to_torch_ir``
and ``torch.export`` strict and non-strict.

Each cell checks every captured name against the tensor the model really holds, the exact eager
name set, shapes and dtypes, and that the registry invents no captured name. Collision cells show
where dynamo's own meta is wrong and the registry is not.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize
from torch._dynamo.aot_compile_types import GraphModuleSerializableCallable
from torch._dynamo.functional_export import _dynamo_graph_capture_for_export, dynamo_graph_capture_for_export
from torch.export._trace import _export_to_torch_ir, _restore_state_dict
from torch.nn.utils.parametrizations import weight_norm
from torch.utils.checkpoint import checkpoint

import fqn
from fqn import CaptureMismatchError, FQNMap

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

PATHS = [
    "compile",
    "aot_compile",
    "dgc_public",
    "dgc_raw",
    "dgc_restore",
    "torch_ir",
    "export_strict",
    "export_nonstrict",
]


def _lin():
    return nn.Linear(4, 4)


class Nested(nn.Module):
    """ModuleList / ModuleDict / Sequential, persistent + non-persistent buffers, an unused Linear."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(_lin(), nn.ReLU()), nn.Sequential(_lin())])
        self.heads = nn.ModuleDict({"cls": _lin()})
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.register_buffer("shift", torch.ones(4), persistent=False)
        self.unused = _lin()

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.heads["cls"](x) * self.scale + self.shift


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = _lin()
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.embed(x))


class Bf16Cast(nn.Module):
    """fqnckpt's own mixed-precision cast: transparent, so the eager name stays ``lin.weight``."""

    _fqnckpt_transparent = True

    def forward(self, w):
        return w.to(torch.bfloat16)


class Parametrized(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)
        parametrize.register_parametrization(self.lin, "weight", Bf16Cast(), unsafe=True)
        self.wn = weight_norm(_lin())

    def forward(self, x):
        return self.wn(self.lin(x.to(torch.bfloat16)).float())


class ACFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.blk = nn.Sequential(_lin(), nn.ReLU(), _lin())

    def forward(self, x):
        return checkpoint(self.blk, x, use_reentrant=False)


class ACWrapper(nn.Module):
    def __init__(self):
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        self.blk = checkpoint_wrapper(nn.Sequential(_lin(), nn.ReLU()))
        self.out = _lin()

    def forward(self, x):
        return self.out(self.blk(x))


class Colliding(nn.Module):
    """``a_b.c`` vs ``a.b_c`` and ``layers.1`` vs ``layers_1``: same flattened spelling, same shapes."""

    def __init__(self):
        super().__init__()
        self.a_b = nn.ModuleDict({"c": _lin()})
        self.a = nn.Module()
        self.a.b_c = _lin()
        self.layers = nn.ModuleList([_lin(), _lin()])
        self.layers_1 = _lin()

    def forward(self, x):
        x = self.a_b["c"](x) + self.a.b_c(x)
        return self.layers[1](self.layers[0](x)) - self.layers_1(x)


class KwargsDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = _lin()
        self.q = _lin()

    def forward(self, d, *, scale):
        return self.p(d["a"]) * scale + self.q(d["b"])


def _x():
    return torch.randn(2, 4)


MODELS = {
    "nested": (Nested, lambda: ((_x(),), {})),
    "tied": (Tied, lambda: ((_x(),), {})),
    "parametrized": (Parametrized, lambda: ((_x(),), {})),
    "ac_function": (ACFunction, lambda: ((_x(),), {})),
    "ac_wrapper": (ACWrapper, lambda: ((_x(),), {})),
    "colliding": (Colliding, lambda: ((_x(),), {})),
    "kwargs_dict": (KwargsDict, lambda: (({"a": _x(), "b": _x()},), {"scale": torch.tensor(2.0)})),
}
# Cells where the path cannot capture the model in torch 2.13 (asserted, not skipped).
RAISES = {
    ("ac_function", "export_strict"): "_checkpoint_context_fn",
    ("ac_wrapper", "export_strict"): "_checkpoint_context_fn",
    # precompile pickles its guards' state, and a parametrized module pickles only as a state_dict
    ("parametrized", "aot_compile"): "Serialization of parametrized modules",
}

# The eager FQN of a module-owned name, written out here (not computed by fqn).
EAGER_SPELLING = {
    "lin.parametrizations.weight.original": "lin.weight",  # transparent cast
    "blk._checkpoint_wrapped_module.0.weight": "blk.0.weight",
    "blk._checkpoint_wrapped_module.0.bias": "blk.0.bias",
}


def _owned(model):
    return list(model.named_parameters()) + list(model.named_buffers())


def _truth_by_identity(model: nn.Module, named_tensors) -> dict[str, str]:
    """``{captured name: eager FQN}`` where the captured tensor *is* the model's tensor."""
    owned = _owned(model)
    out = {}
    for name, t in named_tensors:
        hits = [n for n, mt in owned if mt is t]
        if hits:
            assert len(hits) == 1, hits
            out[name] = EAGER_SPELLING.get(hits[0], hits[0])
    return out


def _graph_named_tensors(gm: torch.fx.GraphModule):
    """Graph attributes and get_attr nodes (name and target), nested subgraphs included."""
    yield from gm.named_parameters(remove_duplicate=False)
    yield from gm.named_buffers(remove_duplicate=False)
    for prefix, mod in gm.named_modules():
        if isinstance(mod, torch.fx.GraphModule):
            pre = f"{prefix}." if prefix else ""
            for node in mod.graph.nodes:
                if node.op == "get_attr":
                    t = mod
                    for seg in node.target.split("."):
                        t = getattr(t, seg)
                    if isinstance(t, torch.Tensor):
                        yield pre + node.target, t
                        yield pre + node.name, t


def capture(model_name: str, path: str):
    """Capture one cell. Returns ``(model, fmap, truth, gm_or_ep)``."""
    cls, make_inputs = MODELS[model_name]
    torch.manual_seed(0)
    model = cls()
    args, kwargs = make_inputs()
    torch._dynamo.reset()
    if path in ("compile", "aot_compile"):
        seen = {}

        def backend(gm, example_inputs):
            seen["gm"], seen["inputs"] = gm, example_inputs
            if path == "compile":
                return gm.forward
            # precompile takes a serializable callable (serialized only when saved)
            return GraphModuleSerializableCallable(gm)

        compiled = torch.compile(model, backend=backend, fullgraph=True)
        if path == "compile":
            compiled(*args, **kwargs)
        else:
            compiled.forward.aot_compile((args, kwargs))
        gm, inputs = seen["gm"], seen["inputs"]
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        named = [(n.target, t) for n, t in zip(phs, inputs)] + [(n.name, t) for n, t in zip(phs, inputs)]
        return model, FQNMap.from_capture(model, gm, inputs), _truth_by_identity(model, named), gm
    if path in ("export_strict", "export_nonstrict"):
        ep = torch.export.export(model, args, kwargs, strict=path == "export_strict")
        named = []
        for spec in ep.graph_signature.input_specs:
            # Non-persistent buffers live in ep.constants, the rest in ep.state_dict.
            value = ep.state_dict.get(spec.target, ep.constants.get(spec.target))
            if isinstance(value, torch.Tensor):
                named += [(spec.arg.name, value)]
        return model, FQNMap.from_exported_program(ep, model), _truth_by_identity(model, named), ep
    if path == "dgc_public":
        gm = dynamo_graph_capture_for_export(model)(*args, **kwargs)
        inputs = fqn.capture.graph_input_tensors(gm, args, kwargs)
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        named = [(n.target, t) for n, t in zip(phs, inputs)] + [(n.name, t) for n, t in zip(phs, inputs)]
        named += list(_graph_named_tensors(gm))
        return model, FQNMap.from_capture(model, gm, inputs), _truth_by_identity(model, named), gm
    if path == "torch_ir":
        gm = _export_to_torch_ir(model, args, kwargs)
    else:
        gm = _dynamo_graph_capture_for_export(model)(*args, **kwargs)
        if path == "dgc_restore":
            _restore_state_dict(model, gm)
    named = list(_graph_named_tensors(gm))
    return model, FQNMap.from_capture(model, gm), _truth_by_identity(model, named), gm


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_capture_cell(model_name, path):
    if (model_name, path) in RAISES:
        with pytest.raises(RuntimeError, match=RAISES[model_name, path]):
            capture(model_name, path)
        return
    model, fmap, truth, captured = capture(model_name, path)
    assert truth, "no model tensor reached the graph"
    for name, eager in truth.items():
        assert fmap.to_eager(name) == eager, name
    # The registry's eager side is exactly the model's eager names, tensor for tensor.
    expected = {EAGER_SPELLING.get(n, n): t for n, t in _owned(model)}
    assert set(fmap.eager_fqns()) == set(expected)
    for rec in fmap:
        assert tuple(rec.shape) == tuple(expected[rec.fqn].shape)
        assert rec.dtype == fqn.dtype_name(expected[rec.fqn].dtype)
    # Every captured name the registry keeps is one the ground truth knows (nothing invented),
    # except the raw dgc code spelling and export targets that are not eager names.
    extra = set(fmap.captured_to_eager()) - set(truth)
    if path == "dgc_raw":
        for n in extra:
            assert n.startswith("L__self____export_root_") and f"self.{n}" in captured.code, n
    elif path.startswith("export"):
        targets = {s.target for s in captured.graph_signature.input_specs}
        assert extra <= targets, extra
    else:
        assert extra == set()


@pytest.mark.parametrize("path", ["dgc_raw", "torch_ir", "dgc_restore"])
def test_collision_cells_where_meta_is_wrong(path):
    """dynamo's own meta maps a colliding name to the wrong module; the registry does not."""
    _, fmap, truth, gm = capture("colliding", path)
    meta = gm.meta["dynamo_flat_name_to_original_fqn"]
    # dynamo's meta says `L__self___a_b_c_weight` is `a.b_c.weight`; the graph holds a_b.c's tensor.
    assert meta["L__self___a_b_c_weight"] == "a.b_c.weight"
    assert truth["l__self____export_root_a_b_c_weight"] == "a_b.c.weight"
    assert fmap.to_eager("l__self____export_root_a_b_c_weight") == "a_b.c.weight"
    assert fmap.to_eager("l__self____export_root_a_b_c_weight_0") == "a.b_c.weight"
    assert fmap.to_eager("l__self____export_root_layers_1_weight") == "layers.1.weight"
    assert fmap.to_eager("l__self____export_root_layers_1_weight_0") == "layers_1.weight"
    if path == "dgc_raw":
        # A map trusting the meta would differ from identity on exactly these names.
        wrong = {k for k, v in meta.items() if k in truth and v != truth[k]}
        assert wrong == {
            "L__self___a_b_c_weight",
            "L__self___a_b_c_bias",
            "L__self___layers_1_weight",
            "L__self___layers_1_bias",
        }
        assert "L__self___a_b_c_weight_0" not in meta  # the collision copy is missing from the meta
        for k in wrong:
            assert fmap.to_eager(k) == truth[k] != meta[k]


def test_flattened_names_alone_cannot_build_the_matrix():
    """A registry keyed by flattened names would merge the collision cells: prove they collide."""
    _, fmap, truth, _ = capture("colliding", "dgc_restore")
    eager = sorted(set(truth.values()))
    flat: dict[str, list[str]] = {}
    for e in eager:
        flat.setdefault(fqn.flatten_name(e), []).append(e)
    assert {k: v for k, v in flat.items() if len(v) > 1} == {
        "a_b_c_weight": ["a.b_c.weight", "a_b.c.weight"],
        "a_b_c_bias": ["a.b_c.bias", "a_b.c.bias"],
        "layers_1_weight": ["layers.1.weight", "layers_1.weight"],
        "layers_1_bias": ["layers.1.bias", "layers_1.bias"],
    }
    # ... and the registry keeps all 10 tensors apart.
    assert len({fmap.to_eager(n) for n in truth}) == len(eager) == 10


def test_tampered_meta_raises_and_lossy_meta_is_tolerated():
    model, _, _, gm = capture("colliding", "dgc_raw")
    meta = gm.meta["dynamo_flat_name_to_original_fqn"]
    # Lossy but flattening-equal claim (dynamo's own bug): identity wins, no error.
    assert FQNMap.from_capture(model, gm).to_eager("L__self___a_b_c_weight") == "a_b.c.weight"
    # A claim that flattens differently is a real contradiction: raise, never pick one.
    meta["L__self___layers_0_weight"] = "a_b.c.bias"
    with pytest.raises(CaptureMismatchError, match="L__self___layers_0_weight"):
        FQNMap.from_capture(model, gm)


def test_compile_collisions_decided_by_example_inputs():
    _, fmap, truth, _ = capture("colliding", "compile")
    assert fmap.to_eager("L_self_modules_a_b_modules_c_parameters_weight_") == "a_b.c.weight"
    assert fmap.to_eager("L_self_modules_a_modules_b_c_parameters_weight_") == "a.b_c.weight"
    assert fmap.to_eager("L_self_modules_layers_1_parameters_weight_") == "layers_1.weight"
    assert fmap.to_eager("l_self_modules_layers_modules_1_parameters_weight_") == "layers.1.weight"
    assert len(truth) == 2 * 10  # 10 tensors, placeholder target + node name each


def test_tied_alias_and_buffer_kinds():
    _, fmap, _, _ = capture("tied", "export_strict")
    assert fmap.alias_groups() == [["embed.weight", "head.weight"]]
    assert fmap.to_eager("head.weight") == "embed.weight"
    _, fmap, _, _ = capture("nested", "dgc_restore")
    assert fmap.record("shift").kind == fqn.TensorKind.non_persistent_buffer
    assert fmap.record("scale").kind == fqn.TensorKind.persistent_buffer
    assert fmap.to_captured("unused.weight") == []  # never used: no captured name
    assert fmap.to_eager("l__self____export_root_shift") == "shift"


def test_raw_dgc_code_spelling_maps_by_identity():
    """The raw dgc code reads ``self.L__self____export_root_...``: that spelling maps by identity."""
    model, fmap, _, gm = capture("colliding", "dgc_raw")
    pairs = dict(re.findall(r"(\w+) = self\.(L__self____export_root_\w+)", gm.code))
    assert pairs, "raw dgc code no longer uses the _export_root spelling"
    nodes = {n.name: n for n in gm.graph.nodes if n.op == "get_attr"}
    eager_of = {id(t): n for n, t in _owned(model)}
    for node_name, spelled in pairs.items():
        t = getattr(gm, nodes[node_name].target)
        assert fmap.to_eager(spelled) == eager_of[id(t)], spelled
    assert fmap.to_eager("L__self____export_root_a_b_c_weight_0") == "a.b_c.weight"


@pytest.mark.parametrize("strict", [True, False])
def test_export_without_model_keeps_tied_alias(strict):
    """A tied alias on the export side: strict export drops the alias, non-strict lifts it; both recorded."""
    model = Tied()
    ep = torch.export.export(model, (_x(),), strict=strict)
    fmap = FQNMap.from_exported_program(ep)
    assert fmap.alias_groups() == [["embed.weight", "head.weight"]]
    assert fmap.to_eager("head.weight") == "embed.weight"
