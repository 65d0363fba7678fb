"""DCP (``torch.distributed.checkpoint``) directories as a first-class source: migration and load
(:class:`DCPSource`).

Read through torch's own reader: ``FileSystemReader`` (``.metadata`` + ``*.distcp``) or
``HuggingFaceStorageReader`` (DCP's per-rank safetensors shards) with a ``DefaultLoadPlanner``
whose only change is that non-tensor entries are unpickled with ``weights_only=True`` (torch's
planner uses ``weights_only=False``). ``.metadata`` itself is a plain pickle that
``weights_only`` cannot parse, so it is read with an exact ``(module, name)`` allowlist
(:mod:`checkpoint.sources.unpickle`). Every file named by the metadata passes the one symlink rule
(:mod:`checkpoint.storage.paths`).

Structure comes from the metadata's ``planner_data`` (flat key -> path in the saved nested
state_dict): a model container (``{"model": ...}``) is chosen like a pickle's, and an optimizer
state_dict from ``torch.distributed.checkpoint.state_dict.get_state_dict`` (``{"state": {fqn:
{slot: t}}, "param_groups": [...]}``) is kept apart as the optimizer, keyed by FQN.

Any DCP ``CheckpointException`` (a ``BaseException``) becomes our
:class:`~checkpoint.errors.CorruptCheckpointError` naming DCP, the file, key and rank.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import AmbiguousSourceError, CheckpointError, CorruptCheckpointError
from ..storage import paths
from ..storage.st_header import cover_problem, shape_problem
from .base import OptimizerInfo, Source, SourceSpec
from .sniffing import is_dcp, is_dcp_hf, st_files
from .unpickle import load_dcp_metadata, torch_load
from .training_state import is_training_state

# Bytes of tensors read by one dcp.load call when the read order is known (batches amortise
# DCP's per-call planning; peak memory stays about one batch).
READ_BATCH_BYTES = 64 << 20
# DCP items up to this size are read into memory in one call before torch.load parses them.
SLICE_IN_MEMORY = 1 << 20


def _check_storage_paths(root: Path, md: Any) -> None:
    rels = {
        str(info.relative_path) for info in (md.storage_data or {}).values() if hasattr(info, "relative_path")
    }
    for rel in rels:  # each distinct file once, not once per stored chunk
        # HuggingFaceStorageReader records the full path of each file it globbed in ``root``.
        if os.path.isabs(rel) and os.path.dirname(rel) == os.path.abspath(root):
            rel = os.path.basename(rel)
        paths.member(root, rel)


def _check_dcp_shapes(path: Path, key: str, m: Any) -> None:
    """A DCP tensor's recorded size and every chunk's sizes and offsets: dims torch can hold
    (:func:`~checkpoint.storage.st_header.shape_problem`), chunks covering the tensor exactly once
    (:func:`~checkpoint.storage.st_header.cover_problem`).

    Raises:
        CorruptCheckpointError: names the DCP checkpoint and the tensor.
    """
    size = list(getattr(m, "size", ()) or ())
    chunks = [(list(c.offsets), list(c.sizes)) for c in getattr(m, "chunks", None) or ()]
    why = shape_problem(size)
    for offsets, sizes in chunks:
        why = why or shape_problem(sizes) or shape_problem(offsets)
    why = why or cover_problem(size, chunks)
    if why is not None:
        raise CorruptCheckpointError(str(path), f"DCP tensor {key!r} {why}")


def _display_names(root: Path, path: Path, md: Any) -> dict[str, str]:
    """``relative_path`` as stored -> file name relative to ``path`` (computed once per file)."""
    rels = {str(info.relative_path) for info in (md.storage_data or {}).values()}
    return {r: os.path.relpath(str(root / r), str(path)) for r in rels}


def _readers():
    from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader

    class SafeFileSystemReader(FileSystemReader):
        """``FileSystemReader`` whose metadata is read once with :func:`~checkpoint.sources.unpickle.load_dcp_metadata` (exact globals only)."""

        _md = None

        def read_metadata(self, *args: Any, **kwargs: Any):
            if self._md is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                path = Path(paths.member(self.path, ".metadata"))
                with open(path, "rb") as f:
                    md = load_dcp_metadata(f, str(path))
                if getattr(md, "storage_meta", None) is None:
                    md.storage_meta = StorageMeta()
                _check_storage_paths(Path(self.path), md)
                self._md = md
            self._md.storage_meta.load_id = self.load_id
            return self._md

        def _slice_file(self, file: Any, sinfo: Any):
            # torch.load of an item through DCP's file view makes ~25 seek / tell / readinto
            # calls, each Python; from one read into BytesIO they are C (a load of many small
            # items is faster). Large items keep the view
            # (no second copy in memory). The parse is still torch.load(weights_only=True).
            if not 0 <= sinfo.length <= SLICE_IN_MEMORY or sinfo.offset < 0:
                return super()._slice_file(file, sinfo)  # large, or damaged metadata: DCP's own checks
            file.seek(sinfo.offset)
            data = file.read(sinfo.length)
            if len(data) != sinfo.length:  # the file ends early: DCP's view reports it as DCP does
                return super()._slice_file(file, sinfo)
            return io.BytesIO(data)

    class SafeHFReader(HuggingFaceStorageReader):
        """``HuggingFaceStorageReader`` with the symlink rule applied to the shards it names."""

        _md = None

        def read_metadata(self, *args: Any, **kwargs: Any):
            if self._md is None:
                for f in Path(self.path).glob("*.safetensors"):
                    paths.member(self.path, f.name)
                md = super().read_metadata(*args, **kwargs)
                _check_storage_paths(Path(self.path), md)
                self._md = md
            return self._md

        def read_data(self, plan: Any, planner: Any):
            """Each read item's block read with ``preadv`` (:meth:`CheckpointReader.copy_into`)
            straight into the planner's target. Not torch's ``read_data``: it copies from
            ``safe_open``'s mapping (``get_slice``), and a shard cut or failing while mapped kills
            the process with SIGBUS; here it is an error naming file and tensor."""
            from torch.futures import Future

            from ..storage.opening import open_checkpoint

            per_file: dict[str, list] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for name, reqs in per_file.items():
                with open_checkpoint(name) as rd:
                    for req in reqs:
                        fqn = req.storage_index.fqn
                        slices = [slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths)]
                        target = planner.resolve_tensor(req).detach()
                        if tuple(target.shape) != tuple(req.lengths):
                            raise CorruptCheckpointError(
                                name, f"tensor {fqn!r}: block {tuple(req.lengths)} into a target of shape {tuple(target.shape)}"
                            )
                        if not rd.copy_into(fqn, target, slices):  # not on the CPU
                            target.copy_(rd.get_slice(fqn, slices))
                        planner.commit_tensor(req, target)
            fut: Future = Future()
            fut.set_result(None)
            return fut

    return SafeFileSystemReader, SafeHFReader


def dcp_load_planner(path: str | os.PathLike):
    """A DCP load planner for ``path`` (DCP's own ``DefaultLoadPlanner``: it plans the reads,
    resharding onto the targets' meshes) whose non-tensor entries go through :func:`torch_load`."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._nested_dict import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        """``DefaultLoadPlanner`` unpickling non-tensor entries with ``weights_only=True``."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch_load(value, f"DCP checkpoint {self._path} entry {read_item.dest_index.fqn!r}")
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    planner = SafeLoadPlanner()
    planner._path = os.fspath(path)
    return planner


def _first_failure(e: BaseException) -> tuple[int | None, BaseException]:
    failures = getattr(e, "failures", None) or {}
    for rank, pair in sorted(failures.items()):
        exc = pair[0] if isinstance(pair, tuple) else pair
        return rank, exc
    return None, e


@contextlib.contextmanager
def dcp_errors(
    path: Path, keys: list[str], files: list[str] | None = None, collective: bool = False
) -> Iterator[None]:
    """Turn anything DCP raises (``CheckpointException`` is a ``BaseException``) into our
    :class:`CorruptCheckpointError` naming DCP, the file, the keys and the rank, numbered as in
    the default process group: DCP numbers the ranks of the group it ran on (``collective``: the
    group of :mod:`checkpoint.ranks.dist`, a load's sub-mesh), or calls a load without
    collectives rank 0 (then this process's rank is named)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    except CheckpointError:
        raise
    except (CheckpointException, Exception) as e:  # noqa: BLE001
        rank, inner = _first_failure(e)
        if isinstance(inner, CheckpointError):
            raise inner from None
        if rank is not None:
            from ..ranks import dist

            if dist.active():
                rank = dist.group_ranks()[rank] if collective else dist.rank()
        on = f" on rank {rank}" if rank is not None else ""
        which = repr(keys[0]) if len(keys) == 1 else f"{keys[:5]}{' ...' if len(keys) > 5 else ''}"
        in_files = f" in {sorted(files)[:5]}" if files else ""
        msg = str(inner).strip().splitlines()
        detail = f": {msg[-1]}" if msg else " (truncated or damaged file?)"
        raise CorruptCheckpointError(
            str(path), f"DCP read of {which}{in_files} failed{on}: {type(inner).__name__}{detail}"
        ) from None


def open_metadata(path: Path, fmt: str) -> tuple[Any, Any, Path]:
    """``(storage reader, metadata, root)`` of the DCP checkpoint at ``path``."""
    safe_fs, safe_hf = _readers()
    root = path
    if fmt == "dcp-hf-sharded" and (path / "sharded").is_dir() and is_dcp_hf(path / "sharded"):
        root = path / "sharded"
    # HuggingFaceStorageReader records each shard as the path it globbed (``run/shard-...`` for a
    # relative ``run``): given the absolute path, every record is ``root/<name>`` however the
    # user typed it (relative, ``./``, trailing slash), which _check_storage_paths accepts.
    reader = safe_fs(str(root)) if fmt == "dcp" else safe_hf(os.path.abspath(root))
    # DCP's per-rank safetensors shards have no .metadata: torch builds it from each shard's
    # header (its DCP_SHARDING_INFO), so a failure there names the shards.
    what = [".metadata"] if fmt == "dcp" else ["DCP_SHARDING_INFO headers"]
    shards = None if fmt == "dcp" else [f.name for f in st_files(root)]
    with dcp_errors(root / ".metadata" if fmt == "dcp" else root, what, shards):
        md = reader.read_metadata()
    return reader, md, root


class _DCPReader:
    """Reads tensors through ``dcp.load`` into fresh tensors (no process group needed), in
    batches along the order given by :meth:`read_ahead`."""

    def __init__(
        self, reader: Any, specs: dict[str, SourceSpec], flat: dict[str, str], path: Path, files: dict
    ):
        self.reader, self.specs, self.flat, self.path = reader, specs, flat, path
        self.files = files  # DCP flat key -> files holding its chunks (for error messages)
        self.order: list[str] = []
        self.pos: dict[str, int] = {}
        self.cache: dict[str, torch.Tensor] = {}

    def read_ahead(self, keys: list[str]) -> None:
        self.order = [k for k in keys if k in self.specs]
        self.pos = {k: i for i, k in enumerate(self.order)}

    def _batch(self, key: str) -> list[str]:
        i = self.pos.get(key)
        if i is None:
            return [key]
        out, size = [], 0
        for k in itertools.islice(self.order, i, None):
            s = self.specs[k]
            nb = math.prod(s.shape) * s.dtype.itemsize
            if out and size + nb > READ_BATCH_BYTES:
                break
            out.append(k)
            size += nb
        return out

    def load(self, keys: list[str]) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        out = {self.flat[k]: torch.empty(self.specs[k].shape, dtype=self.specs[k].dtype) for k in keys}
        with dcp_errors(self.path, list(out), self.files_of(list(out))):
            dcp.load(out, storage_reader=self.reader, planner=dcp_load_planner(self.path), no_dist=True)
        return {k: out[self.flat[k]] for k in keys}

    def get(self, key: str) -> torch.Tensor:
        t = self.cache.pop(key, None)
        if t is None:
            got = self.load(self._batch(key))
            t = got.pop(key)
            self.cache = got
        return t

    def read_bytes(self, flat_keys: list[str]) -> dict[str, Any]:
        """Non-tensor entries (param-group hyper-parameters), unpickled with ``weights_only=True``."""
        import torch.distributed.checkpoint as dcp

        out: dict[str, Any] = dict.fromkeys(flat_keys)
        with dcp_errors(self.path, flat_keys, self.files_of(flat_keys)):
            dcp.load(out, storage_reader=self.reader, planner=dcp_load_planner(self.path), no_dist=True)
        return out

    def files_of(self, flat_keys: list[str]) -> list[str]:
        return sorted({f for k in flat_keys for f in self.files.get(k, ())})

    def close(self) -> None:
        self.cache = {}


def _path_of(md: Any, key: str) -> tuple:
    p = (md.planner_data or {}).get(key) if isinstance(md.planner_data, Mapping) else None
    return tuple(p) if p else (key,)


# torchtitan's top-level entries beside the model and optimizer (components/checkpoint.py).
EXTRA_KINDS = ("lr_scheduler", "dataloader", "train_state")


def _opt_part(p: tuple) -> str | None:
    """``"state"`` / ``"param_groups"`` when path ``p`` lies in an optimizer state_dict, nested
    (``get_state_dict``: ``(c, "state", fqn, slot)``) or flattened (torchtitan,
    ``flatten_optimizer_state_dict=True``: ``(c, "state.<fqn>.<slot>")``), else None."""
    if len(p) >= 3 and p[1] in ("state", "param_groups"):
        return p[1]
    if len(p) == 2 and isinstance(p[1], str):
        head = p[1].split(".", 1)[0]
        if head in ("state", "param_groups") and p[1].count(".") >= 2:
            return head
    return None


def _opt_split(p: tuple) -> tuple[str, str]:
    """``(fqn, slot or hyper-parameter)`` of an optimizer path (see :func:`_opt_part`)."""
    if len(p) >= 3:
        return str(p[2]), ".".join(map(str, p[3:]))
    fqn, _, name = p[1].split(".", 1)[1].rpartition(".")
    return fqn, name


def _optimizer_containers(md: Any) -> set[str]:
    """Top-level containers shaped like an optimizer state_dict: every entry under ``state`` or
    ``param_groups`` (nested or flattened, :func:`_opt_part`), both present."""
    seen: dict[str, set[str | None]] = {}
    for k in md.state_dict_metadata:
        p = _path_of(md, k)
        if len(p) >= 2:
            seen.setdefault(str(p[0]), set()).add(_opt_part(p))
    return {c for c, parts in seen.items() if parts == {"state", "param_groups"}}


def classify_entries(md: Any, model: str | None, optimizer: str | None) -> dict[str, str]:
    """Kind of every top-level entry of a DCP checkpoint: ``model`` (the model container, or each
    top-level tensor), ``optimizer``, torchtitan's :data:`EXTRA_KINDS`, else ``other``."""
    out: dict[str, str] = {}
    for k, m in md.state_dict_metadata.items():
        p = _path_of(md, k)
        top = str(p[0])
        if top == optimizer:
            out[top] = "optimizer"
        elif top == model or (len(p) == 1 and hasattr(m, "chunks") and model is None):
            out[top] = "model"
        elif top in EXTRA_KINDS:
            out[top] = top
        else:
            out.setdefault(top, "other")
    return out


def _per_file(md: Any, root: Path, path: Path) -> dict[str, dict[str, int]]:
    """True per-file figures: tensor chunks stored in each file (a tensor split over ranks counts
    in every file holding a chunk of it, with that chunk's bytes)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    chunk_bytes: dict[tuple, int] = {}
    for k, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            for c in m.chunks:
                chunk_bytes[(k, tuple(c.offsets))] = math.prod(c.sizes) * m.properties.dtype.itemsize
    out: dict[str, dict[str, Any]] = {}
    names = _display_names(root, path, md)
    for idx, info in (md.storage_data or {}).items():
        f = names[str(info.relative_path)]
        d = out.setdefault(f, {"tensors": set(), "bytes": 0})
        off = tuple(idx.offset) if idx.offset is not None else None
        nb = chunk_bytes.get((idx.fqn, off))
        if nb is not None:
            d["tensors"].add(idx.fqn)
            d["bytes"] += nb
    return {f: {"tensors": len(d["tensors"]), "bytes": d["bytes"]} for f, d in sorted(out.items())}


@dataclass
class DCPSource(Source):
    """A :class:`Source` over a DCP checkpoint, also ``load``'s reader of it: :meth:`prefetch`
    runs one ``dcp.load`` into fresh tensors shaped like the targets, in the stored dtype
    (``torch.empty_like``: a DTensor keeps its mesh and placements, so DCP's own planner reads
    only this rank's slices, resharding onto any mesh); the value checks then look at these
    buffers (:meth:`read_block`), and :mod:`checkpoint.apply` copies them into the targets.
    Collective (every rank calls it) when a process group is active and a target is a DTensor.
    No checksums, no alias groups (DCP stores neither)."""

    _bufs: dict[str, torch.Tensor] = field(default_factory=dict)
    kind = "DCP checkpoint"

    def prefetch(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """Read every ``(key, target)`` in one ``dcp.load`` (see the class docstring).

        Raises:
            CorruptCheckpointError / UnsafePickleError: DCP failed (names DCP, file, keys, rank).
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.tensor import DTensor

        from ..ranks import dist

        flat = self._reader.flat
        bufs = {}
        for k, t in pairs:
            s = self.spec(k)
            # Shaped like the target (a DTensor keeps mesh and placements: DCP reshards), in the
            # stored dtype; a state tensor of another shape (an optimizer's step) is read whole.
            like = tuple(t.shape) == tuple(s.shape) and not t.is_meta
            bufs[flat[k]] = torch.empty_like(t, dtype=s.dtype) if like else torch.empty(s.shape, dtype=s.dtype)
        if not bufs:
            return
        collective = dist.active() and any(isinstance(b, DTensor) for b in bufs.values())
        with dcp_errors(self.path, list(bufs), self._reader.files_of(list(bufs)), collective):
            dcp.load(bufs, storage_reader=self._reader.reader, planner=dcp_load_planner(self.path),
                     no_dist=not collective, process_group=dist.current_group())  # (the load's mesh ranks)
        self._bufs.update({k: bufs[flat[k]] for k, _ in pairs})

    def read_block(self, key: str, t: torch.Tensor) -> torch.Tensor | None:
        """This rank's block of ``key`` as prefetched for target ``t`` (None if not prefetched)."""
        from torch.distributed.tensor import DTensor

        b = self._bufs.get(key)
        if b is None:
            return None
        return b.to_local() if isinstance(b, DTensor) else b

    def entry_kinds(self) -> dict[str, str]:
        """Kind of every top-level entry (see :func:`classify_entries`)."""
        return dict(self._reader.kinds)

    def extra_entries(self) -> dict[str, Any]:
        """Every top-level entry that is neither model nor optimizer (torchtitan's
        ``lr_scheduler``, ``dataloader``, ``train_state``; anything else), rebuilt as saved:
        nested dicts / lists of values and tensors (non-tensors unpickled ``weights_only``)."""
        return read_entries(self, self._reader.extra_keys)

    def close(self) -> None:
        self._bufs = {}
        super().close()


def open_dcp(path: Path, fmt: str, key: str | None = None, read_optimizer: bool = True) -> DCPSource:
    """A :class:`DCPSource` over a DCP directory (see module docstring).

    ``key``: which top-level container holds the model when several do (``"model"``).
    ``read_optimizer``: False skips reading the optimizer's param groups (a model-only load).

    Raises:
        UnsafePickleError: ``.metadata`` references a global outside DCP's metadata classes.
        CorruptCheckpointError: unreadable metadata or param groups (DCP, file and key named).
        AmbiguousSourceError: several model containers and no ``key``.
        UnsafePathError: the metadata names a file that is not a plain name, or a symlink leads out.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader, md, root = open_metadata(path, fmt)
    optim = _optimizer_containers(md)
    tensor_keys = [k for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)]
    tensor_set = set(tensor_keys)
    for k in tensor_keys:
        _check_dcp_shapes(path, k, md.state_dict_metadata[k])
    other = [k for k in md.state_dict_metadata if k not in tensor_set]
    containers = list(dict.fromkeys(str(_path_of(md, k)[0]) for k in tensor_keys if len(_path_of(md, k)) > 1))
    model_like = [c for c in containers if c not in optim and c not in EXTRA_KINDS]
    # Top-level tensors named like training state (step, rng...) beside a model container are
    # extra state, as pickles treat them (checkpoint.sources.training_state), not model keys.
    beside = {k for k in tensor_keys if len(_path_of(md, k)) == 1 and is_training_state(str(_path_of(md, k)[0]))}
    beside = beside if model_like else set()
    top_level = any(len(_path_of(md, k)) == 1 and k not in beside for k in tensor_keys)
    if top_level and key is None and model_like:
        raise AmbiguousSourceError(
            str(path), model_like, "model tensors at the top level and other containers holding tensors "
            "(not an optimizer, lr_scheduler, dataloader or train_state); pick the model with key=",
        )  # fmt: skip
    if key is not None:
        if key not in containers:
            raise AmbiguousSourceError(
                str(path), containers, f"key {key!r} is not a DCP container holding tensors"
            )
        container = key
    elif top_level or not model_like:
        container = None
    elif len(model_like) == 1:
        container = model_like[0]
    else:
        raise AmbiguousSourceError(
            str(path), model_like, "several DCP containers hold tensors; pick one with key="
        )
    opt_name = None
    if container is not None or top_level:
        left = [c for c in optim if c != container]
        if len(left) > 1:
            raise AmbiguousSourceError(
                str(path), left, "several optimizer state_dicts; pick the model with key="
            )
        opt_name = left[0] if left else None
    elif len(optim) == 1:
        opt_name = next(iter(optim))

    specs: dict[str, SourceSpec] = {}
    extra: dict[str, SourceSpec] = {}
    flat: dict[str, str] = {}
    file_of: dict[str, str] = {}
    first_file: dict[str, str] = {}
    all_files: dict[str, set[str]] = {}
    names = _display_names(root, path, md)
    for idx, info in (md.storage_data or {}).items():
        f = names[str(info.relative_path)]
        first_file.setdefault(idx.fqn, f)
        all_files.setdefault(idx.fqn, set()).add(f)
    opt_state: dict[str, tuple[str, str]] = {}
    extra_tensors: list[str] = []
    left_out: list[str] = []
    skipped: dict[str, str] = {}
    separate = container is not None or top_level
    for k in tensor_keys:
        m = md.state_dict_metadata[k]
        p = _path_of(md, k)
        if opt_name is not None and str(p[0]) == opt_name:
            if _opt_part(p) != "state" or (len(p) >= 3 and len(p) < 4):
                raise CorruptCheckpointError(
                    str(path), f"DCP optimizer tensor {k!r} is not under 'state.<fqn>.<slot>'"
                )
            name = k
            opt_state[name] = _opt_split(p)
            (extra if separate else specs)[name] = SourceSpec(name, tuple(m.size), m.properties.dtype)
        elif (len(p) > 1 and str(p[0]) in EXTRA_KINDS and str(p[0]) != container) or k in beside:
            extra_tensors.append(k)  # lr_scheduler / dataloader / train_state: extra state
            continue
        elif container is not None and str(p[0]) != container:
            if len(p) > 1:
                left_out.append(str(p[0]))
                continue
            name = k  # a top-level tensor beside the containers
            specs[name] = SourceSpec(name, tuple(m.size), m.properties.dtype)
        else:
            name = ".".join(map(str, p[1:])) if container is not None else k
            if name in specs or name in flat:
                raise CorruptCheckpointError(str(path), f"two DCP entries both name tensor {name!r}")
            specs[name] = SourceSpec(name, tuple(m.size), m.properties.dtype)
        flat[name] = k
        file_of[name] = first_file.get(k, "")
    pg_keys = [
        k for k in other if opt_name is not None and str(_path_of(md, k)[0]) == opt_name
        and _opt_part(_path_of(md, k)) == "param_groups"
    ]  # fmt: skip
    dreader = _DCPReader(reader, {**specs, **extra}, flat, path, all_files)
    dreader.md = md
    dreader.kinds = classify_entries(md, container, opt_name)
    dreader.extra_keys = {}  # top-level entry -> its DCP keys (not model, not optimizer)
    for k in md.state_dict_metadata:
        top = str(_path_of(md, k)[0])
        if dreader.kinds.get(top) not in ("model", "optimizer"):
            dreader.extra_keys.setdefault(top, []).append(k)
    in_extra = {k for ks in dreader.extra_keys.values() for k in ks}
    for k in other:  # non-tensor entries of the model / optimizer containers (extra state is read)
        if k not in pg_keys and k not in in_extra:
            skipped[k] = type(md.state_dict_metadata[k]).__name__
    info = None
    if opt_name is not None and read_optimizer:
        info = _optimizer_info(md, pg_keys, dreader, opt_state, path)
        info.separate, info.container = separate, opt_name
    files = sorted(set(first_file.values()))
    src = DCPSource(path, fmt, files, specs, file_of, dreader, skipped, [], container, info, extra,
                    _per_file(md, root, path))  # fmt: skip
    src.extra_state = {t: dreader.kinds[t] for t in dreader.extra_keys}
    src._stored = {name: k for name, k in flat.items() if name != k}  # errors name the DCP key
    if container is not None and key is None:
        src.notes.append(f"picked DCP container {container!r}, the only one holding model tensors")
    if left_out:
        src.notes.append(f"DCP containers not migrated (key={key!r} chose one): {sorted(set(left_out))}")
    if info is not None and separate:
        src.notes.append(f"optimizer state {opt_name!r} (keyed by FQN): written to the optimizer files")
    if src.extra_state:
        src.notes.append(
            f"entries {sorted(src.extra_state)} are extra state: migrated to extra_state.json, "
            "restored by load(extra_state=...)"
        )
    if skipped:
        src.notes.append(f"{len(skipped)} non-tensor DCP entries are not migrated")
    return src


def _optimizer_info(
    md: Any, pg_keys: list[str], reader: _DCPReader, state: dict, path: Path
) -> OptimizerInfo:
    values = reader.read_bytes(pg_keys) if pg_keys else {}
    groups: dict[int, dict[str, Any]] = {}
    if pg_keys and len(_path_of(md, pg_keys[0])) == 2:
        groups = _flat_groups(md, pg_keys, values)
        pg_keys = []
    for k in pg_keys:
        p = _path_of(md, k)
        if len(p) < 4:
            raise CorruptCheckpointError(
                str(path), f"DCP param group entry {k!r} is not 'param_groups.<i>.<name>'"
            )
        groups.setdefault(int(p[2]), {})[".".join(map(str, p[3:]))] = values[k]
    ids: list[str] = []
    hyper, group_ids = [], []
    for i in sorted(groups):
        g = groups[i]
        params = g.pop("params", None)
        if not isinstance(params, (list, tuple)) or not all(isinstance(x, str) for x in params):
            raise CorruptCheckpointError(
                str(path),
                f"DCP optimizer param_groups.{i}.params is not a list of FQNs (get_state_dict layout)",
            )
        g.pop("param_names", None)
        ids.extend(params)
        group_ids.append(list(params))
        hyper.append(g)
    known = set(ids)
    for k, (fqn, _) in state.items():
        if fqn not in known:
            raise CorruptCheckpointError(
                str(path), f"DCP optimizer state {k!r}: {fqn!r} is in no param group"
            )
    return OptimizerInfo(ids, list(ids), hyper, group_ids, dict(state))


def read_entries(src: Source, keys: dict[str, list[str]]) -> dict[str, Any]:
    """``{top-level entry: value}`` for the DCP keys of each entry (``keys`` from
    ``_DCPReader.extra_keys``), rebuilt along the saved paths (dict keys, list indices)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    r = src._reader
    md = r.md
    flat = [k for ks in keys.values() for k in ks]
    tensors = [k for k in flat if isinstance(md.state_dict_metadata[k], TensorStorageMetadata)]
    values: dict[str, Any] = r.read_bytes([k for k in flat if k not in set(tensors)]) if flat else {}
    if tensors:
        import torch.distributed.checkpoint as dcp

        out = {k: torch.empty(md.state_dict_metadata[k].size, dtype=md.state_dict_metadata[k].properties.dtype)
               for k in tensors}  # fmt: skip
        with dcp_errors(r.path, tensors, r.files_of(tensors)):
            dcp.load(out, storage_reader=r.reader, planner=dcp_load_planner(r.path), no_dist=True)
        values.update(out)
    result: dict[str, Any] = {}
    for top, ks in keys.items():
        for k in ks:
            p = _path_of(md, k)
            if len(p) == 1:
                result[top] = values[k]
                continue
            cur = result.setdefault(top, {})
            for seg, nxt in zip(p[1:-1], p[2:]):
                cur = _child(cur, seg, [] if isinstance(nxt, int) else {})
            _put(cur, p[-1], values[k])
    return result


def _child(cur: Any, seg: Any, empty: Any) -> Any:
    if isinstance(cur, list):
        while len(cur) <= seg:
            cur.append(None)
        if cur[seg] is None:
            cur[seg] = empty
        return cur[seg]
    return cur.setdefault(seg, empty)


def _put(cur: Any, seg: Any, value: Any) -> None:
    if isinstance(cur, list):
        while len(cur) <= seg:
            cur.append(None)
    cur[seg] = value


def _flat_groups(md: Any, pg_keys: list[str], values: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Param groups of a flattened optimizer state_dict (``param_groups.<fqn>.<name>`` per
    parameter, torch's ``_flatten_optim_state_dict``): parameters with equal hyper-parameters form
    one group, in the order first seen."""
    per_param: dict[str, dict[str, Any]] = {}
    for k in pg_keys:
        fqn, name = _opt_split(_path_of(md, k))
        per_param.setdefault(fqn, {})[name] = values[k]
    groups: list[dict[str, Any]] = []
    for fqn, hyper in per_param.items():
        g = next((g for g in groups if {n: v for n, v in g.items() if n != "params"} == hyper), None)
        if g is None:
            g = {**hyper, "params": []}
            groups.append(g)
        g["params"].append(fqn)
    return dict(enumerate(groups))


def dcp_format(path: str | os.PathLike) -> str | None:
    """``"dcp"`` / ``"dcp-hf-sharded"`` when ``path`` is a DCP directory, else None (cheap: no
    header of a plain safetensors checkpoint is parsed); None too for a directory removed while
    it is being looked at (its reader then finds nothing)."""
    p = Path(path)
    if not p.is_dir():
        return None
    try:
        return _dcp_dir_format(p)
    except CheckpointError:
        raise
    except (FileNotFoundError, NotADirectoryError):  # removed meanwhile (a retention, rm -r)
        return None


def _dcp_dir_format(p: Path) -> str | None:
    if is_dcp(p):
        return "dcp"
    if (p / "model.safetensors.index.json").exists() or (p / "model.safetensors").exists():
        return None  # the consolidated Hugging Face files win over DCP's sharded/ (see sniff)
    if ((p / "sharded").is_dir() and is_dcp_hf(p / "sharded")) or is_dcp_hf(p):
        return "dcp-hf-sharded"
    return None


__all__ = ["DCPSource", "open_dcp", "dcp_format", "dcp_errors", "READ_BATCH_BYTES"]
