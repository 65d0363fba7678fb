"""Block-scaled quantized weights as checkpoints store them: the formats, found by name and dtype,
checked against their config, and the arithmetic that turns them back into floating point (and
bf16 into FP8 blocks).

* **FP8 blocks** (DeepSeek-V3 / R1, Qwen3-FP8; transformers' ``FineGrainedFP8``): a 2-D weight
  ``W`` stored as ``float8_e4m3fn`` beside ``W_scale_inv`` (``<name>.weight_scale_inv``), one
  floating-point scale per ``br x bc`` block (``config.json`` ``quantization_config``:
  ``{"quant_method": "fp8", "weight_block_size": [br, bc]}``; 128 x 128 when no config says).
  The scale grid is ``(ceil(R / br), ceil(C / bc))``: the last row / column of blocks may be
  short. Value ``W[i, j]`` is ``float32(W[i, j]) * float32(scale[i // br, j // bc])``, then the
  target's dtype (torch's ``QuantizedHuggingFaceStorageReader``, DeepSeek's ``weight_dequant``).
* **MXFP4** (gpt-oss; the OCP microscaling format): ``X_blocks`` ``uint8 [*prefix, G, B]`` holds
  two FP4 (E2M1) codes a byte, low nibble first, and ``X_scales`` ``uint8 [*prefix, G]`` one
  E8M0 exponent per group of ``2 B`` values (bias 127). Value = ``FP4_VALUES[code] * 2 **
  (scale - 127)``, computed in the target's dtype with ``torch.ldexp`` as torch's reader and
  transformers' ``convert_moe_packed_tensors`` do. Dequantized, ``X`` is ``[*prefix, G * 2 B]``
  (torch's reader, under the name ``X_blocks``); transformers' gpt-oss experts hold it with
  dims 1 and 2 swapped (``[E, 2 B G, R]`` from ``[E, R, G, B]``), under the name ``X``.

Every function here works on a block of a tensor (offsets into the whole), so a rank reads and
dequantizes only the rows and columns it holds.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationError

from ..errors import QuantizationError

CONFIG_NAME = "config.json"
FP8_SCALE_SUFFIX = "_scale_inv"  # "<...>.weight" + "_scale_inv"
MX_BLOCKS, MX_SCALES = "_blocks", "_scales"
DEFAULT_BLOCK = (128, 128)  # torch's QuantizedHuggingFaceStorageReader and transformers' default
FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: DeepSeek's act_quant / weight scale divisor

# FP4 E2M1 values by code (sign bit 3): the table of gpt-oss, torch's reader and transformers.
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class QuantizationConfig(BaseModel):
    """``quantization_config`` of a Hugging Face ``config.json`` (the fields used here; the others
    are kept). ``weight_block_size``: ``[rows, cols]`` of one FP8 scale block."""

    model_config = ConfigDict(extra="allow")
    quant_method: str
    weight_block_size: tuple[PositiveInt, PositiveInt] | None = None


def read_quantization_config(root: str | None) -> QuantizationConfig | None:
    """The ``quantization_config`` of ``root/config.json`` when it is one of the methods read
    here (``fp8``, ``mxfp4``), else None (no such file, a file that is not JSON, a remote
    checkpoint, a config without one, another method: ``load`` reads nothing else of it).

    Raises:
        QuantizationError: an ``fp8`` / ``mxfp4`` entry whose fields do not parse (names the
            file and the field).
    """
    if root is None or not os.path.isdir(root):
        return None
    path = os.path.join(root, CONFIG_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if not isinstance(q, dict) or str(q.get("quant_method", "")).lower() not in ("fp8", "mxfp4"):
        return None
    try:
        return QuantizationConfig.model_validate(q)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"])) or "quantization_config"
        raise QuantizationError(path, f"quantization_config.{where}", err["msg"]) from None


@dataclass(frozen=True)
class Fp8Pair:
    """A ``float8`` weight (``weight``, shape ``(R, C)``) and its per-block scales (``scale``,
    shape :meth:`grid`) in blocks of ``block`` = ``(br, bc)``."""

    weight: str
    scale: str
    shape: tuple[int, ...]
    block: tuple[int, int]

    def grid(self) -> tuple[int, int]:
        return scale_grid(self.shape, self.block)


@dataclass(frozen=True)
class MxPair:
    """MXFP4 ``blocks`` (``uint8 [*prefix, G, B]``) and ``scales`` (``uint8 [*prefix, G]``) of
    tensor ``name`` (``blocks`` without its ``_blocks`` suffix)."""

    name: str
    blocks: str
    scales: str
    shape: tuple[int, ...]  # of the blocks

    def dequantized_shape(self, transformers: bool = False) -> tuple[int, ...]:
        """``[*prefix, G * 2 B]`` (torch's reader), or with ``transformers`` dims 1 and 2 swapped."""
        *prefix, g, b = self.shape
        out = (*prefix, g * b * 2)
        return (out[0], out[2], out[1], *out[3:]) if transformers else out


def scale_grid(shape: Sequence[int], block: Sequence[int]) -> tuple[int, int]:
    """Scale rows and columns covering a ``(R, C)`` weight in ``block`` = ``(br, bc)`` blocks, the
    last ones short where ``br`` / ``bc`` do not divide ``R`` / ``C``."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def find_pairs(keys: Sequence[str], spec, config: QuantizationConfig | None, where) -> tuple[dict[str, Fp8Pair], dict[str, MxPair]]:
    """The quantized tensors among ``keys`` (``spec(key)`` -> shape and dtype, headers only),
    checked against each other and against ``config``: ``({weight: Fp8Pair}, {blocks: MxPair})``.

    FP8: a 2-D float8 ``K`` with a floating-point ``K_scale_inv`` of 2 dims. MXFP4: a ``uint8``
    ``X_blocks`` of 3 or more dims with a ``uint8`` ``X_scales``. ``where(key)`` names the file of
    a key for errors.

    Raises:
        QuantizationError: a scale grid that does not cover its weight in the config's blocks
            (128 x 128 without a config), MXFP4 scales not of the blocks' shape less the last dim,
            a config of ``quant_method`` ``fp8`` / ``mxfp4`` over tensors holding none of that
            kind, or a float8 weight without its scales under an ``fp8`` config.
    """
    method = config.quant_method.lower() if config is not None else None
    block = tuple(config.weight_block_size) if config is not None and config.weight_block_size else DEFAULT_BLOCK
    present = set(keys)
    fp8: dict[str, Fp8Pair] = {}
    mx: dict[str, MxPair] = {}
    for key in keys:
        if key.endswith(FP8_SCALE_SUFFIX) and (w := key[: -len(FP8_SCALE_SUFFIX)]) in present:
            ws, ss = spec(w), spec(key)
            if ws.dtype not in FP8_DTYPES:
                continue
            if len(ws.shape) != 2 or len(ss.shape) != 2 or not ss.dtype.is_floating_point or ss.dtype in FP8_DTYPES:
                raise QuantizationError(
                    where(key), key, f"scales {tuple(ss.shape)} {ss.dtype} of float8 weight {w!r} {tuple(ws.shape)}: "
                    "block-scaled FP8 holds a 2-D weight and a 2-D floating-point scale grid",
                )  # fmt: skip
            pair = Fp8Pair(w, key, tuple(ws.shape), block)
            if tuple(ss.shape) != pair.grid():
                raise QuantizationError(
                    where(key), key, f"scale grid {tuple(ss.shape)} does not cover weight {w!r} {tuple(ws.shape)} in "
                    f"{block[0]}x{block[1]} blocks ({'config.json' if config else 'no config.json: the default'}): "
                    f"expected {pair.grid()}",
                )  # fmt: skip
            fp8[w] = pair
        elif key.endswith(MX_BLOCKS) and (s := key[: -len(MX_BLOCKS)] + MX_SCALES) in present:
            bs, ss = spec(key), spec(s)
            if bs.dtype != torch.uint8 or ss.dtype != torch.uint8 or len(bs.shape) < 3:
                if method == "mxfp4":
                    raise QuantizationError(
                        where(key), key, f"is {tuple(bs.shape)} {bs.dtype} with scales {tuple(ss.shape)} {ss.dtype}: "
                        "MXFP4 stores uint8 blocks [..., groups, bytes] and uint8 scales [..., groups]",
                    )  # fmt: skip
                continue
            if tuple(ss.shape) != tuple(bs.shape[:-1]):
                raise QuantizationError(
                    where(s), s, f"MXFP4 scales {tuple(ss.shape)} do not cover blocks {key!r} {tuple(bs.shape)}: "
                    f"expected one per group, {tuple(bs.shape[:-1])}",
                )  # fmt: skip
            mx[key] = MxPair(key[: -len(MX_BLOCKS)], key, s, tuple(bs.shape))
    if method == "fp8":
        if not fp8:
            raise QuantizationError(
                where(keys[0]) if keys else "", "quantization_config",
                "config.json says quant_method fp8, but no float8 weight has a '<weight>_scale_inv' beside it",
            )  # fmt: skip
        for key in keys:
            if key not in fp8 and spec(key).dtype in FP8_DTYPES and len(spec(key).shape) == 2:
                raise QuantizationError(
                    where(key), key, "is float8 under config.json's quant_method fp8, but has no "
                    f"{key + FP8_SCALE_SUFFIX!r}: its values cannot be scaled",
                )  # fmt: skip
    elif method == "mxfp4" and not mx:
        raise QuantizationError(
            where(keys[0]) if keys else "", "quantization_config",
            "config.json says quant_method mxfp4, but no '<name>_blocks' has a '<name>_scales' beside it",
        )  # fmt: skip
    return fp8, mx


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor, block: Sequence[int], at: Sequence[int] = (0, 0),
                   out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``weight`` (a float8 block of the whole weight starting at row / column ``at``) times its
    blocks' scales, in float32 (``out``: written there instead, in its dtype). ``scale``: the
    scale rows and columns covering the block, first one that of block ``(at[0] // br, at[1] //
    bc)``, any floating dtype (read as float32). ``ValueError`` when they do not cover the block.

    Bit-identical to torch's ``QuantizedHuggingFaceStorageReader`` and DeepSeek's
    ``weight_dequant``: each value is ``float32(w) * float32(s)``, one multiplication, then
    ``out``'s dtype. A float8 value is one of 256 codes, so each block's 256 products are
    computed once (that multiplication, then the conversion) and every element is looked up by
    its code: one gather, no float32 tensor of the weight's size (:func:`_gather_blocks`).
    """
    rows, cols = weight.shape
    br, bc = block
    need = ((at[0] + rows - 1) // br - at[0] // br + 1, (at[1] + cols - 1) // bc - at[1] // bc + 1) if rows and cols else (0, 0)
    if scale.dim() != 2 or scale.shape[0] < need[0] or scale.shape[1] < need[1]:
        raise ValueError(f"scales {tuple(scale.shape)} do not cover a ({rows}, {cols}) block at {tuple(at)} in "
                         f"{br}x{bc} blocks: {need} needed")  # fmt: skip
    if out is None:
        out = torch.empty(rows, cols, dtype=torch.float32)
    scale = scale.to(torch.float32)
    if out.dtype in _GATHER_VIEW and weight.element_size() == 1 and rows and cols:
        _gather_blocks(weight, scale, block, at, out)
        return out
    r0, c0 = at
    first_col, r = c0 // bc, 0
    while r < rows:  # other dtypes (complex targets): one band of scale rows at a time
        i = (r0 + r) // br - r0 // br
        h = min(rows - r, br - (r0 + r) % br)
        s_row = scale[i].repeat_interleave(bc)[c0 - first_col * bc : c0 - first_col * bc + cols]
        out[r : r + h] = weight[r : r + h].to(torch.float32) * s_row
        r += h
    return out


# Target dtypes looked up as bit patterns (numpy has no bfloat16): the integer of their size.
_GATHER_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _gather_blocks(weight: torch.Tensor, scale: torch.Tensor, block: Sequence[int], at: Sequence[int], out: torch.Tensor) -> None:
    """:func:`fp8_dequantize` by lookup: per band of rows sharing a scale row, a table of
    ``(blocks across, 256)`` values ``float32(code) * scale`` in ``out``'s dtype, and every
    element gathered from its block's row of it by ``code + 256 * block`` (numpy's ``take``)."""
    br, bc = block
    r0, c0 = at
    rows, cols = weight.shape
    codes = torch.arange(256, dtype=torch.uint8).view(weight.dtype).to(torch.float32)  # every float8 value
    first_col = c0 // bc
    n_blocks = (c0 + cols - 1) // bc - first_col + 1
    wide = np.uint16 if n_blocks * 256 <= 1 << 16 else np.uint32
    offsets = (((np.arange(cols) + c0) // bc - first_col) * 256).astype(wide)
    u = weight.contiguous().view(torch.uint8).numpy()
    view = _GATHER_VIEW[out.dtype]
    direct = out.is_contiguous()
    o = out.view(view).numpy() if direct else None
    r = 0
    while r < rows:
        i = (r0 + r) // br - r0 // br
        h = min(rows - r, br - (r0 + r) % br)
        table = (codes[None, :] * scale[i, :n_blocks, None]).to(out.dtype).view(view).reshape(-1).numpy()
        idx = u[r : r + h].astype(wide)
        idx += offsets
        if direct:
            np.take(table, idx, out=o[r : r + h], mode="wrap")
        else:
            out[r : r + h] = torch.from_numpy(np.take(table, idx, mode="wrap")).view(out.dtype)
        r += h


def fp8_scale_slices(block: Sequence[int], slices: Sequence[slice]) -> tuple[slice, slice]:
    """The scale rows and columns a block ``weight[slices]`` (two step-1 slices with bounds)
    needs."""
    (a, b), (c, d) = (slices[0].start, slices[0].stop), (slices[1].start, slices[1].stop)
    br, bc = block
    return slice(a // br, max(a // br, -(-b // br))), slice(c // bc, max(c // bc, -(-d // bc)))


def fp8_quantize(weight: torch.Tensor, block: Sequence[int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D floating-point weight as DeepSeek-V3's ``weight_quant`` / transformers' fine-grained
    FP8 store it: per ``br x bc`` block (edge blocks short) ``scale = amax(|w|) / 448`` in float32
    (1.0 for an all-zero block), ``q = float8_e4m3fn(w / scale)`` (``w`` read as float32).
    Returns ``(q, scale)``, ``q`` of the weight's shape, ``scale`` of :func:`scale_grid`'s. Round
    trip: ``fp8_dequantize(q, scale)`` is within float8_e4m3fn's rounding of ``w``: a relative
    error of at most 2**-4 for values at least 2**-6 times their block's amax / 448 (normal
    FP8), and below that an absolute error of at most 2**-10 times the block's scale."""
    rows, cols = weight.shape
    br, bc = block
    gr, gc = scale_grid(weight.shape, block)
    w = weight.to(torch.float32)
    pad = torch.zeros(gr * br, gc * bc, dtype=torch.float32)
    pad[:rows, :cols] = w
    tiles = pad.view(gr, br, gc, bc)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale.view(gr, 1, gc, 1)).view(gr * br, gc * bc)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 ``blocks`` ``uint8 [*prefix, G, B]`` with ``scales`` ``uint8 [*prefix, G]`` as a
    ``[*prefix, G * 2 B]`` tensor of ``dtype``: each byte's low nibble, then its high nibble,
    looked up in :data:`FP4_VALUES` (in ``dtype``), times ``2 ** (scale - 127)`` by
    ``torch.ldexp`` in place: the operations of torch's reader and of transformers'
    ``convert_moe_packed_tensors``, so the values are theirs bit for bit."""
    *prefix, g, b = blocks.shape
    if tuple(scales.shape) != (*prefix, g):
        raise ValueError(f"MXFP4 scales {tuple(scales.shape)} do not match blocks {tuple(blocks.shape)}")
    rows = math.prod(prefix) * g
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    blk = blocks.reshape(rows, b)
    exp = scales.reshape(rows, 1).to(torch.int32) - 127
    out = torch.empty(rows, b * 2, dtype=dtype)
    out[:, 0::2] = lut[(blk & 0x0F).to(torch.long)]
    out[:, 1::2] = lut[(blk >> 4).to(torch.long)]
    torch.ldexp(out, exp, out=out)
    return out.view(*prefix, g * b * 2)


def fp8_config_entry(block: Sequence[int] = DEFAULT_BLOCK) -> dict[str, Any]:
    """The ``quantization_config`` of a checkpoint :func:`fp8_quantize` wrote: transformers'
    ``FineGrainedFP8Config`` fields (``quant_method`` ``fp8``, dynamic activations, the block)."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [int(block[0]), int(block[1])]}


def without_quantization(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (a ``config.json`` document) without its ``quantization_config``."""
    return {k: v for k, v in config.items() if k != "quantization_config"}


__all__ = [
    "CONFIG_NAME", "DEFAULT_BLOCK", "FP4_VALUES", "FP8_DTYPES", "FP8_MAX", "Fp8Pair", "MxPair", "QuantizationConfig",
    "find_pairs", "fp8_config_entry", "fp8_dequantize", "fp8_quantize", "fp8_scale_slices", "mxfp4_dequantize",
    "read_quantization_config", "scale_grid", "without_quantization",
]  # fmt: skip
