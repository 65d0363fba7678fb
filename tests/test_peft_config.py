"""A PEFT checkpoint's ``adapter_config.json`` against the target's peft config: ``load`` into a
``PeftModel`` built with another rank, scaling or rsLoRA flag is refused naming each field and
both values before any tensor changes (peft and transformers build the model from the saved
config, so such a target computes other outputs); an equal config loads exactly. ``inspect``
shows the saved fields, ``diff`` compares them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import checkpoint
from checkpoint.errors import AdapterConfigMismatchError
from tests.helpers import run_cli

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

TOKENS = torch.tensor([[1, 5, 9, 33, 2, 60, 7, 7]])


def lora(seed: int, **cfg):
    """A tiny Llama with LoRA on q / v (r=4, alpha 16 unless ``cfg`` says otherwise), every
    tensor drawn from ``seed`` (lora_B too, so the adapter changes the outputs)."""
    from tests.models import hf_llama

    torch.manual_seed(seed)
    kw = {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], **cfg}
    pm = peft.get_peft_model(hf_llama(layers=1), peft.LoraConfig(**kw))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_()
    return pm.eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("peftcfg")
    pm = lora(0)
    checkpoint.save(pm, root / "ck")
    pm.save_pretrained(root / "adapter")  # peft's own adapter directory (adapter files only)
    return root, pm


@pytest.mark.parametrize("where", ["ck", "adapter"])
@pytest.mark.parametrize("cfg, fields", [
    ({"lora_alpha": 64}, {"lora_alpha": (16, 64)}),
    ({"use_rslora": True}, {"use_rslora": (False, True)}),
    ({"r": 8, "lora_alpha": 32}, {"r": (4, 8), "lora_alpha": (16, 32)}),
    ({"target_modules": ["q_proj"]}, {"target_modules": (["q_proj", "v_proj"], ["q_proj"])}),
])
def test_a_target_built_with_another_config_is_refused_before_any_tensor_changes(saved, where, cfg, fields):
    # Loaded without a word, the logits would be off (0.47 for alpha 64 vs 16, 0.23 for rsLoRA).
    root, _ = saved
    target = lora(1, **cfg)
    before = snapshot(target)
    with pytest.raises(AdapterConfigMismatchError) as e:
        checkpoint.load(target, root / where)
    assert e.value.fields == fields and e.value.key == next(iter(fields))
    assert e.value.file == str(root / where / "adapter_config.json")
    for k, (s, t) in fields.items():
        assert f"{k}: saved {s!r}, target {t!r}" in str(e.value)
    after = target.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


def test_a_crafted_rank_beside_tensors_of_another_rank_is_refused(saved, tmp_path):
    # r: 8 written into the config of r=4 tensors: peft would build r=8 layers (and refuse the
    # tensors); a target of r=4, as the tensors are, must not take them as if all were well.
    root, _ = saved
    shutil.copytree(root / "adapter", tmp_path / "crafted")
    cfg_file = tmp_path / "crafted" / "adapter_config.json"
    doc = json.loads(cfg_file.read_text())
    doc["r"] = 8
    cfg_file.write_text(json.dumps(doc))
    target = lora(1)
    before = snapshot(target)
    with pytest.raises(AdapterConfigMismatchError) as e:
        checkpoint.load(target, tmp_path / "crafted")
    assert e.value.fields == {"r": (8, 4)}
    assert all(torch.equal(target.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("where", ["ck", "adapter"])
def test_an_equal_config_loads_exactly(saved, where):
    root, pm = saved
    target = lora(1)
    if where == "adapter":  # the adapter directory holds no base: give the target pm's base
        with torch.no_grad():
            for (n, p), q in zip(target.named_parameters(), pm.parameters()):
                if "lora_" not in n:
                    p.copy_(q)
    assert not torch.equal(logits(target), logits(pm))
    rep = checkpoint.load(target, root / where)
    assert rep.ok
    want = pm.state_dict()
    assert target.state_dict().keys() == want.keys()
    assert all(torch.equal(target.state_dict()[k], v) for k, v in want.items())
    assert torch.equal(logits(target), logits(pm))


def test_a_field_missing_from_an_older_config_takes_peft_default(saved, tmp_path):
    root, pm = saved
    shutil.copytree(root / "ck", tmp_path / "old")
    cfg_file = tmp_path / "old" / "adapter_config.json"
    doc = json.loads(cfg_file.read_text())
    for k in ("use_dora", "rank_pattern", "alpha_pattern", "lora_bias", "target_parameters"):
        doc.pop(k, None)
    cfg_file.write_text(json.dumps(doc))
    target = lora(1)
    assert checkpoint.load(target, tmp_path / "old").ok
    assert torch.equal(logits(target), logits(pm))
    with pytest.raises(AdapterConfigMismatchError) as e:
        checkpoint.load(lora(1, use_dora=True), tmp_path / "old")
    assert e.value.fields == {"use_dora": (False, True)}


def test_inspect_and_diff_show_the_adapter_config(saved, tmp_path):
    root, _ = saved
    checkpoint.save(lora(0, lora_alpha=64, use_rslora=True), tmp_path / "b")
    code, out, _ = run_cli("inspect", root / "ck", "--json")
    cfg = json.loads(out)["parts"]["adapter_config"]
    assert code == 0 and cfg == {
        "peft_type": "LORA", "r": 4, "lora_alpha": 16, "use_rslora": False, "use_dora": False,
        "target_modules": ["q_proj", "v_proj"], "modules_to_save": None, "fan_in_fan_out": False, "bias": "none",
        "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None,
        "lora_bias": False, "target_parameters": None,
    }  # fmt: skip
    code, out, _ = run_cli("inspect", root / "ck")
    assert code == 0 and "  adapter config: peft_type=LORA, r=4, lora_alpha=16, use_rslora=False," in out
    code, out, _ = run_cli("inspect", root / "adapter", "--json")  # peft's own adapter directory
    assert code == 0 and json.loads(out)["adapter_config"] == cfg
    code, out, _ = run_cli("diff", root / "ck", tmp_path / "b", "--json")
    data = json.loads(out)
    assert code == 1 and data["parts"]["model"]["same"] and not data["parts"]["adapter"]["same"]
    assert data["parts"]["adapter"]["config_differs"] == {"lora_alpha": [16, 64], "use_rslora": [False, True]}
    assert data["parts"]["adapter"]["value_differs"] == []  # the same tensors, another config
    code, out, _ = run_cli("diff", root / "ck", tmp_path / "b")
    assert code == 1 and "    adapter config differs: lora_alpha: 16 vs 64; use_rslora: False vs True" in out
    assert run_cli("diff", root / "ck", root / "ck")[0] == 0
