"""Pure planning of a sharded safetensors checkpoint: which tensor goes to which file, at which bytes.

Given ``TensorSpec``s and ``max_shard_size`` the plan is deterministic, so every rank computes the
same files, headers and byte offsets without talking to the others.

The safetensors header is built here by hand because safetensors has no API to preallocate a file
and let several processes fill byte ranges of it. It follows the safetensors spec
(https://github.com/huggingface/safetensors#format): 8-byte little-endian header length, a JSON
header ``{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets": [begin, end]}}`` padded
with spaces to a multiple of 8, then the data bytes, with offsets relative to the data start and
no holes. Within a file tensors are ordered by element size (largest first), then name, as
safetensors' own writer does, so every tensor starts aligned to its element size.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from .format import MODEL_PREFIX, parse_size
from .st_header import PACKED, ST_DTYPES, header_shape

# safetensors dtype strings, from the torch-free table of checkpoint.storage.st_header.
DTYPE_TO_ST: dict[torch.dtype, str] = {getattr(torch, name): st for st, (name, _) in ST_DTYPES.items()}
ST_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in DTYPE_TO_ST.items()}
HEADER_METADATA = {"format": "pt"}


@dataclass(frozen=True, init=False)
class TensorSpec:
    """A tensor to save: eager ``fqn``, global ``shape`` (elements), ``dtype``. No data.

    Raises (on construction):
        TypeError: ``dtype`` cannot be stored in safetensors, or a 0-dim tensor of a packed dtype.
        ValueError: a negative dimension.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __init__(self, fqn: str, shape: Sequence[int], dtype: torch.dtype) -> None:
        # Written straight into the instance __dict__ (frozen only guards __setattr__): planning
        # and loading build one per tensor, 10^4-10^5 per checkpoint.
        if type(shape) is not tuple or any(type(d) is not int for d in shape):
            shape = tuple(map(int, shape))
        st = DTYPE_TO_ST.get(dtype)
        if st is None:
            raise TypeError(f"tensor {fqn!r}: dtype {dtype} cannot be stored in safetensors")
        if shape and min(shape) < 0:
            raise ValueError(f"tensor {fqn!r}: negative dimension in shape {shape}")
        if not shape and st in PACKED:  # no header shape (st_header.header_shape)
            raise TypeError(f"tensor {fqn!r}: a 0-dim {str(dtype).removeprefix('torch.')} cannot be stored in safetensors")
        # Computed once here: planning reads them several times per tensor (10^5 tensors in MoE
        # checkpoints). Not fields, so equality and hashing stay (fqn, shape, dtype).
        numel = math.prod(shape)
        d = self.__dict__
        d["fqn"], d["shape"], d["dtype"] = fqn, shape, dtype
        d["_numel"], d["_nbytes"] = numel, numel * dtype.itemsize

    @classmethod
    def trusted(cls, fqn: str, shape: tuple[int, ...], dtype: torch.dtype) -> TensorSpec:
        """The spec of a shape and dtype checked already: ``shape`` a tuple of non-negative ints
        and ``dtype`` one safetensors stores (a validated safetensors header's, as
        :class:`checkpoint.storage.reader.CheckpointReader` holds them); the per-dim checks of
        the constructor are skipped (a load asks for the specs of 10^4-10^5 tensors).

        Raises:
            TypeError: a 0-dim tensor of a packed dtype (as the constructor)."""
        if not shape and DTYPE_TO_ST[dtype] in PACKED:
            return cls(fqn, shape, dtype)  # raises
        self = object.__new__(cls)
        numel = math.prod(shape)
        d = self.__dict__
        d["fqn"], d["shape"], d["dtype"] = fqn, shape, dtype
        d["_numel"], d["_nbytes"] = numel, numel * dtype.itemsize
        return self

    @classmethod
    def of(cls, fqn: str, tensor: torch.Tensor) -> TensorSpec:
        """Spec of ``tensor`` (a DTensor gives its global shape).

        Raises:
            TypeError: ``tensor`` is not strided (sparse / mkldnn layouts have no flat bytes to store).
        """
        if tensor.layout != torch.strided:
            raise TypeError(f"{fqn!r} has layout {tensor.layout}; only dense (strided) tensors can be saved")
        return cls(fqn, tuple(tensor.shape), tensor.dtype)

    @property
    def numel(self) -> int:
        return self._numel

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self._nbytes


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor's bytes go: ``file`` and absolute byte range ``[begin, end)`` in it."""

    spec: TensorSpec
    file: str
    begin: int
    end: int


@dataclass(frozen=True)
class FilePlan:
    """One shard file: ``header`` (length prefix + padded JSON), ``slots`` in byte order, ``size`` in bytes."""

    name: str
    header: bytes
    slots: tuple[TensorSlot, ...]
    size: int

    @property
    def data_start(self) -> int:
        return len(self.header)


@dataclass(frozen=True)
class Layout:
    """Every file of a checkpoint part (``model`` or ``optimizer``) and where each tensor lives."""

    prefix: str
    files: tuple[FilePlan, ...]

    # Computed once (cached_property writes the instance __dict__, allowed on a frozen dataclass).
    @cached_property
    def slots(self) -> dict[str, TensorSlot]:
        return {s.spec.fqn: s for f in self.files for s in f.slots}

    @cached_property
    def total_size(self) -> int:
        """Sum of tensor data bytes (HF's ``metadata.total_size``; headers excluded)."""
        return sum(s.end - s.begin for f in self.files for s in f.slots)

    @cached_property
    def weight_map(self) -> dict[str, str]:
        return dict(sorted((s.spec.fqn, f.name) for f in self.files for s in f.slots))

    @cached_property
    def first_slot(self) -> dict[str, int]:
        """File name -> position of its first slot in the layout's slot order."""
        out, n = {}, 0
        for f in self.files:
            out[f.name] = n
            n += len(f.slots)
        return out


def shard_file_name(prefix: str, k: int, n: int) -> str:
    """``model-00001-of-00003.safetensors`` (HF's name; ``k`` counts from 1)."""
    return f"{prefix}-{k:05d}-of-{n:05d}.safetensors"


def build_header(
    entries: Iterable[tuple[TensorSpec, int, int]], metadata: dict[str, str] | None = None
) -> bytes:
    """Header bytes for ``(spec, begin, end)`` entries (offsets relative to the data start)."""
    head: dict[str, object] = {"__metadata__": dict(metadata or HEADER_METADATA)}
    st = DTYPE_TO_ST
    for spec, b, e in entries:
        head[spec.fqn] = {"dtype": st[spec.dtype], "shape": header_shape(st[spec.dtype], spec.shape), "data_offsets": (b, e)}
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _split(specs: Sequence[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    # Greedy in the given order, a tensor larger than the limit alone in its file
    # (huggingface_hub.split_state_dict_into_shards_factory does the same).
    groups: list[list[TensorSpec]] = []
    cur: list[TensorSpec] = []
    size = 0
    for s in specs:
        if cur and size + s.nbytes > max_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += s.nbytes
    if cur:  # no tensors, no files: a file the index cannot name would make the checkpoint unloadable
        groups.append(cur)
    return groups


DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default
# Floor of the default file size of a distributed save split into world-size files: a smaller
# state stays in fewer files (below it, per-file costs - create, header, fsync, index entry -
# outweigh writing files in parallel; tests/bench/shared_writes.py measures the split).
MIN_SPLIT_SHARD_BYTES = 64 * 2**20


def default_shard_size(specs: Sequence[TensorSpec], world: int) -> int:
    """Bytes of tensor data per file when the caller passed no ``max_shard_size``: 5 GB
    (transformers' default) for one process; with ``world`` > 1 ranks,
    ``min(5 GB, max(64 MiB, ceil(total bytes / world)))`` so the state is cut into at least
    ``world`` files once it holds ``world * 64 MiB``. Each rank then starts writing at a file of its
    own (the kernel serializes writers of one file: the inode lock on tmpfs). Depends on
    the specs and ``world`` only: the same on every rank."""
    cap = parse_size(DEFAULT_MAX_SHARD_SIZE)
    if world <= 1:
        return cap
    total = sum(s.nbytes for s in specs)
    return min(cap, max(MIN_SPLIT_SHARD_BYTES, -(-total // world)))


def plan_layout(
    specs: Sequence[TensorSpec],
    max_shard_size: int | str | None = DEFAULT_MAX_SHARD_SIZE,
    prefix: str = MODEL_PREFIX,
    world: int = 1,
) -> Layout:
    """Plan files ``<prefix>-0000k-of-0000n.safetensors`` holding ``specs``, each at most
    ``max_shard_size`` bytes of tensor data (a bigger tensor gets a file of its own).
    ``max_shard_size=None``: :func:`default_shard_size` of ``specs`` for ``world`` ranks.

    Raises:
        ValueError: duplicate FQN, the reserved name ``__metadata__``, or a bad ``max_shard_size``.
        TypeError: a dtype safetensors cannot store.
    """
    max_bytes = default_shard_size(specs, world) if max_shard_size is None else parse_size(max_shard_size)
    seen: set[str] = set()
    for s in specs:
        if s.fqn in seen or s.fqn == "__metadata__":
            raise ValueError(f"tensor name {s.fqn!r} is duplicated or reserved")
        seen.add(s.fqn)
    groups = _split(list(specs), max_bytes)
    return plan_files([(shard_file_name(prefix, k, len(groups)), g) for k, g in enumerate(groups, 1)], prefix)


def plan_files(groups: Sequence[tuple[str, Sequence[TensorSpec]]], prefix: str = MODEL_PREFIX) -> Layout:
    """Plan the files named in ``groups`` (``(file name, specs)`` pairs, in file order), each
    holding exactly its specs: :func:`plan_layout` after its size split, or a caller's own
    assignment (DCP's ``fqn_to_index_mapping``, :mod:`checkpoint.dcp`). Names are not checked
    for duplicates here (:func:`plan_layout` does)."""
    files = []
    for name, group in groups:
        ordered = sorted(group, key=lambda s: (-s.itemsize, s.fqn))
        rel, pos = [], 0
        for s in ordered:
            rel.append((s, pos, pos + s.nbytes))
            pos += s.nbytes
        header = build_header(rel)
        base = len(header)
        slots = tuple(TensorSlot(s, name, base + b, base + e) for s, b, e in rel)
        files.append(FilePlan(name, header, slots, base + pos))
    return Layout(prefix, tuple(files))
