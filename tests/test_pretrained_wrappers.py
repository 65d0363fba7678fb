"""``from_pretrained`` of ``checkpoint.save`` gets the trained model whatever wrapped it:
config.json names the eager class and every tensor its eager name for ``torch.compile``,
``checkpoint_wrapper``, ``DataParallel`` and peft's ``PeftModel`` (adapter beside the base, or
merged). Oracles: transformers' ``from_pretrained`` and peft's ``PeftModel.from_pretrained`` /
``merge_and_unload``. FSDP1 / FSDP2 / DDP run in test_world_of_one's shared spawn."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import checkpoint
from tests.helpers import run_cli

transformers = pytest.importorskip("transformers")

TOKENS = torch.tensor([[1, 5, 9, 33, 2, 60, 7, 7]])


def trained_llama(seed: int = 0):
    """A tiny Llama moved off its init by one SGD step (a from_pretrained that falls back to a
    random init cannot match it)."""
    from tests.models import hf_llama

    torch.manual_seed(seed)
    model = hf_llama(layers=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(TOKENS, labels=TOKENS).loss.backward()
    opt.step()
    return model.eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def reloaded(path):
    back, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return back.eval()


def architectures(path) -> list[str]:
    return json.loads((path / "config.json").read_text())["architectures"]


def _ckpt_wrapped(model):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
    return model


WRAPPERS = {  # checkpoint_wrapper alone is inside the last one
    "compile": torch.compile,
    "data_parallel": torch.nn.DataParallel,
    "compile(checkpoint_wrapper)": lambda m: torch.compile(_ckpt_wrapped(m)),
}


@pytest.mark.parametrize("how", list(WRAPPERS))
def test_wrapped_model_reloads_as_its_eager_class(tmp_path, how):
    model = trained_llama()
    want = logits(model)
    checkpoint.save(WRAPPERS[how](copy.deepcopy(model)), tmp_path / "ck")
    assert architectures(tmp_path / "ck") == ["LlamaForCausalLM"]
    assert torch.equal(logits(reloaded(tmp_path / "ck")), want)


# -- PEFT -------------------------------------------------------------------------------------


def lora_model(seed: int = 0, modules_to_save=None):
    """A LoRA model whose adapter is trained (lora_B starts at zero: untrained LoRA is a no-op)."""
    peft = pytest.importorskip("peft")
    base = trained_llama(seed)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=modules_to_save)
    pm = peft.get_peft_model(base, cfg)
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.5)
    pm.train()
    pm(input_ids=TOKENS, labels=TOKENS).loss.backward()
    opt.step()
    return pm.eval()


def base_from(path):
    """The base model alone from our checkpoint (transformers would attach the adapter beside it)."""
    base = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(path))
    rep = checkpoint.load(base, path)
    assert rep.ok
    return base.eval()


@pytest.mark.parametrize("compiled, modules_to_save", [(False, ["lm_head"]), (True, None)])
def test_peft_adapter_beside_base_is_read_by_transformers_and_peft(tmp_path, compiled, modules_to_save):
    peft = pytest.importorskip("peft")
    pm = lora_model(modules_to_save=modules_to_save)
    want = logits(pm)
    checkpoint.save(torch.compile(pm) if compiled else pm, tmp_path / "ck")
    ck = tmp_path / "ck"
    assert architectures(ck) == ["LlamaForCausalLM"]
    idx = json.loads((ck / "model.safetensors.index.json").read_text())
    assert set(idx["weight_map"]) == set(transformers.LlamaForCausalLM(pm.config).state_dict())  # eager names
    # peft's own reader of the adapter directory, over the base model we wrote.
    again = peft.PeftModel.from_pretrained(base_from(ck), ck).eval()
    assert torch.equal(logits(again), want)
    # transformers: a local model with an embedded adapter.
    assert torch.equal(logits(transformers.AutoModelForCausalLM.from_pretrained(ck).eval()), want)
    # the adapter file equals what peft's save_pretrained writes, tensor for tensor
    from safetensors.torch import load_file

    pm.save_pretrained(tmp_path / "peft")
    ours, theirs = load_file(ck / "adapter_model.safetensors"), load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert json.loads((ck / "adapter_config.json").read_text()) == json.loads(
        (tmp_path / "peft" / "adapter_config.json").read_text()
    )


@pytest.mark.parametrize("modules_to_save", [["lm_head"]])
def test_peft_merged_equals_merge_and_unload(tmp_path, modules_to_save):
    pytest.importorskip("peft")
    pm = lora_model(modules_to_save=modules_to_save)
    checkpoint.save(pm, tmp_path / "ck", peft="merged")
    ck = tmp_path / "ck"
    assert not (ck / "adapter_config.json").exists() and not (ck / "adapter_model.safetensors").exists()
    merged = copy.deepcopy(pm).merge_and_unload().eval()  # peft's own merge: the oracle
    back = reloaded(ck)
    assert back.state_dict().keys() == merged.state_dict().keys()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in merged.state_dict().items())
    assert torch.equal(logits(back), logits(merged))


def test_peft_merged_over_adapter_save_removes_adapter_files(tmp_path):
    pytest.importorskip("peft")
    pm = lora_model()
    checkpoint.save(pm, tmp_path / "ck")
    (tmp_path / "ck" / "notes.txt").write_text("mine")
    checkpoint.save(pm, tmp_path / "ck", peft="merged", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith(("adapter", "notes"))) == [
        "notes.txt"
    ]


def test_peft_bad_mode_refused_before_writing(tmp_path):
    pytest.importorskip("peft")
    with pytest.raises(ValueError, match="peft='both'"):
        checkpoint.save(lora_model(), tmp_path / "ck", peft="both")
    assert not (tmp_path / "ck").exists()


def _fresh_lora(seed, modules_to_save=None):
    """The same PEFT architecture, other values everywhere (base and adapter)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    from tests.models import hf_llama

    base = hf_llama(layers=2)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=modules_to_save)
    pm = peft.get_peft_model(base, cfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_()
    return pm.eval()


def test_peft_training_checkpoint_loads_back_into_the_peft_model(tmp_path):
    """save(peft_model, optimizer=opt) then load into another PeftModel: base from the model part,
    adapter from peft's file, optimizer state by the same names; exact values and logits."""
    pm = lora_model(modules_to_save=["lm_head"])
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    pm.train()
    pm(input_ids=TOKENS, labels=TOKENS).loss.backward()
    opt.step()
    pm.eval()
    checkpoint.save(pm, tmp_path / "ck", optimizer=opt)
    other = _fresh_lora(5, modules_to_save=["lm_head"])
    opt2 = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=1e-2)
    rep = checkpoint.load(other, tmp_path / "ck", optimizer=opt2)
    assert rep.ok and rep.optimizer_loaded
    assert other.state_dict().keys() == pm.state_dict().keys()
    assert all(torch.equal(other.state_dict()[k], v) for k, v in pm.state_dict().items())
    assert torch.equal(logits(other), logits(pm))
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys() and all(torch.equal(s1[i][k], s2[i][k]) for i in s1 for k in ("exp_avg", "exp_avg_sq"))


def test_peft_adapter_directory_is_a_source(tmp_path):
    """peft's own save_pretrained directory (adapter files only) loads into a PeftModel: the
    adapter tensors, by peft's names; the base stays (it comes from elsewhere). Oracle: peft's
    PeftModel.from_pretrained over the same base."""
    peft = pytest.importorskip("peft")
    pm = lora_model()
    pm.save_pretrained(tmp_path / "adapter")
    want = logits(pm)
    target = _fresh_lora(5)
    checkpoint.load(target, _saved_base(pm, tmp_path / "base"))  # the same base as pm ...
    with torch.no_grad():  # ... and other adapter values, which the adapter directory replaces
        for n, p in target.named_parameters():
            if "lora_" in n:
                p.normal_()
    assert not torch.equal(logits(target), want)
    base_before = {k: v.clone() for k, v in target.state_dict().items() if "lora_" not in k}
    rep = checkpoint.load(target, tmp_path / "adapter")
    assert rep.ok and sorted(rep.loaded_keys) == sorted(
        k for k in peft.get_peft_model_state_dict(pm))  # fmt: skip
    assert all(torch.equal(target.state_dict()[k], v) for k, v in base_before.items())
    assert torch.equal(logits(target), want)
    oracle = peft.PeftModel.from_pretrained(base_from(tmp_path / "base"), tmp_path / "adapter")
    assert torch.equal(logits(oracle.eval()), want)


def _saved_base(pm, path):
    checkpoint.save(pm, path)  # base + adapter of pm
    return path


def test_peft_checkpoint_in_inspect_diff_migrate(tmp_path):
    """The adapter beside the base is a part of the checkpoint: inspect lists it, diff compares it
    (an adapter-only change is a difference), migrate carries it byte for byte."""
    pytest.importorskip("peft")
    pm = lora_model()
    checkpoint.save(pm, tmp_path / "a")
    with torch.no_grad():
        next(p for n, p in pm.named_parameters() if "lora_B" in n).add_(1.0)
    checkpoint.save(pm, tmp_path / "b")
    code, out, _ = run_cli("inspect", tmp_path / "a", "--json")
    assert code == 0 and json.loads(out)["parts"]["adapter"] == "adapter_model.safetensors"
    code, out, _ = run_cli("diff", tmp_path / "a", tmp_path / "b", "--json")
    data = json.loads(out)
    assert code == 1 and data["parts"]["model"]["same"] and not data["parts"]["adapter"]["same"]
    assert data["parts"]["adapter"]["value_differs"] == [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    ]
    assert run_cli("diff", tmp_path / "a", tmp_path / "a")[0] == 0
    assert run_cli("migrate", tmp_path / "b", tmp_path / "m")[0] == 0
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "m" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert run_cli("diff", tmp_path / "b", tmp_path / "m")[0] == 0
