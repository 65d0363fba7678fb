"""The fields of peft's ``adapter_config.json`` that change what a model computes, read without
importing torch or peft (``fqnckpt inspect`` / ``diff`` show them; ``load`` compares them with a
``PeftModel`` target's config in :func:`checkpoint.peft_state.check_adapter_config`).

Field names and their meaning are peft's (``peft.LoraConfig``; the file is written by
``PeftConfigMixin.save_pretrained``, sets as lists and enums by value).
"""

from __future__ import annotations

import enum
import json
import os
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"  # peft.utils.constants.CONFIG_NAME

# Fields of a peft config (LoRA's and its kin's, as in peft's LoraConfig) that change what the
# model computes: rank and scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``, per
# layer through the patterns), DoRA's magnitude, which modules are adapted, trained whole or carry
# a bias, and the weight layout (``fan_in_fan_out``). Dropout, init and bookkeeping are not compared.
MATH_FIELDS = ("peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "target_modules", "modules_to_save",
               "fan_in_fan_out", "bias", "rank_pattern", "alpha_pattern", "layers_to_transform", "layers_pattern",
               "lora_bias", "target_parameters")  # fmt: skip
_UNORDERED = ("target_modules", "modules_to_save", "layers_to_transform", "target_parameters")


def plain_value(name: str, value: Any) -> Any:
    """``value`` of field ``name`` as JSON holds it (peft's ``save_pretrained`` writes sets as
    lists, enums by value); names of modules in sorted order (a set in peft's live config)."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, (set, frozenset, tuple, list)):
        value = [plain_value(name, v) for v in value]
        if name in _UNORDERED:
            value = sorted(value, key=repr)
    elif isinstance(value, dict):
        value = {str(k): plain_value(name, v) for k, v in sorted(value.items())}
    return value


def adapter_math(config: Any) -> dict[str, Any]:
    """The :data:`MATH_FIELDS` of a peft config (a ``PeftConfig`` or the dict of a saved
    ``adapter_config.json``), in JSON's plain values. A field a saved dict lacks (an older peft)
    is left out; a config object gives every field its class has."""
    if isinstance(config, dict):
        return {k: plain_value(k, config[k]) for k in MATH_FIELDS if k in config}
    return {k: plain_value(k, getattr(config, k)) for k in MATH_FIELDS if hasattr(config, k)}


def read_adapter_config(path: str) -> dict[str, Any]:
    """``adapter_config.json`` of directory ``path``, parsed.

    Raises:
        CorruptCheckpointError: not a JSON object (names the file)."""
    from .errors import CorruptCheckpointError

    file = os.path.join(path, ADAPTER_CONFIG)
    with open(file, "rb") as f:
        raw = f.read()
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CorruptCheckpointError(file, f"not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(file, f"holds a JSON {type(doc).__name__}, not an object")
    return doc


__all__ = ["ADAPTER_CONFIG", "MATH_FIELDS", "adapter_math", "plain_value", "read_adapter_config"]
