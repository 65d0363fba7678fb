"""The one set of value and target checks, for every source (fqnckpt, HF, pickle, DCP).

Dtype conversions (by kind and by value range: :class:`LossyConversionError`), several stored
keys naming one tensor (:class:`TiedValuesMismatchError`), targets that cannot take an in-place
copy, and distinct targets sharing memory. Reads only.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    LoadError,
    OverlappingTargetsError,
    TiedValuesMismatchError,
    UnwritableTargetError,
)
from ..ranks import shards
from ..storage.reader import CheckpointReader
from fqn.registry import dtype_name

from .actions import CopyAction


def check_tied_values(reader, stored: list[str], path: str) -> None:
    """Several stored keys that name one target tensor (tied names, or spellings of one name)
    must hold equal values (read here, before anything is copied); otherwise one would silently
    overwrite the other.

    ``reader`` is anything with ``get(key)`` and ``file_of(key)`` (a checkpoint or a migration
    source). Raises :class:`TiedValuesMismatchError` (naming the keys and files) when shape,
    dtype or bytes differ.
    """
    if len(stored) < 2:
        return
    first = guarded_get(reader, stored[0])
    for other in stored[1:]:
        t = guarded_get(reader, other)
        # Bitwise, so NaNs stored twice compare equal.
        if not (t.shape == first.shape and t.dtype == first.dtype and _same_bits(t, first)):
            raise TiedValuesMismatchError([stored_key(reader, k) for k in stored], [reader.file_of(k) for k in stored], path)



def guarded_get(reader, key: str) -> torch.Tensor:
    """``reader.get(key)``, checked against the shape and dtype the header / metadata recorded
    (:func:`read_problem`), for every source and entry point (``load``, ``migrate``, ``verify``).

    Raises:
        LoadError: safetensors / torch / the OS fail to read it (names key and file).
        CorruptCheckpointError: it reads as another shape or dtype than recorded (names key and file).
    """
    try:
        t = reader.get(key)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. SafetensorError after the file changed
        raise LoadError(stored_key(reader, key), file_of_key(reader, key), f"{type(e).__name__}: {e}") from e
    why = read_problem(reader.spec(key), t)
    if why is not None:
        raise CorruptCheckpointError(file_of_key(reader, key), f"tensor {stored_key(reader, key)!r} {why}")
    return t


def read_problem(spec, t: torch.Tensor) -> str | None:
    """Why tensor ``t`` as read does not match ``spec`` (its recorded shape and dtype), or None."""
    if tuple(t.shape) != tuple(spec.shape) or t.dtype != spec.dtype:
        return f"reads as {tuple(t.shape)} {t.dtype}, recorded {tuple(spec.shape)} {spec.dtype}"
    return None



def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0:
        return True
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )



def _rank(dt: torch.dtype) -> int:
    """0 bool, 1 integer, 2 floating, 3 complex."""
    if dt == torch.bool:
        return 0
    if dt.is_complex:
        return 3
    return 2 if dt.is_floating_point else 1



def _range(dt: torch.dtype) -> tuple[float, float]:
    if dt.is_complex:
        dt = dt.to_real()
    info = torch.finfo(dt) if dt.is_floating_point else torch.iinfo(dt)
    return float(info.min), float(info.max)



# Dtypes torch has no conversion for (copy_ / to() raise NotImplementedError): loaded only into
# a target of the same dtype. float4_e2m1fn_x2 packs two FP4 values per byte (safetensors F4).
_NO_CAST = frozenset(d for d in (getattr(torch, "float4_e2m1fn_x2", None),) if d is not None)


def cast_problem(src: torch.dtype, dst: torch.dtype) -> str | None:
    """Why torch cannot convert ``src`` to ``dst`` at all (``allow_lossy`` cannot help), or None."""
    if src != dst and (src in _NO_CAST or dst in _NO_CAST):
        return (f"is {dtype_name(src)}, the target is {dtype_name(dst)}: torch has no conversion between them "
                "(float4_e2m1fn_x2 holds two packed FP4 values); load it into a target of the stored dtype")  # fmt: skip
    return None


def conversion_kind_problem(src: torch.dtype, dst: torch.dtype) -> str | None:
    """Why converting ``src`` to ``dst`` always loses information (a different kind of number),
    or None. Value-dependent losses are :func:`needs_value_check`."""
    rs, rd = _rank(src), _rank(dst)
    if rs == 3 and rd < 3:
        return "complex to real drops the imaginary part"
    if rs == 2 and rd < 2:
        return f"floating point to {'bool' if rd == 0 else 'integer'} drops the fraction"
    if rs == 1 and rd == 0:
        return "integer to bool keeps only zero / non-zero"
    return None



def needs_value_check(src: torch.dtype, dst: torch.dtype) -> bool:
    """True when some values of ``src`` are out of ``dst``'s range (e.g. float32 -> float16,
    int64 -> int32, int32 -> uint8): the stored values are then read and checked before copying.
    Rounding within range (float32 -> bfloat16, int64 -> float32) is not a loss of range."""
    if src == dst or src == torch.bool or conversion_kind_problem(src, dst):
        return False
    lo_s, hi_s = _range(src)
    lo_d, hi_d = _range(dst)
    return lo_s < lo_d or hi_s > hi_d



def value_problem(src: torch.Tensor, dst: torch.dtype) -> str | None:
    """The first stored value that ``dst`` cannot represent (overflow to inf / nan, integer out of
    range), or None."""
    conv = src.to(dst)
    if dst.is_floating_point or dst.is_complex:
        bad = (
            torch.isfinite(src) & ~torch.isfinite(conv)
            if src.is_floating_point() or src.is_complex()
            else ~torch.isfinite(conv)
        )
    elif not (src.is_floating_point() or src.is_complex()) and src.dtype != torch.bool:
        # Compare with the target's bounds: a round trip cannot see int8 <-> uint8 wrapping.
        info = torch.iinfo(dst)
        wide = src.to(torch.int64)
        bad = (wide < info.min) | (wide > info.max)
    else:
        bad = conv.to(src.dtype) != src
    if not bool(bad.any()):
        return None
    i = int(bad.reshape(-1).nonzero()[0])
    return f"value {src.reshape(-1)[i].item()!r} at flat index {i} is out of range"



def local_shard(t: torch.Tensor) -> torch.Tensor:
    # The local shard itself, what to_local() returns under no_grad: to_local() with grad enabled
    # is an autograd Function call (~0.1-0.4 ms), paid three times per DTensor while planning.
    return t._local_tensor if isinstance(t, DTensor) else t



def target_problem(local: torch.Tensor, inference_mode: bool) -> str | None:
    """Why torch would refuse, or carry out wrongly, an in-place copy into ``local`` (a target, or
    a DTensor target's local shard), or None; ``inference_mode``: ``torch.is_inference_mode_enabled()``,
    asked once per load by the caller. Meta tensors are handled apart (:class:`MetaTargetError`).
    Leaves that require grad are fine: the copies run under ``torch.no_grad()``."""
    if local.layout != torch.strided:
        return f"layout {local.layout} (only strided tensors are loaded in place)"
    if not inference_mode and local.is_inference():
        return (
            "it is an inference tensor (made under torch.inference_mode()); load inside "
            "torch.inference_mode() or build the model outside it"
        )
    if not local.is_contiguous() and local.numel() > 1 and _has_internal_overlap(local):
        return (
            f"several of its elements share memory (strides {tuple(local.stride())}, e.g. an expand()ed "
            "tensor); make it contiguous (.clone()) or load with assign=True"
        )
    return None



def _has_internal_overlap(t: torch.Tensor) -> bool:
    """Two elements of ``t`` share memory. torch answers Yes / No / TooHard
    (``_debug_has_internal_overlap``) and copies into TooHard views (e.g. ``as_strided`` with
    overlapping strides) silently, last write wins; those are counted exactly here (O(numel),
    only for non-dense views)."""
    status = torch._debug_has_internal_overlap(t)
    if status != 2:  # 0 No, 1 Yes
        return status == 1
    # Dims sorted by stride: when each stride passes the span of all smaller-stride dims, no two
    # elements meet (O(ndim); a strided view like x[::2] is TooHard for torch and took seconds
    # per 10^7 elements through the exact count below).
    reach = 0
    dims = sorted(((st, n) for n, st in zip(t.shape, t.stride()) if n > 1))
    for st, n in dims:
        if st <= reach:
            break
        reach += (n - 1) * st
    else:
        return False
    offsets = torch.zeros((), dtype=torch.int64)
    for n, s in zip(t.shape, t.stride()):
        offsets = (offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * s).reshape(-1)
    return int(torch.unique(offsets).numel()) < t.numel()



def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last+1) byte offsets of ``t``'s elements within its storage."""
    lo = hi = t.storage_offset()
    for n, s in zip(t.shape, t.stride()):
        if s > 0:
            hi += (n - 1) * s
        else:
            lo += (n - 1) * s
    return lo * t.element_size(), (hi + 1) * t.element_size()



def target_span(local: torch.Tensor, i: int) -> tuple[int, int, int, object] | None:
    """``(first byte address, end address, i, device or None for CPU)`` of the strided, non-meta
    local tensor ``local`` (copy number ``i``), or None when it holds no bytes. Taken while the
    plan walks its targets (one pass over 10^4-10^5 tensors fewer)."""
    if local.is_contiguous():  # the common case: no stride walk
        n = local.nbytes
        if not n:
            return None
        lo = local.data_ptr()
        return lo, lo + n, i, None if local.is_cpu else local.device
    if not local.numel():
        return None
    base = local.data_ptr() - local.storage_offset() * local.element_size()
    lo, hi = _byte_span(local)
    return base + lo, base + hi, i, None if local.is_cpu else local.device


def overlap_clusters(copies: list[CopyAction], spans: list[tuple[int, int, int, object]]) -> list[list[CopyAction]]:
    """Groups of in-place copy targets whose bytes intersect in memory (distinct entries: exact
    aliases are one entry), in address order; ``spans``: :func:`target_span` of the copies to
    check. Swept by address per device, so views made through different storage objects of one
    buffer (``torch.from_numpy(t.numpy()[2:])``) are found too, and no target is asked for its
    storage (that and its device cost microseconds for each of 10^4-10^5 targets)."""
    cpu: list[tuple[int, int, int, object]] = []
    by_device: dict[object, list[tuple[int, int, int, object]]] = {}
    for span in spans:
        if span[3] is None:
            cpu.append(span)
        else:
            by_device.setdefault(span[3], []).append(span)
    clusters: list[list[CopyAction]] = []
    for group in (cpu, *by_device.values()):
        if len(group) < 2:
            continue
        group.sort(key=lambda s: (s[0], s[1]))
        cur: list[int] = []
        cur_end = -1
        for lo, hi, i, _ in group:
            if cur and lo < cur_end:
                cur.append(i)
                cur_end = max(cur_end, hi)
                continue
            if len(cur) > 1:
                clusters.append([copies[j] for j in cur])
            cur, cur_end = [i], hi
        if len(cur) > 1:
            clusters.append([copies[j] for j in cur])
    return clusters


def check_overlaps(cluster: list[CopyAction], read, path: str) -> None:
    """Targets sharing memory: apply their copies, in order, to scratch memory laid out like the
    cluster's address range (each target's view at its own byte offset, strides, dtype and
    conjugate / negative bits); every target must then read back its own checkpoint value, else
    one overwrote another. Raises :class:`OverlappingTargetsError` naming them."""
    targets = [local_shard(a.entry.tensor) for a in cluster]
    spans = [target_span(t, 0) for t in targets]
    lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
    lo -= lo % 64  # every target's offset from here is a multiple of its element size
    for a, t in zip(cluster, targets):
        if (t.data_ptr() - lo) % t.element_size():  # e.g. np.frombuffer(..., offset=1) under torch.from_numpy
            others = [b.entry.fqn for b in cluster if b is not a]
            raise UnwritableTargetError(
                a.entry.fqn, path, f"it shares memory with {others} at an address that is not a multiple of its "
                "element size, so which values win cannot be checked; load into separate tensors",
            )  # fmt: skip
    scratch = torch.empty(hi - lo, dtype=torch.uint8, device=targets[0].device).untyped_storage()
    views = []
    for a, t in zip(cluster, targets):
        v = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            scratch, (t.data_ptr() - lo) // t.element_size(), t.shape, t.stride()
        )
        if t.is_neg():  # set_ keeps neither bit: copy_ into such a view writes -src / conj(src)
            v = v._neg_view()
        if t.is_conj():
            v = v.conj()
        src = read(a).to(t.dtype)
        v.copy_(src)
        views.append((a, v, src))
    for a, v, src in views:
        if not _same_bits(v.resolve_conj().resolve_neg(), src.to(v.device)):
            others = [b.entry.fqn for b in cluster if b is not a]
            raise OverlappingTargetsError([a.entry.fqn, *others], path)



def stored_key(reader: Any, key: str) -> str:
    """``key`` as the checkpoint stores it, for errors: a DCP source's key with its container
    (``model.layers.0.weight``, :meth:`checkpoint.sources.base.Source.stored_key`), else ``key``."""
    named = getattr(reader, "stored_key", None)
    return named(key) if named is not None else key


def file_of_key(reader: CheckpointReader, key: str) -> str:
    """Path of the file holding ``key``, for messages."""
    path = getattr(reader, "path", None)  # a migration Source: path is the file or the directory
    if path is not None and not os.path.isdir(path):
        return str(path)
    return os.path.join(str(path) if path is not None else getattr(reader, "root", ""), reader.file_of(key))



def read_target_block(reader: CheckpointReader, key: str, t: torch.Tensor) -> torch.Tensor:
    """The block of ``key`` that target ``t`` holds on this rank (all of it for a plain tensor).

    Raises:
        LoadError: safetensors / torch / the OS fail to read it (names key and file).
    """
    block = getattr(reader, "read_block", None)  # prefetched by the source (DCP)
    if block is not None and (b := block(key, t)) is not None:
        return b
    try:
        if isinstance(t, DTensor) and t.dim():
            # Each rank reads only its blocks, whatever the placements (several for _StridedShard).
            return shards.read_local(reader, key, t)
        return guarded_get(reader, key)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. SafetensorError after the file changed
        raise LoadError(stored_key(reader, key), file_of_key(reader, key), f"{type(e).__name__}: {e}") from e
