"""``detect_layout`` (``fqnckpt inspect``'s ``layout:`` line) names torchtitan only for torchtitan's
own names: a Hugging Face Llama state_dict (``model.*`` + ``lm_head.weight``) is no torchtitan layout."""

import pytest

from checkpoint.layout_versions import detect_layout

transformers = pytest.importorskip("transformers")


def test_hf_llama_keys_are_not_torchtitan():
    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=32)  # fmt: skip
    keys = list(transformers.LlamaForCausalLM(cfg).state_dict())
    assert "lm_head.weight" in keys
    assert detect_layout(keys) is None


def test_torchtitan_keys_still_detected():
    tt = ["tok_embeddings.weight", "layers.0.attention.wk.weight", "layers.0.attention.wv.weight",
          "layers.0.attention.wq.weight", "norm.weight", "lm_head.weight"]  # fmt: skip
    assert detect_layout(tt) == "torchtitan 786e26f..200100e"
    assert detect_layout([k.replace("lm_head", "output") for k in tt]) == "torchtitan legacy"
