"""``torch.save`` pickles (zip and legacy) as a migration :class:`~checkpoint.sources.base.Source`.

Only ever ``weights_only=True``: unsafe globals are listed first (by disassembling the pickle,
nothing runs) and refused unless the caller trusts them by name. Every tensor of the chosen
container is found, however deep it is nested in dicts, lists and tuples (no depth limit: an
explicit stack, not recursion); non-tensor leaves are reported as ``skipped`` with their type.
"""

from __future__ import annotations

import importlib
import numbers
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import AmbiguousSourceError, CorruptCheckpointError, UnsafePickleError, UnsupportedFormatError
from ..tensor_checks import check_dense_tensors
from .base import OptimizerInfo, Source, SourceSpec
from .sniffing import sniff_file
from .training_state import is_training_state
from .unpickle import scan_globals, torch_load
from .validate import validate_optimizer_state_dict

def resolve_globals(trusted: Iterable[Any]) -> list[Any]:
    """Turn ``trusted_globals`` entries into objects for ``torch.serialization.safe_globals``.

    Entries are classes / functions, or ``"module.qualname"`` strings, imported by name (the user
    named them explicitly, e.g. on the command line).

    Raises:
        UnsafePickleError: a string names nothing importable.
    """
    out = []
    for g in trusted:
        if not isinstance(g, str):
            out.append(g)
            continue
        mod, _, name = g.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(mod), name))
        except (ImportError, AttributeError, ValueError):
            raise UnsafePickleError(
                "<trusted_globals>", [g], why=f"cannot import trusted global {g!r}"
            ) from None
    return out


def _legacy_globals(path: Path) -> set[tuple[str, str]]:
    """``(module, name)`` of every global in a legacy (non-zip) ``torch.save`` file, read with
    ``pickletools`` without executing anything. ``torch.serialization.get_unsafe_globals_in_checkpoint``
    only reads zip files; a legacy file is 4 pickles (magic, protocol, sys info, object) + raw data."""
    found: set[tuple[str, str]] = set()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        for _ in range(4):
            if f.tell() >= size:  # a plain ``pickle.dump`` file holds one pickle, not 4
                break
            try:
                found |= scan_globals(f)
            except ValueError as e:  # truncated or not a pickle
                raise CorruptCheckpointError(str(path), f"damaged pickle: {e}") from None
    return found


def _zip_globals(path: Path) -> set[tuple[str, str]]:
    """``(module, name)`` of every global in a ``torch.save`` zip's ``data.pkl`` (every opcode
    :func:`~.unpickle.scan_globals` knows, INST / OBJ / STACK_GLOBAL / EXT included), or an
    empty set when the archive cannot be read (the caller reports the damage)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.endswith("data.pkl")]
            return set().union(*(scan_globals(z.read(n)) for n in names)) if names else set()
    except (zipfile.BadZipFile, ValueError, OSError):
        return set()


def unsafe_globals(path: str | os.PathLike, trusted: Iterable[Any] = ()) -> list[str]:
    """Globals of a ``torch.save`` file outside the ``weights_only`` safe set and ``trusted``,
    found by disassembling the pickle (nothing runs). Sorted ``module.name`` strings.

    Raises:
        CorruptCheckpointError: the file cannot be disassembled and names no unsafe global."""
    objs = resolve_globals(trusted)
    p = Path(path)
    with torch.serialization.safe_globals(objs):
        from torch import _weights_only_unpickler as wou  # the safe set torch itself applies

        safe = set(wou._get_allowed_globals()) | set(wou._get_user_allowed_globals())
        if sniff_file(p) == "torch-zip":
            try:
                return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(str(p)))
            except Exception as e:  # noqa: BLE001 - torch's zip reader / pickle scan on damaged bytes
                # torch's scan stops at opcodes it does not take (INST, OBJ, EXT1/2/4): ours names them
                bad = _unsafe(_zip_globals(p), safe)
                if bad:
                    return bad
                raise CorruptCheckpointError(
                    str(p),
                    f"not a valid torch.save zip archive: {type(e).__name__}: {' '.join(str(e).split())}",
                ) from None
    return _unsafe(_legacy_globals(p), safe)


def _unsafe(found: Iterable[tuple[str, str]], safe: set[str]) -> list[str]:
    # Exact pairs: torch's table is keyed "module.name"; a dotted name is never in it. torch.*
    # rebuild functions pass here: torch.load(weights_only=True) checks them against its table.
    return sorted(
        f"{m}.{n}" for m, n in found if "." in n or (f"{m}.{n}" not in safe and m != "torch" and not m.startswith("torch."))
    )


# -- walking the unpickled object ------------------------------------------------------------------
def _is_optimizer_sd(obj: Any) -> bool:
    return isinstance(obj, Mapping) and "state" in obj and "param_groups" in obj


def _children(obj: Any) -> Iterable[tuple[str, Any]] | None:
    """``(segment, value)`` pairs of a container (dict keys as ``str``, list / tuple indices), or
    None for a leaf."""
    if isinstance(obj, Mapping):
        return ((str(k), v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return ((str(i), v) for i, v in enumerate(obj))
    return None


def _has_tensors(obj: Any) -> bool:
    """Any tensor anywhere under ``obj`` (explicit stack: no depth limit, no recursion limit)."""
    stack = [obj]
    while stack:
        cur = stack.pop()
        if isinstance(cur, torch.Tensor):
            return True
        kids = _children(cur)
        if kids is not None:
            stack.extend(v for _, v in kids)
    return False


def _tensor_subtrees(obj: Any) -> set[int]:
    """``id`` of every container under ``obj`` (itself included) holding a tensor somewhere below:
    one iterative post-order walk, so flattening stays linear however deep the nesting is."""
    holds: set[int] = set()
    stack: list[tuple[Any, bool]] = [(obj, False)]
    while stack:
        cur, done = stack.pop()
        kids = _children(cur)
        if kids is None:
            continue
        if done:
            for _, v in _children(cur):
                if isinstance(v, torch.Tensor) or id(v) in holds:
                    holds.add(id(cur))
                    break
            continue
        stack.append((cur, True))
        stack.extend((v, False) for _, v in kids)
    return holds


def _flatten(
    obj: Any, prefix: str, out: dict[str, Any], skipped: dict[str, str], path: Path, optimizers: dict
) -> None:
    """Every tensor under ``obj`` into ``out`` keyed by its dotted path; non-tensor values into
    ``skipped`` (name -> type; a container without tensors is one value). An optimizer
    state_dict met on the way goes into ``optimizers`` (name -> object), not among model tensors."""
    holds = _tensor_subtrees(obj)
    stack: list[tuple[str, Any]] = [(prefix.rstrip("."), obj)]
    while stack:
        name, v = stack.pop()
        if isinstance(v, torch.Tensor):
            if name in out:  # {"a": {"b": t}, "a.b": u} or {1: t, "1": u}: never keep one silently
                raise CorruptCheckpointError(str(path), f"two entries both flatten to tensor name {name!r}")
            out[name] = v
            continue
        if id(v) not in holds:
            skipped[name or "<root>"] = type(v).__name__
            continue
        if name and _is_optimizer_sd(v):
            optimizers[name] = v
            continue
        # reversed: the stack pops in source order, so tensors keep their order
        items = list(_children(v))
        stack.extend((f"{name}.{k}" if name else k, x) for k, x in reversed(items))


def _pick_container(obj: Any, key: str | None, path: Path) -> tuple[Any, str | None, dict[str, Any]]:
    """The state_dict inside a loaded pickle: ``key`` (``a/b`` for nested) or the only candidate,
    then :func:`_past_training_state`. Returns ``(container, its key path or None, entries left
    beside it by key path)``."""
    if key is not None:
        cur = obj
        for part in key.split("/"):
            if not isinstance(cur, Mapping) or part not in cur:
                choices = _container_choices(obj)
                raise AmbiguousSourceError(str(path), choices, f"key {key!r} is not in the checkpoint")
            cur = cur[part]
        if not _has_tensors(cur):
            raise AmbiguousSourceError(str(path), _container_choices(obj), f"key {key!r} holds no tensors")
        return _past_training_state(cur, key, {}, path)
    if not isinstance(obj, Mapping):
        raise UnsupportedFormatError(
            str(path), f"top-level object is a {type(obj).__name__}, not a dict of tensors"
        )
    if _is_optimizer_sd(obj):
        return obj, None, {}
    if any(isinstance(v, torch.Tensor) for v in obj.values()):
        return _past_training_state(obj, None, {}, path)
    choices = _container_choices(obj)
    model_like = [c for c in choices if not _is_optimizer_sd(obj[c]) and not is_training_state(c)]
    if len(model_like) == 1:
        c = model_like[0]
        return _past_training_state(obj[c], c, {str(k): v for k, v in obj.items() if str(k) != c}, path)
    if not choices:
        raise UnsupportedFormatError(str(path), "no tensors found in the checkpoint")
    if not model_like and len(choices) == 1:
        return obj[choices[0]], choices[0], {}
    raise AmbiguousSourceError(str(path), model_like or choices, "several containers hold tensors; pick one with key=")


def _past_training_state(cur: Any, name: str | None, beside: dict[str, Any], path: Path):
    """Down from container ``cur`` (key path ``name``) while it is a training checkpoint rather
    than a state_dict: tensors named like training state at its top (``step``, ``rng``: see
    :mod:`.training_state`) beside exactly one other container holding tensors, the model's
    (``{"state": {"model": sd}, "step": t}``). Everything else at such a level is left
    ``beside`` (optimizer state_dicts are found there too). A level holding model-named
    top-level tensors stays a state_dict, as it always was."""
    while isinstance(cur, Mapping) and not _is_optimizer_sd(cur):
        leaves = [str(k) for k, v in cur.items() if isinstance(v, torch.Tensor)]
        if not leaves or not all(is_training_state(k) for k in leaves):
            break
        conts = [str(k) for k, v in cur.items() if not isinstance(v, torch.Tensor) and _children(v) is not None
                 and _has_tensors(v) and not _is_optimizer_sd(v) and not is_training_state(str(k))]  # fmt: skip
        if not conts:
            break  # {"step": t} alone: nothing else to be the model
        where = f"{name}/" if name else ""
        if len(conts) > 1:
            raise AmbiguousSourceError(str(path), [where + c for c in conts],
                                       "several containers beside the training state hold tensors; pick one with key=")  # fmt: skip
        beside.update({where + str(k): v for k, v in cur.items() if str(k) != conts[0]})
        cur, name = cur[conts[0]], where + conts[0]
    return cur, name, beside


def _container_choices(obj: Any) -> list[str]:
    if not isinstance(obj, Mapping):
        return []
    return [str(k) for k, v in obj.items() if _children(v) is not None and _has_tensors(v)]


def _optimizer_view(
    osd: Mapping, path: Path, prefix: str = ""
) -> tuple[dict[str, torch.Tensor], OptimizerInfo, dict[str, str]]:
    """Tensors of an optimizer state_dict keyed ``<prefix>state.<param id>.<slot>`` plus its
    groups. Python-number state (``step`` of older optimizers) becomes a 0-dim tensor listed in
    ``scalars`` so it is carried over, not dropped; anything else is ``skipped`` by type."""
    validate_optimizer_state_dict(osd, str(path))
    ids: list[Any] = []
    names: list[str] | None = []
    groups = []
    group_ids = []
    for gi, g in enumerate(osd["param_groups"]):
        if not isinstance(g, Mapping) or "params" not in g:
            raise CorruptCheckpointError(str(path), f"optimizer param_groups[{gi}] has no 'params'")
        ids.extend(g["params"])
        group_ids.append(list(g["params"]))
        if names is not None and "param_names" in g:
            names.extend(g["param_names"])
        else:
            names = None
        groups.append({k: v for k, v in g.items() if k not in ("params", "param_names")})
    tensors: dict[str, torch.Tensor] = {}
    skipped: dict[str, str] = {}
    info = OptimizerInfo(ids, names, groups, group_ids)
    known = set(ids)
    for pid, slots in osd["state"].items():
        if pid not in known:
            raise CorruptCheckpointError(
                str(path), f"optimizer state has param id {pid!r} absent from param_groups"
            )
        for slot, v in slots.items():
            k = f"{prefix}state.{pid}.{slot}"
            if isinstance(v, torch.Tensor):
                tensors[k] = v
            elif isinstance(v, numbers.Number) and not isinstance(v, (bool, complex)):
                dt = torch.int64 if isinstance(v, numbers.Integral) else torch.float64
                tensors[k] = torch.tensor(v, dtype=dt)
                info.scalars.add(k)
            else:
                skipped[k] = type(v).__name__
                continue
            info.state[k] = (pid, str(slot))
    return tensors, info, skipped


class _PickleReader:
    """Loads a ``torch.save`` file with ``weights_only=True``.

    Zip files: structure only (``map_location="meta"``: every tensor a meta tensor whose storage
    carries its record's offset in the file, torch's own way to read the bytes elsewhere), each
    storage checked against the zip's own directory (a stored, uncompressed record at that offset
    holding at least the storage's bytes), and each tensor's bytes read with ``preadv`` by
    :meth:`get`. Why not ``torch.load(mmap=True)``: a file cut short or an I/O error while mapped
    kills the process with SIGBUS (nothing in Python can catch it); a short read is
    :class:`CorruptCheckpointError` naming file and tensor, a failed one :class:`LoadError`. It
    also bounds memory without re-opening: only the tensor asked for is in memory. Tensors torch
    cannot build on the meta device (quantized, nested) and legacy (non-zip) files: loaded whole
    into memory (no mapping either), then checked (:func:`check_dense_tensors` refuses those).
    """

    def __init__(self, path: Path, fmt: str, key: str | None, trusted: list[Any], window: int):
        self.path, self.fmt, self.key, self.trusted, self.window = path, fmt, key, trusted, window
        self.since_trim = 0
        self.tensors: dict[str, torch.Tensor] | None = None
        self.container: str | None = None
        self.skipped: dict[str, str] = {}
        self.optimizer: OptimizerInfo | None = None
        self.left_out: list[str] = []
        self.beside: list[str] = []
        self._fd: int | None = None
        self._load()

    def _load(self) -> None:
        obj = None
        if self.fmt == "torch-zip":
            try:
                obj = torch_load(self.path, str(self.path), self.trusted, map_location="meta")
            except NotImplementedError:  # quantized / nested: whole, then refused by the check
                obj = None
        if obj is None:
            obj = torch_load(self.path, str(self.path), self.trusted)
        cont, self.container, beside = _pick_container(obj, self.key, self.path)
        # Training state beside the model (step, epoch, rng, scheduler...): not model keys.
        self.beside = sorted(k for k, v in beside.items() if not _is_optimizer_sd(v))
        skipped: dict[str, str] = {}
        optimizers: dict[str, Any] = {}
        if _is_optimizer_sd(cont):
            tensors, self.optimizer, skipped = _optimizer_view(cont, self.path)
        else:
            tensors = {}
            if isinstance(cont, torch.Tensor):
                tensors[self.container or "tensor"] = cont
            else:
                _flatten(cont, "", tensors, skipped, self.path, optimizers)
            if self.container is not None and self.key is None and isinstance(obj, Mapping):
                # An optimizer beside the auto-picked model container ({"model", "optimizer"}).
                opts = {k.replace("/", "."): v for k, v in beside.items() if _is_optimizer_sd(v)}
                held = {k: v for k, v in opts.items() if _has_tensors(v)}
                # One without tensors (SGD without momentum) is the optimizer when it is the only one.
                optimizers.update(held if held or len(opts) != 1 else opts)
            if len(optimizers) > 1:
                raise AmbiguousSourceError(
                    str(self.path), sorted(optimizers), "several optimizer state_dicts hold tensors; pick one "
                    "container with key= (the others are then not migrated)",
                )  # fmt: skip
            for name, osd in optimizers.items():
                opt_tensors, info, opt_skipped = _optimizer_view(osd, self.path, f"{name}.")
                info.separate, info.container = True, name
                tensors.update(opt_tensors)
                skipped.update(opt_skipped)
                self.optimizer = info
        if self.key is not None and isinstance(obj, Mapping):
            top = self.key.split("/")[0]
            self.left_out = [c for c in _container_choices(obj) if c != top]
        check_dense_tensors(tensors, str(self.path))
        if any(t.is_meta for t in tensors.values()):
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                _check_records(self.path, self._fd, tensors)
            except BaseException:
                self.close()
                raise
        self.tensors, self.skipped = tensors, skipped

    def get(self, key: str) -> torch.Tensor:
        """Tensor ``key`` as a new contiguous CPU tensor (its stored shape and dtype).

        Raises:
            CorruptCheckpointError: the file ends before the tensor's bytes (file and tensor named).
            LoadError: the read fails (tensor and file named).
        """
        if self.tensors is None:
            self._load()
        t = self.tensors[key]
        if not t.is_meta:  # built here (a Python-number optimizer step) or loaded whole
            return t.contiguous()
        self.since_trim += t.nbytes
        if self.since_trim > self.window:
            # Tensors read, written and dropped one by one leave freed heap blocks that glibc
            # keeps (its mmap threshold grows with freed sizes); hand them back every window
            # (measured: 192 MiB pickle in 8 MiB tensors migrated at 66 MiB peak, 10 MiB with this).
            self.since_trim = 0
            _trim_heap()
        return _read_meta(self._fd, self.path, key, t)

    def close(self) -> None:
        self.tensors = None
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _trim_heap() -> None:
    """glibc's ``malloc_trim(0)`` (freed heap pages back to the OS); nothing elsewhere."""
    import ctypes

    from ..storage.libc import libc_function

    trim = libc_function("malloc_trim", (ctypes.c_size_t,))
    if trim:
        trim(0)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of ``t``'s storage that ``t`` reaches (``hi == lo`` when empty)."""
    if not t.numel():
        return t.storage_offset(), t.storage_offset()
    lo = t.storage_offset()
    return lo, lo + 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


def _check_records(path: Path, fd: int, tensors: Mapping[str, torch.Tensor]) -> None:
    """Every meta tensor's storage is a stored (uncompressed) record of the zip at its
    ``_checkpoint_offset`` holding the bytes the tensor reaches (torch computes those offsets from
    its own layout rules; the zip's directory and local headers are what the file says).

    Raises:
        CorruptCheckpointError: a record missing, compressed or too short, or a tensor saved from
            the meta device (no record at all; names file and tensor).
    """
    import struct
    import zipfile

    records: dict[int, tuple[str, int, int]] = {}
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                head = os.pread(fd, 30, info.header_offset)
                if len(head) < 30 or head[:4] != b"PK\x03\x04":
                    raise CorruptCheckpointError(str(path), f"zip record {info.filename!r}: no local header")
                n, m = struct.unpack("<HH", head[26:30])
                records[info.header_offset + 30 + n + m] = (info.filename, info.file_size, info.compress_type)
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise CorruptCheckpointError(str(path), f"damaged torch.save file: {type(e).__name__}: {e}") from None
    for key, t in tensors.items():
        if not t.is_meta:
            continue
        off = getattr(t.untyped_storage(), "_checkpoint_offset", None)
        if off is None:  # torch pickles a meta tensor with no storage record (_rebuild_meta_tensor_no_storage)
            raise CorruptCheckpointError(
                str(path),
                f"tensor {key!r} holds no values: it was saved from the meta device, "
                "and torch.save keeps only a meta tensor's shape and dtype",
                key,
            )
        rec = records.get(off)
        hi = _extent(t)[1] * t.element_size()
        if rec is None:
            raise CorruptCheckpointError(str(path), f"tensor {key!r}: no zip record at its storage offset {off}", key)
        name, size, kind = rec
        if kind != zipfile.ZIP_STORED:
            raise CorruptCheckpointError(str(path), f"tensor {key!r}: record {name!r} is compressed", key)
        if size < hi:
            raise CorruptCheckpointError(
                str(path), f"tensor {key!r}: record {name!r} holds {size} bytes, the tensor reaches {hi}", key
            )


def _read_meta(fd: int | None, path: Path, key: str, t: torch.Tensor) -> torch.Tensor:
    """The values of meta tensor ``t`` (shape, strides, storage offset; bytes at its storage's
    ``_checkpoint_offset``) read with ``preadv`` into a new contiguous CPU tensor."""
    from ..storage.pread import Run, read_runs
    from ..storage.writer import tensor_bytes

    if not t.numel():
        return torch.empty(t.shape, dtype=t.dtype)
    lo, hi = _extent(t)
    item = t.element_size()
    buf = torch.empty((hi - lo) * item, dtype=torch.uint8)
    base = t.untyped_storage()._checkpoint_offset + lo * item
    read_runs([Run(fd, [tensor_bytes(buf)], [key], base, str(path.parent), path.name, (buf,))])
    vals = buf.view(t.dtype)
    out = vals.view(t.shape) if t.is_contiguous() else torch.as_strided(vals, t.shape, t.stride(), 0)
    # The stored bytes are the base's; a conjugate or negative view's values need its bit applied.
    if t.is_conj():
        out = out.conj()
    if t.is_neg():
        out = torch._neg_view(out)
    return out.resolve_conj().resolve_neg().contiguous()


def open_pickle(path: Path, fmt: str, key: str | None, trusted_globals: Iterable[Any], window: int) -> Source:
    """A :class:`Source` over a ``torch.save`` file (see module docstring).

    Raises:
        UnsafePickleError: globals outside the ``weights_only`` safe set and ``trusted_globals``.
        AmbiguousSourceError: several model containers (or several optimizers) and no ``key``.
        CorruptCheckpointError / UnsupportedFormatError: a damaged file or no tensors.
    """
    trusted = resolve_globals(trusted_globals)
    bad = unsafe_globals(path, trusted)
    if bad:
        raise UnsafePickleError(str(path), bad)
    r = _PickleReader(path, fmt, key, trusted, window)
    specs = {k: SourceSpec(k, tuple(t.shape), t.dtype) for k, t in r.tensors.items()}
    extra: dict[str, SourceSpec] = {}
    if r.optimizer is not None and r.optimizer.separate:
        extra = {k: specs.pop(k) for k in r.optimizer.state}
    notes = []
    if fmt == "torch-legacy":
        notes.append(
            "legacy (non-zip) torch.save format cannot be memory-mapped: it was loaded fully into memory"
        )
    if r.container is not None and key is None:
        notes.append(f"picked container {r.container!r}, the only one holding model tensors")
    if r.optimizer is not None and r.optimizer.separate:
        notes.append(
            f"optimizer state_dict {r.optimizer.container!r} beside the model: written to the optimizer files"
        )
    if r.beside:
        notes.append(f"training state beside the model, not model keys (not migrated): {r.beside}")
    if r.left_out:
        notes.append(f"containers not migrated (key={key!r} chose one): {r.left_out}")
    all_files = dict.fromkeys([*specs, *extra], path.name)
    return Source(
        path, fmt, [path.name], specs, all_files, r, r.skipped, notes, r.container, r.optimizer, extra
    )  # fmt: skip


__all__ = ["open_pickle", "resolve_globals", "unsafe_globals"]
