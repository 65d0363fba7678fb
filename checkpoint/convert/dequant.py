"""Quantized checkpoints (FP8 blocks, MXFP4: :mod:`.quant`) as the reader ``load`` plans against:
each quantized weight whose target is floating point of another dtype is presented as the
float32 tensor it stands for, its scales folded into it (not keys of their own); every other key
is the checkpoint's own, bytes as stored (an FP8 target receives its weight and scales as they
are).

Which view a weight takes is decided by the targets: :func:`dequantizing_reader` matches the
checkpoint's names against them once (:func:`checkpoint.plan.names.match_stored`, every spelling
``load`` accepts), with MXFP4 tensors offered under both names their references use (torch's
reader: ``X_blocks``, ``[*prefix, G * 2 B]``; transformers' gpt-oss: ``X``, dims 1 and 2 swapped).
A block of a weight (a rank's shard) is read as the rows and columns of FP8 values and the scale
blocks that cover it, nothing more, and dequantized there.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ..storage.layout import TensorSpec
from .quant import (
    FP8_SCALE_SUFFIX,
    MX_SCALES,
    Fp8Pair,
    MxPair,
    find_pairs,
    fp8_dequantize,
    fp8_scale_slices,
    mxfp4_dequantize,
    read_quantization_config,
)


def _bounds(slices: Sequence[slice], shape: Sequence[int]) -> list[slice] | None:
    """``slices`` (padded to ``shape``'s dims) as step-1 slices with bounds, or None for a step."""
    out = []
    for d, n in enumerate(shape):
        s = slices[d] if d < len(slices) else slice(None)
        a, b, step = s.indices(n)
        if step != 1:
            return None
        out.append(slice(a, max(a, b)))
    return out


class DequantizingReader:
    """The reader of ``load`` over a quantized checkpoint (see the module docstring): ``fp8`` maps
    each presented FP8 weight to its pair, ``mx`` each presented MXFP4 name to ``(pair,
    transformers layout)``; ``hidden`` keys (scales folded into their weight, blocks presented
    under another name) are not among :meth:`keys`. Everything else goes to ``inner``."""

    def __init__(self, inner: Any, fp8: dict[str, Fp8Pair], mx: dict[str, tuple[MxPair, bool]], hidden: set[str]):
        self.inner = inner
        self.fp8 = fp8
        self.mx = mx
        self.hidden = hidden
        self._specs: dict[str, TensorSpec] = {k: TensorSpec(k, p.shape, torch.float32) for k, p in fp8.items()}
        self._specs.update({k: TensorSpec(k, p.dequantized_shape(t), torch.float32) for k, (p, t) in mx.items()})
        self._keys = sorted({k for k in inner.keys() if k not in hidden} | set(self._specs))

    def __getattr__(self, name: str) -> Any:  # root, files, meta, index_path, open_part, ...
        if name in ("prefetch", "read_block"):  # sources read collectively are not wrapped
            raise AttributeError(name)
        return getattr(self.__dict__["inner"], name)

    def dequantized(self, key: str) -> str | None:
        """What ``key`` is dequantized from (``"fp8 128x128 blocks, scales <key>"``), or None."""
        p = self.fp8.get(key)
        if p is not None:
            return f"fp8 {p.block[0]}x{p.block[1]} blocks, scales {p.scale}"
        m = self.mx.get(key)
        if m is not None:
            layout = "transformers' layout" if m[1] else "torch's layout"
            return f"mxfp4 {m[0].blocks} with scales {m[0].scales}, {layout}"
        return None

    # -- the reader interface -----------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._specs or (key not in self.hidden and key in self.inner)

    def spec(self, key: str):
        s = self._specs.get(key)
        return s if s is not None else self.inner.spec(self._raw(key))

    def _raw(self, key: str) -> str:
        if key in self.hidden:
            raise KeyError(f"{key!r} is folded into its dequantized weight")
        return key

    def _source(self, key: str) -> str:
        """The stored tensor a presented key is read from."""
        m = self.mx.get(key)
        return m[0].blocks if m is not None else key

    def file_of(self, key: str) -> str:
        return self.inner.file_of(self._source(key))

    def stored_key(self, key: str) -> str:
        named = getattr(self.inner, "stored_key", None)
        src = self._source(key)
        return named(src) if named is not None else src

    def get(self, key: str) -> torch.Tensor:
        if key in self._specs:
            return self.get_slice(key, ())
        return self.inner.get(self._raw(key))

    def get_slice(self, key: str, slices: Sequence[slice]) -> torch.Tensor:
        """Block ``tensor[slices]``: a dequantized one from only the FP8 rows and columns (or
        MXFP4 groups) and scales it covers, in float32."""
        spec = self._specs.get(key)
        if spec is None:
            return self.inner.get_slice(self._raw(key), slices)
        sl = _bounds(tuple(slices), spec.shape)
        if sl is None:  # a stepped slice: the block of steps, cut from its bounding block
            return self.get(key)[tuple(slices)]
        out = torch.empty(tuple(s.stop - s.start for s in sl), dtype=torch.float32)
        self._block_into(key, sl, out)
        return out

    def copy_into(self, key: str, out: torch.Tensor, slices: Sequence[slice] | None = None, check: bool = False) -> bool:
        """Block ``tensor[slices]`` (all of it without) into CPU tensor ``out`` of any dtype:
        dequantized straight into it (no float32 tensor of its size); other keys through the
        inner reader's ``copy_into``. False when ``out`` is not on the CPU or the reader cannot."""
        spec = self._specs.get(key)
        if spec is None:
            copy = getattr(self.inner, "copy_into", None)
            return copy is not None and copy(self._raw(key), out, slices, check=check)
        p = self.fp8.get(key)
        if p is not None and out.dtype == self.inner.spec(p.weight).dtype:  # an FP8 target: the stored bytes
            copy = getattr(self.inner, "copy_into", None)
            return copy is not None and copy(p.weight, out, slices, check=check)
        sl = _bounds(tuple(slices) if slices is not None else (), spec.shape)
        if not out.is_cpu or sl is None or not (out.is_floating_point() or out.is_complex()):
            return False
        if tuple(out.shape) != tuple(s.stop - s.start for s in sl):
            return False
        if out.numel():
            self._block_into(key, sl, out)
        return True

    def fits(self, key: str, dtype: torch.dtype) -> bool:
        """Whether every dequantized value of ``key`` is within ``dtype``'s range, from its scales
        alone (a bound: the largest stored magnitude, 448 for float8_e4m3fn and 6 for FP4, times
        the largest scale); False for stored keys or when the bound does not prove it (the
        values are then read and checked)."""
        if key not in self._specs or not dtype.is_floating_point:
            return False
        p = self.fp8.get(key)
        if p is not None:
            top = torch.finfo(self.inner.spec(p.weight).dtype).max * float(self.inner.get(p.scale).abs().max())
        else:
            pair = self.mx[key][0]
            top = 6.0 * 2.0 ** (int(self.inner.get(pair.scales).max()) - 127)
        return top <= torch.finfo(dtype).max

    def read_into(self, key: str, t: torch.Tensor) -> bool:
        return False if key in self._specs else self.inner.read_into(self._raw(key), t)

    def read_many(self, pairs: Sequence[tuple], check: Any = True) -> list[bool]:
        """The inner reader's ``read_many`` for stored keys; False for the dequantized ones (they
        are copied by :meth:`copy_into`)."""
        many = getattr(self.inner, "read_many", None)
        done = [False] * len(pairs)
        plain = [i for i, p in enumerate(pairs) if p[0] not in self._specs]
        if many is not None and plain:
            for i, ok in zip(plain, many([pairs[i] for i in plain], check)):
                done[i] = ok
        return done

    def _stored(self, keys: Iterable[str]) -> list[str]:
        """The stored tensors behind presented ``keys`` (a dequantized weight's pair)."""
        raw: list[str] = []
        for k in keys:
            p = self.fp8.get(k)
            m = self.mx.get(k)
            raw += [p.weight, p.scale] if p is not None else [m[0].blocks, m[0].scales] if m is not None else [k]
        return raw

    def check_first(self, keys: Iterable[str] = (), rows: Mapping[str, Sequence[tuple[int, int]]] | None = None) -> dict:
        """The inner reader's ``check_first`` over the stored tensors behind ``keys``; a
        dequantized weight's row ranges are in dequantized bytes, so its stored pair is checked
        whole (every rank holding rows of it), other ``rows`` as the inner reader checks them."""
        check = getattr(self.inner, "check_first", None)
        if check is None:
            return {}
        rows = rows or {}
        whole = self._stored(list(keys) + [k for k in rows if k in self._specs])
        return check(whole, {k: r for k, r in rows.items() if k not in self._specs})

    def expect(self, keys: Sequence[str]) -> None:
        """Read-ahead hint of an object-store reader, for the stored tensors behind ``keys``."""
        hint = getattr(self.inner, "expect", None)
        if hint is not None:
            hint(self._stored(keys))

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> DequantizingReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- dequantizing -------------------------------------------------------------------------
    def _read(self, key: str, slices: Sequence[slice]) -> torch.Tensor:
        """Stored block ``key[slices]`` (the whole tensor through ``get``: checked against the
        index's digest where it records one)."""
        shape = self.inner.spec(key).shape
        if all(s.start == 0 and s.stop == n for s, n in zip(slices, shape)):
            return self.inner.get(key)
        return self.inner.get_slice(key, tuple(slices))

    def _block_into(self, key: str, sl: list[slice], out: torch.Tensor) -> None:
        p = self.fp8.get(key)
        if p is not None:
            ss = fp8_scale_slices(p.block, sl)
            fp8_dequantize(self._read(p.weight, sl), self._read(p.scale, ss), p.block, (sl[0].start, sl[1].start), out)
            return
        pair, transformers = self.mx[key]
        *prefix, _, b = pair.shape
        per = 2 * b
        if transformers:  # [E, N, R, ...] of blocks [E, R, ..., G, B]
            sl = [sl[0], sl[2], *sl[3:], sl[1]]
        a, e = sl[-1].start, sl[-1].stop
        g0, g1 = a // per, max(a // per, -(-e // per))
        groups = (*sl[:-1], slice(g0, g1))
        dtype = out.dtype if out.is_floating_point() else torch.float32
        val = mxfp4_dequantize(self._read(pair.blocks, (*groups, slice(0, b))), self._read(pair.scales, groups), dtype)
        val = val[..., a - g0 * per : e - g0 * per]
        out.copy_(val.transpose(1, 2) if transformers else val)


def dequantized_view(reader: Any) -> Any:
    """``reader`` with every quantized weight presented dequantized in float32, as torch's
    ``QuantizedHuggingFaceStorageReader`` describes them (FP8 weights under their name; MXFP4
    under ``X_blocks``, ``[*prefix, G * 2 B]``), the scales still keys of their own (a state_dict
    may load them); ``reader`` itself when it holds none. :meth:`DequantizingReader.copy_into`
    gives an FP8 target of an FP8 weight its stored bytes. For DCP's ``StorageReader``, which
    describes the checkpoint before it sees the targets.

    Raises:
        QuantizationError: as :func:`dequantizing_reader`.
    """
    pairs = _quantized_pairs(reader)
    if pairs is None:
        return reader
    fp8, mx = pairs
    return DequantizingReader(reader, fp8, {k: (p, False) for k, p in mx.items()}, set())


def _quantized_pairs(reader: Any) -> tuple[dict, dict] | None:
    """``(fp8, mx)`` (:func:`~.quant.find_pairs`) of the quantized weights ``reader`` holds, with
    the ``config.json`` beside it; None when it holds none (no config saying so, no scale keys).

    Raises:
        QuantizationError: see :func:`~.quant.find_pairs`."""
    root = getattr(reader, "root", None)
    config = read_quantization_config(root if isinstance(root, str) else None)
    keys = reader.keys()
    if config is None and not any(k.endswith((FP8_SCALE_SUFFIX, MX_SCALES)) for k in keys):
        return None
    fp8, mx = find_pairs(keys, reader.spec, config, _where(reader))
    return (fp8, mx) if fp8 or mx else None


def _where(reader: Any):
    root = getattr(reader, "root", None)

    def where(key: str) -> str:
        try:
            return os.path.join(str(root), reader.file_of(key))
        except Exception:  # noqa: BLE001 - a name for a message only
            return str(root)

    return where


def dequantizing_reader(reader: Any, state: Any, model: Any, path: str, dtype: torch.dtype | None = None) -> Any:
    """``reader``, or a :class:`DequantizingReader` over it when it holds quantized weights
    (:func:`~.quant.find_pairs`) that targets of ``state`` (``object_state`` of the load's
    object; ``model`` the module or None) take in another floating-point dtype (with ``dtype``,
    ``load``'s: the dtype the floating-point targets will have). Sources read collectively (DCP,
    ``prefetch``) are returned as they are.

    Raises:
        QuantizationError: see :func:`~.quant.find_pairs` (a scale grid not covering its weight,
            a config disagreeing with the tensors), naming tensor and file.
    """
    if getattr(reader, "prefetch", None) is not None or getattr(reader, "read_block", None) is not None:
        return reader
    pairs = _quantized_pairs(reader)
    if pairs is None:
        return reader
    fp8, mx = pairs
    from ..plan.names import match_stored  # plan depends on storage only; imported here, no cycle

    # Every way a target may take these tensors: raw names, and MXFP4 in transformers' layout.
    offer = {p.name: (p, True) for p in mx.values() if len(p.shape) == 4 and p.name not in reader}
    offered = DequantizingReader(reader, {}, offer, set())
    _report, pairs = match_stored(offered, state, model, path)

    def target_dtype(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and (t.is_floating_point() or t.is_complex()) else t.dtype

    taken = {key: target_dtype(e.tensor) for e, key in pairs}
    use_fp8: dict[str, Fp8Pair] = {}
    use_mx: dict[str, tuple[MxPair, bool]] = {}
    hidden: set[str] = set()
    for w, p in fp8.items():
        td = taken.get(w)
        if td is not None and td.is_floating_point and td != reader.spec(w).dtype:
            use_fp8[w] = p
            if p.scale not in taken:
                hidden.add(p.scale)
    for k, p in mx.items():
        td = taken.get(p.name) if p.name in offer else None
        if td is not None and td.is_floating_point:
            use_mx[p.name] = (p, True)
            hidden.add(k)
        elif (td := taken.get(k)) is not None and td.is_floating_point:
            use_mx[k] = (p, False)
        else:
            continue
        if p.scales not in taken:
            hidden.add(p.scales)
    if not use_fp8 and not use_mx:
        return reader
    return DequantizingReader(reader, use_fp8, use_mx, hidden)


__all__ = ["DequantizingReader", "dequantized_view", "dequantizing_reader"]
