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
from .hf_files import META_LAYOUT_KEY, META_PARAMS_KEY, hf_config_files, llama_config_from_meta, llama_generation_config, meta_model_from_config, with_transformers4_rope
from .catalog import HF_CONFIG_NAME, Catalog, PARAMS_DIMS, PARAMS_NAME, hf_config_of, hf_dims, model_dims, open_catalog, params_dims, write_params_json
from .dims import resolve as resolve_dims
from .layouts import LayoutError, bind_dims, meta_versioned, variant_versioned, versioned
from .verify import GENERATION_CONFIG_NAME, dims_problems, inverse_problems, side_file_problems
from .plan import ConversionPlan, plan_conversion
from .recipes import OPTIONS, RECIPES, RecipeError, get_recipe, recipe_table  # noqa: F401 - recipe_table: its old home
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
            layouts.pop("why", None)
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


def _versioned(rec: Recipe, catalog, asked: str | None, model: Any = None) -> tuple[Recipe, dict[str, str]]:
    """The recipe for the layout version of its source (detected) or target (asked, else the
    version the forward conversion read (:func:`default_version`), else the newest)."""
    if asked is None and "inverse_of" in rec.meta:  # it writes the framework's layout
        asked, why = default_version(rec, catalog, model)
        if asked is not None:
            try:
                out, layouts = _versioned(rec, catalog, asked)
            except LayoutError as e:
                raise LayoutError(f"{e} (the version from {why}; name one with {rec.name}@VERSION)") from None
            return out, layouts | {"why": why}  # open_conversion moves it to the report's checks
    if "meta" in (rec.reads, rec.writes):
        return meta_versioned(rec, catalog, asked)
    if (rec.meta.get("inverse_of") or rec).meta.get("variants"):
        return variant_versioned(rec, catalog.keys(), asked)
    return versioned(rec, catalog.keys(), asked)


def _forward_of(rec: Recipe, catalog) -> Any:
    """The source's :class:`~.report.ForwardRecord` when the recipe that wrote it is ``rec``'s
    forward (``meta-llama-to-hf`` for ``hf-to-meta-llama``), else None."""
    record = catalog.record
    return record if record is not None and record.recipe == rec.inverse_name else None


def meta_version_from_config(cfg: Any) -> tuple[str | None, str]:
    """Meta's layout version a transformers Llama config describes: ``llama3`` for Llama 3's
    tokenizer (``vocab_size`` >= 128000), ``rope_theta`` >= 500000 or its scaled RoPE; ``llama2``
    for Llama 1 / 2's 32000-row SentencePiece vocabulary (Code Llama's 32016) with ``rope_theta``
    10000 (1e6 for Code Llama); else None. (transformers ``convert_llama_weights_to_hf.py`` picks
    the split by the version the same way: Llama 3's tokenizer, else Llama 2's.) Also ``why``."""
    if cfg is None:
        return None, ""
    kept = cfg.fqnckpt_meta_params or {}
    if kept.get("layout") in ("llama2", "llama3"):
        return kept["layout"], f"config.json {META_PARAMS_KEY}.{META_LAYOUT_KEY} (written by the conversion from Meta's layout)"
    rope = cfg.rope_parameters or cfg.rope_scaling or {}
    theta = cfg.rope_theta if cfg.rope_theta is not None else rope.get("rope_theta")
    scaled = (rope.get("rope_type") or rope.get("type")) == "llama3"
    vocab = cfg.vocab_size
    if (vocab or 0) >= 128000 or scaled or (theta or 0) >= 500000:
        return "llama3", f"config.json vocab_size={vocab}, rope_theta={theta}{', llama3 RoPE scaling' if scaled else ''}: Llama 3"
    if vocab in (32000, 32016) and theta in (10000, 10000.0, 1000000, 1000000.0):
        return "llama2", f"config.json vocab_size={vocab}, rope_theta={theta}: Llama 1 / 2"
    return None, ""


def default_version(rec: Recipe, catalog, model: Any = None) -> tuple[str | None, str]:
    """The layout version a recipe that writes a framework's layout writes when none is asked:
    the version its forward conversion read, recorded in ``conversion_report.json`` beside the
    source; for Meta's layout, else the one the config says (:func:`meta_version_from_config`:
    the model's, else the source's ``config.json``). ``(None, "")`` when neither says: the
    recipe's own default. Also ``why`` (for the report's checks)."""
    record = _forward_of(rec, catalog)
    version = record.version_read() if record is not None else None
    if version is not None:
        return version, f"{CONVERSION_REPORT_NAME} beside the source: the conversion that wrote it read {record.layouts['source']!r}"
    if "meta" in (rec.reads, rec.writes):
        return meta_version_from_config(hf_config_of(model) or catalog.hf_config)
    return None, ""


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


def _check_layer_shift(rec: Recipe, catalog, src: str) -> None:
    """DeepSeek-V3's ``mtp_layers.{j}`` follow the decoder's ``n_layers`` layers: a recipe that
    places them (:class:`~.layouts.LayerShift`) needs ``n_layers``.

    Raises:
        DimError: ``n_layers`` is unknown and the source has ``mtp_layers.*`` keys (one line)."""
    from .dims import DimError
    from .layouts import LayerShift

    fwd = rec.meta.get("inverse_of") or rec
    unbound = any(isinstance(r, LayerShift) and r.offset is None for r in fwd.pre + fwd.post)
    mtp = next((k for k in catalog.keys() if k.startswith("mtp_layers.")), None) if unbound and rec is fwd else None
    if mtp is not None:
        raise DimError(f"{src} has DeepSeek-V3 multi-token-prediction layers ({mtp!r}), which follow the decoder's n_layers "
                       f"layers, and n_layers is unknown: pass --dim n_layers=N (dims=), model= or config.json beside the source", "n_layers", True)  # fmt: skip


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
        record = catalog.record
        recorded = {k: v for k, v in (record.dims if record is not None else {}).items() if k != "shards"}
        stated = [(PARAMS_NAME, params_dims(catalog.params)), (HF_CONFIG_NAME, hf_dims(catalog.hf_config)),
                  (CONVERSION_REPORT_NAME, recorded),
                  ("the model's config", model_dims(model)), ("dims=", dims),
                  ("the source's consolidated.NN.pth files", {"shards": catalog.shards} if catalog.shards > 1 else None)]  # fmt: skip
        d, by_source = resolve_dims(stated)
        if recipe == "auto":
            plan = _auto(catalog, model, d, str(src))
        else:
            try:
                rec, layouts = _versioned(with_options(get_recipe(recipe, model), options), catalog, asked, model)
            except LayoutError as e:
                raise RecipeError(f"{src}: {e}") from None
            why = layouts.pop("why", None)
            forward = _forward_of(rec, catalog)
            if rec.writes == "meta" and "shards" not in d and forward is not None and forward.shards > 1:
                d["shards"] = by_source.setdefault(CONVERSION_REPORT_NAME, {})["shards"] = forward.shards  # as it went
            rec = bind_dims(rec, d)
            _check_layer_shift(rec, catalog, str(src))
            missing = [k for k in PARAMS_DIMS if k not in d] if rec.writes == "meta" else []
            if missing:
                raise RecipeError(f"recipe {rec.name!r} writes params.json: dims {missing} unknown for {src} (model=, config.json or --dim)")
            plan = plan_conversion(catalog, rec, d, model=model if rec.writes == "hf-model" else None, source=str(src),
                                   tied=_tied(model, catalog))  # fmt: skip
            plan.report.layouts = layouts
            if why:
                plan.report.checks.append(f"layout version {layouts.get('target')!r} from {why}")
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
    elif plan.recipe.writes in ("hf", "hf-model") and plan.catalog.hf_config is not None:  # the source's own config
        out[HF_CONFIG_NAME] = _source_config(plan)
    elif plan.recipe.meta.get("config_beside"):  # a layout whose tools read the model's HF config beside it
        cfg = hf_config_files(model).get(HF_CONFIG_NAME) if model is not None else None
        if cfg is None and plan.catalog.hf_config is not None:
            cfg = _source_config(plan)
        if cfg is not None:
            out[HF_CONFIG_NAME] = with_transformers4_rope(cfg)
        else:
            plan.report.notes.append(f"no {HF_CONFIG_NAME} written beside the {plan.recipe.name} output: the source has none and "
                                     f"no model= was given")  # fmt: skip
    return out


def _source_config(plan: ConversionPlan) -> bytes:
    """The source's ``config.json`` (the whole file), as transformers 4.x and 5 read it."""
    return with_transformers4_rope((json.dumps(plan.catalog.hf_config.whole, indent=2, sort_keys=True) + "\n").encode())


def verify_plan(plan: ConversionPlan, by_source: Mapping[str, Mapping[str, int]]) -> None:
    """Before anything is written: the dims against each other and the tensors, then the side
    files built and re-read by their formats' readers (:mod:`.verify`); the checks are listed in
    the report.

    Raises:
        ConversionError: naming each disagreement (source and value); nothing written."""
    plan.report.dim_sources = {k: dict(v) for k, v in by_source.items()}
    plan.report.unchecked = unchecked_dims(by_source)
    problems = dims_problems(plan, by_source) or inverse_problems(plan)
    if not problems:
        try:
            plan.side = _build_side_files(plan, plan.model)
        except ValueError as e:  # a field the target's side file cannot say
            problems = [Problem(kind="side-file", keys=[], message=str(e))]
        else:
            problems = side_file_problems(plan.side, plan)
            if plan.recipe.writes in ("hf", "hf-model") and HF_CONFIG_NAME not in plan.side:
                plan.report.notes.append(
                    f"no {HF_CONFIG_NAME} written: neither the source ({HF_CONFIG_NAME} / {PARAMS_NAME}) nor model= (a transformers model) "
                    f"gives its RoPE theta, norm epsilon and model class (dims= / --dim give sizes only); from_pretrained needs one: "
                    f"pass model=, or copy the model's {HF_CONFIG_NAME} beside the output")  # fmt: skip
    if problems:
        plan.report.problems.extend(problems)
        raise ConversionError(plan.report)


# The dims that the tensors' shapes cannot confirm: any head count whose heads divide the rows fits.
HEAD_DIMS = ("n_heads", "n_kv_heads", "head_dim", "qk_rope_head_dim")


def unchecked_dims(by_source: Mapping[str, Mapping[str, int]], caller: str = "dims=") -> list[str]:
    """``["n_heads=8", ...]``: the :data:`HEAD_DIMS` only ``caller`` states (no other source)."""
    mine = by_source.get(caller) or {}
    others = {k for name, d in by_source.items() if name != caller for k in d}
    return [f"{k}={v}" for k, v in mine.items() if k in HEAD_DIMS and k not in others]


def _meta_llama_specs(plan: ConversionPlan) -> tuple[dict[str, TensorSpec], TensorSpec, TensorSpec]:
    specs = {s.fqn: s for s in plan.specs}
    embed, gate = specs.get("model.embed_tokens.weight"), specs.get("model.layers.0.mlp.gate_proj.weight")
    if embed is None or gate is None:
        raise ConversionError(plan.report, "no model.embed_tokens / layer-0 gate_proj to size config.json from: pass model=")
    return specs, embed, gate


def _meta_llama_config(plan: ConversionPlan) -> bytes:
    _, embed, gate = _meta_llama_specs(plan)
    dtype = str(embed.dtype).removeprefix("torch.")
    return llama_config_from_meta(plan.catalog.params.model_dump(), gate.shape[0], embed.shape[0], dtype,
                                  layout=plan.recipe.meta.get("version") if plan.catalog.shards > 1 else None)  # fmt: skip


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


__all__ = ["open_conversion", "run_recipe", "side_files", "recipe_table"]
