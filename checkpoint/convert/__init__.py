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

from .api import open_conversion, recipe_table, run_recipe, side_files
from .ops import Chunk, Concat, FuseQKV, JoinShards, Op, OpError, PermuteRope, PermuteRopeTail, SplitQKV, SplitShards, Stack, Transpose, Unstack
from .plan import ConversionPlan, plan_conversion
from .recipes import RECIPES, RecipeError, get_recipe
from .report import CONVERSION_REPORT_NAME, ConversionError, ConversionReport
from .rules import Pattern, Recipe, Rule

__all__ = [
    "open_conversion", "run_recipe", "side_files", "recipe_table", "plan_conversion", "ConversionPlan",
    "get_recipe", "RECIPES", "RecipeError", "ConversionError", "ConversionReport", "CONVERSION_REPORT_NAME",
    "Pattern", "Rule", "Recipe", "Op", "OpError", "Transpose", "Stack", "Unstack", "Concat", "Chunk",
    "PermuteRope", "PermuteRopeTail", "FuseQKV", "SplitQKV", "JoinShards", "SplitShards",
]  # fmt: skip
