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


__all__ = ["hf_config_files", "RUNTIME_ONLY"]
