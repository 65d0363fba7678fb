"""The one entry into conversions used by ``checkpoint.migrate(..., recipe=)`` and the CLI:
open the source, pick the recipe, resolve the dims, plan (checked), then hand the target specs and
a fetch to the writer the caller gives (``checkpoint.save``'s), so this package never imports the
entry points."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..progress import progress_bar
from ..storage.layout import TensorSpec
from .hf_files import hf_config_files, llama_config_from_meta, llama_generation_config, meta_model_from_config, with_transformers4_rope
from .catalog import HF_CONFIG_NAME, Catalog, PARAMS_DIMS, PARAMS_NAME, hf_config_of, hf_dims, model_dims, open_catalog, params_dims, write_params_json
from .dims import resolve as resolve_dims
from .layouts import LayoutError, bind_dims, meta_versioned, variant_versioned, versioned
from .verify import GENERATION_CONFIG_NAME, dims_problems, inverse_problems, side_file_problems
from .plan import ConversionPlan, plan_conversion
from .recipes import RECIPES, RecipeError, get_recipe
from .report import CONVERSION_REPORT_NAME, ConversionError, ConversionReport, Problem
from .rules import Recipe

# write(specs, fetch, extra_files, layout): layout is the recipe's ``writes`` ("meta": Meta's
# consolidated.NN.pth files, else safetensors); the caller's writer picks the files by it.
Writer = Callable[[Sequence[TensorSpec], Callable[[TensorSpec], torch.Tensor], Mapping[str, bytes], str | None], Any]


def _auto(catalog, model, dims, source: str) -> ConversionPlan:
    """The one built-in recipe under which every source key and every model FQN match (and which
    changes something: a checkpoint already in the model's layout needs none)."""
    if model is None:
        raise RecipeError("recipe='auto' needs model= to check the targets against")
    fits, tried = [], []
    for name, entry in RECIPES.items():
        try:
            rec = entry.build(model)
            if rec.writes != "hf-model":  # only these name the model's FQNs
                continue
            rec, layouts = _versioned(rec, catalog, None)
            plan = plan_conversion(catalog, rec, dims, model=model, source=source)
            plan.report.layouts = layouts
        except (ConversionError, TypeError, ValueError) as e:
            tried.append(f"{name}: {str(e)[:120]}")
            continue
        if plan.groups and not any(rec.rules == r.rules and rec.pre == r.pre for _, _, r in fits):
            fits.append((name, plan, rec))  # identical rules (Meta / torchtitan Llama) are one conversion
    if len(fits) != 1:
        why = f"several recipes fit: {[f[0] for f in fits]}" if fits else "no built-in recipe changes it into the model's layout"
        raise RecipeError(f"recipe='auto' for {source}: {why}" + ("" if fits else "; " + " | ".join(tried[:12])))
    return fits[0][1]


# Recipe options (``NAME+option``): what each changes in the recipe.
OPTIONS = {
    "drop-expert-bias": ("torchtitan-moe-to-hf", "layers.{i}.moe.expert_bias",
                         "drop torchtitan's MoE load-balancing bias (Qwen3-MoE in transformers has none)"),
}


def with_options(rec: Recipe, options: Sequence[str]) -> Recipe:
    """``rec`` with each option of :data:`OPTIONS` applied (a dropped key is listed in the report).

    Raises:
        RecipeError: an option unknown or not for this recipe."""
    from dataclasses import replace

    for opt in options:
        known = OPTIONS.get(opt)
        if known is None or known[0] != rec.name:
            raise RecipeError(f"recipe {rec.name!r} has no option {opt!r}; options: " +
                              (", ".join(f"{r}+{o} ({w})" for o, (r, _, w) in OPTIONS.items()) or "none"))  # fmt: skip
        rec = replace(rec, drop=rec.drop + (known[1],))
    return rec


def _versioned(rec: Recipe, catalog, asked: str | None) -> tuple[Recipe, dict[str, str]]:
    """The recipe for the layout version of its source (detected) or target (asked / newest)."""
    if "meta" in (rec.reads, rec.writes):
        return meta_versioned(rec, catalog, asked)
    if (rec.meta.get("inverse_of") or rec).meta.get("variants"):
        return variant_versioned(rec, catalog.keys(), asked)
    return versioned(rec, catalog.keys(), asked)


def _tied(model: Any, catalog) -> bool:
    """Whether the model (or else the source's config.json) ties the output projection to the
    embeddings (transformers ``tie_word_embeddings``)."""
    cfg = hf_config_of(model)
    if cfg is not None:
        return bool(getattr(model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config, "tie_word_embeddings", False)
                    or getattr(model.config, "tie_word_embeddings", False))  # fmt: skip
    whole = catalog.hf_config.whole if catalog.hf_config is not None else {}
    text = whole.get("text_config") if isinstance(whole.get("text_config"), dict) else {}
    return bool(whole.get("tie_word_embeddings") or text.get("tie_word_embeddings"))


def open_conversion(src: Any, recipe: str | Recipe, *, model: Any = None,
                    dims: Mapping[str, int] | None = None, key: str | None = None,
                    trusted_globals: Iterable[Any] = (), storage_options: Mapping | None = None) -> ConversionPlan:  # fmt: skip
    """Plan converting the checkpoint at ``src`` with ``recipe`` (a name from ``fqnckpt recipes``,
    ``"auto"``, or a :class:`Recipe`). Dims come from ``params.json`` (or else transformers'
    ``config.json``) beside ``src``, then the ``model``'s config, then ``dims``; several Meta
    shards read set ``dims["shards"]``, and ``dims["shards"]`` is how many a Meta target gets.
    ``src`` may be a URL (``s3://...``; ``storage_options`` for its filesystem) or an object store:
    read through the remote source stage (:func:`~checkpoint.convert.catalog.open_catalog`); or
    a :class:`~checkpoint.convert.catalog.Catalog` opened already (tensors in memory).

    The returned plan keeps the source open: call ``plan.catalog.close()`` when done.

    Raises:
        RecipeError: unknown recipe, one that needs ``model=``, ``auto`` with none / several fits,
            or a Meta target whose ``params.json`` dims are not known (named).
        ConversionError: the plan's checks failed (see :func:`plan_conversion`); nothing was read.
    """
    if isinstance(src, Catalog):  # tensors already at hand (save of a model in memory)
        catalog, src = src, src.path
    else:
        catalog = open_catalog(src, trusted_globals=trusted_globals, key=key, storage_options=storage_options)
        src = getattr(src, "url", src)  # an object store: messages name its URL
    try:
        asked, options = None, []
        if isinstance(recipe, str):  # NAME[@version][+option...]: hf-to-torchtitan-llama3@legacy
            recipe, *options = recipe.split("+")
            if "@" in recipe:
                recipe, _, asked = recipe.partition("@")
        entry = RECIPES.get(recipe) if isinstance(recipe, str) else None
        if model is None and entry is not None and entry.needs_model and catalog.hf_config is not None:
            try:  # the source's own config.json describes the model the recipe needs
                model = meta_model_from_config(catalog.hf_config.whole, f"{src}: config.json")
            except ValueError as e:
                raise RecipeError(f"recipe {recipe!r} takes its rules from the target model: pass model= (--model); {e}") from None
        stated = [(PARAMS_NAME, params_dims(catalog.params)), (HF_CONFIG_NAME, hf_dims(catalog.hf_config)),
                  ("the model's config", model_dims(model)), ("dims=", dims),
                  ("the source's consolidated.NN.pth files", {"shards": catalog.shards} if catalog.shards > 1 else None)]  # fmt: skip
        d, by_source = resolve_dims(stated)
        if recipe == "auto":
            plan = _auto(catalog, model, d, str(src))
        else:
            try:
                rec, layouts = _versioned(with_options(get_recipe(recipe, model), options), catalog, asked)
            except LayoutError as e:
                raise RecipeError(f"{src}: {e}") from None
            rec = bind_dims(rec, d)
            missing = [k for k in PARAMS_DIMS if k not in d] if rec.writes == "meta" else []
            if missing:
                raise RecipeError(f"recipe {rec.name!r} writes params.json: dims {missing} unknown for {src} (model=, config.json or --dim)")
            plan = plan_conversion(catalog, rec, d, model=model if rec.writes == "hf-model" else None, source=str(src),
                                   tied=_tied(model, catalog))  # fmt: skip
            plan.report.layouts = layouts
        plan.model = model
        verify_plan(plan, by_source)
        return plan
    except BaseException:
        catalog.close()
        raise


def side_files(plan: ConversionPlan, model: Any) -> dict[str, bytes]:
    """Files written beside the tensors: the report, and ``config.json`` (+ ``generation_config.json``)
    for a Hugging Face target model, or ``params.json`` for Meta's layout (from the model's config
    or the source's ``config.json``). Built and checked while planning (:func:`verify_plan`)."""
    files = plan.side if plan.side is not None else _build_side_files(plan, model)
    return {CONVERSION_REPORT_NAME: plan.report.model_dump_json(indent=2).encode(), **files}


def _build_side_files(plan: ConversionPlan, model: Any) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    if plan.recipe.writes == "meta":
        out[PARAMS_NAME] = write_params_json(plan.dims, hf_config_of(model) or plan.catalog.hf_config)
    elif plan.recipe.writes in ("hf", "hf-model") and model is not None:
        out.update(hf_config_files(model))
        if HF_CONFIG_NAME in out:
            out[HF_CONFIG_NAME] = with_transformers4_rope(out[HF_CONFIG_NAME])
    elif plan.recipe.writes == "hf-model" and plan.catalog.params is not None:  # Meta -> HF, no model
        out[HF_CONFIG_NAME] = _meta_llama_config(plan)
        out[GENERATION_CONFIG_NAME] = llama_generation_config(json.loads(out[HF_CONFIG_NAME]))
    return out


def verify_plan(plan: ConversionPlan, by_source: Mapping[str, Mapping[str, int]]) -> None:
    """Before anything is written: the dims against each other and the tensors, then the side
    files built and re-read by their formats' readers (:mod:`.verify`); the checks are listed in
    the report.

    Raises:
        ConversionError: naming each disagreement (source and value); nothing written."""
    plan.report.dim_sources = {k: dict(v) for k, v in by_source.items()}
    problems = dims_problems(plan, by_source) or inverse_problems(plan)
    if not problems:
        try:
            plan.side = _build_side_files(plan, plan.model)
        except ValueError as e:  # a field the target's side file cannot say
            problems = [Problem(kind="side-file", keys=[], message=str(e))]
        else:
            problems = side_file_problems(plan.side, plan)
    if problems:
        plan.report.problems.extend(problems)
        raise ConversionError(plan.report)


def _meta_llama_specs(plan: ConversionPlan) -> tuple[dict[str, TensorSpec], TensorSpec, TensorSpec]:
    specs = {s.fqn: s for s in plan.specs}
    embed, gate = specs.get("model.embed_tokens.weight"), specs.get("model.layers.0.mlp.gate_proj.weight")
    if embed is None or gate is None:
        raise ConversionError(plan.report, "no model.embed_tokens / layer-0 gate_proj to size config.json from: pass model=")
    return specs, embed, gate


def _meta_llama_config(plan: ConversionPlan) -> bytes:
    _, embed, gate = _meta_llama_specs(plan)
    dtype = str(embed.dtype).removeprefix("torch.")
    return llama_config_from_meta(plan.catalog.params.model_dump(), gate.shape[0], embed.shape[0], dtype)


def run_recipe(src: Any, dst: str | os.PathLike, recipe: str | Recipe, *, write: Writer,
               model: Any = None, dims: Mapping[str, int] | None = None, key: str | None = None,
               dry_run: bool = False, trusted_globals: Iterable[Any] = (), progress: bool | None = None,
               storage_options: Mapping | None = None) -> ConversionReport:  # fmt: skip
    """Plan, then (unless ``dry_run``) stream every target through ``write(specs, fetch, extra_files)``.

    Returns:
        The :class:`ConversionReport` (also written as ``conversion_report.json``).

    Raises:
        RecipeError, ConversionError: as :func:`open_conversion`; plus whatever ``write`` raises.
    """
    plan = open_conversion(src, recipe, model=model, dims=dims, key=key, trusted_globals=trusted_globals,
                           storage_options=storage_options)  # fmt: skip
    try:
        report = plan.report
        if dry_run:
            report.dry_run = True
            return report
        report.destination = getattr(dst, "url", None) or os.fspath(dst)
        report.written = True
        bar = progress_bar(report.total_bytes, "convert", progress)

        def fetch(spec: TensorSpec) -> torch.Tensor:
            t = plan.fetch(spec)
            bar.update(t.nbytes)
            return t

        try:
            write(plan.specs, fetch, side_files(plan, plan.model), plan.recipe.writes)
        except BaseException:
            report.written = False
            raise
        finally:
            bar.close()
        return report
    finally:
        plan.catalog.close()


def recipe_table() -> list[dict[str, Any]]:
    """``[{name, inverse, needs_model, summary, source, versions, options}]`` of the built-in
    recipes: ``source`` the code (repository, commit, file) each follows, ``versions`` the layout
    versions a name takes after ``@`` (the first read by detection, the last written by default),
    ``options`` what ``+option`` adds."""
    from ..layout_versions import FAMILIES
    from .layouts import META_VERSIONS
    from .recipes import SOURCES

    def versions(name: str, e) -> list[str]:
        try:
            rec = e.build(None)
        except Exception:  # noqa: BLE001 - a recipe that needs a model has no layout versions
            return []
        fwd = rec.meta.get("inverse_of", rec)
        if "meta" in (rec.reads, rec.writes):
            return [v for v, _ in META_VERSIONS]
        if fwd.meta.get("variants"):
            return sorted(fwd.meta["variants"])
        fam = FAMILIES.get(fwd.meta.get("family", ""))
        return [v for v, _, _ in fam.versions] if fam else []

    return [{"name": n, "inverse": e.inverse, "needs_model": e.needs_model, "summary": e.summary,
             "source": SOURCES.get(n) or SOURCES.get(e.inverse, ""), "versions": versions(n, e),
             "options": sorted(o for o, (r, _, _) in OPTIONS.items() if r == n)} for n, e in RECIPES.items()]  # fmt: skip


__all__ = ["open_conversion", "run_recipe", "side_files", "recipe_table"]
