"""``load``: a checkpoint into an eager, wrapped or parallel module (any mesh / placements).

Two phases, so that a rejected load changes nothing. :func:`plan_load` makes every check (index
and headers, names, shapes, dtype conversions, whether each target can take the copy, tied and
overlapping targets, the optimizer state) and returns a :class:`LoadPlan`: the copy actions and
the optimizer state to install. :func:`apply_load` then only reads and writes. Each rank reads only
the slices of its local shards (``safe_open(...).get_slice``), so loading reshards.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fqn import canonical_fqn
from fqn.registry import dtype_name

from .atomic import read_view
from .errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    LoadError,
    LossyConversionError,
    MetaTargetError,
    OverlappingTargetsError,
    TiedValuesMismatchError,
    UnwritableTargetError,
)
from .progress import copy_progress
from .ranks import dist, shards
from .reports import DtypeConversion, LoadReport, ShapeMismatch
from .state import Entry, ModuleState, object_state
from .storage.format import OPTIMIZER_PREFIX, index_name
from .storage.reader import CheckpointReader, open_checkpoint


@dataclass
class CopyAction:
    """Fill target ``entry`` from checkpoint tensor ``key``; the target has dtype ``dtype`` when
    written (after ``load(dtype=...)``). ``assign``: replace the target instead of copying into it."""

    entry: Entry
    key: str
    dtype: torch.dtype
    assign: bool = False
    stored_dtype: torch.dtype | None = None  # dtype of ``key`` in the checkpoint


@dataclass
class LoadPlan:
    """Everything :func:`apply_load` does, decided and checked by :func:`plan_load`."""

    report: LoadReport
    copies: list[CopyAction] = field(default_factory=list)
    optimizer_state: dict[str, Any] | None = None


# -- names ---------------------------------------------------------------------------------------


def _match(reader: CheckpointReader, state: ModuleState, model: torch.nn.Module | None, path: str):
    """Checkpoint keys per target entry: (report, [(entry, key)]).

    A key stored under a name of the entry (or a spelling of it that the *model* resolves, e.g.
    ``_orig_mod.weight`` where the model says ``_orig_mod`` is a wrapper) fills it; when several
    do, their values must be equal (:func:`check_tied_values`). Only when none does, a stored key
    whose index alias group names the entry fills it (an alias group never overrides stored values).
    Linear in the number of keys and entries.
    """
    by_name = state.by_name()
    report = LoadReport(path=path)
    groups = {g[0]: g for g in reader.alias_groups}
    direct: dict[int, list[str]] = {}
    via_group: dict[int, str] = {}
    unknown: list[str] = []
    ignorable: set[str] = set()
    for key in reader.keys():
        found = False
        e = by_name.get(key)
        if e is None and model is not None:
            canon = canonical_fqn(key, model)
            e = by_name.get(canon)
            if canon in state.non_persistent:
                ignorable.add(key)
        if e is not None:
            direct.setdefault(id(e), []).append(key)
            found = True
        for n in groups.get(key, ())[1:]:
            g = by_name.get(n)
            if g is not None:
                via_group.setdefault(id(g), key)
                found = True
        if not found:
            unknown.append(key)
    pairs: list[tuple[Entry, str]] = []
    for e in state.entries:
        keys = direct.get(id(e))
        if keys:
            order = {n: i for i, n in enumerate(e.names)}
            keys.sort(key=lambda k: (order.get(k, len(order)), k))  # the entry's own names first
            check_tied_values(reader, keys, path)
            key = keys[0]
        else:
            key = via_group.get(id(e))
        if key is None:
            report.missing_keys.append(e.fqn)
            continue
        if key != e.fqn:
            report.filled_from[e.fqn] = key
        pairs.append((e, key))
    for key in unknown:
        ignore = key in state.non_persistent or key in ignorable
        (report.ignorable_keys if ignore else report.unexpected_keys).append(key)
    return report, pairs


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
            raise TiedValuesMismatchError(stored, [reader.file_of(k) for k in stored], path)


def guarded_get(reader, key: str) -> torch.Tensor:
    """``reader.get(key)``; a failure of safetensors / torch / the OS becomes a :class:`LoadError`
    naming the key and its file."""
    try:
        return reader.get(key)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. SafetensorError after the file changed
        root = getattr(reader, "root", "")
        raise LoadError(key, os.path.join(root, reader.file_of(key)), f"{type(e).__name__}: {e}") from e


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0:
        return True
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


# -- dtype conversions ---------------------------------------------------------------------------


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


# -- targets -------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def target_problem(t: torch.Tensor) -> str | None:
    """Why torch would refuse, or carry out wrongly, an in-place copy into ``t``, or None. Meta
    tensors are handled apart (:class:`MetaTargetError`). Leaves that require grad are fine: the
    copies run under ``torch.no_grad()``."""
    local = _local(t)
    if local.layout != torch.strided:
        return f"layout {local.layout} (only strided tensors are loaded in place)"
    if local.is_inference() and not torch.is_inference_mode_enabled():
        return (
            "it is an inference tensor (made under torch.inference_mode()); load inside "
            "torch.inference_mode() or build the model outside it"
        )
    if local.numel() > 1 and _has_internal_overlap(local):
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


def _overlap_clusters(copies: list[CopyAction]) -> list[list[CopyAction]]:
    """Groups of in-place copy targets whose byte spans in one storage intersect (distinct
    entries: exact aliases are one entry). Sort and sweep: O(n log n)."""
    spans = []
    for a in copies:
        t = _local(a.entry.tensor)
        if a.assign or t.numel() == 0 or t.is_meta or t.layout != torch.strided:
            continue
        us = t.untyped_storage()
        spans.append(((t.device.type, t.device.index, us.data_ptr()), *_byte_span(t), a))
    spans.sort(key=lambda s: (s[0], s[1], s[2]))
    clusters: list[list[CopyAction]] = []
    cur: list[CopyAction] = []
    cur_store, cur_end = None, -1
    for store, lo, hi, a in spans:
        if store == cur_store and lo < cur_end:
            cur.append(a)
            cur_end = max(cur_end, hi)
            continue
        if len(cur) > 1:
            clusters.append(cur)
        cur, cur_store, cur_end = [a], store, hi
    if len(cur) > 1:
        clusters.append(cur)
    return clusters


def _check_overlaps(cluster: list[CopyAction], read, path: str) -> None:
    """Targets sharing memory: apply their copies, in order, to a scratch copy of the storage;
    every target must then read back its own checkpoint value, else one overwrote another."""
    base = _local(cluster[0].entry.tensor)
    scratch = base.untyped_storage().clone()
    views = []
    for a in cluster:
        t = _local(a.entry.tensor)
        v = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            scratch, t.storage_offset(), t.shape, t.stride()
        )
        src = read(a).to(t.dtype)
        v.copy_(src)
        views.append((a, v, src))
    for a, v, src in views:
        if not _same_bits(v.contiguous(), src.to(v.device).contiguous()):
            others = [b.entry.fqn for b in cluster if b is not a]
            raise OverlappingTargetsError([a.entry.fqn, *others], path)


def _owner_slot(model: torch.nn.Module, name: str):
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if attr in owner._parameters:
        return owner, "_parameters", attr
    if attr in owner._buffers:
        return owner, "_buffers", attr
    raise AttributeError(f"{name!r} is neither a parameter nor a buffer of its module")


# -- plan ----------------------------------------------------------------------------------------


def _file(reader: CheckpointReader, key: str) -> str:
    """Path of the file holding ``key``, for messages."""
    return os.path.join(reader.root, reader.file_of(key))


def _read_target_block(reader: CheckpointReader, key: str, t: torch.Tensor) -> torch.Tensor:
    """The block of ``key`` that target ``t`` holds on this rank (all of it for a plain tensor).

    Raises:
        LoadError: safetensors / torch / the OS fail to read it (names key and file).
    """
    try:
        if isinstance(t, DTensor) and t.dim():
            # Each rank reads only its blocks, whatever the placements (several for _StridedShard).
            return shards.read_local(reader, key, t)
        return reader.get(key)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. SafetensorError after the file changed
        raise LoadError(key, _file(reader, key), f"{type(e).__name__}: {e}") from e


def plan_load(
    obj: torch.nn.Module | Mapping[str, torch.Tensor],
    reader: CheckpointReader,
    path: str,
    *,
    strict: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
    dtype: torch.dtype | None = None,
    assign: bool = False,
    allow_lossy: bool = False,
    verify: bool = False,
    state: ModuleState | None = None,
) -> LoadPlan:
    """Every check of :func:`load`, reading only (headers, and tensor data where a check needs
    values: duplicate spellings, range-narrowing conversions, targets sharing memory, optimizer
    state). Changes nothing. ``state``: ``object_state(obj)`` if the caller has it already.
    Raises what :func:`load` raises."""
    state = state if state is not None else object_state(obj)
    model = obj if isinstance(obj, torch.nn.Module) else None
    if verify:
        reader.check_index_digest()
        for name in reader.files:
            reader.verify_file(name)
    report, pairs = _match(reader, state, model, path)
    copies: list[CopyAction] = []
    meta: list[str] = []
    for e, key in pairs:
        spec = reader.spec(key)
        t = e.tensor
        if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
            raise UnwritableTargetError(
                e.fqn,
                path,
                "it is an uninitialized lazy parameter / buffer (no shape yet): run one forward pass first",
            )
        if spec.shape != tuple(t.shape):
            report.shape_mismatched.append(
                ShapeMismatch(key=e.fqn, checkpoint_shape=list(spec.shape), target_shape=list(t.shape))
            )
            continue
        target = dtype if dtype is not None and (t.is_floating_point() or t.is_complex()) else t.dtype
        if spec.dtype != target:
            why = conversion_kind_problem(spec.dtype, target)
            if why and not allow_lossy:
                raise LossyConversionError(
                    key, _file(reader, key), dtype_name(spec.dtype), dtype_name(target), why
                )
            report.dtype_converted.append(
                DtypeConversion(
                    key=e.fqn, checkpoint_dtype=dtype_name(spec.dtype), target_dtype=dtype_name(target)
                )
            )
        if assign:
            if isinstance(t, DTensor):
                raise UnwritableTargetError(e.fqn, path, "assign=True does not replace DTensor targets")
            if model is not None:
                for n in e.module_names:
                    _owner_slot(model, n)
            elif not isinstance(obj, MutableMapping):
                raise TypeError(f"assign=True needs a mutable state_dict, got {type(obj).__name__}")
        elif _local(t).is_meta:
            meta.append(e.fqn)
        elif target == t.dtype or not isinstance(obj, torch.nn.Module):  # else module.to makes a new tensor
            why = target_problem(t)
            if why:
                raise UnwritableTargetError(e.fqn, path, why)
        elif _local(t).is_inference() and not torch.is_inference_mode_enabled():
            raise UnwritableTargetError(e.fqn, path, target_problem(t))
        copies.append(CopyAction(e, key, target, assign, spec.dtype))
        report.loaded_keys.append(e.fqn)
    for name in ("missing_keys", "unexpected_keys", "ignorable_keys", "loaded_keys"):
        getattr(report, name).sort()
    if strict and not report.ok:
        raise CheckpointMismatchError(report, path)
    if meta:
        raise MetaTargetError(meta, path)

    def read(a: CopyAction) -> torch.Tensor:
        return _read_target_block(reader, a.key, a.entry.tensor)

    for a in copies:
        if not allow_lossy and needs_value_check(a.stored_dtype, a.dtype):
            why = value_problem(read(a), a.dtype)
            if why:
                raise LossyConversionError(
                    a.key, _file(reader, a.key), dtype_name(a.stored_dtype), dtype_name(a.dtype), why
                )
    for cluster in _overlap_clusters([a for a in copies if a.dtype == a.entry.tensor.dtype]):
        _check_overlaps(cluster, read, path)

    plan = LoadPlan(report, copies)
    if optimizer is not None:
        if model is None:
            raise TypeError("optimizer= needs the nn.Module (parameters are matched by identity)")
        root = reader.root
        if not os.path.isfile(os.path.join(root, index_name(OPTIMIZER_PREFIX))):
            raise CheckpointNotFoundError(
                root, f"no {index_name(OPTIMIZER_PREFIX)} (saved without optimizer=?)"
            )
        from .optim import plan_optimizer

        with open_checkpoint(root, prefix=OPTIMIZER_PREFIX) as opt_reader:
            if verify:
                opt_reader.check_index_digest()
            for name in opt_reader.files if verify else ():
                opt_reader.verify_file(name)
            plan.optimizer_state = plan_optimizer(optimizer, opt_reader, state)
    return plan


# -- apply ---------------------------------------------------------------------------------------


@torch.no_grad()
def apply_load(
    plan: LoadPlan,
    obj: torch.nn.Module | Mapping[str, torch.Tensor],
    reader: CheckpointReader,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    dtype: torch.dtype | None = None,
    on_copy: Callable[[str], None] | None = None,
) -> LoadReport:
    """Carry out a checked :class:`LoadPlan`: ``module.to(dtype)``, the copies (or replacements),
    the optimizer state. Only reads and writes remain here; a failure of torch or the OS (e.g. the
    file vanishes from under a mapping) is a :class:`LoadError` naming key and file."""
    copies = plan.copies
    if dtype is not None:
        try:
            obj.to(dtype)
        except Exception as e:  # noqa: BLE001
            raise LoadError(f"module.to({dtype})", reader.root, f"{type(e).__name__}: {e}") from e
        # Buffers are new tensors now (parameters keep their identity): find each target again.
        fresh = object_state(obj).by_name()
        copies = [CopyAction(fresh[a.entry.fqn], a.key, a.dtype, a.assign, a.stored_dtype) for a in copies]
    replaced: dict[int, torch.Tensor] = {}
    for a in copies:
        if on_copy is not None:
            on_copy(a.key)  # progress
        try:
            t = a.entry.tensor
            if not a.assign and not isinstance(t, DTensor) and reader.read_into(a.key, t):
                continue  # same dtype, contiguous CPU target: bytes read straight into it
            src = _read_target_block(reader, a.key, t)
            if a.assign:
                replaced.update(_assign(obj, a, src))
            elif isinstance(t, DTensor):
                local = t.to_local()
                if local.numel():
                    local.copy_(src)
            else:
                t.copy_(src)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - torch / OS errors are named by key and file
            raise LoadError(a.key, _file(reader, a.key), f"{type(e).__name__}: {e}") from e
    if optimizer is not None and plan.optimizer_state is not None:
        if replaced:
            for g in optimizer.param_groups:
                g["params"] = [replaced.get(id(p), p) for p in g["params"]]
        from .optim import apply_optimizer

        try:
            apply_optimizer(optimizer, plan.optimizer_state)
        except Exception as e:  # noqa: BLE001
            raise LoadError(
                "optimizer state",
                os.path.join(reader.root, index_name(OPTIMIZER_PREFIX)),
                f"{type(e).__name__}: {e}",
            ) from e
        plan.report.optimizer_loaded = True
    return plan.report


def _assign(obj, a: CopyAction, src: torch.Tensor) -> dict[int, torch.Tensor]:
    """Replace target ``a.entry`` (every name of it) with the checkpoint value, in the target's
    dtype and device (CPU for meta), keeping Parameter-ness and ``requires_grad`` (torch's
    ``load_state_dict(assign=True)``). Returns {id(old parameter): new parameter}."""
    old = a.entry.tensor
    device = torch.device("cpu") if old.is_meta else old.device
    value = src.to(device=device, dtype=a.dtype)
    if value is src:
        value = src.clone()  # never share memory with the reader's mapping
    if not isinstance(obj, torch.nn.Module):
        for n in a.entry.module_names:
            obj[n] = value
        return {}
    new = (
        torch.nn.Parameter(value, requires_grad=old.requires_grad)
        if isinstance(old, torch.nn.Parameter)
        else value
    )
    for n in a.entry.module_names:
        owner, slots, attr = _owner_slot(obj, n)
        getattr(owner, slots)[attr] = new
    return {id(old): new} if new is not value else {}


# -- load ----------------------------------------------------------------------------------------


def load(
    obj: torch.nn.Module | Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    *,
    strict: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
    dtype: torch.dtype | None = None,
    verify: bool = False,
    assign: bool = False,
    allow_lossy: bool = False,
    extra_state: MutableMapping[str, Any] | None = None,
    progress: bool | None = None,
) -> LoadReport:
    """Load a checkpoint into ``obj`` in place and return the :class:`LoadReport`.

    Validate, then mutate: every check below runs before the first byte of any target tensor or
    optimizer state changes, so a rejected load leaves model and optimizer bit-identical.

    ``obj``: an ``nn.Module`` (eager, compiled, DDP, checkpoint-wrapped, or with DTensor
    parameters on any mesh / placements: each rank reads only its slices) or a state_dict whose
    tensors are filled in place. ``path``: a directory with ``model.safetensors.index.json``
    (authoritative), a directory with one ``model.safetensors``, or one ``.safetensors`` file.
    A DCP directory is read through ``torch.distributed.checkpoint`` (see
    :mod:`checkpoint.sources.dcp_load`; its errors name DCP).

    Names: a checkpoint key fills the target tensor it names; with a module, also a spelling that
    the module resolves (wrapper segments such as ``_orig_mod.`` / ``module.`` are dropped only
    where the module says that child is a wrapper, :func:`fqn.canonical_fqn`); a state_dict
    target is matched by its keys exactly. Tied tensors are filled from whichever alias the
    checkpoint stored. Several stored keys naming one target tensor must hold equal values.
    Keys that are non-persistent buffers of the target are ``ignorable_keys``, not loaded.

    Dtypes: tensors stored in another dtype are converted to the target's dtype and listed in
    ``dtype_converted``. A conversion that loses values is refused (:class:`LossyConversionError`)
    unless ``allow_lossy=True``: by kind (complex -> real, floating -> integer / bool, integer ->
    bool), or by value where the target's range is narrower (float32 -> float16 overflowing to
    inf, int64 -> int32 out of range; such tensors are read once more to check). Rounding within
    range (float32 -> bfloat16) is a conversion, not a loss. ``dtype``: the module's floating-point
    and complex parameters and buffers take this dtype (``module.to(dtype)``, like
    ``from_pretrained(torch_dtype=...)``), done after every check.

    ``assign``: replace each loaded target with the checkpoint's tensor (in the target's dtype,
    on the target's device, CPU for meta targets), keeping Parameter-ness and ``requires_grad``
    (torch's ``load_state_dict(assign=True)``); the optimizer's param groups then hold the new
    parameters. Needed for meta targets, which hold no data to copy into.

    ``optimizer``: also restore it from ``optimizer.safetensors.index.json``, by FQN, values
    exact (see :mod:`checkpoint.optim`). ``verify``: first check the index's own digest and
    re-hash every file read against the index's ``metadata.fqnckpt.files`` record (size; xxh3-128
    of header and each tensor, or sha256 for format version 1: safetensors itself has no checksum,
    so a flipped data byte otherwise loads silently); costs one extra read of the files.

    ``extra_state``: fill this dict from the checkpoint's ``extra_state.json``: objects with
    ``load_state_dict`` are restored in place, other keys get the saved value (see
    :mod:`checkpoint.training.extra_state`); its entries appear in the report as
    ``extra_state.<key>`` (missing / unexpected / loaded), checked with everything else and applied
    after the tensors.

    ``progress``: tqdm bar on stderr, rank 0 only (``None``: only when stderr is a terminal;
    shown after 1 s).

    Raises (all before anything is changed):
        CheckpointNotFoundError, MissingShardError, UnsafePathError, TensorNotInShardError,
        DuplicateTensorError, CorruptCheckpointError: see :func:`checkpoint.storage.reader.open_checkpoint`.
        TiedValuesMismatchError: stored keys naming one target tensor hold different values.
        ChecksumMismatchError: ``verify`` and a file's size or digest, or the index's own digest,
            differs from the record.
        CheckpointMismatchError: ``strict`` and missing / unexpected / shape-mismatched keys
            (``.report`` carries the LoadReport). With ``strict=False`` the matching keys load.
        LossyConversionError: a dtype conversion would lose values (see above).
        MetaTargetError: targets on the meta device and ``assign`` is False.
        UnwritableTargetError: a target cannot take an in-place copy (expanded / internally
            overlapping, inference tensor outside inference mode, sparse, uninitialized lazy).
        LoadError: safetensors / torch / the OS fail to read a tensor the checks need (names key
            and file).
        OverlappingTargetsError: distinct targets share memory and the checkpoint gives the shared
            elements different values.
        OptimizerMismatchError (``checkpoint.optim``): optimizer groups match no saved groups.
        TypeError: ``dtype`` without a module or not floating / complex; ``optimizer`` without a module.
        RankAgreementError: another rank failed (when loading DTensors).
    Raises after the checks: LoadError, naming key and file, if torch or the OS fails while
    copying (nothing checkable is left to that phase).
    """
    path = os.fspath(path)
    from .sources.dcp import dcp_format  # a DCP directory is read through torch.distributed.checkpoint

    if dcp_format(path):
        from .sources.dcp_load import load_dcp

        if assign or extra_state is not None:
            from .sources.dcp_load import DCPLoadError

            raise DCPLoadError(
                os.fspath(path), "assign= and extra_state= are not read from DCP directly; migrate it first"
            )
        return load_dcp(
            obj, path, strict=strict, optimizer=optimizer, dtype=dtype, verify=verify, allow_lossy=allow_lossy
        )
    if dtype is not None:
        if not isinstance(obj, torch.nn.Module):
            raise TypeError("dtype= needs an nn.Module")
        if not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or dtype.is_complex):
            raise TypeError(f"dtype= must be a floating point or complex torch.dtype, got {dtype!r}")
    state = object_state(obj)
    collective = state.has_dtensor and dist.active()
    err: BaseException | None = None
    reader = plan = extra = None
    try:
        # Model and optimizer parts (and extra state) of one checkpoint: see checkpoint.atomic.
        with read_view(path):
            reader = open_checkpoint(path)
            plan = plan_load(
                obj, reader, path, strict=strict, optimizer=optimizer, dtype=dtype,
                assign=assign, allow_lossy=allow_lossy, verify=verify, state=state,
            )  # fmt: skip
            if extra_state is not None:
                from .training.extra_state import plan_extra_state

                extra = plan_extra_state(reader.root if reader.index_path else None, extra_state, plan.report)
                if strict and not plan.report.ok:
                    raise CheckpointMismatchError(plan.report, path)
    except BaseException as e:  # noqa: BLE001 - agreed across ranks below
        err = e
    try:
        if collective:
            dist.check_all(f"opening {path}", err)
        elif err is not None:
            raise err
        err = None
        try:
            with copy_progress(reader, plan.copies, progress) as on_copy:
                apply_load(plan, obj, reader, optimizer=optimizer, dtype=dtype, on_copy=on_copy)
            if extra is not None:
                extra.apply()
        except BaseException as e:  # noqa: BLE001
            err = e
        if collective:
            dist.check_all(f"loading {path}", err)
        elif err is not None:
            raise err
    finally:
        if reader is not None:
            reader.close()
    return plan.report
