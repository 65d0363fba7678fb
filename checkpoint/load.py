"""``load``: a checkpoint into an eager, wrapped or parallel module (any mesh / placements).

Everything is checked before any copy: the reader validates index and headers, then the
:class:`~checkpoint.reports.LoadReport` is computed from names, shapes and dtypes alone. Each rank
reads only the slices of its local shards (``safe_open(...).get_slice``), so loading reshards.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor

from fqn import canonical_fqn
from fqn.registry import dtype_name

from .errors import CheckpointMismatchError, TiedValuesMismatchError
from .progress import copy_progress
from .ranks import dist
from .reports import DtypeConversion, LoadReport, ShapeMismatch
from .state import ModuleState, object_state
from .storage.format import OPTIMIZER_PREFIX, index_name
from .storage.reader import CheckpointReader, open_checkpoint


def local_slices(t: DTensor) -> tuple[slice, ...]:
    """Slices of the global tensor that ``t``'s local shard covers on this rank (one per dim)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _plan(reader: CheckpointReader, state: ModuleState, model: torch.nn.Module | None, path: str):
    """Match checkpoint keys to target entries; returns (report, [(entry, checkpoint key)])."""
    by_name = state.by_name()
    report = LoadReport(path=path)
    # A stored key also stands for the other names of its saved alias group (tied weights).
    # A stored key always stands for itself: an alias group never overrides stored values.
    sources: dict[str, str] = {k: k for k in reader.keys()}
    groups = {g[0]: g for g in reader.alias_groups}
    matched_keys: set[str] = set()
    for key in reader.keys():
        for name in groups.get(key, [key]):
            sources.setdefault(name, key)
    unknown = []
    for key in reader.keys():
        if key in by_name or any(n in by_name for n in groups.get(key, [])):
            continue
        alt = canonical_fqn(key, model) if model is not None else canonical_fqn(key)
        if alt != key and alt in by_name:
            sources.setdefault(alt, key)
            continue
        unknown.append(key)
    copies = []
    for e in state.entries:
        stored = [n for n in e.names if n in sources and sources[n] == n]
        check_tied_values(reader, stored, path)
        key = stored[0] if stored else None
        key = key or next((sources[n] for n in e.names if n in sources), None)
        if key is None:
            report.missing_keys.append(e.fqn)
            continue
        matched_keys.add(key)
        spec = reader.spec(key)
        if spec.shape != tuple(e.tensor.shape):
            report.shape_mismatched.append(
                ShapeMismatch(key=e.fqn, checkpoint_shape=list(spec.shape), target_shape=list(e.tensor.shape))
            )
            continue
        if spec.dtype != e.tensor.dtype:
            report.dtype_converted.append(
                DtypeConversion(
                    key=e.fqn,
                    checkpoint_dtype=dtype_name(spec.dtype),
                    target_dtype=dtype_name(e.tensor.dtype),
                )
            )
        if key != e.fqn:
            report.filled_from[e.fqn] = key
        report.loaded_keys.append(e.fqn)
        copies.append((e, key))
    for key in unknown:
        if key in matched_keys:
            continue
        if key in state.non_persistent:
            report.ignorable_keys.append(key)
        else:
            report.unexpected_keys.append(key)
    for field in ("missing_keys", "unexpected_keys", "ignorable_keys", "loaded_keys"):
        getattr(report, field).sort()
    return report, copies


def check_tied_values(reader, stored: list[str], path: str) -> None:
    """Several names of one tied target tensor stored separately must hold equal values (read
    here, before anything is copied); otherwise one would silently overwrite the other.

    ``reader`` is anything with ``get(key)`` and ``file_of(key)`` (a checkpoint or a migration
    source). Raises :class:`TiedValuesMismatchError` when shape, dtype or bytes differ.
    """
    if len(stored) < 2:
        return
    first = reader.get(stored[0])
    for other in stored[1:]:
        t = reader.get(other)
        same = t.shape == first.shape and t.dtype == first.dtype
        # Bitwise, so NaNs stored twice compare equal.
        if not same or not torch.equal(t.reshape(-1).view(torch.uint8), first.reshape(-1).view(torch.uint8)):
            raise TiedValuesMismatchError(stored, [reader.file_of(k) for k in stored], path)


@torch.no_grad()
def _copy(reader: CheckpointReader, copies, on_copy=None) -> None:
    for e, key in copies:
        if on_copy is not None:
            on_copy(key)
        t = e.tensor
        if isinstance(t, DTensor):
            local = t.to_local()
            if local.numel() == 0:
                continue
            src = reader.get_slice(key, local_slices(t)) if t.dim() else reader.get(key)
            local.copy_(src)
        else:
            t.copy_(reader.get(key))


def load(
    obj: torch.nn.Module | Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    *,
    strict: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
    dtype: torch.dtype | None = None,
    verify: bool = False,
    progress: bool | None = None,
) -> LoadReport:
    """Load a checkpoint into ``obj`` in place and return the :class:`LoadReport`.

    ``obj``: an ``nn.Module`` (eager, compiled, DDP, checkpoint-wrapped, or with DTensor
    parameters on any mesh / placements: each rank reads only its slices) or a state_dict whose
    tensors are filled in place. ``path``: a directory with ``model.safetensors.index.json``
    (authoritative), a directory with one ``model.safetensors``, or one ``.safetensors`` file.
    Tied tensors are filled from whichever alias the checkpoint stored. Keys that are
    non-persistent buffers of the target are reported as ``ignorable_keys`` and not loaded.
    Tensors stored in another dtype are converted to the target's dtype and listed in
    ``dtype_converted``. ``dtype``: first cast the module's floating-point parameters and buffers
    to this dtype (``module.to(dtype)``), like ``from_pretrained(torch_dtype=...)``.
    ``optimizer``: also restore it from ``optimizer.safetensors.index.json``, by FQN.
    ``verify``: first re-hash every file read and compare its byte size and sha256 with the
    index's ``metadata.fqnckpt.files`` record (safetensors itself has no checksum, so a flipped
    data byte otherwise loads silently); costs one extra read of the files.
    ``progress``: tqdm bar on stderr, rank 0 only (``None``: only when stderr is a terminal;
    shown after 1 s).

    Raises (all before anything is copied):
        CheckpointNotFoundError, MissingShardError, UnsafePathError, TensorNotInShardError,
        DuplicateTensorError, CorruptCheckpointError: see :func:`checkpoint.storage.reader.open_checkpoint`.
        TiedValuesMismatchError: names the target ties are stored separately with different values.
        ChecksumMismatchError: ``verify`` and a file's size or sha256 differs from the index.
        CheckpointMismatchError: ``strict`` and missing / unexpected / shape-mismatched keys
            (``.report`` carries the LoadReport). With ``strict=False`` the matching keys load.
        RankAgreementError: another rank failed (when loading DTensors).
    """
    path = os.fspath(path)
    if dtype is not None:
        if not isinstance(obj, torch.nn.Module):
            raise TypeError("dtype= needs an nn.Module")
        obj.to(dtype)
    state = object_state(obj)
    model = obj if isinstance(obj, torch.nn.Module) else None
    collective = state.has_dtensor and dist.active()
    err: BaseException | None = None
    report = None
    reader = None
    try:
        reader = open_checkpoint(path)
        if verify:
            for name in reader.files:
                reader.verify_file(name)
        report, copies = _plan(reader, state, model, path)
        if strict and not report.ok:
            raise CheckpointMismatchError(report, path)
        opt_reader = None
        if optimizer is not None:
            root = reader.root
            if not os.path.isfile(os.path.join(root, index_name(OPTIMIZER_PREFIX))):
                from .errors import CheckpointNotFoundError

                raise CheckpointNotFoundError(
                    root, f"no {index_name(OPTIMIZER_PREFIX)} (saved without optimizer=?)"
                )
            opt_reader = open_checkpoint(root, prefix=OPTIMIZER_PREFIX)
            for name in opt_reader.files if verify else ():
                opt_reader.verify_file(name)
    except BaseException as e:  # noqa: BLE001 - agreed across ranks below
        err = e
    if collective:
        dist.check_all(f"opening {path}", err)
    elif err is not None:
        raise err
    try:
        with copy_progress(reader, copies, progress) as on_copy:  # progress hook
            _copy(reader, copies, on_copy)
        if opt_reader is not None:
            from .optim import load_optimizer

            load_optimizer(optimizer, opt_reader, state)
            report.optimizer_loaded = True
    except BaseException as e:  # noqa: BLE001
        err = e
    finally:
        reader.close()
    if collective:
        dist.check_all(f"loading {path}", err)
    elif err is not None:
        raise err
    return report
