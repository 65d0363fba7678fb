"""``migrate`` recipes between quantized and floating-point checkpoints (:mod:`.quant`), streamed
one tensor at a time (memory: one weight, whatever the checkpoint's size), written in
``checkpoint.save``'s format with the source's ``config.json`` adjusted.

* ``dequantize-bf16`` / ``dequantize-fp32``: FP8 block weights and MXFP4 experts into that
  dtype (DeepSeek's ``fp8_cast_bf16.py``; MXFP4 under the name and in the layout transformers'
  gpt-oss holds: ``X`` from ``X_blocks`` / ``X_scales``, dims 1 and 2 swapped); every other
  tensor as stored; ``config.json`` without ``quantization_config``.
* ``quantize-fp8``: every 2-D floating-point ``*.weight`` outside :data:`NOT_QUANTIZED` into
  ``float8_e4m3fn`` blocks of 128 x 128 with a float32 ``weight_scale_inv`` (DeepSeek-V3's
  ``weight_quant``: amax / 448 per block); ``config.json`` gains transformers'
  ``FineGrainedFP8Config`` fields. Round trip: within FP8's own rounding
  (:func:`~.quant.fp8_quantize`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

import torch
from pydantic import BaseModel, Field

from ..storage.layout import TensorSpec
from .dequant import DequantizingReader
from .recipes import QUANT_SOURCES, QUANT_SUMMARIES, RecipeError, recipe_rows  # noqa: F401 (recipe_rows re-exported)
from .quant import (
    CONFIG_NAME,
    DEFAULT_BLOCK,
    FP8_SCALE_SUFFIX,
    find_pairs,
    fp8_config_entry,
    fp8_quantize,
    read_quantization_config,
    without_quantization,
)

QUANT_RECIPES = {"dequantize-bf16": torch.bfloat16, "dequantize-fp32": torch.float32, "quantize-fp8": torch.float8_e4m3fn}
# Weights DeepSeek-V3 and transformers' fine-grained FP8 keep in full precision: embeddings,
# the output head, norms, MoE routers (a segment of the key matching one of these).
NOT_QUANTIZED = re.compile(r"(^|\.)(embed_tokens|embed|wte|wpe|lm_head|output|norm|[a-z_]*norm[a-z_]*|gate|router)(\.|$)")
SIDE_FILES = (CONFIG_NAME, "generation_config.json")
REPORT_NAME = "quantization_report.json"


class QuantRecipeReport(BaseModel):
    """What a quantization recipe did (also written as ``quantization_report.json``): the keys
    ``dequantized`` (into ``dtype``), ``quantized`` (to FP8 blocks, each with its
    ``<key>_scale_inv``) and ``kept`` as stored."""

    recipe: str
    source: str
    destination: str
    dtype: str
    written: bool = False
    dry_run: bool = False
    dequantized: list[str] = Field(default_factory=list)
    quantized: list[str] = Field(default_factory=list)
    kept: list[str] = Field(default_factory=list)


def _side_files(root: str, recipe: str, dtype: torch.dtype) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name in SIDE_FILES:
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            raw = f.read()
        if name == CONFIG_NAME:
            cfg = json.loads(raw)
            if recipe == "quantize-fp8":
                cfg = {**cfg, "quantization_config": fp8_config_entry(DEFAULT_BLOCK)}
            else:
                cfg = without_quantization(cfg)
                for k in ("torch_dtype", "dtype"):
                    if k in cfg:
                        cfg[k] = str(dtype).removeprefix("torch.")
            raw = (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()
        out[name] = raw
    return out


def run_quant_recipe(src: Any, dst: Any, recipe: str, *, write: Callable, dry_run: bool = False) -> QuantRecipeReport:
    """Migrate the safetensors checkpoint (fqnckpt or Hugging Face) at ``src`` with ``recipe``
    (one of :data:`QUANT_RECIPES`, see the module docstring), streaming every tensor through
    ``write(specs, fetch, extra_files)`` (:func:`checkpoint.saving.converted_writer`).

    Raises:
        QuantizationError: the source's scales or config disagree with its tensors (names them),
            before anything is written.
        RecipeError (a ValueError): ``dequantize-*`` of a checkpoint holding no quantized weight,
            ``quantize-fp8`` of one holding quantized weights already, or of one with no weight
            to quantize.
        What :func:`checkpoint.open_checkpoint` raises for ``src``.
    """
    from ..storage.opening import open_checkpoint

    dtype = QUANT_RECIPES[recipe]
    reader = open_checkpoint(src)
    try:
        root = reader.root if isinstance(reader.root, str) else None
        config = read_quantization_config(root)
        keys = reader.keys()
        fp8, mx = find_pairs(keys, reader.spec, config, lambda k: os.path.join(str(reader.root), reader.file_of(k)))
        report = QuantRecipeReport(recipe=recipe, source=str(src), destination=str(getattr(dst, "url", None) or dst),
                                   dtype=str(dtype).removeprefix("torch."))  # fmt: skip
        specs: list[TensorSpec] = []
        how: dict[str, Callable[[TensorSpec], torch.Tensor]] = {}
        if recipe != "quantize-fp8":
            if not fp8 and not mx:
                raise RecipeError(f"{src}: {recipe} found no quantized weight (FP8 with '*_scale_inv', MXFP4 '*_blocks')")
            view = DequantizingReader(reader, fp8, {p.name if len(p.shape) == 4 else p.blocks: (p, len(p.shape) == 4)
                                                    for p in mx.values()},  # fmt: skip
                                      {p.scale for p in fp8.values()} | {p.scales for p in mx.values()}
                                      | {p.blocks for p in mx.values() if len(p.shape) == 4})  # fmt: skip

            def dequantized(spec: TensorSpec) -> torch.Tensor:
                out = torch.empty(spec.shape, dtype=spec.dtype)
                view.copy_into(spec.fqn, out)
                return out

            for k in view.keys():
                if view.dequantized(k):
                    specs.append(TensorSpec(k, view.spec(k).shape, dtype))
                    how[k] = dequantized
                    report.dequantized.append(k)
                else:
                    specs.append(TensorSpec(k, reader.spec(k).shape, reader.spec(k).dtype))
                    report.kept.append(k)
        else:
            if fp8 or mx or (config is not None and config.quant_method):
                raise RecipeError(f"{src}: holds quantized weights already (quantize-fp8 reads a floating-point checkpoint)")
            cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

            def quantized(spec: TensorSpec) -> torch.Tensor:
                name = spec.fqn.removesuffix(FP8_SCALE_SUFFIX)
                if name not in cache:  # weight then its scales: one weight quantized at a time
                    cache.clear()
                    cache[name] = fp8_quantize(reader.get(name), DEFAULT_BLOCK)
                q, s = cache[name]
                return s if spec.fqn.endswith(FP8_SCALE_SUFFIX) else q

            for k in keys:
                s = reader.spec(k)
                if k.endswith(".weight") and len(s.shape) == 2 and s.dtype.is_floating_point and not NOT_QUANTIZED.search(k):
                    grid = (-(-s.shape[0] // DEFAULT_BLOCK[0]), -(-s.shape[1] // DEFAULT_BLOCK[1]))
                    specs += [TensorSpec(k, s.shape, dtype), TensorSpec(k + FP8_SCALE_SUFFIX, grid, torch.float32)]
                    how[k] = how[k + FP8_SCALE_SUFFIX] = quantized
                    report.quantized.append(k)
                else:
                    specs.append(TensorSpec(k, s.shape, s.dtype))
                    report.kept.append(k)
            if not report.quantized:
                raise RecipeError(f"{src}: quantize-fp8 found no 2-D floating-point weight to quantize")

        def fetch(spec: TensorSpec) -> torch.Tensor:
            f = how.get(spec.fqn)
            return f(spec) if f is not None else reader.get(spec.fqn)

        if dry_run:
            report.dry_run = True
            return report
        report.written = True
        write(specs, fetch, {**_side_files(root, recipe, dtype), REPORT_NAME: report.model_dump_json(indent=2).encode()})
        return report
    finally:
        reader.close()


__all__ = ["NOT_QUANTIZED", "QUANT_RECIPES", "REPORT_NAME", "recipe_rows", "QuantRecipeReport", "run_quant_recipe"]
