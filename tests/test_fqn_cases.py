"""The naming kinds of real checkpoints (compiled, DataParallel / DDP, FSDP1, activation-checkpoint
wrappers, dynamo and export names, tied aliases, weight_norm spellings, container prefixes) as
tests of fqnckpt's public API.

Each test rebuilds the situation with its own tiny model, checks fqn's mapping against the right
outcome, and where a mapping is produced, loads it strictly and compares values.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import fqn
from tests.models import Base, WithHead

warnings.filterwarnings("ignore")


def _load_mapped(target: nn.Module, sd: dict[str, torch.Tensor], mapping: dict[str, str]) -> None:
    target.load_state_dict({mapping[k]: v for k, v in sd.items()}, strict=True)
    got = target.state_dict()
    for k, v in sd.items():
        assert torch.equal(got[mapping[k]], v), k


# -- _orig_mod -------------------------------------------------------------------------------------
class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16)


def test_b01_orig_mod_prefix():
    src = torch.compile(TinyLM())
    sd = src.state_dict()
    eager_keys = list(TinyLM().state_dict())
    assert set(sd) == {"_orig_mod." + k for k in eager_keys}
    target = TinyLM()
    mapping = fqn.resolve(sd, target)
    assert mapping == {"_orig_mod." + k: k for k in eager_keys}
    assert all(fqn.canonical_fqn(k) == mapping[k] for k in sd)
    _load_mapped(target, sd, mapping)


class Block2(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(6, 6)
        self.mlp = nn.Linear(6, 6)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, 6)
        self.layers = nn.ModuleList([Block2() for _ in range(3)])
        self.out = nn.Linear(6, 2)


def test_b02_orig_mod_interior():
    src = Stack()
    for i in range(3):
        src.layers[i] = torch.compile(src.layers[i])
    sd = src.state_dict()
    assert "layers.0._orig_mod.attn.weight" in sd
    expected = {k: k.replace("._orig_mod", "") for k in sd}
    assert fqn.resolve(sd, Stack()) == expected
    # The model-free rule agrees and is idempotent on eager names.
    assert {k: fqn.canonical_fqn(k) for k in sd} == expected
    assert fqn.canonical_fqn("layers.0.attn.weight") == "layers.0.attn.weight"
    # The compiled model itself names its tensors eagerly.
    assert fqn.FQNMap.from_module(src).eager_fqns() == list(Stack().state_dict())
    _load_mapped(Stack(), sd, expected)


# -- module. (DataParallel / DDP) ------------------------------------------------------------------
class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
        self.fc = nn.Linear(2, 3)


class HasRealModuleChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.module = nn.Linear(2, 2)
        self.fc = nn.Linear(2, 1)


def test_b04_dataparallel_prefix_and_real_module_child():
    sd = nn.DataParallel(Classifier()).state_dict()
    eager_keys = list(Classifier().state_dict())
    assert "features.1.num_batches_tracked" in eager_keys
    mapping = fqn.resolve(sd, Classifier())
    assert mapping == {"module." + k: k for k in eager_keys}
    _load_mapped(Classifier(), sd, mapping)
    # Negative control: a real child called ``module`` is never stripped.
    neg = HasRealModuleChild().state_dict()
    assert fqn.resolve(neg, HasRealModuleChild()) == {k: k for k in neg}
    assert fqn.canonical_fqn("module.weight", HasRealModuleChild()) == "module.weight"
    # Without the model the string rule cannot know; it strips (documented limitation).
    assert fqn.canonical_fqn("module.weight") == "weight"


class SmallVGG(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
        self.classifier = nn.Linear(4, 10)


def test_b05_submodule_dataparallel():
    src = SmallVGG()
    src.features = nn.DataParallel(src.features)
    sd = src.state_dict()
    expected = {
        "features.module.0.weight": "features.0.weight",
        "features.module.0.bias": "features.0.bias",
        "features.module.2.weight": "features.2.weight",
        "features.module.2.bias": "features.2.bias",
        "classifier.weight": "classifier.weight",
        "classifier.bias": "classifier.bias",
    }
    assert fqn.resolve(sd, SmallVGG()) == expected
    _load_mapped(SmallVGG(), sd, expected)
    # Into a whole-model DataParallel: eager FQNs, or the keys its state_dict uses.
    dp = nn.DataParallel(SmallVGG())
    assert fqn.resolve(sd, dp) == expected
    to_dp = fqn.resolve(sd, dp, spelling="state_dict")
    assert to_dp == {k: "module." + v for k, v in expected.items()}
    _load_mapped(dp, sd, to_dp)


# -- FSDP1 names -----------------------------------------------------------------------------------
class FBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([FBlock(), FBlock()])
        self.head = nn.Linear(4, 2)


def test_b06_fsdp1_wrapped_names_and_flat_param():
    eager = list(Backbone().state_dict())
    expected = {}
    for k in eager:
        if k.startswith("blocks."):
            _, i, rest = k.split(".", 2)
            expected[f"_fsdp_wrapped_module.blocks.{i}._fsdp_wrapped_module.{rest}"] = k
        else:
            expected[f"_fsdp_wrapped_module.{k}"] = k
    assert fqn.resolve(expected, Backbone()) == expected
    assert {k: fqn.canonical_fqn(k) for k in expected} == expected
    for flat in (
        "_fsdp_wrapped_module._flat_param",
        "_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module._flat_param",
    ):
        with pytest.raises(fqn.FlatParamError, match="_flat_param") as ei:
            fqn.resolve([*expected, flat], Backbone())
        assert ei.value.name == flat
        with pytest.raises(fqn.FlatParamError, match="_flat_param"):
            fqn.canonical_fqn(flat, Backbone())


# -- _checkpoint_wrapped_module --------------------------------------------------------------------
class MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([MLPBlock() for _ in range(2)])


def test_b07_checkpoint_wrapper_named_parameters():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    train = Tower()
    for i in range(2):
        train.blocks[i] = checkpoint_wrapper(train.blocks[i])
    by_name = {n: p.detach().clone() for n, p in train.named_parameters()}
    assert "blocks.0._checkpoint_wrapped_module.fc.weight" in by_name
    expected = {k: k.replace("._checkpoint_wrapped_module", "") for k in by_name}
    assert fqn.resolve(by_name, Tower()) == expected
    _load_mapped(Tower(), by_name, expected)
    # The wrapped model's own eager names carry no wrapper segment.
    assert fqn.FQNMap.from_module(train).eager_fqns() == list(Tower().state_dict())
    # Eager names into a wrapped target: identity on eager names, state_dict keys on request.
    eager_sd = Tower().state_dict()
    assert fqn.resolve(eager_sd, train) == {k: k for k in eager_sd}
    assert fqn.resolve(eager_sd, train, spelling="state_dict") == {k: k for k in eager_sd}


# -- dynamo-mangled names --------------------------------------------------------------------------
class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))

    def forward(self, x):
        return self.seq(x)


class Sampler(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.ModuleList([nn.LayerNorm(4), FeedForward()]) for _ in range(2)])
        self.extra_modules = nn.ModuleDict({"proj_in": nn.Linear(4, 4)})
        self.latents = nn.Parameter(torch.randn(4))
        self.register_buffer("pos_scale", torch.ones(4))

    def forward(self, x):
        x = self.extra_modules["proj_in"](self.to_q(x)) + self.latents * self.pos_scale
        for norm, ff in self.blocks:
            x = ff(norm(x))
        return x


DYNAMO_EXPECTED = {
    "L_self_modules_to_q_parameters_weight_": "to_q.weight",
    "L_self_modules_to_q_parameters_bias_": "to_q.bias",
    "L_self_modules_extra_modules_modules_proj_in_parameters_weight_": "extra_modules.proj_in.weight",
    "L_self_modules_extra_modules_modules_proj_in_parameters_bias_": "extra_modules.proj_in.bias",
    "L_self_parameters_latents_": "latents",
    "L_self_buffers_pos_scale_": "pos_scale",
}
for _b in range(2):
    for _t in ("weight", "bias"):
        DYNAMO_EXPECTED[f"L_self_modules_blocks_modules_{_b}_modules_0_parameters_{_t}_"] = f"blocks.{_b}.0.{_t}"
        for _j in (0, 2):
            DYNAMO_EXPECTED[
                f"L_self_modules_blocks_modules_{_b}_modules_1_modules_seq_modules_{_j}_parameters_{_t}_"
            ] = f"blocks.{_b}.1.seq.{_j}.{_t}"


def test_b09_dynamo_placeholders_by_identity_and_by_model():
    model = Sampler()
    seen = {}

    def backend(gm, example_inputs):
        seen["gm"], seen["inputs"] = gm, list(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(torch.randn(2, 4))
    fmap = fqn.FQNMap.from_capture(model, seen["gm"], seen["inputs"])
    assert {k: v for k, v in fmap.captured_to_eager().items() if k.startswith("L_")} == DYNAMO_EXPECTED
    with pytest.raises(fqn.UnknownNameError):  # a user input is not model state
        fmap.to_eager("L_x_")
    # Without the graph, the same strings resolve against the model's real names.
    assert fqn.resolve(DYNAMO_EXPECTED, Sampler()) == DYNAMO_EXPECTED
    # node names are the lower-cased spelling
    lower = {k.replace("L_", "l_", 1): v for k, v in DYNAMO_EXPECTED.items()}
    assert fqn.resolve(lower, Sampler()) == lower


class Legacy(nn.Module):
    """The older spelling of the dynamo-mangled names: ``sampler.blocks.0.mlp.1.seq.2.weight``."""

    def __init__(self):
        super().__init__()
        self.sampler = nn.Module()
        self.sampler.to_q = nn.Linear(4, 4)
        mlp = nn.ModuleList([nn.Identity(), FeedForward()])
        blk = nn.Module()
        blk.mlp = mlp
        self.sampler.blocks = nn.ModuleList([blk])


def test_b09_legacy_spellings_against_the_model():
    legacy = {
        "getattr_getattr_L__self___sampler_blocks___0___mlp___1___seq___2___weight": "sampler.blocks.0.mlp.1.seq.2.weight",
        "L__self___sampler_to_q_weight": "sampler.to_q.weight",
        "self____modules__sampler____modules__to_q____parameters__bias": "sampler.to_q.bias",
    }
    assert fqn.resolve(legacy, Legacy()) == legacy
    # 'sampler_blocks' vs 'sampler.blocks': with both present the flattened name is refused.
    both = Legacy()
    both.sampler_to_q = nn.Linear(4, 4)
    with pytest.raises(fqn.AmbiguousFQNError) as ei:
        fqn.resolve(["L__self___sampler_to_q_weight"], both)
    assert ei.value.candidates == ["sampler.to_q.weight", "sampler_to_q.weight"]


# -- export placeholders ---------------------------------------------------------------------------
class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.ModuleList([nn.Linear(4, 4)])


class ExportNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = Inner()
        self.enc_block = nn.ModuleList([nn.Linear(4, 4)])
        self.register_buffer("running_scale", torch.ones(4))
        self.offset = torch.full((4,), 0.5)  # lifted constant

    def forward(self, x):
        y = self.enc.block[0](x) + self.enc_block[0](x)
        return y * self.running_scale + self.offset


_EXPORT_COMMON = {
    "p_enc_block_0_weight": "enc.block.0.weight",
    "p_enc_block_0_bias": "enc.block.0.bias",
    "b_running_scale": "running_scale",
    "c_offset": "offset",
}
EXPORT_EXPECTED = {
    True: {
        **_EXPORT_COMMON,
        "p_enc_block_0_weight_0": "enc_block.0.weight",
        "p_enc_block_0_bias_0": "enc_block.0.bias",
    },
    False: {
        **_EXPORT_COMMON,
        "p_enc_block_0_weight_1": "enc_block.0.weight",
        "p_enc_block_0_bias_1": "enc_block.0.bias",
    },
}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non_strict"])
def test_b10_export_placeholders_from_signature(strict):
    model = ExportNet()
    ep = torch.export.export(model, (torch.randn(2, 4),), strict=strict)
    for m in (None, model):
        fmap = fqn.FQNMap.from_exported_program(ep, m)
        got = {c: fmap.to_eager(c) for c in EXPORT_EXPECTED[strict]}
        assert got == EXPORT_EXPECTED[strict]
        rec = fmap.record("c_offset")
        assert rec.kind == fqn.TensorKind.constant
        assert (rec.shape, rec.dtype) == ([4], "float32")
        assert torch.equal(ep.constants["offset"], model.offset)
        assert fmap.record("b_running_scale").kind == fqn.TensorKind.persistent_buffer
    # Against the model alone the colliding placeholders are refused, never guessed ...
    for name in ("p_enc_block_0_weight", "p_enc_block_0_weight_0", "p_enc_block_0_weight_1"):
        with pytest.raises(fqn.AmbiguousFQNError) as ei:
            fqn.resolve([name], ExportNet())
        assert ei.value.candidates == ["enc.block.0.weight", "enc_block.0.weight"]
    # ... and unambiguous ones resolve; a lifted constant is not state_dict state.
    assert fqn.resolve(["b_running_scale"], ExportNet()) == {"b_running_scale": "running_scale"}
    with pytest.raises(fqn.UnknownNameError):
        fqn.resolve(["c_offset"], ExportNet())


# -- strict export drops a tied alias --------------------------------------------------------------
class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return self.lm_head(self.proj(self.embed(ids)))


@pytest.mark.parametrize("with_model", [True, False])
def test_b11_export_keeps_every_eager_key(with_model):
    model = TiedLM()
    ep = torch.export.export(model, (torch.tensor([[1, 2, 3]]),), strict=True)
    assert "lm_head.weight" not in dict(ep.module().named_parameters())  # the torch fault
    fmap = fqn.FQNMap.from_exported_program(ep, model if with_model else None)
    assert fmap.eager_fqns(include_aliases=True) == [
        "embed.weight",
        "lm_head.weight",
        "proj.weight",
        "proj.bias",
    ]
    assert [set(g) for g in fmap.alias_groups()] == [{"embed.weight", "lm_head.weight"}]
    assert fmap.to_eager("lm_head.weight") == "embed.weight"
    # Every eager key resolves against the model; the tied pair stays one storage after loading.
    sd = model.state_dict()
    assert fqn.resolve(sd, TiedLM()) == {k: k for k in sd}
    target = TiedLM()
    target.load_state_dict(sd, strict=True)
    assert target.lm_head.weight.data_ptr() == target.embed.weight.data_ptr()


# -- weight_norm new <-> legacy --------------------------------------------------------------------
class PosConv(nn.Module):
    def __init__(self, wn):
        super().__init__()
        self.conv = wn(nn.Conv1d(4, 4, 3, padding=1), name="weight", dim=2)
        self.proj = nn.Linear(4, 4)


def test_b13_weight_norm_both_directions():
    from torch.nn.utils import weight_norm as legacy_wn
    from torch.nn.utils.parametrizations import weight_norm as new_wn

    expected = {
        "conv.parametrizations.weight.original0": "conv.weight_g",
        "conv.parametrizations.weight.original1": "conv.weight_v",
        "conv.bias": "conv.bias",
        "proj.weight": "proj.weight",
        "proj.bias": "proj.bias",
    }
    torch.manual_seed(0)
    new, legacy = PosConv(new_wn), PosConv(legacy_wn)
    new_sd = new.state_dict()
    to_legacy = fqn.resolve(new_sd, legacy)
    assert to_legacy == expected
    _load_mapped(legacy, new_sd, to_legacy)
    x = torch.randn(1, 4, 5)
    torch.testing.assert_close(legacy.conv(x), new.conv(x), atol=1e-6, rtol=0)

    fresh = PosConv(new_wn)
    legacy_sd = legacy.state_dict()
    to_new = fqn.resolve(legacy_sd, fresh)
    assert to_new == {v: k for k, v in expected.items()}
    _load_mapped(fresh, legacy_sd, to_new)
    torch.testing.assert_close(fresh.conv(x), new.conv(x), atol=1e-6, rtol=0)
    # Same spelling on both sides: identity.
    assert fqn.resolve(new_sd, PosConv(new_wn)) == {k: k for k in new_sd}


# -- container prefixes ----------------------------------------------------------------------------
class Net23(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.out = nn.Linear(4, 1)


def test_b23_container_prefix_added_and_removed():
    flat = Net23().state_dict()
    nested = nn.ModuleDict({"model": Net23()})
    rep = fqn.resolve_report(flat, nested)
    assert rep.mapping == {k: "model." + k for k in flat}
    assert rep.prefix == ("add", "model")
    assert rep.missing == [] and rep.unexpected == []
    _load_mapped(nested, flat, rep.mapping)
    # The other way: nested keys into the flat model.
    nested_sd = nested.state_dict()
    assert fqn.resolve(nested_sd, Net23()) == {k: k.removeprefix("model.") for k in nested_sd}
    # Keys that disagree on the prefix are not rewritten.
    with pytest.raises(fqn.UnknownNameError):
        fqn.resolve(["model.layers.0.weight", "other.out.weight"], Net23())


def test_b28_base_prefix_with_head_keys_reported():
    base_keys = ["embed.weight", "layer.weight", "layer.bias"]
    base_sd = Base().state_dict()
    rep = fqn.resolve_report(base_sd, WithHead())
    assert rep.mapping == {k: "backbone." + k for k in base_keys}
    assert rep.missing == ["classifier.bias", "classifier.weight"]
    assert rep.unexpected == []
    target = WithHead()
    r = target.load_state_dict({rep.mapping[k]: v for k, v in base_sd.items()}, strict=False)
    assert sorted(r.missing_keys) == rep.missing

    head_sd = WithHead().state_dict()
    rep = fqn.resolve_report(head_sd, Base())
    assert rep.mapping == {"backbone." + k: k for k in base_keys}
    assert rep.unexpected == ["classifier.bias", "classifier.weight"]
    assert rep.missing == []
    assert rep.prefix == ("strip", "backbone")
    with pytest.raises(fqn.UnknownNameError, match="classifier"):
        fqn.resolve(head_sd, Base())
