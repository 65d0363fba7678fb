"""Capture matrix: every capture path x every naming hazard; the FQN map must agree with tensor
identity, which each test derives on its own from the graph (never from fqnckpt)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm
from torch.utils.checkpoint import checkpoint

import fqn

warnings.filterwarnings("ignore")


class Cast(nn.Module):
    """The mixed-precision cast fqnckpt adds: transparent for naming."""

    _fqnckpt_transparent = True

    def forward(self, w):
        return w.to(torch.bfloat16)


class Nested(nn.Module):
    """ModuleList / ModuleDict / Sequential, both buffer kinds, tied weights, an unused Linear."""

    RENAME: dict[str, str] = {}

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2)])
        self.heads = nn.ModuleDict({"out": nn.Linear(4, 4, bias=False)})
        self.emb = nn.Linear(4, 4, bias=False)
        self.heads["out"].weight = self.emb.weight  # tied
        self.unused = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.register_buffer("mask", torch.ones(4), persistent=False)

    def forward(self, x):
        x = self.emb(x) * self.scale * self.mask
        for b in self.blocks:
            x = b(x)
        return self.heads["out"](x)


class Collide(nn.Module):
    """``a_b.c`` vs ``a.b_c`` and ``layers.1`` vs ``layers_1``: same flattened names, same shapes."""

    RENAME: dict[str, str] = {}

    def __init__(self):
        super().__init__()
        self.a_b = nn.ModuleDict({"c": nn.Linear(4, 4)})
        self.a = nn.ModuleDict({"b_c": nn.Linear(4, 4)})
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.layers_1 = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a_b["c"](x) + 2 * self.a["b_c"](x)
        return self.layers[1](self.layers[0](y)) + 3 * self.layers_1(y)


class Parametrized(nn.Module):
    """bf16 cast (``unsafe=True``, transparent) and the user's weight_norm (kept as is)."""

    RENAME = {"cast.parametrizations.weight.original": "cast.weight"}

    def __init__(self):
        super().__init__()
        self.cast = nn.Linear(4, 4)
        parametrize.register_parametrization(self.cast, "weight", Cast(), unsafe=True)
        self.wn = weight_norm(nn.Linear(4, 4))

    def forward(self, x):
        y = torch.nn.functional.linear(
            x.to(torch.bfloat16), self.cast.weight, self.cast.bias.to(torch.bfloat16)
        )
        return self.wn(x) + y.float()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


class ACFunction(nn.Module):
    """``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` around a block."""

    RENAME: dict[str, str] = {}

    def __init__(self):
        super().__init__()
        self.block = Block()
        self.out = nn.Linear(4, 4)

    def forward(self, x):
        return self.out(checkpoint(self.block, x, use_reentrant=False))


class ACWrapper(nn.Module):
    """``checkpoint_wrapper`` adds ``_checkpoint_wrapped_module`` to ``named_parameters``."""

    RENAME = {
        "block._checkpoint_wrapped_module.fc.weight": "block.fc.weight",
        "block._checkpoint_wrapped_module.fc.bias": "block.fc.bias",
    }

    def __init__(self):
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        self.block = checkpoint_wrapper(Block())
        self.out = nn.Linear(4, 4)

    def forward(self, x):
        return self.out(self.block(x))


class KwDict(nn.Module):
    """Forward with a dict input and a keyword argument."""

    RENAME: dict[str, str] = {}

    def __init__(self):
        super().__init__()
        self.p = nn.Linear(4, 4)
        self.q = nn.Linear(4, 4)

    def forward(self, inp, *, scale):
        return self.p(inp["a"]) * scale + self.q(inp["b"])


def _inputs(model):
    x = torch.randn(2, 4)
    if isinstance(model, KwDict):
        return ({"a": x, "b": x + 1},), {"scale": torch.tensor(2.0)}
    return (x,), {}


MODELS = [Nested, Collide, Parametrized, ACFunction, ACWrapper, KwDict]
PATHS = ["compile", "dgc", "dgc_restore", "export_to_torch_ir", "export_strict", "export_nonstrict"]
# torch 2.13: strict export cannot trace AC (KeyError _checkpoint_context_fn in wrap.py).
RAISES = {(ACFunction, "export_strict"), (ACWrapper, "export_strict")}


def truth_names(model: nn.Module) -> dict[int, set[str]]:
    """``{id(tensor): its eager names}`` from the module's own names and the model's RENAME table."""
    out: dict[int, set[str]] = {}
    named = list(model.named_parameters(remove_duplicate=False))
    named += list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        out.setdefault(id(t), set()).add(type(model).RENAME.get(name, name))
    return out


def _attr(root, target):
    for seg in target.split("."):
        root = getattr(root, seg)
    return root


def capture(model, path):
    """Capture ``model`` on ``path``; return (FQNMap, [(captured name, tensor)], gm or ep)."""
    from torch._dynamo.functional_export import _dynamo_graph_capture_for_export
    from torch.export._trace import _export_to_torch_ir, _restore_state_dict

    torch._dynamo.reset()
    args, kwargs = _inputs(model)
    if path == "compile":
        seen = {}

        def backend(gm, example_inputs):
            seen["gm"], seen["inputs"] = gm, list(example_inputs)
            return gm.forward

        torch.compile(model, backend=backend, fullgraph=True)(*args, **kwargs)
        gm = seen["gm"]
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        truth = [(n.target, t) for n, t in zip(phs, seen["inputs"])]
        truth += [(n.name, t) for n, t in zip(phs, seen["inputs"])]
        return fqn.FQNMap.from_capture(model, gm, seen["inputs"]), truth, gm
    if path in ("export_strict", "export_nonstrict"):
        ep = torch.export.export(model, args, kwargs, strict=path == "export_strict")
        truth = []
        for spec in ep.graph_signature.input_specs:
            if spec.target is not None and spec.kind.name in ("PARAMETER", "BUFFER"):
                truth.append((spec.arg.name, _attr(model, spec.target)))
        return fqn.FQNMap.from_exported_program(ep, model), truth, ep
    if path == "export_to_torch_ir":
        gm = _export_to_torch_ir(model, args, kwargs)
    else:
        gm = _dynamo_graph_capture_for_export(model)(*args, **kwargs)
        if path == "dgc_restore":
            _restore_state_dict(model, gm)
    gets = [n for n in gm.graph.nodes if n.op == "get_attr"]
    truth = [(n.target, _attr(gm, n.target)) for n in gets] + [(n.name, _attr(gm, n.target)) for n in gets]
    return fqn.FQNMap.from_capture(model, gm), truth, gm


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("model_cls", MODELS, ids=lambda c: c.__name__)
def test_capture_cell(model_cls, path):
    torch.manual_seed(0)
    model = model_cls()
    if (model_cls, path) in RAISES:
        with pytest.raises(RuntimeError, match="_checkpoint_context_fn"):
            capture(model, path)
        return
    fmap, truth, _ = capture(model, path)
    names_of = truth_names(model)
    state = [(n, t) for n, t in truth if id(t) in names_of]
    assert state, "the capture saw no model tensor"
    for name, t in state:
        assert set(fmap.record(name).eager_names) == names_of[id(t)], name
        assert fmap.to_eager(name) in names_of[id(t)]
        assert name in fmap.to_captured(fmap.to_eager(name)) or name in names_of[id(t)]
    # The eager side is exactly the model's eager names, each tensor once.
    assert {frozenset(r.eager_names) for r in fmap} == {frozenset(v) for v in names_of.values()}
    assert "parametrizations" not in " ".join(fmap.eager_fqns(include_aliases=True)).replace(
        "wn.parametrizations", ""
    )


def test_collisions_defeat_the_meta_and_flat_names():
    """On the collision model the meta and flattened names are wrong; identity is right.

    A registry that trusted the meta (or matched flattened names) would fail the matrix."""
    model = Collide()
    fmap, truth, gm = capture(model, "dgc")
    names_of = truth_names(model)
    meta = gm.meta["dynamo_flat_name_to_original_fqn"]
    targets = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    by_target = {n: t for n, t in truth if n in targets}
    meta_wrong = {n for n, t in by_target.items() if n in meta and meta[n] not in names_of[id(t)]}
    assert meta_wrong == {
        "L__self___a_b_c_weight",
        "L__self___a_b_c_bias",
        "L__self___layers_1_weight",
        "L__self___layers_1_bias",
    }
    assert "L__self___a_b_c_weight_0" not in meta  # the meta drops the colliding twin
    # Flattened names cannot tell the pairs apart at all.
    assert fqn.flatten_name("a_b.c.weight") == fqn.flatten_name("a.b_c.weight")
    # The registry follows identity on every one of them.
    assert fmap.to_eager("L__self___a_b_c_weight") == "a_b.c.weight"
    assert fmap.to_eager("L__self___a_b_c_weight_0") == "a.b_c.weight"
    assert fmap.to_eager("L__self___layers_1_weight") == "layers.1.weight"
    assert fmap.to_eager("L__self___layers_1_weight_0") == "layers_1.weight"
    for n, t in by_target.items():
        assert fmap.to_eager(n) in names_of[id(t)]
    # And the values behind those names are the model's own tensors.
    assert _attr(gm, "L__self___a_b_c_weight_0") is model.a.b_c.weight


def test_raw_dgc_code_spelling_is_a_captured_name():
    """The raw dgc code reads ``self.L__self____export_root_...``; that spelling maps by identity."""
    model = Collide()
    fmap, _, gm = capture(model, "dgc")
    pairs = dict(re.findall(r"(\w+) = self\.(L__self____export_root_\w+)", gm.code))
    assert pairs, "raw dgc code no longer uses the _export_root spelling"
    nodes = {n.name: n for n in gm.graph.nodes if n.op == "get_attr"}
    for node_name, spelled in pairs.items():
        t = _attr(gm, nodes[node_name].target)
        assert fmap.to_eager(spelled) in truth_names(model)[id(t)]
    assert fmap.to_eager("L__self____export_root_a_b_c_weight_0") == "a.b_c.weight"


@pytest.mark.parametrize("tamper", ["different_flattening", "same_flattening"])
def test_meta_cross_check(tamper):
    """Meta contradicting identity raises unless the two FQNs flatten alike (meta provably lossy)."""
    model = Collide()
    from torch._dynamo.functional_export import _dynamo_graph_capture_for_export

    torch._dynamo.reset()
    gm = _dynamo_graph_capture_for_export(model)(torch.randn(2, 4))
    meta = gm.meta["dynamo_flat_name_to_original_fqn"]
    if tamper == "different_flattening":
        meta["L__self___layers_0_weight"] = "a.b_c.weight"
        with pytest.raises(fqn.CaptureMismatchError, match="L__self___layers_0_weight"):
            fqn.FQNMap.from_capture(model, gm)
    else:
        meta["L__self___layers_0_weight"] = "layers_0.weight"  # lossy-equal: identity decides
        fmap = fqn.FQNMap.from_capture(model, gm)
        assert fmap.to_eager("L__self___layers_0_weight") == "layers.0.weight"


def test_export_without_model_keeps_tied_alias():
    """B11 on the export side: strict export drops ``heads.out.weight`` from the signature."""
    model = Nested()
    for strict in (True, False):
        ep = torch.export.export(model, (torch.randn(2, 4),), strict=strict)
        fmap = fqn.FQNMap.from_exported_program(ep)
        # Canonical = first in state_dict order (``heads`` is registered before ``emb``).
        first = next(k for k in model.state_dict() if k in ("emb.weight", "heads.out.weight"))
        assert first == "heads.out.weight"
        assert fmap.alias_groups() == [["heads.out.weight", "emb.weight"]]
        assert fmap.to_eager("emb.weight") == "heads.out.weight"
        assert fmap.record("mask").kind == fqn.TensorKind.non_persistent_buffer
        assert fmap.record("scale").kind == fqn.TensorKind.persistent_buffer
