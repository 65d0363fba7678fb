"""Conversions that change tensors between framework layouts (Meta, torchtitan, Megatron, GPT-2
Conv1D, MoE experts) and Hugging Face, both ways and checked.

- :mod:`.ops`: transforms as data, each with an exact inverse.
- :mod:`.rules`: key patterns, :class:`Rule`, :class:`Recipe` (``recipe.inverse()``).
- :mod:`.recipes`: the built-in recipes; :mod:`.transformers_rules` takes ``experts-to-fused``
  from transformers' own ``get_model_conversion_mapping``: ``load`` and ``save`` of a
  transformers model apply it by default (:func:`.reader.pretrained_reader`), as
  ``from_pretrained`` / ``save_pretrained`` do.
- :mod:`.plan`: planning apart from bytes (every source key consumed once, every target filled
  once, shapes checked on meta tensors) and streaming one group at a time.
- :mod:`.api`: what ``checkpoint.migrate(..., recipe=)`` and ``fqnckpt migrate --recipe`` call.

Never imports ``checkpoint.load`` / ``migrate`` / ``save``: the caller passes the writer.
"""

import importlib

# Each public name -> its module, imported on first use: ``fqnckpt recipes`` lists the recipes
# (:mod:`.recipes`, :mod:`.rules`, :mod:`.ops` import no torch) without loading the planner.
_WHERE = {
    **dict.fromkeys(("open_conversion", "run_recipe", "side_files"), "api"),
    **dict.fromkeys(("plan_conversion", "ConversionPlan"), "plan"),
    **dict.fromkeys(("get_recipe", "RECIPES", "RecipeError", "recipe_table"), "recipes"),
    **dict.fromkeys(("ConversionError", "ConversionReport", "CONVERSION_REPORT_NAME"), "report"),
    **dict.fromkeys(("Pattern", "Rule", "Recipe"), "rules"),
    **dict.fromkeys(("Op", "OpError", "Transpose", "Stack", "Unstack", "Concat", "Chunk", "PermuteRope", "PermuteRopeTail",
                     "FuseQKV", "SplitQKV", "JoinShards", "SplitShards"), "ops"),
}  # fmt: skip


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = [
    "open_conversion", "run_recipe", "side_files", "recipe_table", "plan_conversion", "ConversionPlan",
    "get_recipe", "RECIPES", "RecipeError", "ConversionError", "ConversionReport", "CONVERSION_REPORT_NAME",
    "Pattern", "Rule", "Recipe", "Op", "OpError", "Transpose", "Stack", "Unstack", "Concat", "Chunk",
    "PermuteRope", "PermuteRopeTail", "FuseQKV", "SplitQKV", "JoinShards", "SplitShards",
]  # fmt: skip
