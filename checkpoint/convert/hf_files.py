"""``config.json`` / ``generation_config.json`` beside a checkpoint of a transformers model, so
``AutoModelForCausalLM.from_pretrained(dir)`` works with no step by hand (transformers'
``PreTrainedModel.save_pretrained`` writes the same two files, with ``architectures`` set)."""

from __future__ import annotations

import copy
import json
from typing import Any

# Runtime knobs a caller (capture needs use_cache=False) may have set: never written into the file.
RUNTIME_ONLY = ("use_cache",)


def unwrap_model(obj: Any) -> Any:
    """The module under torch's wrappers (``torch.compile``'s ``_orig_mod``, DDP / DataParallel's
    ``module``, FSDP1's ``_fsdp_wrapped_module``, ``checkpoint_wrapper``'s
    ``_checkpoint_wrapped_module``) and PEFT's ``PeftModel`` (``base_model.model``), however they
    stack. Attributes are read from ``_modules`` only: wrappers forward ``__getattr__`` to what
    they wrap, which would hide them."""
    from fqn.rules import is_wrapper_module
    from fqn.segments import WRAPPER_SEGMENTS

    for _ in range(64):  # wrappers stack a few deep; a cycle cannot loop forever
        mods = getattr(obj, "_modules", None) or {}
        if is_peft_model(obj):
            inner = getattr(mods.get("base_model"), "_modules", {}).get("model")
        elif is_wrapper_module(obj):
            inner = next((c for s, c in mods.items() if s in WRAPPER_SEGMENTS and c is not None), None)
        else:
            return obj
        if inner is None:
            return obj
        obj = inner
    return obj


def is_peft_model(obj: Any) -> bool:
    """True for peft's ``PeftModel`` (and its task subclasses), found by class name and module so
    that peft is imported only when a model of it is given."""
    return any(c.__name__ == "PeftModel" and c.__module__.startswith("peft.") for c in type(obj).__mro__)


def architecture_class(owner: Any) -> type:
    """The eager class a wrapped model loads back as: autoparallel's parallel module names it as
    ``eager_class``; FSDP2's ``fully_shard`` swaps in a class ``FSDP<Name>`` deriving from
    ``FSDPModule`` and the model's class (skipped here)."""
    for cls in type(owner).__mro__:
        eager = cls.__dict__.get("eager_class")
        if eager is not None:
            return eager
        if any(b.__name__ == "FSDPModule" and b.__module__.startswith("torch.distributed") for b in cls.__mro__):
            continue
        return cls
    return type(owner)


def _config_owner(obj: Any) -> Any:
    """The module under every wrapper (:func:`unwrap_model`) when it carries a transformers config."""
    cand = unwrap_model(obj)
    cfg = getattr(cand, "config", None)
    if cfg is not None and hasattr(cfg, "to_diff_dict") and hasattr(cfg, "model_type"):
        return cand
    return None


def hf_config_files(obj: Any) -> dict[str, bytes]:
    """``{"config.json": ..., "generation_config.json": ...}`` for a transformers model (or a
    wrapper of one: ``torch.compile``, DDP, FSDP1 / FSDP2, checkpoint wrappers, autoparallel's parallel
    module, PEFT); ``{}`` for anything else. ``architectures`` is the eager class's name
    (:func:`architecture_class`, e.g. ``LlamaForCausalLM`` for FSDP2's ``FSDPLlamaForCausalLM``);
    :data:`RUNTIME_ONLY` keys are left out (transformers then uses its defaults)."""
    owner = _config_owner(obj)
    if owner is None:
        return {}
    cfg = copy.deepcopy(owner.config)
    cfg.architectures = [architecture_class(owner).__name__]
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


# Meta params.json fields a transformers config has no field for: kept under this key of
# config.json (transformers keeps unknown keys as attributes and saves them back), so
# Meta -> HF -> Meta gives params.json's keys back exactly (multiple_of / ffn_dim_multiplier are
# not unique for an intermediate_size: 256 and 1024 both give Llama 3.2 1B's 8192).
META_PARAMS_KEY = "fqnckpt_meta_params"
# ... and, under it, Meta's layout version the shards were split by (``llama2`` / ``llama3``:
# :data:`checkpoint.convert.layouts.META_VERSIONS`), the default split of the way back.
META_LAYOUT_KEY = "layout"
_EXPRESSED = {"dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "norm_eps", "rope_theta", "use_scaled_rope",
              "rope_scaling_factor", "rope_high_freq_factor"}  # fmt: skip


def meta_token_ids(vocab_size: int) -> tuple[int, int]:
    """``(bos, eos)`` of Meta's tokenizers by vocabulary: Llama 3's tiktoken (128256 rows:
    ``<|begin_of_text|>`` 128000, ``<|end_of_text|>`` 128001), else Llama 1 / 2's SentencePiece
    (1, 2); transformers ``convert_llama_weights_to_hf.py`` sets the same."""
    return (128000, 128001) if vocab_size >= 128000 else (1, 2)


def meta_max_positions(params: dict[str, Any]) -> int:
    """``max_position_embeddings`` for Meta's params.json: its ``max_seq_len`` when given, else by
    generation as transformers' converter does: scaled RoPE (3.1 / 3.2) 131072, rope_theta
    500000 (Llama 3) 8192, else 4096 (Llama 2)."""
    if isinstance(params.get("max_seq_len"), int) and params["max_seq_len"] > 0:
        return int(params["max_seq_len"])
    if params.get("use_scaled_rope"):
        return 131072
    return 8192 if float(params.get("rope_theta") or 10000.0) >= 500000.0 else 4096


def llama_config_from_meta(params: dict[str, Any], intermediate_size: int, vocab_size: int, dtype: str,
                           layout: str | None = None) -> bytes:  # fmt: skip
    """``config.json`` of the HF ``LlamaForCausalLM`` that Meta's ``params.json`` describes, for
    a conversion with no target model (``fqnckpt migrate meta/ out --recipe meta-llama-to-hf``),
    readable by transformers 4.x and 5 alike.

    Fields as transformers' ``convert_llama_weights_to_hf.write_model`` sets them: hidden size,
    heads, KV heads, layers, ``norm_eps``, ``max_position_embeddings`` (:func:`meta_max_positions`),
    bos / eos ids (:func:`meta_token_ids`) and RoPE: transformers 5 reads ``rope_parameters``,
    4.x ``rope_theta`` and ``rope_scaling`` (both written, the same values); ``use_scaled_rope``
    (Llama 3.1 / 3.2) is the ``llama3`` scaling (factor ``rope_scaling_factor`` or 8, low / high
    frequency factors 1 / ``rope_high_freq_factor`` or 4, 8192 original positions).
    ``intermediate_size`` and ``vocab_size`` come from the converted tensors' shapes, ``dtype``
    from their dtype; Meta fields transformers has none for go under :data:`META_PARAMS_KEY`, with
    ``layout`` (the version the source shards were split by) as :data:`META_LAYOUT_KEY`."""
    theta = float(params.get("rope_theta") or 10000.0)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = None
    if params.get("use_scaled_rope"):
        scaling = {"rope_type": "llama3", "factor": float(params.get("rope_scaling_factor") or 8.0), "low_freq_factor": 1.0,
                   "high_freq_factor": float(params.get("rope_high_freq_factor") or 4.0), "original_max_position_embeddings": 8192}  # fmt: skip
        rope = {**scaling, "rope_theta": theta}
    bos, eos = meta_token_ids(vocab_size)
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
        "max_position_embeddings": meta_max_positions(params),
        "bos_token_id": bos,
        "eos_token_id": eos,
        "rope_parameters": rope,  # transformers 5
        "rope_theta": theta,  # transformers 4.x
        "rope_scaling": scaling,  # transformers 4.x (null: unscaled)
        "tie_word_embeddings": False,
        "dtype": dtype,
        "torch_dtype": dtype,  # transformers 4.x's name for it
    }
    kept = {k: v for k, v in params.items() if (k not in _EXPRESSED or (k == "vocab_size" and (v or 0) <= 0)) and v is not None}
    kept["keys"] = sorted(k for k, v in params.items() if v is not None)  # the way back writes these, no more
    if layout is not None:
        kept[META_LAYOUT_KEY] = layout
    cfg[META_PARAMS_KEY] = kept
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()


def with_transformers4_rope(data: bytes) -> bytes:
    """``config.json`` bytes that transformers 4.x reads with the same RoPE as 5: where 5's
    ``rope_parameters`` is written without 4.x's ``rope_theta`` / ``rope_scaling``, they are added
    (4.x ignores ``rope_parameters`` and would run theta 10000 unscaled)."""
    cfg = json.loads(data)
    targets = [cfg] + ([cfg["text_config"]] if isinstance(cfg.get("text_config"), dict) else [])
    changed = False
    for c in targets:
        rope = c.get("rope_parameters")
        if not isinstance(rope, dict) or "rope_theta" not in rope:
            continue
        if "rope_theta" not in c:
            c["rope_theta"] = rope["rope_theta"]
            changed = True
        kind = rope.get("rope_type", "default")
        if "rope_scaling" not in c:
            c["rope_scaling"] = None if kind == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
            changed = True
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode() if changed else data


def llama_generation_config(config: dict[str, Any]) -> bytes:
    """``generation_config.json`` beside a config from :func:`llama_config_from_meta`: its bos /
    eos ids (what ``GenerationConfig.from_model_config`` takes from the config)."""
    out = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    return (json.dumps(out, indent=2, sort_keys=True) + "\n").encode()


__all__ = ["architecture_class", "hf_config_files", "is_peft_model", "unwrap_model", "llama_config_from_meta", "meta_model_from_config",
           "RUNTIME_ONLY", "META_PARAMS_KEY", "META_LAYOUT_KEY", "meta_token_ids", "meta_max_positions", "llama_generation_config",
           "with_transformers4_rope"]
