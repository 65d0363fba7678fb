"""Each naming kind migrates to eager FQNs, and nothing is guessed (weight_norm spellings, prefixes, collisions, rules)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file
from torch.nn.utils import weight_norm as legacy_weight_norm
from torch.nn.utils.parametrizations import weight_norm as param_weight_norm

from checkpoint.errors import MigrationError, TiedValuesMismatchError
from checkpoint.migrating import REPORT_NAME, migrate, read_report
from checkpoint.storage.opening import open_checkpoint
from fqn import FQNMap
from tests.models import Base, WithHead
from tests.helpers import assert_same_state


def _load_strict(model: nn.Module, dst) -> None:
    """Strict ``load_state_dict`` of everything stored (plus tied aliases from the index)."""
    with open_checkpoint(dst) as r:
        sd = {k: r.get(k) for k in r.keys()}
        for group in r.alias_groups:
            for alias in group[1:]:
                sd[alias] = sd[group[0]]
    model.load_state_dict(sd, strict=True)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(4)
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.register_buffer("cache", torch.zeros(4), persistent=False)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x) * self.scale


def _seeded(cls=Net, seed=0):
    torch.manual_seed(seed)
    return cls()


def test_wrapper_segments_anywhere(tmp_path):
    src = _seeded()
    sd = src.state_dict()
    # compile prefix, DDP prefix, FSDP1 and checkpoint-wrapper segments inside keys, stacked.
    spelled = {}
    for k, v in sd.items():
        if k.startswith("layers.0."):
            k = k.replace("layers.0.", "layers.0._checkpoint_wrapped_module._orig_mod.")
        elif k.startswith("layers.1."):
            k = k.replace("layers.1.", "_fsdp_wrapped_module.layers.1._fsdp_wrapped_module.")
        spelled["module._orig_mod." + k] = v
    save_file(spelled, tmp_path / "w.safetensors")
    report = migrate(tmp_path / "w.safetensors", tmp_path / "out", model=Net())
    assert set(report.mapping.values()) == set(sd)
    assert all(e.decided_by == ["wrapper segments"] for e in report.entries)
    dst = _seeded(seed=1)
    _load_strict(dst, tmp_path / "out")
    assert_same_state(src, dst)


def test_real_child_named_module_is_kept(tmp_path):
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)  # a real child called "module" (negative control)

    sd = Holder().state_dict()
    save_file(dict(sd), tmp_path / "w.safetensors")
    report = migrate(tmp_path / "w.safetensors", tmp_path / "out", model=Holder(), dry_run=True)
    assert report.mapping == {"module.weight": "module.weight", "module.bias": "module.bias"}


def test_flat_param_refused(tmp_path):
    save_file({"_fsdp_wrapped_module._flat_param": torch.zeros(10)}, tmp_path / "w.safetensors")
    with pytest.raises(MigrationError) as e:
        migrate(tmp_path / "w.safetensors", tmp_path / "out", model=Net())
    (u,) = e.value.report.unresolved
    assert u.source == "_fsdp_wrapped_module._flat_param" and "_flat_param" in u.reason
    assert not (tmp_path / "out").exists()


def test_captured_graph_checkpoint_migrates_and_loads_strictly(tmp_path):
    from torch._dynamo.functional_export import _dynamo_graph_capture_for_export

    src = _seeded()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = _dynamo_graph_capture_for_export(src)(torch.randn(2, 3))
    flat = gm.state_dict()
    assert "L__self___layers_0_fc1_weight" in flat  # really flattened
    torch.save(flat, tmp_path / "captured.pt")
    # Without a model or map nothing is guessed.
    with pytest.raises(MigrationError, match="unresolved"):
        migrate(tmp_path / "captured.pt", tmp_path / "out")
    report = migrate(tmp_path / "captured.pt", tmp_path / "out", model=Net())
    assert report.mapping["L__self___layers_0_fc1_weight"] == "layers.0.fc1.weight"
    assert report.mapping["L__self___scale"] == "scale"
    assert set(report.mapping.values()) == {k for k in src.state_dict()}
    dst = _seeded(seed=1)
    _load_strict(dst, tmp_path / "out")
    assert_same_state(src, dst)
    x = torch.randn(2, 3)
    assert torch.equal(dst(x), src(x))


def test_fqn_map_decides_flattened_names(tmp_path):
    src = _seeded()
    fmap = FQNMap.from_module(src)
    for r in fmap:
        fmap.add_captured(r.fqn, "g_" + r.fqn.replace(".", "_"))
    (tmp_path / "map.json").write_text(fmap.to_json())
    save_file(
        {"g_" + k.replace(".", "_"): v for k, v in src.state_dict().items()}, tmp_path / "w.safetensors"
    )
    report = migrate(tmp_path / "w.safetensors", tmp_path / "out", fqn_map=tmp_path / "map.json")
    assert report.mapping["g_layers_1_fc2_bias"] == "layers.1.fc2.bias"
    assert report.entries[0].decided_by == ["fqn_map (rule)"]
    dst = _seeded(seed=1)
    _load_strict(dst, tmp_path / "out")
    assert_same_state(src, dst)


class Clash(nn.Module):
    """Modules ``a_b.c`` and ``a.b_c`` flatten to the same ``a_b_c``."""

    def __init__(self, same_shapes: bool):
        super().__init__()
        self.a_b = nn.Module()
        self.a_b.c = nn.Linear(3, 3)
        self.a = nn.Module()
        self.a.b_c = nn.Linear(3, 3 if same_shapes else 5)


def test_colliding_flattened_names_by_shape_or_refused(tmp_path):
    m = Clash(same_shapes=False)
    names = {"a_b.c.weight": "L__self___a_b_c_weight", "a.b_c.weight": "L__self___a_b_c_weight_0"}
    flat = {names[k]: v for k, v in m.state_dict().items() if k in names}
    save_file(flat, tmp_path / "w.safetensors")
    report = migrate(tmp_path / "w.safetensors", tmp_path / "out", model=Clash(False), allow_unresolved=True)
    assert report.mapping == {
        "L__self___a_b_c_weight": "a_b.c.weight",
        "L__self___a_b_c_weight_0": "a.b_c.weight",
    }
    assert report.missing == ["a.b_c.bias", "a_b.c.bias"]

    m = Clash(same_shapes=True)
    save_file({names[k]: v for k, v in m.state_dict().items() if k in names}, tmp_path / "s.safetensors")
    with pytest.raises(MigrationError) as e:
        migrate(tmp_path / "s.safetensors", tmp_path / "out2", model=Clash(True))
    rep = e.value.report
    assert {u.source for u in rep.unresolved} == set(flat)
    assert all(set(u.candidates) == {"a.b_c.weight", "a_b.c.weight"} for u in rep.unresolved)
    assert rep.entries == [] and not (tmp_path / "out2").exists()


def test_rules_whole_segments_and_collisions(tmp_path):
    sd = {"enc.layer.w": torch.ones(2), "enc.layers.w": torch.zeros(3)}
    save_file(sd, tmp_path / "w.safetensors")
    report = migrate(tmp_path / "w.safetensors", tmp_path / "o", rules=[("layer", "block"), (r"^enc\.", "")])
    assert report.mapping == {"enc.layer.w": "block.w", "enc.layers.w": "layers.w"}  # "layers" untouched
    assert report.entries[0].decided_by == ["rule 'layer'", "rule '^enc\\\\.'"]
    with pytest.raises(MigrationError) as e:
        migrate(tmp_path / "w.safetensors", tmp_path / "o2", rules=[("layers?", "blk")])
    assert [(c.target, c.sources) for c in e.value.report.collisions] == [("enc.blk.w", sorted(sd))]
    assert not (tmp_path / "o2").exists()


class PosConv(nn.Module):
    def __init__(self, wn):
        super().__init__()
        self.conv = wn(nn.Conv1d(4, 4, 3, padding=1), name="weight", dim=2)
        self.proj = nn.Linear(4, 4)


@pytest.mark.parametrize("direction", ["new_to_legacy", "legacy_to_new"])
def test_b13_weight_norm_spellings(tmp_path, direction):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        src = PosConv(param_weight_norm if direction == "new_to_legacy" else legacy_weight_norm)
        dst = PosConv(legacy_weight_norm if direction == "new_to_legacy" else param_weight_norm)
    torch.save(src.state_dict(), tmp_path / "w.pt")
    report = migrate(tmp_path / "w.pt", tmp_path / "out", model=dst)
    new_to_legacy = {
        "conv.parametrizations.weight.original0": "conv.weight_g",
        "conv.parametrizations.weight.original1": "conv.weight_v",
        "conv.bias": "conv.bias",
        "proj.weight": "proj.weight",
        "proj.bias": "proj.bias",
    }
    expected = new_to_legacy if direction == "new_to_legacy" else {v: k for k, v in new_to_legacy.items()}
    assert report.mapping == expected
    _load_strict(dst, tmp_path / "out")
    x = torch.randn(1, 4, 5)
    assert torch.allclose(dst.conv(x), src.conv(x), atol=1e-6)


def test_b28_base_checkpoint_into_model_with_head(tmp_path):
    base = _seeded(Base)
    save_file(base.state_dict(), tmp_path / "base.safetensors")
    with pytest.raises(MigrationError) as e:  # the head would stay random: refused by default
        migrate(tmp_path / "base.safetensors", tmp_path / "out", model=WithHead())
    assert e.value.report.missing == ["classifier.bias", "classifier.weight"]
    report = migrate(tmp_path / "base.safetensors", tmp_path / "out", model=WithHead(), allow_unresolved=True)
    assert report.mapping == {k: "backbone." + k for k in ["embed.weight", "layer.weight", "layer.bias"]}
    assert report.missing == ["classifier.bias", "classifier.weight"]
    assert read_report(tmp_path / "out").missing == report.missing
    target = WithHead()
    with open_checkpoint(tmp_path / "out") as r:
        res = target.load_state_dict({k: r.get(k) for k in r.keys()}, strict=False)
    assert sorted(res.missing_keys) == ["classifier.bias", "classifier.weight"] and res.unexpected_keys == []
    assert torch.equal(target.backbone.layer.weight, base.layer.weight)


def test_non_persistent_buffer_ignorable_and_tied_alias(tmp_path):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight
            self.register_buffer("rope", torch.ones(2), persistent=False)

    src = _seeded(Tied)
    sd = {"emb.weight": src.emb.weight.detach().clone(), "head.weight": src.emb.weight.detach().clone()}
    sd["rope"] = torch.ones(2)
    save_file(sd, tmp_path / "w.safetensors")
    report = migrate(tmp_path / "w.safetensors", tmp_path / "out", model=Tied())
    assert report.ignorable == ["rope"] and report.alias_groups == [["emb.weight", "head.weight"]]
    with open_checkpoint(tmp_path / "out") as r:
        assert r.keys() == ["emb.weight"]
    assert report.tied_sources == [["emb.weight", "head.weight"]]
    dst = _seeded(Tied, seed=3)
    _load_strict(dst, tmp_path / "out")
    assert torch.equal(dst.head.weight, src.emb.weight)

    # The two names of one tied tensor with different values: refused, nothing written.
    sd["head.weight"] = sd["head.weight"] + 1
    save_file(sd, tmp_path / "bad.safetensors")
    with pytest.raises(TiedValuesMismatchError, match=r"emb\.weight.*head\.weight.*bad\.safetensors"):
        migrate(tmp_path / "bad.safetensors", tmp_path / "out2", model=Tied())
    assert not (tmp_path / "out2").exists()


def test_optimizer_state_by_names_order_or_refused(tmp_path):
    model = _seeded(Block)
    compiled_names = [("_orig_mod." + n, p) for n, p in model.named_parameters()]
    opt = torch.optim.Adam(compiled_names, lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    osd = opt.state_dict()
    assert "param_names" in osd["param_groups"][0]
    torch.save({"model": model.state_dict(), "optimizer": osd}, tmp_path / "ck.pt")
    report = migrate(tmp_path / "ck.pt", tmp_path / "opt", key="optimizer")
    assert report.mapping["state.0.exp_avg"] == "state.fc1.weight.exp_avg"
    assert report.optimizer_param_groups[0]["params"] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    groups = json.loads((tmp_path / "opt" / "optimizer_param_groups.json").read_text())
    assert groups[0]["lr"] == 0.01
    with open_checkpoint(tmp_path / "opt") as r:
        assert torch.equal(r.get("state.fc2.bias.exp_avg_sq"), osd["state"][3]["exp_avg_sq"])

    # Positional ids without names: the model's parameter order decides, or it is refused.
    for g in osd["param_groups"]:
        del g["param_names"]
    torch.save({"model": model.state_dict(), "optimizer": osd}, tmp_path / "ck2.pt")
    with pytest.raises(MigrationError, match="keyed by position"):
        migrate(tmp_path / "ck2.pt", tmp_path / "opt2", key="optimizer")
    report = migrate(tmp_path / "ck2.pt", tmp_path / "opt2", key="optimizer", model=Block())
    assert report.mapping["state.2.exp_avg"] == "state.fc2.weight.exp_avg"
    with pytest.raises(MigrationError, match="has 4 params but the model has 12"):
        migrate(tmp_path / "ck2.pt", tmp_path / "opt3", key="optimizer", model=Net())


def test_report_inside_checkpoint_and_dry_run(tmp_path):
    save_file({"_orig_mod.embed.weight": torch.ones(4, 3)}, tmp_path / "w.safetensors")
    report = migrate(tmp_path / "w.safetensors", tmp_path / "dry", dry_run=True)
    assert not (tmp_path / "dry").exists() and not report.written and report.dry_run
    report = migrate(tmp_path / "w.safetensors", tmp_path / "out")
    on_disk = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    assert on_disk["entries"] == [
        {
            "source": "_orig_mod.embed.weight",
            "target": "embed.weight",
            "decided_by": ["wrapper segments"],
            "shape": [4, 3],
            "dtype": "float32",
            "file": "w.safetensors",
        }
    ]
    import checkpoint

    assert checkpoint.verify(tmp_path / "out").ok
