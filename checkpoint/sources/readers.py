"""Readers for every checkpoint format fqnckpt migrates from, behind one small interface.

``open_source(path)`` sniffs the format from the first bytes (not the extension) and returns a
:class:`Source` with ``keys()`` / ``spec(key)`` / ``get(key)``, the interface of
``checkpoint.storage.reader.open_checkpoint``, so a migration streams one tensor at a time from any format:

* ``torch.save`` pickles (zip ``PK\\x03\\x04``; legacy non-zip, pickle protocol byte ``\\x80``):
  only ever ``weights_only=True``; unsafe globals are listed before loading and refused unless the
  caller trusts them by name (``torch.serialization.safe_globals``).
* safetensors: one file (8-byte little-endian header length + ``{``), or shards with or without a
  ``*.index.json`` (HF layout: ``{"metadata": ..., "weight_map": {key: file}}``).
* DCP directories (``.metadata`` + ``*.distcp``) and DCP's per-rank safetensors shards written by
  ``HuggingFaceStorageWriter(save_distributed=True)``, read through ``torch.distributed.checkpoint``.
* Git LFS pointer files are refused with a hint to run ``git lfs pull``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import pickletools
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors import safe_open

from ..errors import (
    AmbiguousSourceError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DuplicateTensorError,
    MissingShardError,
    TensorNotInShardError,
    UnsafePathError,
    UnsafePickleError,
    UnsupportedFormatError,
    external_errors,
)
from ..storage.layout import ST_TO_DTYPE
from ..storage.reader import open_safetensors
from ..tensor_checks import check_dense_tensors
from .validate import validate_optimizer_state_dict

ZIP_MAGIC = b"PK\x03\x04"
LFS_MAGIC = b"version https://git-lfs"
# Key under which DCP's HuggingFaceStorageWriter stores per-rank sharding info in the header.
DCP_SHARDING_KEY = "DCP_SHARDING_INFO"
# Bytes read through one pickle mmap before it is dropped and re-opened: touched pages of a mapped
# file stay resident (they count in RSS) until the mapping goes, so this bounds peak memory.
DEFAULT_MMAP_WINDOW = 16 << 20


class SourceSpec(NamedTuple):
    """Shape (elements) and dtype of one source tensor; ``fqn`` is the source key."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class OptimizerInfo:
    """An optimizer ``state_dict`` found in the source (``{"state": {id: {...}}, "param_groups"}``).

    ``param_ids`` are the ids in ``param_groups`` order; ``param_names`` the names the source
    carries (torch's ``param_names`` in each group, when the optimizer was built from
    ``named_parameters()``), else ``None``; ``groups`` are the hyper-parameters without ids.
    """

    param_ids: list[Any]
    param_names: list[str] | None
    groups: list[dict[str, Any]]
    group_ids: list[list[Any]]


@dataclass
class Source:
    """A readable checkpoint: ``keys()`` / ``spec(key)`` / ``get(key)`` plus what was found.

    ``format`` is one of :data:`FORMATS`; ``files`` the files read (relative to ``path`` when it
    is a directory); ``skipped`` maps non-tensor entries to their type name; ``notes`` are facts
    a user should know (e.g. "legacy pickle: loaded fully"); ``container`` the key chosen inside a
    pickle; ``optimizer`` is set when the chosen container is an optimizer state_dict.
    """

    path: Path
    format: str
    files: list[str]
    _specs: dict[str, SourceSpec]
    _file_of: dict[str, str]
    _reader: Any
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    container: str | None = None
    optimizer: OptimizerInfo | None = None

    def keys(self) -> list[str]:
        """Tensor keys in source order."""
        return list(self._specs)

    def spec(self, key: str) -> SourceSpec:
        """Shape and dtype of ``key`` from headers / metadata only (no tensor data read)."""
        try:
            return self._specs[key]
        except KeyError:
            raise KeyError(f"{key!r} is not a tensor of {self.path}") from None

    def file_of(self, key: str) -> str:
        """The file holding ``key``."""
        return self._file_of[key]

    def get(self, key: str) -> torch.Tensor:
        """The tensor ``key``, contiguous (one read). For a zip pickle it may view the memory-mapped
        file: use it and drop it, do not keep it (holding it keeps the mapping resident)."""
        self.spec(key)
        file = self.path / self.file_of(key) if self.path.is_dir() else self.path
        with external_errors(str(file), key, "reading"):
            return self._reader.get(key)

    def nbytes(self, key: str) -> int:
        """Size of ``key`` in bytes."""
        s = self._specs[key]
        return _numel(s.shape) * s.dtype.itemsize

    def total_bytes(self) -> int:
        return sum(self.nbytes(k) for k in self._specs)

    def close(self) -> None:
        close = getattr(self._reader, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


FORMATS = ("torch-zip", "torch-legacy", "safetensors", "safetensors-sharded", "dcp", "dcp-hf-sharded")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- sniffing ------------------------------------------------------------------------------------
def sniff_file(path: Path) -> str:
    """Format of one file from its first bytes: ``torch-zip``, ``torch-legacy``, ``safetensors``,
    ``index`` (a JSON ``*.index.json``).

    Raises:
        CorruptCheckpointError: a Git LFS pointer (run ``git lfs pull``), or unknown content.
    """
    with open(path, "rb") as f:
        head = f.read(64)
    if head.startswith(ZIP_MAGIC):
        return "torch-zip"
    if head.startswith(LFS_MAGIC):
        raise CorruptCheckpointError(
            str(path), "this is a Git LFS pointer file, not the data; run `git lfs pull` to fetch it"
        )
    if len(head) >= 9 and head[8:9] == b"{":
        return "safetensors"
    if head[:1] == b"\x80":
        return "torch-legacy"
    if head.lstrip()[:1] == b"{":
        return "index"
    raise UnsupportedFormatError(str(path), f"unrecognised content (first bytes {head[:8]!r})")


def sniff(path: str | os.PathLike) -> str:
    """Format of the checkpoint at ``path`` (a file or a directory); one of :data:`FORMATS`.

    Raises:
        CheckpointNotFoundError: nothing at ``path``, or a directory without a known layout.
        CorruptCheckpointError / UnsupportedFormatError: see :func:`sniff_file`.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(str(p))
    if p.is_file():
        kind = sniff_file(p)
        return "safetensors-sharded" if kind == "index" else kind
    if not p.is_dir():  # a FIFO / socket / device: opening it could block or never end
        raise CheckpointNotFoundError(str(p), "not a regular file or a directory")
    if (p / ".metadata").is_file():
        return "dcp"
    if (p / "sharded").is_dir() and _dcp_hf_files(p / "sharded"):
        return "dcp-hf-sharded"
    if _dcp_hf_files(p):
        return "dcp-hf-sharded"
    if _index_files(p) or _st_files(p):
        return "safetensors-sharded"
    pickles = [f for f in sorted(p.iterdir()) if f.is_file() and f.suffix in (".pt", ".pth", ".bin", ".ckpt")]
    if len(pickles) == 1:
        return sniff_file(pickles[0])
    if len(pickles) > 1:  # never pick one silently: list them
        raise AmbiguousSourceError(
            str(p), [f.name for f in pickles], "several pickle files, name one of them as the path", "the path"
        )
    raise CheckpointNotFoundError(str(p), "no .metadata, *.safetensors, index or single pickle file in it")


def _index_files(d: Path) -> list[Path]:
    return sorted(f for f in d.glob("*.index.json") if f.is_file())


def _st_files(d: Path) -> list[Path]:
    """Regular ``*.safetensors`` files of ``d``: a FIFO so named would block the reader forever."""
    return sorted(f for f in d.glob("*.safetensors") if f.is_file())


def _dcp_hf_files(d: Path) -> list[Path]:
    files = _st_files(d)
    out = []
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                if DCP_SHARDING_KEY in (h.metadata() or {}):
                    out.append(f)
        except Exception:  # a bad file is reported by the reader that opens it
            continue
    return out


# -- pickles ---------------------------------------------------------------------------------------
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


def _legacy_globals(path: Path) -> set[str]:
    """GLOBAL / STACK_GLOBAL names in a legacy (non-zip) ``torch.save`` file, read with
    ``pickletools`` without executing anything. ``torch.serialization.get_unsafe_globals_in_checkpoint``
    only reads zip files; a legacy file is 4 pickles (magic, protocol, sys info, object) + raw data."""
    found: set[str] = set()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        for _ in range(4):
            if f.tell() >= size:  # a plain ``pickle.dump`` file holds one pickle, not 4
                break
            strings: list[str] = []
            try:
                for op, arg, _pos in pickletools.genops(f):
                    if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                        strings.append(arg)
                    elif op.name == "GLOBAL":
                        found.add(arg.replace(" ", "."))
                    elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                        found.add(f"{strings[-2]}.{strings[-1]}")
            except ValueError as e:  # truncated or not a pickle
                raise CorruptCheckpointError(str(path), f"damaged pickle: {e}") from None
    return found


def unsafe_globals(path: str | os.PathLike, trusted: Iterable[Any] = ()) -> list[str]:
    """Globals of a ``torch.save`` file outside the ``weights_only`` safe set and ``trusted``,
    found by disassembling the pickle (nothing runs). Sorted ``module.name`` strings."""
    objs = resolve_globals(trusted)
    p = Path(path)
    with torch.serialization.safe_globals(objs):
        if sniff_file(p) == "torch-zip":
            try:
                return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(str(p)))
            except Exception as e:  # noqa: BLE001 - torch's zip reader / pickle scan on damaged bytes
                raise CorruptCheckpointError(
                    str(p), f"not a valid torch.save zip archive: {type(e).__name__}: {' '.join(str(e).split())}"
                ) from None
        from torch import _weights_only_unpickler as wou  # the safe set torch itself applies

        safe = set(wou._get_allowed_globals()) | set(wou._get_user_allowed_globals())
    return sorted(g for g in _legacy_globals(p) if g not in safe and not g.startswith("torch."))


def _is_optimizer_sd(obj: Any) -> bool:
    return isinstance(obj, Mapping) and "state" in obj and "param_groups" in obj


def _has_tensors(obj: Any, depth: int = 0) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, Mapping) and depth < 8:
        return any(_has_tensors(v, depth + 1) for v in obj.values())
    return False


def _flatten(obj: Mapping, prefix: str, out: dict[str, Any], skipped: dict[str, str], path: Path) -> None:
    for k, v in obj.items():
        name = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            if name in out:  # {"a": {"b": t}, "a.b": u} or {1: t, "1": u}: never keep one silently
                raise CorruptCheckpointError(str(path), f"two entries both flatten to tensor name {name!r}")
            out[name] = v
        elif isinstance(v, Mapping) and _has_tensors(v):
            _flatten(v, name + ".", out, skipped, path)
        else:
            skipped[name] = type(v).__name__


def _pick_container(obj: Any, key: str | None, path: Path) -> tuple[Any, str | None]:
    """The state_dict inside a loaded pickle: ``key`` (``a/b`` for nested) or the only candidate."""
    if key is not None:
        cur = obj
        for part in key.split("/"):
            if not isinstance(cur, Mapping) or part not in cur:
                choices = _container_choices(obj)
                raise AmbiguousSourceError(str(path), choices, f"key {key!r} is not in the checkpoint")
            cur = cur[part]
        if not _has_tensors(cur):
            raise AmbiguousSourceError(str(path), _container_choices(obj), f"key {key!r} holds no tensors")
        return cur, key
    if not isinstance(obj, Mapping):
        raise UnsupportedFormatError(
            str(path), f"top-level object is a {type(obj).__name__}, not a dict of tensors"
        )
    if _is_optimizer_sd(obj) or any(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj, None
    choices = _container_choices(obj)
    model_like = [c for c in choices if not _is_optimizer_sd(obj[c])]
    if len(model_like) == 1 and len(choices) >= 1:
        return obj[model_like[0]], model_like[0]
    if not choices:
        raise UnsupportedFormatError(str(path), "no tensors found in the checkpoint")
    raise AmbiguousSourceError(str(path), choices, "several containers hold tensors; pick one with key=")


def _container_choices(obj: Any) -> list[str]:
    if not isinstance(obj, Mapping):
        return []
    return [str(k) for k, v in obj.items() if isinstance(v, Mapping) and _has_tensors(v)]


def _optimizer_view(
    osd: Mapping, path: Path
) -> tuple[dict[str, torch.Tensor], OptimizerInfo, dict[str, str]]:
    """Tensors of an optimizer state_dict keyed ``state.<param id>.<slot>`` plus its groups."""
    validate_optimizer_state_dict(osd, str(path))
    ids: list[Any] = []
    names: list[str] | None = []
    groups = []
    group_ids = []
    for g in osd["param_groups"]:
        ids.extend(g["params"])
        group_ids.append(list(g["params"]))
        if names is not None and "param_names" in g:
            names.extend(g["param_names"])
        else:
            names = None
        groups.append({k: v for k, v in g.items() if k not in ("params", "param_names")})
    tensors: dict[str, torch.Tensor] = {}
    skipped: dict[str, str] = {}
    for pid, slots in osd["state"].items():
        if pid not in ids:
            raise CorruptCheckpointError(
                str(path), f"optimizer state has param id {pid!r} absent from param_groups"
            )
        for slot, v in slots.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{pid}.{slot}"] = v
            else:
                skipped[f"state.{pid}.{slot}"] = type(v).__name__
    return tensors, OptimizerInfo(ids, names, groups, group_ids), skipped


class _PickleReader:
    """Loads a ``torch.save`` file with ``weights_only=True``; zip files through ``mmap=True``.

    Why the re-open: a mapped file's touched pages stay resident until unmapped, so after
    ``window`` bytes have been copied out the load is dropped and done again (metadata only).
    """

    def __init__(self, path: Path, fmt: str, key: str | None, trusted: list[Any], window: int):
        self.path, self.fmt, self.key, self.trusted, self.window = path, fmt, key, trusted, window
        self.touched = 0
        self.tensors: dict[str, torch.Tensor] | None = None
        self.container: str | None = None
        self.skipped: dict[str, str] = {}
        self.optimizer: OptimizerInfo | None = None
        self._load()

    def _load(self) -> None:
        try:
            with torch.serialization.safe_globals(self.trusted), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                obj = torch.load(self.path, mmap=self.fmt == "torch-zip", weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafePickleError(str(self.path), [], why=str(e).splitlines()[0]) from None
        except RuntimeError as e:  # torch's zip reader on a damaged archive
            raise CorruptCheckpointError(str(self.path), f"damaged torch.save file: {e}") from None
        except Exception as e:  # noqa: BLE001 - a malformed pickle surfaces as any error type
            raise CorruptCheckpointError(
                str(self.path), f"damaged torch.save file: {type(e).__name__}: {' '.join(str(e).split())}"
            ) from None
        cont, self.container = _pick_container(obj, self.key, self.path)
        skipped: dict[str, str] = {}
        if _is_optimizer_sd(cont):
            tensors, self.optimizer, skipped = _optimizer_view(cont, self.path)
        else:
            tensors = {}
            if isinstance(cont, torch.Tensor):
                tensors[self.container or "tensor"] = cont
            else:
                _flatten(cont, "", tensors, skipped, self.path)
        check_dense_tensors(tensors, str(self.path))
        self.tensors, self.skipped = tensors, skipped
        self.touched = 0

    def get(self, key: str) -> torch.Tensor:
        if self.tensors is None or (self.fmt == "torch-zip" and self.touched > self.window):
            self.tensors = None  # drop the old mapping before mapping again
            self._load()
        # No copy: a view of the mapping (the writer reads it once and drops it); a copy would put
        # every tensor through the heap, where freed blocks are not always returned to the OS.
        t = self.tensors[key].contiguous()
        self.touched += t.nbytes
        return t

    def close(self) -> None:
        self.tensors = None


def _open_pickle(
    path: Path, fmt: str, key: str | None, trusted_globals: Iterable[Any], window: int
) -> Source:
    trusted = resolve_globals(trusted_globals)
    bad = unsafe_globals(path, trusted)
    if bad:
        raise UnsafePickleError(str(path), bad)
    r = _PickleReader(path, fmt, key, trusted, window)
    specs = {k: SourceSpec(k, tuple(t.shape), t.dtype) for k, t in r.tensors.items()}
    notes = []
    if fmt == "torch-legacy":
        notes.append(
            "legacy (non-zip) torch.save format cannot be memory-mapped: it was loaded fully into memory"
        )
    if r.container is not None and key is None:
        notes.append(f"picked container {r.container!r}, the only one holding model tensors")
    return Source(
        path,
        fmt,
        [path.name],
        specs,
        dict.fromkeys(specs, path.name),
        r,
        r.skipped,
        notes,
        r.container,
        r.optimizer,
    )


# -- safetensors -----------------------------------------------------------------------------------
class HFIndex(BaseModel):
    """HF sharded-checkpoint index (``model.safetensors.index.json``): ``weight_map`` key -> file."""

    model_config = ConfigDict(extra="allow")

    metadata: dict[str, Any] = {}
    weight_map: dict[str, str]


def _inside(root: Path, entry: str, index: str) -> Path:
    """``root/entry`` if it stays inside ``root`` (no absolute path, ``..`` or escaping symlink)."""
    if os.path.isabs(entry) or ".." in Path(entry).parts:
        raise UnsafePathError(entry, str(root), "absolute or parent-relative path")
    p = root / entry
    if not p.resolve().is_relative_to(root.resolve()):
        raise UnsafePathError(entry, str(root), "resolves outside the checkpoint directory (symlink)")
    return p


class _FileReader:
    """Per-key reads through ``safetensors.safe_open`` (which validates header and offsets)."""

    def __init__(self, root: Path, files: dict[str, str]):
        self.root, self.files = root, files

    def get(self, key: str) -> torch.Tensor:
        with safe_open(str(self.root / self.files[key]), framework="pt") as f:
            return f.get_tensor(key).contiguous()


def _st_header(path: Path) -> dict[str, SourceSpec]:
    try:
        with open_safetensors(str(path)) as f:
            out = {}
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = SourceSpec(k, tuple(sl.get_shape()), _st_dtype(sl.get_dtype(), path, k))
            return out
    except Exception as e:
        if isinstance(e, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(str(path), f"not a valid safetensors file: {e}") from None


# The writer's own table, so every dtype fqnckpt saves (C64, FNUZ float8s too) can be read back.
_ST_DTYPES = ST_TO_DTYPE


def _st_dtype(name: str, path: Path, key: str) -> torch.dtype:
    try:
        return _ST_DTYPES[name]
    except KeyError:
        raise CorruptCheckpointError(
            str(path), f"tensor {key!r} has dtype {name} torch cannot hold"
        ) from None


def _open_safetensors(path: Path) -> Source:
    if path.is_file() and sniff_file(path) == "safetensors":
        specs = _st_header(path)
        return Source(path, "safetensors", [path.name], specs, dict.fromkeys(specs, path.name),
                      _FileReader(path.parent, dict.fromkeys(specs, path.name)))  # fmt: skip
    root, index_file = (path.parent, path) if path.is_file() else (path, None)
    if index_file is None:
        idx = _index_files(root)
        if len(idx) > 1:
            raise AmbiguousSourceError(str(root), [i.name for i in idx], "several index files")
        index_file = idx[0] if idx else None
    specs: dict[str, SourceSpec] = {}
    file_of: dict[str, str] = {}
    if index_file is not None:
        try:
            index = HFIndex.model_validate_json(index_file.read_bytes())
        except ValidationError as e:
            raise CorruptCheckpointError(str(index_file), f"invalid index: {e.errors()[0]['msg']}") from None
        files = sorted(set(index.weight_map.values()))
        missing = [f for f in files if not _inside(root, f, index_file.name).is_file()]
        if missing:
            raise MissingShardError(str(root), missing, index_file.name)
        headers = {f: _st_header(root / f) for f in files}
        for key, f in index.weight_map.items():
            if key not in headers[f]:
                found = next((g for g, h in headers.items() if key in h), None)
                raise TensorNotInShardError(key, f, found)
            specs[key], file_of[key] = headers[f][key], f
    else:  # shards without an index: every *.safetensors file, each key in exactly one
        files = [f.name for f in _st_files(root)]
        for f in files:
            for key, s in _st_header(root / f).items():
                if key in file_of:
                    raise DuplicateTensorError(key, [file_of[key], f])
                specs[key], file_of[key] = s, f
    src = Source(root, "safetensors-sharded", files, specs, file_of, _FileReader(root, file_of))
    if index_file is not None:
        src.notes.append(f"read the files named by {index_file.name} only")
    return src


# -- DCP ---------------------------------------------------------------------------------------------
_DCP_META_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler for DCP's ``.metadata`` (a plain protocol-4+ pickle that ``weights_only`` cannot
    parse: torch's own reader calls ``pickle.load``). Only DCP metadata classes, torch dtypes,
    ``torch.Size`` and ``pathlib`` paths resolve; any other global is refused (Python docs,
    "Restricting Globals")."""

    def find_class(self, module: str, name: str) -> Any:
        ok = (
            module in _DCP_META_MODULES
            or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "Path"))
        )
        if not ok:
            raise UnsafePickleError("<DCP .metadata>", [f"{module}.{name}"])
        return super().find_class(module, name)


def _dcp_readers():
    from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader

    class SafeFileSystemReader(FileSystemReader):
        """``FileSystemReader`` whose metadata is read once with :class:`_RestrictedUnpickler`."""

        _md = None

        def read_metadata(self, *args: Any, **kwargs: Any):
            if self._md is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                path = Path(self.path) / ".metadata"
                try:
                    with open(path, "rb") as f:
                        md = _RestrictedUnpickler(f).load()
                except UnsafePickleError as e:
                    raise UnsafePickleError(str(path), e.globals) from None
                except Exception as e:
                    raise CorruptCheckpointError(str(path), f"unreadable DCP metadata: {e}") from None
                if getattr(md, "storage_meta", None) is None:
                    md.storage_meta = StorageMeta()
                for info in (md.storage_data or {}).values():
                    _inside(Path(self.path), str(info.relative_path), ".metadata")
                self._md = md
            self._md.storage_meta.load_id = self.load_id
            return self._md

    return SafeFileSystemReader, HuggingFaceStorageReader


class _DCPReader:
    """One ``dcp.load`` per key into a freshly allocated tensor (no process group needed)."""

    def __init__(self, reader: Any, specs: dict[str, SourceSpec]):
        self.reader, self.specs = reader, specs

    def get(self, key: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        s = self.specs[key]
        out = {key: torch.empty(s.shape, dtype=s.dtype)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(out, storage_reader=self.reader, no_dist=True)
        return out[key]


def _open_dcp(path: Path, fmt: str) -> Source:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    safe_fs, hf_reader = _dcp_readers()
    root = path
    if fmt == "dcp-hf-sharded" and (path / "sharded").is_dir() and _dcp_hf_files(path / "sharded"):
        root = path / "sharded"
    reader = safe_fs(str(root)) if fmt == "dcp" else hf_reader(str(root))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        md = reader.read_metadata()
    specs: dict[str, SourceSpec] = {}
    skipped: dict[str, str] = {}
    for k, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            specs[k] = SourceSpec(k, tuple(m.size), m.properties.dtype)
        else:
            skipped[k] = type(m).__name__
    file_of: dict[str, str] = {}
    for idx, info in (md.storage_data or {}).items():
        file_of.setdefault(idx.fqn, os.path.relpath(str(root / str(info.relative_path)), str(path)))
    files = sorted(set(file_of.values()))
    src = Source(path, fmt, files, specs, file_of, _DCPReader(reader, specs), skipped)
    if skipped:
        src.notes.append(f"{len(skipped)} non-tensor DCP entries are not migrated")
    return src


# -- entry point -------------------------------------------------------------------------------------
def open_source(
    path: str | os.PathLike,
    *,
    key: str | None = None,
    trusted_globals: Iterable[Any] = (),
    mmap_window: int = DEFAULT_MMAP_WINDOW,
) -> Source:
    """Open any supported checkpoint at ``path`` for streaming reads (format sniffed by content).

    Args:
        key: for pickles holding several containers (``{"model": sd, "ema": sd}``), which one to
            read (``a/b`` for a nested one); without it the only container holding model tensors
            is used.
        trusted_globals: classes / functions (or ``"module.name"`` strings) a pickle may
            reference beyond the ``weights_only`` safe set; nothing else is ever unpickled.
        mmap_window: bytes copied out of one pickle mmap before it is re-opened (bounds RSS).

    Raises:
        CheckpointNotFoundError: nothing readable at ``path``.
        UnsafePickleError: the pickle references globals outside the safe set (``.globals`` lists them).
        AmbiguousSourceError: several containers and no ``key`` (``.choices`` lists them).
        CorruptCheckpointError, MissingShardError, TensorNotInShardError, UnsafePathError,
        DuplicateTensorError, UnsupportedFormatError: a malformed checkpoint (file and key named).
    """
    p = Path(path)
    fmt = sniff(p)
    if fmt in ("torch-zip", "torch-legacy"):
        f = p
        if p.is_dir():
            f = next(
                x for x in sorted(p.iterdir()) if x.is_file() and x.suffix in (".pt", ".pth", ".bin", ".ckpt")
            )
        return _open_pickle(f, fmt, key, trusted_globals, mmap_window)
    if key is not None:
        raise AmbiguousSourceError(str(p), [], f"key={key!r} applies to pickles only; this is {fmt}")
    if fmt in ("dcp", "dcp-hf-sharded"):
        return _open_dcp(p, fmt)
    return _open_safetensors(p)


@contextlib.contextmanager
def opened(path: str | os.PathLike, **kwargs: Any):
    """``with opened(path) as src:`` form of :func:`open_source`."""
    src = open_source(path, **kwargs)
    try:
        yield src
    finally:
        src.close()


__all__ = [
    "FORMATS",
    "HFIndex",
    "OptimizerInfo",
    "Source",
    "SourceSpec",
    "open_source",
    "opened",
    "sniff",
    "sniff_file",
    "unsafe_globals",
    "resolve_globals",
]
