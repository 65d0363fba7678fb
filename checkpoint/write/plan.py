"""Stage 1 of the write pipeline, plan: which tensors go to which shard file at which bytes, which
rank writes which bytes, and every check a checkpoint must pass before its first byte is written.

Pure (no I/O but the nested-checkpoint check): every rank plans the same files from the same specs
(:func:`checkpoint.storage.layout.plan_layout`), so the ranks of a distributed save agree without
talking, and the one exchange of the pipeline only compares what they planned
(:func:`check_same_arguments`, :func:`check_same_tensors`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fqn import FQNMapFile

from ..errors import NestedCheckpointError, RankMismatchError
from ..peft_state import ADAPTER_WEIGHTS
from ..storage import limits
from ..storage.format import FileRecordV2, OptimizerMeta, parse_size
from ..storage.layout import Layout, TensorSpec, plan_files, plan_layout, shard_file_name
from ..storage.local_commit import enclosing_checkpoint
from ..storage.location import local_path


@dataclass
class Part:
    """One indexed part of a checkpoint (``model`` or ``optimizer``): the tensors' ``specs`` (eager
    FQN, global shape, dtype), ``fetch(spec)`` returning each tensor when the writer reaches it
    (a plain tensor or a DTensor of exactly that global shape and dtype), and what its index
    records besides the tensors."""

    prefix: str
    specs: list[TensorSpec]
    fetch: Callable[[TensorSpec], torch.Tensor]
    alias_groups: list[list[str]] = field(default_factory=list)
    fqn_map: FQNMapFile | None = None
    optimizer: OptimizerMeta | None = None
    extra_shards: dict[str, FileRecordV2] | None = None  # FqnckptMeta.extra_shards (the model part)


def refuse_nested(path: Any) -> None:
    """Refuse a local save into a folder inside another checkpoint's directory
    (:func:`checkpoint.storage.local_commit.enclosing_checkpoint`): that checkpoint's overwrite and retention
    manage only their own files, and readers of it would meet the inner one's. The one rule of
    ``save``, ``async_save``, ``migrate``, conversions and DCP's ``StorageWriter``. A URL's store
    (no folders) passes.

    Raises:
        NestedCheckpointError: naming ``path`` and the enclosing checkpoint."""
    local = local_path(path)
    if local is None:
        return
    outer = enclosing_checkpoint(local)
    if outer is not None:
        raise NestedCheckpointError(local, outer)


def check_extra_names(names: Sequence[str]) -> None:
    """Extra files of a save (``{name: bytes}`` written beside the shards) are plain, visible file
    names that are neither shards nor indexes; peft's ``adapter_model.safetensors`` is the one
    ``.safetensors`` allowed (:mod:`checkpoint.peft_state`).

    Raises:
        ValueError: naming the first name that is not."""
    for name in names:
        if name == ADAPTER_WEIGHTS:
            continue
        if not name or "/" in name or "\\" in name or name.startswith(".") or name.endswith(".safetensors"):
            raise ValueError(f"extra file name {name!r} must be a plain file name, not hidden, not .safetensors")
        if name.endswith(".safetensors.index.json"):
            raise ValueError(f"extra file name {name!r} is reserved for indexes")


def spec_of(path: str, fqn: str, tensor: torch.Tensor) -> TensorSpec:
    """The spec of ``tensor`` saved as ``fqn`` (a DTensor: its global shape), after the checks
    safetensors needs of a name and a tensor (:mod:`checkpoint.storage.limits`).

    Raises:
        UnsavableError / UnsavableTypeError: naming ``fqn`` (a name safetensors cannot hold, a
            dtype or layout it cannot store)."""
    limits.check_name(fqn, path)
    limits.check_tensor(fqn, tensor, path)
    return TensorSpec.of(fqn, tensor)


def layouts_of(parts: Sequence[Part], max_shard_size, world: int = 1) -> list[Layout]:
    """Each part's files (:func:`checkpoint.storage.layout.plan_layout`, ``max_shard_size=None``:
    its default for ``world`` ranks), unchecked: what :func:`plan_parts` plans, for callers that
    must know the files before writing (``async_save``'s staging, ``migrate``'s read-ahead)."""
    return [plan_layout(p.specs, max_shard_size, p.prefix, world) for p in parts]


def layout_by_index(specs: Sequence[TensorSpec], mapping: Mapping[str, int], prefix: str, path: str) -> Layout:
    """Files chosen by the caller: ``mapping[fqn] = k`` puts the tensor in
    ``<prefix>-0000k-of-0000N.safetensors`` (``N``: the largest ``k``), as torch's
    ``HuggingFaceStorageWriter`` takes ``fqn_to_index_mapping``.

    Raises:
        ValueError: a spec missing from ``mapping``, or an index that is not an int >= 1."""
    missing = sorted(s.fqn for s in specs if s.fqn not in mapping)
    if missing:
        raise ValueError(f"saving {path}: fqn_to_index_mapping has no file index for {missing[:10]}")
    bad = sorted({k for k in mapping.values() if not isinstance(k, int) or isinstance(k, bool) or k < 1})
    if bad:
        raise ValueError(f"saving {path}: fqn_to_index_mapping file indexes must be ints >= 1, got {bad}")
    n = max(mapping.values(), default=1)
    by_file: dict[int, list[TensorSpec]] = {}
    for s in specs:
        by_file.setdefault(mapping[s.fqn], []).append(s)
    return plan_files([(shard_file_name(prefix, k, n), by_file[k]) for k in sorted(by_file)], prefix)


def plan_parts(
    path: str, parts: Sequence[Part], max_shard_size, world: int = 1, layouts: Sequence[Layout] | None = None
) -> list[Layout]:
    """Plan every part's files (or take ``layouts``, planned by the caller) and check everything
    safetensors must be able to read back (names, aliases, header sizes; dtypes were checked when
    the specs were made) before anything is written: a checkpoint no reader can open is never
    committed. Linear in the number of tensors. ``max_shard_size=None``: each part's default for
    ``world`` ranks (:func:`checkpoint.storage.layout.default_shard_size`). A local ``path``
    inside another checkpoint is refused first (:func:`refuse_nested`).

    Raises:
        NestedCheckpointError, UnsavableError: naming the path, key or file (or
            ``max_shard_size`` and its value, :func:`checkpoint.storage.format.parse_size`)."""
    refuse_nested(path)
    if max_shard_size is not None:
        parse_size(max_shard_size, str(path))
    for part in parts:
        for spec in part.specs:
            limits.check_name(spec.fqn, path)
        for group in part.alias_groups:
            for name in group:
                limits.check_name(name, path)
    planned = list(layouts) if layouts is not None else layouts_of(parts, max_shard_size, world)
    for lay in planned:
        for f in lay.files:
            limits.check_header(f, path)
    return planned


# -- which rank writes which bytes ---------------------------------------------------------------


def plain_writer(slot_index: int, world: int) -> int:
    """The rank that writes a plain tensor (the same on every rank) of a distributed save: the
    ``slot_index``-th slot of its part's layout goes to rank ``slot_index % world``."""
    return slot_index % world


def writes_shard(t: DTensor) -> bool:
    """Whether this rank writes its local shard of DTensor ``t``: it is in the mesh and its
    coordinate is 0 on every mesh dim that does not shard ``t`` (one writer per replica group)."""
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return False
    return all(isinstance(p, (Shard, _StridedShard)) or coord[d] == 0 for d, p in enumerate(t.placements))


def whole_on_writer(t: torch.Tensor) -> bool:
    """Whether the rank that writes ``t`` holds all of it (a plain tensor; a DTensor sharded on no
    mesh dim of more than one rank): decided from placements alone, so every rank agrees."""
    if not isinstance(t, DTensor):
        return True
    mesh = t.device_mesh
    return all(
        not isinstance(p, (Shard, _StridedShard)) or mesh.size(d) == 1 for d, p in enumerate(t.placements)
    )


def slots_written_elsewhere(
    parts: Sequence[Part], max_shard_size, rank: int, world: int, by_file: bool = False
) -> set[tuple[str, str]]:
    """(prefix, FQN) of the slots another rank writes if their tensor is plain: on a local path the
    k-th slot of a part's layout goes to :func:`plain_writer`; on object storage (``by_file``) the
    j-th file of all parts is uploaded by rank ``j % world`` (:mod:`checkpoint.write.upload`)."""
    out = set()
    j = 0
    for part, lay in zip(parts, layouts_of(parts, max_shard_size, world)):
        k = 0
        for f in lay.files:
            for slot in f.slots:
                if (j % world if by_file else plain_writer(k, world)) != rank:
                    out.add((part.prefix, slot.spec.fqn))
                k += 1
            j += 1
    return out


def write_orders(file_names: Sequence[str], world: int) -> list[list[int]]:
    """For the slots in the common order (``file_names[k]``: the shard file of slot ``k``, slots of
    one file consecutive): the order each rank writes them in, as indices. Rank ``r`` starts at
    file ``r * files // world`` and wraps around, so while there are as many files as ranks, ranks
    write different files at a time.

    Why: the kernel serializes writers of one file (the inode lock, held across each write's copy on
    tmpfs), so ranks going through the files in one order wait for each other; starting at
    different files comes close to each rank writing a file of its own
    (``tests/bench/shared_writes.py`` measures the three)."""
    n = len(file_names)
    return [walk(first, n) for first in walk_starts(file_names, world)]


def walk_starts(file_names: Sequence[str], world: int) -> list[int]:
    """The slot each rank starts its walk at (see :func:`write_orders`)."""
    starts = [k for k, name in enumerate(file_names) if k == 0 or name != file_names[k - 1]]
    return [starts[r * len(starts) // world] if starts else 0 for r in range(world)]


def walk(first: int, n: int) -> list[int]:
    """Slots ``first .. n-1`` then ``0 .. first-1``."""
    return list(range(first, n)) + list(range(first))


# -- what the ranks planned must agree -----------------------------------------------------------


def check_same_arguments(what: str, per_rank: Sequence[tuple], names: Sequence[str]) -> None:
    """Refuse a collective call whose ranks were given different arguments (``per_rank[r]``: rank
    ``r``'s values, in the order of ``names``): only rank 0's would take effect (it commits) and
    the others' would be ignored without a word, e.g. a destination per rank. The same verdict
    on every rank (every rank holds the same gathered values).

    Raises:
        RankMismatchError: naming the first argument that differs and each rank's value.
    """
    for i, name in enumerate(names):
        values = {r: repr(v[i]) for r, v in enumerate(per_rank)}
        if len(set(values.values())) > 1:
            raise RankMismatchError(what, name, values)


def check_same_tensors(path: Any, fingerprints: Sequence[list]) -> None:
    """Ranks whose planned files differ (``fingerprints[r]``: rank ``r``'s ``[(file, header)]``
    per part): name the first tensor whose shape or dtype differs between ranks, or that some
    rank lacks, from the safetensors headers they planned. The same verdict on every rank.

    Raises:
        RankMismatchError: naming the tensor and each rank's shape and dtype ("absent")."""
    per_rank: list[dict[str, str]] = []
    for fp in fingerprints:
        seen: dict[str, str] = {}
        for files in fp:
            for _, header in files:
                n = int.from_bytes(header[:8], "little")
                for k, v in json.loads(header[8 : 8 + n]).items():
                    if k != "__metadata__":
                        seen[k] = f"{v['shape']} {v['dtype']}"
        per_rank.append(seen)
    for key in sorted({k for seen in per_rank for k in seen}):
        values = {r: seen.get(key, "absent") for r, seen in enumerate(per_rank)}
        if len(set(values.values())) > 1:
            raise RankMismatchError(
                f"saving {path}", f"the shape and dtype of tensor {key!r}", values,
                note="each rank must save the same tensors; nothing was committed",
            )  # fmt: skip
