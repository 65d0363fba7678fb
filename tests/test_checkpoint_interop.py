"""Interop with transformers (single process): ``save_pretrained`` -> ``checkpoint.load``, and
``checkpoint.save`` -> ``from_pretrained`` with no missing / unexpected keys and identical logits.
The 2-rank parts (parallel module, DCP's HuggingFaceStorageReader) run in test_checkpoint_dist."""

from __future__ import annotations

import json

import pytest
import torch

import checkpoint

transformers = pytest.importorskip("transformers")


def tiny_llama(seed: int, tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


TOKENS = torch.tensor([[1, 5, 9, 33, 2, 60, 7, 7]])


@pytest.mark.parametrize("tie", [True, False])
def test_save_pretrained_sharded_loads_into_eager(tmp_path, tie):
    src = tiny_llama(0, tie)
    src.save_pretrained(tmp_path / "hf", max_shard_size="8KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    dst = tiny_llama(1, tie)
    rep = checkpoint.load(dst, tmp_path / "hf")
    assert rep.ok and rep.unexpected_keys == [] and rep.ignorable_keys == []
    if tie:
        assert (
            "lm_head.weight" not in index["weight_map"]
            and dst.lm_head.weight is dst.model.embed_tokens.weight
        )
    with torch.no_grad():
        assert torch.equal(dst(TOKENS).logits, src(TOKENS).logits)


def test_our_save_loads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_llama(0, tie=True)
    idx = checkpoint.save(src, tmp_path / "ours", max_shard_size="8KB")
    assert len(idx.files()) > 1 and "lm_head.weight" not in idx.weight_map
    src.config.save_pretrained(tmp_path / "ours")
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        assert torch.equal(back.eval()(TOKENS).logits, src(TOKENS).logits)
