"""Recipes for one version of a framework's layout (:mod:`checkpoint.layout_versions` holds the
versions as data, torch-free, for ``fqnckpt inspect`` too)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..layout_versions import FAMILIES, FUSED_QKV, FUSED_QKV_KEY, TORCHTITAN, Axis, Family, Respell, detect_layout, version_table
from ..keypatterns import Pattern
from .rules import Recipe


class LayoutError(ValueError):
    """A checkpoint mixing the names of several versions, or a version that does not exist."""


def versioned(recipe: Recipe, keys, asked: str | None) -> tuple[Recipe, dict[str, str]]:
    """``recipe`` for one version of its framework's layout (``recipe.meta["family"]``): when it
    reads the framework, the version detected from the source ``keys`` (``asked`` must agree);
    when it writes it, ``asked`` or the newest. Returns the recipe with the renames as ``pre`` /
    ``post`` and ``{"source" | "target": "torchtitan 3101b42 (2026-07-16)"}`` for the report.

    Raises:
        LayoutError: keys of several versions mixed, an unknown version, or ``asked`` not the
            version the keys are."""
    fam = FAMILIES.get(recipe.meta.get("family", ""))
    if fam is None:
        if asked:
            raise LayoutError(f"recipe {recipe.name!r} has no layout versions (asked for {asked!r})")
        return recipe, {}
    fwd = recipe.meta.get("inverse_of")
    has_fused = any(r.only == FUSED_QKV for r in (fwd or recipe).rules)
    known = [v for v, _, _ in fam.versions] + ([FUSED_QKV] if has_fused else [])
    if asked is not None and asked not in known:
        raise LayoutError(f"{fam.name} has no layout version {asked!r}; known: {known}")
    reads = recipe.writes in ("hf", "hf-model")  # the framework's layout is the source
    if reads:
        keys = list(keys)
        fused = has_fused and any(Pattern(FUSED_QKV_KEY).match(k) is not None for k in keys)
        if asked == FUSED_QKV and not fused:
            raise LayoutError(f"the source has no {FUSED_QKV_KEY} (asked for {FUSED_QKV!r})")
        fits, evidence = fam.detect(keys)
        if not fits:
            raise LayoutError(f"the source mixes {fam.name} names of different versions: {'; '.join(evidence)}")
        if asked not in (None, FUSED_QKV) and asked not in fits:
            raise LayoutError(f"the source is {fam.name} {fits[0]}..{fits[-1]}, not {asked!r}: {'; '.join(evidence)}")
        version = asked if asked not in (None, FUSED_QKV) else fits[-1]
        label = f"{fam.name} {version}" if len(fits) == 1 or asked not in (None, FUSED_QKV) else \
            f"{fam.name} {fits[0]}..{fits[-1]} (read as {version})"
        if fused:
            label = f"{fam.name} {FUSED_QKV} ({label.split(' ', 1)[1]} names, {FUSED_QKV_KEY})"
        pre = tuple(r.inverse() for r in fam.respells(version))
        recipe = qkv_form(recipe, fused)
        out = replace(recipe, pre=recipe.pre + pre, meta=_meta(recipe, version))
        return out, {"source": label}
    fused = asked == FUSED_QKV
    version = fam.newest if fused or asked is None else asked
    label = f"{fam.name} {FUSED_QKV} ({version} names, {FUSED_QKV_KEY})" if fused else f"{fam.name} {version}"
    if fwd is not None:  # invert the versioned forward recipe: its rules keep when_present / when_absent
        fwd = qkv_form(fwd, fused)
        pre = tuple(r.inverse() for r in fam.respells(version))
        out = replace(fwd, pre=fwd.pre + pre, meta=_meta(fwd, version)).inverse()
    else:
        recipe = qkv_form(recipe, fused)
        out = replace(recipe, post=recipe.post + fam.respells(version), meta=_meta(recipe, version))
    return out, {"target": label}


def qkv_form(recipe: Recipe, fused: bool) -> Recipe:
    """``recipe`` with the rules of one attention form: torchtitan's fused ``qkv_linear.wqkv``
    (``Rule.only == "fused-qkv"``) or the separate ``wq`` / ``wk`` / ``wv`` (``"separate-qkv"``);
    rules of no form stay. A recipe with neither is returned as is."""
    keep = (None, FUSED_QKV if fused else "separate-qkv")
    if all(r.only is None for r in recipe.rules):
        return recipe
    return replace(recipe, rules=tuple(r for r in recipe.rules if r.only in keep))


META_VERSIONS = (
    ("llama2", "Llama 1 / 2 (facebookresearch/llama model.py ParallelEmbedding): tok_embeddings split by columns (dim 1)"),
    ("llama3", "Llama 3 / 3.1 / 3.2 (meta-llama/llama-models VocabParallelEmbedding): tok_embeddings split by vocabulary (dim 0)"),
)
_EMBED = "tok_embeddings.weight"


def meta_split(catalog) -> tuple[str | None, list[int]]:
    """The version of Meta's model-parallel split of ``catalog``'s shards (``(None, [])`` for one
    shard, or no ``tok_embeddings``) and the embedding width of each shard: every shard holding the
    whole width ``dim`` (``wq``'s columns, else params.json's) is split by vocabulary (``llama3``);
    widths summing to ``dim`` by columns (``llama2``).

    Raises:
        LayoutError: widths that fit neither split."""
    if catalog.shards == 1 or _EMBED not in catalog.keys():
        return None, []
    widths = [s.shape[1] for s in catalog.specs(_EMBED)]
    wq = "layers.0.attention.wq.weight"
    dim = catalog.specs(wq)[0].shape[1] if wq in catalog.keys() else (catalog.params.dim if catalog.params else None)
    found = "llama3" if all(w == dim for w in widths) else "llama2" if sum(widths) == dim else None
    if found is None:
        raise LayoutError(f"Meta shards' {_EMBED} widths {widths} fit neither split of dim={dim} (by vocabulary or by columns)")
    return found, widths


def meta_versioned(recipe: Recipe, catalog, asked: str | None) -> tuple[Recipe, dict[str, str]]:
    """Meta's model-parallel split of ``tok_embeddings`` by version (transformers'
    ``convert_llama_weights_to_hf.py``: ``concat_dim = 0`` for Llama 3.x, else 1; every other
    tensor splits the same way in both). Reading: detected from the shards' shapes (each holding
    the whole width ``dim``, i.e. ``wq``'s columns: split by vocabulary); writing: ``asked`` or
    ``llama3``. One shard is the same in every version.

    Raises:
        LayoutError: shards whose embedding widths fit neither split, or an unknown version."""
    if "meta" not in (recipe.reads, recipe.writes):
        return recipe, {}
    known = [v for v, _ in META_VERSIONS]
    if asked is not None and asked not in known:
        raise LayoutError(f"Meta's layout has no version {asked!r}; known: {known}")
    if recipe.reads == "meta":
        if catalog.shards == 1 or _EMBED not in catalog.keys():
            return recipe, {"source": f"meta {asked or 'llama2 / llama3'} (1 shard: the same in both)"}
        found, widths = meta_split(catalog)
        if asked is not None and asked != found:
            raise LayoutError(f"the Meta shards are split as {found} ({_EMBED} widths {widths}), not {asked!r}")
        version = found
    else:
        version = asked or "llama3"
    fwd = recipe.meta.get("inverse_of", recipe)
    split = 0 if version == "llama3" else 1
    rules = tuple(replace(r, shard_dim=split) if r.sources == (_EMBED,) else r for r in fwd.rules)
    out = replace(fwd, rules=rules, meta=_meta(fwd, version))
    if fwd is not recipe:
        out = out.inverse()
    return out, {"source" if recipe.reads == "meta" else "target": f"meta {version}"}


def variant_versioned(recipe: Recipe, keys, asked: str | None) -> tuple[Recipe, dict[str, str]]:
    """A recipe whose framework spells some names by configuration (``recipe.meta["variants"]``:
    ``{name: (marker source pattern, rules)}`` of the forward recipe, e.g. Megatron's Transformer
    Engine vs local norm names): reading, the variant whose marker a source key matches (one
    only); writing, ``asked`` or ``meta["default_variant"]``.

    Raises:
        LayoutError: keys of two variants, or an unknown one asked for."""
    fwd = recipe.meta.get("inverse_of", recipe)
    variants = fwd.meta.get("variants")
    if not variants:
        return recipe, {}
    fam = fwd.meta.get("variant_family", fwd.name)
    if asked is not None and asked not in variants:
        raise LayoutError(f"{fam} has no layout variant {asked!r}; known: {sorted(variants)}")
    reads = fwd is recipe
    if reads:
        keys = list(keys)
        found = {name for name, (marker, _) in variants.items() if any(Pattern(marker).match(k) is not None for k in keys)}
        if len(found) > 1:
            raise LayoutError(f"the source mixes {fam} variants {sorted(found)}")
        if asked is not None and found and asked not in found:
            raise LayoutError(f"the source is {fam} {sorted(found)[0]}, not {asked!r}")
        name = asked or (found.pop() if found else fwd.meta["default_variant"])
    else:
        name = asked or fwd.meta["default_variant"]
    out = replace(fwd, rules=fwd.rules + variants[name][1], meta=_meta(fwd, name))
    return (out if reads else out.inverse()), {"source" if reads else "target": f"{fam} {name}"}


@dataclass(frozen=True)
class LayerShift:
    """DeepSeek-V3's multi-token-prediction layers: torchtitan's ``mtp_layers.{j}.*`` are HF's
    ``model.layers.{n_layers + j}.*`` (torchtitan deepseek_v3 state_dict_adapter
    ``_map_from_hf_layer_key``). Renames ``mtp_layers.{j}.`` -> ``layers.{offset + j}.`` (the
    canonical names the rules read), or back when ``forward`` is False (layers from ``offset``
    on). Unbound (``offset`` None) it renames nothing: :func:`bind_dims` gives it ``n_layers``."""

    offset: int | None = None
    forward: bool = True

    def apply(self, key: str) -> str:
        if self.offset is None:
            return key
        head, _, rest = key.partition(".")
        idx, _, tail = rest.partition(".")
        if not idx.isdigit() or not tail:
            return key
        if self.forward and head == "mtp_layers":
            return f"layers.{self.offset + int(idx)}.{tail}"
        if not self.forward and head == "layers" and int(idx) >= self.offset:
            return f"mtp_layers.{int(idx) - self.offset}.{tail}"
        return key

    def inverse(self) -> LayerShift:
        return LayerShift(self.offset, not self.forward)

    def describe(self) -> str:
        n = "n_layers" if self.offset is None else str(self.offset)
        return f"mtp_layers.{{j}} -> layers.{{{n} + j}}" if self.forward else f"layers.{{{n} + j}} -> mtp_layers.{{j}}"


def bind_dims(recipe: Recipe, dims) -> Recipe:
    """``recipe`` with every :class:`LayerShift` given ``dims["n_layers"]`` (unchanged without it)."""
    fwd = recipe.meta.get("inverse_of")
    if fwd is not None:
        return bind_dims(fwd, dims).inverse()
    n = dims.get("n_layers")
    if n is None or not any(isinstance(r, LayerShift) for r in recipe.pre + recipe.post):
        return recipe

    def bound(rs):
        return tuple(LayerShift(n, r.forward) if isinstance(r, LayerShift) else r for r in rs)

    return replace(recipe, pre=bound(recipe.pre), post=bound(recipe.post))


def _meta(recipe: Recipe, version: str) -> dict[str, Any]:
    return {k: v for k, v in recipe.meta.items() if k != "inverse_of"} | {"version": version}


__all__ = ["Respell", "Axis", "Family", "FAMILIES", "TORCHTITAN", "LayoutError", "LayerShift", "bind_dims", "variant_versioned", "versioned", "meta_versioned", "meta_split", "META_VERSIONS", "version_table", "detect_layout"]
