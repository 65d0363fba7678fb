"""``experts-to-fused`` from transformers' own rules: the ``WeightRenaming`` / ``WeightConverter``
list of ``transformers.conversion_mapping.get_model_conversion_mapping(model)`` (transformers 5)
translated into fqnckpt rules, so every layout change transformers knows for the model is carried
out by fqnckpt's checked, streamed pipeline and stays in step with transformers.

Ops translated: ``MergeModulelist`` -> :class:`Stack`, ``SplitModulelist`` -> :class:`Unstack`,
``Concatenate`` -> :class:`Concat`, ``Chunk`` -> :class:`Chunk`, ``Transpose`` -> :class:`Transpose`.
Any other op (``PermuteForRope``, quantization, ...) becomes :class:`Untranslated`, which refuses
at planning time naming it (and whether transformers has an inverse for it).
"""

from __future__ import annotations

import re
import sys
import weakref
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from .ops import Chunk, Concat, Op, OpError, Stack, Transpose, Unstack
from .rules import Recipe, Rule

_PLAIN = re.compile(r"^[\w.*]+$")


@dataclass(frozen=True)
class Untranslated(Op):
    """A transformers op fqnckpt does not carry out: refuses when applied, naming it."""

    name: str
    has_inverse: bool
    inverted: bool = False

    def apply(self, values, dims):
        if self.inverted and not self.has_inverse:
            raise OpError(f"transformers op {self.name} has no inverse (its reverse_op raises): cannot convert back")
        raise OpError(f"transformers op {self.name}{' (inverse)' if self.inverted else ''} is not carried out by fqnckpt")

    def inverse(self):
        return Untranslated(self.name, self.has_inverse, not self.inverted)


def _translate_op(op: Any) -> Op:
    kind = type(op).__name__
    if kind == "MergeModulelist":
        return Stack(op.dim)
    if kind == "SplitModulelist":
        return Unstack(op.dim)
    if kind == "Concatenate" and getattr(op, "num_shards_attribute", None) is None:
        return Concat(op.dim)
    if kind == "Chunk" and getattr(op, "num_shards_attribute", None) is None:
        return Chunk(op.dim)
    if kind == "Transpose" and not op.check_dims:
        return Transpose(op.dim0, op.dim1)
    try:
        op.reverse_op
        has_inverse = True
    except NotImplementedError:
        has_inverse = False
    return Untranslated(repr(op), has_inverse)


def _pattern(p: str) -> str:
    """transformers glob (``mlp.experts.*.gate_proj.weight``, matched anywhere in a key) -> ours:
    any prefix ending on a segment boundary, ``*`` the gathered expert index."""
    return ("{h:.*}" if p.startswith(".") else "{h:(?:.*\\.)?}") + p.replace("*", "{*e}")


@dataclass(frozen=True)
class TransformersRename:
    """A transformers ``WeightRenaming`` applied to whole keys; ``back`` is its reverse (``None``:
    a legacy spelling that is read, never written)."""

    forward: Any
    back: Any

    def apply(self, key: str) -> str:
        return key if self.forward is None else self.forward.rename_source_key(key)[0]

    def inverse(self) -> TransformersRename:
        return TransformersRename(self.back, self.forward)

    def describe(self) -> str:
        return repr(self.forward)


def _eager_model(model: Any) -> Any:
    """``model``, or for a wrapper class (``fully_shard``'s ``FSDP<Name>``, a parallel module's
    subclass) a meta-device instance of the transformers class it derives from: transformers looks
    the mapping up by class name and, not finding ``FSDP<Name>``, would scope its rules."""
    from .hf_files import architecture_class

    eager = architecture_class(model)
    eager = next(c for c in eager.__mro__ if c.__module__.startswith("transformers."))
    if eager is type(model):
        return model
    import torch

    with torch.device("meta"):
        return eager(model.config)


def experts_recipe(model: Any) -> Recipe:
    """``experts-to-fused`` for ``model`` (a transformers ``PreTrainedModel``).

    Raises:
        TypeError: ``model`` is not a ``PreTrainedModel``.
        ValueError: a converter of the model uses patterns or scopes fqnckpt cannot translate
            (named in the message).
    """
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"experts-to-fused takes its rules from a transformers PreTrainedModel, got {type(model).__name__}")
    model = _eager_model(model)
    own = {repr(t) for t in get_model_conversion_mapping(model, add_legacy=False)}
    pre, rules = [], []
    for t in get_model_conversion_mapping(model, add_legacy=True):
        if not isinstance(t, WeightConverter):
            back = t.reverse_transform() if repr(t) in own else None
            pre.append(TransformersRename(t, back))
            continue
        pats = [*t._original_source_patterns, *t._original_target_patterns]
        if t.scope_prefix is not None or not all(_PLAIN.match(p) for p in pats):
            raise ValueError(f"transformers converter {t!r} has a scope or regex patterns fqnckpt does not translate")
        rules.append(Rule(
            tuple(_pattern(p) for p in t._original_source_patterns),
            tuple("{h}" + p.replace("*", "{*e}") for p in t._original_target_patterns),
            tuple(_translate_op(op) for op in t.operations),
        ))  # fmt: skip
    return Recipe(
        "experts-to-fused", "fused-to-experts", tuple(rules), passthrough=True, pre=tuple(pre), writes="hf-model", reads="hf",
        summary=f"{type(model).__name__}: transformers' conversion_mapping rules",
    )  # fmt: skip


_RECIPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def transformers_model(obj: Any) -> Any:
    """The transformers ``PreTrainedModel`` ``obj`` is, or holds under torch's wrappers
    (``torch.compile``, DDP, checkpoint wrappers; FSDP2's and autoparallel's subclasses are the
    model itself); None for any other object, for a peft ``PeftModel`` (its adapter layout is
    :mod:`checkpoint.peft_state`'s), and whenever transformers was never imported (no model of
    it can exist then, and it is not imported here)."""
    if "transformers" not in sys.modules:
        return None
    from transformers import PreTrainedModel

    from ..peft_state import find_peft
    from .hf_files import unwrap_model

    if find_peft(obj) is not None:  # a PeftModel under any wrappers
        return None
    inner = unwrap_model(obj)
    return inner if isinstance(inner, PreTrainedModel) else None


def pretrained_recipe(obj: Any) -> Recipe | None:
    """``experts-to-fused`` for the transformers model under ``obj`` (:func:`transformers_model`):
    the conversions ``from_pretrained`` applies to that model's checkpoint keys (its
    ``inverse()``: what ``save_pretrained`` writes). None for another object. Built once per model
    instance.

    Raises:
        ValueError: as :func:`experts_recipe`, a converter fqnckpt cannot translate.
    """
    model = transformers_model(obj)
    if model is None:
        return None
    rec = _RECIPES.get(model)
    if rec is None:
        rec = _RECIPES[model] = experts_recipe(model)
    return rec


def changes_keys(recipe: Recipe, keys: Iterable[str], known: Collection[str] = ()) -> bool:
    """Whether ``recipe`` converts or renames any of ``keys`` other than those in ``known`` (names
    the target has already: a legacy rename such as ``.weight_g`` never takes a key the model
    itself uses). Matching only, nothing is read."""
    rules = [p for rule in recipe.rules for p in rule.source_patterns]
    renames = [r for r in (*recipe.pre, *recipe.post) if getattr(r, "forward", r) is not None]
    if not rules and not renames:  # legacy renames only, on the way back (never written): no key read
        return False
    for key in keys:
        if key in known:
            continue
        name = key
        for r in recipe.pre:
            name = r.apply(name)
        if name != key or any(p.match(name) for p in rules):
            return True
        if any(r.apply(name) != name for r in recipe.post):
            return True
    return False


__all__ = ["experts_recipe", "pretrained_recipe", "transformers_model", "changes_keys", "TransformersRename", "Untranslated"]
