"""``config.json`` / ``generation_config.json`` beside a checkpoint of a transformers model, so
``AutoModelForCausalLM.from_pretrained(dir)`` works with no step by hand (transformers'
``PreTrainedModel.save_pretrained`` writes the same two files, with ``architectures`` set)."""

from __future__ import annotations

import copy
import json
from typing import Any

# Runtime knobs a caller (capture needs use_cache=False) may have set: never written into the file.
RUNTIME_ONLY = ("use_cache",)


def _config_owner(obj: Any) -> Any:
    """``obj`` or the module it wraps (``.module`` / ``._orig_mod``) that carries a transformers config."""
    for cand in (obj, getattr(obj, "module", None), getattr(obj, "_orig_mod", None)):
        cfg = getattr(cand, "config", None)
        if cfg is not None and hasattr(cfg, "to_diff_dict") and hasattr(cfg, "model_type"):
            return cand
    return None


def hf_config_files(obj: Any) -> dict[str, bytes]:
    """``{"config.json": ..., "generation_config.json": ...}`` for a transformers model (or a
    wrapper of one); ``{}`` for anything else. ``architectures`` is the model's class name (its
    ``eager_class``'s for autoparallel's parallel module);
    :data:`RUNTIME_ONLY` keys are left out (transformers then uses its defaults)."""
    owner = _config_owner(obj)
    if owner is None:
        return {}
    cfg = copy.deepcopy(owner.config)
    # A parallel module's class subclasses the eager one and names it as ``eager_class``.
    cfg.architectures = [getattr(type(owner), "eager_class", type(owner)).__name__]
    data = cfg.to_diff_dict()
    for k in RUNTIME_ONLY:
        data.pop(k, None)
    out = {"config.json": (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()}
    gen = getattr(owner, "generation_config", None)
    if gen is not None and hasattr(gen, "to_json_string") and getattr(owner, "can_generate", lambda: False)():
        out["generation_config.json"] = gen.to_json_string(use_diff=True).encode()
    return out


def meta_model_from_config(config: dict[str, Any], where: str) -> Any:
    """The transformers model a ``config.json`` describes, built on the meta device (no memory,
    no weights read): what a recipe that takes its rules and targets from a model uses when the
    source carries its own config (``fqnckpt migrate hub/ out --recipe experts-to-fused``).
    ``AutoModelForCausalLM.from_config`` of transformers' own classes only: ``auto_map`` (code
    shipped with the checkpoint or named on the hub) is dropped and ``trust_remote_code=False``,
    so nothing from the file is imported and transformers never prompts for it.

    Raises:
        ValueError: transformers is not installed, or it cannot build a causal LM from the config
            (no class of its own for ``model_type``, or fields it rejects; ``where`` named).
    """
    try:
        import torch
        import transformers
    except ImportError:
        raise ValueError(f"{where}: building the model from config.json needs transformers installed") from None
    own = {k: v for k, v in config.items() if k != "auto_map"}
    try:
        cfg = transformers.AutoConfig.for_model(**own)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(cfg, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - any field of the file may break the build: bad input, named
        raise ValueError(f"{where}: no transformers causal-LM for model_type {config.get('model_type')!r}: "
                         f"{type(e).__name__}: {e}") from None  # fmt: skip


def llama_config_from_meta(params: dict[str, Any], intermediate_size: int, vocab_size: int, dtype: str) -> bytes:
    """``config.json`` of the HF ``LlamaForCausalLM`` that Meta's ``params.json`` describes, for
    a conversion with no target model (``fqnckpt migrate meta/ out --recipe meta-llama-to-hf``).

    Fields as transformers' ``convert_llama_weights_to_hf.write_model`` sets them: hidden size,
    heads, KV heads, layers, ``norm_eps``, ``rope_theta`` and, for ``use_scaled_rope`` (Llama 3.1),
    the ``llama3`` RoPE scaling (factor 8, low / high frequency factors 1 / 4, 8192 original
    positions). ``intermediate_size`` and ``vocab_size`` come from the converted tensors' shapes
    (``gate_proj`` rows, ``embed_tokens`` rows), ``dtype`` (e.g. ``"bfloat16"``) from their dtype;
    the rest is left to transformers' defaults."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(params.get("rope_theta") or 10000.0)}
    if params.get("use_scaled_rope"):
        rope.update(rope_type="llama3", factor=float(params.get("rope_scaling_factor") or 8.0), low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=8192)  # fmt: skip
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": int(params["dim"]),
        "intermediate_size": int(intermediate_size),
        "num_attention_heads": int(params["n_heads"]),
        "num_key_value_heads": int(params.get("n_kv_heads") or params["n_heads"]),
        "num_hidden_layers": int(params["n_layers"]),
        "rms_norm_eps": float(params.get("norm_eps") or 1e-5),
        "vocab_size": int(vocab_size),
        "rope_parameters": rope,
        "tie_word_embeddings": False,
        "dtype": dtype,
    }
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()


__all__ = ["hf_config_files", "llama_config_from_meta", "meta_model_from_config", "RUNTIME_ONLY"]
