"""``extra_state``: the rest of a training state (step, LR scheduler, dataloader, RNG states) saved
beside the model as one JSON file, ``extra_state.json``, inside the checkpoint's atomic commit.

Each entry of the caller's ``Mapping[str, Any]`` is either

- an object with ``state_dict()`` and ``load_state_dict()`` (LR schedulers, dataloaders, user
  objects): saved as its ``state_dict()``, restored in place with ``load_state_dict``; or
- a plain value: ``None``, ``bool``, ``int`` (any size), ``float`` (including inf, -inf, nan and
  -0.0, stored bit-exactly as ``float.hex``), ``str``, ``bytes`` (kept exactly, never unpickled:
  torchtitan's dataloader state is ``pickle.dumps`` bytes), a tensor (e.g. ``torch.get_rng_state()``:
  dtype, shape and bytes stored exactly, read back on CPU), and lists, tuples and dicts (str or
  int keys) of these; on load the caller's dict gets the saved value under the same key.

On many ranks the file holds rank 0's entries (written once, like the index); a save whose
ranks pass different extra state warns, naming the ranks. Values that belong to one rank (RNG
states of ranks seeded apart, a rank's own data position) are wrapped in :class:`PerRank`: every
rank's value is saved, in ``extra_state.rank-RRRRR-of-WWWWW.json`` (same schema, one file a rank,
listed with the world size in ``extra_state.json``'s ``per_rank``), and restored on the same rank.
On another world size, an entry is re-derived by its ``reshard`` rule from every saved rank's
value, or the load stops naming it (:mod:`checkpoint.plan.extra_state`).

The file follows the pydantic schema :class:`ExtraStateFile`. Tensors are written inline
(base64 of their row-major bytes, safetensors dtype names) because extra state is small (an RNG
state is ~5 KB) and keeping it in one JSON file needs no second tensor container; large tensors
belong in the module. ``sha256`` covers the canonical JSON of ``entries``, so a flipped byte is
caught on load (safetensors files get theirs from the index; this file has none).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, field_validator

from ..errors import ChecksumMismatchError, CorruptCheckpointError, MissingShardError
from ..storage.layout import DTYPE_TO_ST, ST_TO_DTYPE
from .format import EXTRA_STATE_FILE
from .urls import is_url
from .limits import json_int_problem
from .bytestore import LocalStore
from .commit import MODEL_INDEX, parse_index, recorded_object
from .paths import check_name
from .st_header import shape_problem

REPORT_PREFIX = "extra_state."  # LoadReport names of entries: "extra_state.<key>"
_MAX_DEPTH = 64


class _Node(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NoneNode(_Node):
    kind: Literal["none"] = "none"


class BoolNode(_Node):
    kind: Literal["bool"] = "bool"
    value: bool


class IntNode(_Node):
    kind: Literal["int"] = "int"
    value: StrictInt


class FloatNode(_Node):
    """``hex``: ``float.hex()`` (exact bits; ``inf``, ``-inf``, ``nan`` included)."""

    kind: Literal["float"] = "float"
    hex: StrictStr


class StrNode(_Node):
    kind: Literal["str"] = "str"
    value: StrictStr


class BytesNode(_Node):
    """``bytes`` (base64), kept exactly and never interpreted: torchtitan's dataloader stores its
    state as ``pickle.dumps`` bytes, which only its owner's ``load_state_dict`` unpickles."""

    kind: Literal["bytes"] = "bytes"
    data: StrictStr


class TensorNode(_Node):
    """A dense tensor: safetensors ``dtype`` name, ``shape`` (elements), base64 of its bytes."""

    kind: Literal["tensor"] = "tensor"
    dtype: StrictStr
    shape: list[Annotated[int, Field(ge=0)]]
    data: StrictStr

    @field_validator("shape")
    @classmethod
    def _torch_holds(cls, v: list[int]) -> list[int]:
        why = shape_problem(v)  # the one shape rule of every reader (st_header.shape_problem)
        if why is not None:
            raise ValueError(f"tensor {why}")
        return v


class ListNode(_Node):
    kind: Literal["list", "tuple"] = "list"
    items: list[Node]


class DictNode(_Node):
    """Keys in insertion order; a key is a str or an int (JSON keeps them apart)."""

    kind: Literal["dict"] = "dict"
    items: list[tuple[StrictStr | StrictInt, Node]]


Node = Annotated[
    NoneNode | BoolNode | IntNode | FloatNode | StrNode | BytesNode | TensorNode | ListNode | DictNode,
    Field(discriminator="kind"),
]
ListNode.model_rebuild()
DictNode.model_rebuild()


class ExtraStateEntry(BaseModel):
    """One entry: ``stateful`` if it was saved through ``state_dict()`` (``class_name`` of the object)."""

    model_config = ConfigDict(extra="forbid")

    stateful: bool
    class_name: str | None = None
    value: Node


class PerRankFiles(BaseModel):
    """``extra_state.json``'s list of per-rank entries: ``keys`` saved by each of ``world_size``
    ranks, rank ``r``'s in :func:`rank_file_name` ``(r, world_size)`` (a file with its own digest
    and its rank, so a flipped byte or a file of another rank is caught)."""

    model_config = ConfigDict(extra="forbid")

    world_size: Annotated[int, Field(ge=1)]
    keys: list[StrictStr]


class ExtraStateFile(BaseModel):
    """``extra_state.json`` (and a rank's ``extra_state.rank-RRRRR-of-WWWWW.json``, which has
    ``rank`` set and no ``per_rank``). ``sha256``: hex digest of the canonical JSON of ``entries``
    (with ``per_rank`` and ``rank`` where set)."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["fqnckpt-extra-state"] = "fqnckpt-extra-state"
    version: Literal[1] = 1
    entries: dict[str, ExtraStateEntry]
    per_rank: PerRankFiles | None = None
    rank: Annotated[int, Field(ge=0)] | None = None
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


RANK_FILE_RE = re.compile(r"^extra_state\.rank-(\d{5})-of-(\d{5})\.json$")


def rank_file_name(rank: int, world_size: int) -> str:
    """``extra_state.rank-00001-of-00004.json``: rank 1's per-rank entries of a 4-rank save."""
    return f"extra_state.rank-{rank:05d}-of-{world_size:05d}.json"


class PerRank:
    """Marks an ``extra_state`` entry as one rank's own: ``PerRank(obj)`` where ``obj`` is a
    stateful object (``state_dict`` / ``load_state_dict``) or a plain value (read back from
    ``.value`` after a load).

    ``reshard(saved, rank, world_size) -> value``: how a world of another size gets its values,
    from ``saved`` (every saved rank's value, by rank); defaults to ``obj.reshard`` when ``obj``
    has one (e.g. :class:`checkpoint.training.RNGState`). Without a rule, a load on another world
    size raises :class:`~checkpoint.errors.ExtraStateMismatchError` naming the entry.
    """

    def __init__(self, value: Any, reshard: Callable[[list[Any], int, int], Any] | None = None):
        if isinstance(value, PerRank):
            raise TypeError("PerRank(PerRank(...)): wrap the value once")
        self.value = value
        self.reshard = reshard if reshard is not None else getattr(value, "reshard", None)

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"


def is_stateful(v: object) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))


def _encode(v: Any, where: str, depth: int = 0) -> _Node:
    if depth > _MAX_DEPTH:
        raise ValueError(f"extra_state {where!r} is nested deeper than {_MAX_DEPTH} levels")
    if v is None:
        return NoneNode()
    if isinstance(v, bool):
        return BoolNode(value=v)
    if isinstance(v, int):
        why = json_int_problem(int(v))
        if why is not None:
            raise TypeError(f"extra_state {where!r} {why}")
        return IntNode(value=int(v))
    if isinstance(v, float):
        return FloatNode(hex=float(v).hex())
    if isinstance(v, str):
        return StrNode(value=v)
    if isinstance(v, (bytes, bytearray)):
        return BytesNode(data=base64.b64encode(bytes(v)).decode("ascii"))
    if isinstance(v, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(v, DTensor) or v.layout != torch.strided or v.is_meta:
            raise TypeError(f"extra_state {where!r}: only dense non-meta plain tensors can be saved")
        if v.dtype not in DTYPE_TO_ST:
            raise TypeError(f"extra_state {where!r}: dtype {v.dtype} cannot be stored")
        from ..storage.writer import tensor_bytes

        data = base64.b64encode(tensor_bytes(v)).decode("ascii")
        return TensorNode(dtype=DTYPE_TO_ST[v.dtype], shape=list(v.shape), data=data)
    if isinstance(v, (list, tuple)):
        kind = "tuple" if isinstance(v, tuple) else "list"
        return ListNode(kind=kind, items=[_encode(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)])
    if isinstance(v, Mapping):
        items = []
        for k, x in v.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise TypeError(f"extra_state {where!r}: dict key {k!r} is not a str or int")
            items.append((k, _encode(x, f"{where}[{k!r}]", depth + 1)))
        return DictNode(items=items)
    raise TypeError(
        f"extra_state {where!r} is a {type(v).__name__}: not a number, str, bytes, tensor, list, dict or an "
        "object with state_dict() and load_state_dict()"
    )


def decode_node(n: _Node, where: str) -> Any:
    if isinstance(n, NoneNode):
        return None
    if isinstance(n, (BoolNode, IntNode, StrNode)):
        return n.value
    if isinstance(n, BytesNode):
        try:
            return base64.b64decode(n.data, validate=True)
        except ValueError as e:
            raise ValueError(f"{where}: bytes data is not base64") from e
    if isinstance(n, FloatNode):
        try:
            return float.fromhex(n.hex)
        except (ValueError, OverflowError) as e:
            raise ValueError(f"{where}: float {n.hex!r} is not a float.hex() value") from e
    if isinstance(n, TensorNode):
        if n.dtype not in ST_TO_DTYPE:
            raise ValueError(f"{where}: unknown tensor dtype {n.dtype!r}")
        dtype = ST_TO_DTYPE[n.dtype]
        why = shape_problem(n.shape)
        if why is not None:
            raise ValueError(f"{where}: tensor {why}")
        raw = base64.b64decode(n.data, validate=True)
        want = math.prod(n.shape) * torch.empty((), dtype=dtype).element_size()
        if len(raw) != want:
            raise ValueError(f"{where}: {len(raw)} data bytes, shape {n.shape} {n.dtype} needs {want}")
        if not raw:
            return torch.empty(n.shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(n.shape).clone()
    if isinstance(n, ListNode):
        items = [decode_node(x, f"{where}[{i}]") for i, x in enumerate(n.items)]
        return tuple(items) if n.kind == "tuple" else items
    if isinstance(n, DictNode):
        return {k: decode_node(x, f"{where}[{k!r}]") for k, x in n.items}
    raise AssertionError(type(n))


def _digest(
    entries: Mapping[str, ExtraStateEntry], per_rank: PerRankFiles | None = None, rank: int | None = None
) -> str:
    doc: dict[str, Any] = {k: e.model_dump(mode="json") for k, e in entries.items()}
    if per_rank is not None or rank is not None:  # files without them keep their earlier digest
        doc = {"entries": doc, "per_rank": per_rank.model_dump(mode="json") if per_rank else None, "rank": rank}
    canon = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def _entry(k: str, v: Any) -> ExtraStateEntry:
    if is_stateful(v):
        return ExtraStateEntry(stateful=True, class_name=type(v).__name__, value=_encode(v.state_dict(), k))
    return ExtraStateEntry(stateful=False, value=_encode(v, k))


def snapshot_extra_state(extra_state: Mapping[str, Any]) -> dict[str, ExtraStateEntry]:
    """Validated, encoded copy of ``extra_state`` at this moment (stateful objects through
    ``state_dict()``). Later changes to the caller's objects do not reach it.

    Raises:
        TypeError: a key is not a str, or a value (named by its path) cannot be saved.
        ValueError: nesting deeper than 64 levels.
    """
    if not isinstance(extra_state, Mapping):
        raise TypeError(f"extra_state must be a Mapping[str, Any], got {type(extra_state).__name__}")
    shared, _ = snapshot_extra_state_parts(extra_state)
    return shared


def snapshot_extra_state_parts(
    extra_state: Mapping[str, Any],
) -> tuple[dict[str, ExtraStateEntry], dict[str, ExtraStateEntry]]:
    """:func:`snapshot_extra_state` split in two: the shared entries and this rank's
    :class:`PerRank` entries (unwrapped). Raises as :func:`snapshot_extra_state`."""
    if not isinstance(extra_state, Mapping):
        raise TypeError(f"extra_state must be a Mapping[str, Any], got {type(extra_state).__name__}")
    shared: dict[str, ExtraStateEntry] = {}
    mine: dict[str, ExtraStateEntry] = {}
    for k, v in extra_state.items():
        if not isinstance(k, str) or not k:
            raise TypeError(f"extra_state key {k!r} is not a non-empty str")
        if isinstance(v, PerRank):
            mine[k] = _entry(k, v.value)
        else:
            shared[k] = _entry(k, v)
    return shared, mine


def _file_bytes(doc: ExtraStateFile) -> bytes:
    return (doc.model_dump_json(indent=1) + "\n").encode()


def extra_state_file_bytes(
    entries: Mapping[str, ExtraStateEntry],
    per_rank: Mapping[str, ExtraStateEntry] | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, bytes]:
    """``{"extra_state.json": bytes}`` for ``save``'s ``extra_files`` (written in the staging dir),
    plus this rank's per-rank file when ``per_rank`` holds entries. ``extra_state.json`` is the same
    on every rank that passes the same entries; a distributed save gathers the rank files to rank 0."""
    if not per_rank:
        doc = ExtraStateFile(entries=dict(entries), sha256=_digest(entries))
        return {EXTRA_STATE_FILE: _file_bytes(doc)}
    info = PerRankFiles(world_size=world_size, keys=sorted(per_rank))
    doc = ExtraStateFile(entries=dict(entries), per_rank=info, sha256=_digest(entries, info))
    mine = ExtraStateFile(entries=dict(per_rank), rank=rank, sha256=_digest(per_rank, None, rank))
    return {EXTRA_STATE_FILE: _file_bytes(doc), rank_file_name(rank, world_size): _file_bytes(mine)}


def read_extra_state_file(root: str) -> ExtraStateFile | None:
    """Parse and check ``root/extra_state.json``; None if the checkpoint has none.

    Raises:
        CorruptCheckpointError: not JSON or not the schema.
        ChecksumMismatchError: ``sha256`` differs from the entries' digest.
        MissingShardError: the model index's record names it and it is gone.
    """
    path = os.path.join(root, EXTRA_STATE_FILE)
    raw = _member_bytes(root, EXTRA_STATE_FILE)
    if raw is None:
        obj = _recorded_object(root, EXTRA_STATE_FILE)
        if obj is not None:  # the model index's record names it: removed since the save
            raise MissingShardError(root, [obj], MODEL_INDEX)
        return None
    doc = _parse_checked(path, raw)
    if doc.rank is not None:
        raise CorruptCheckpointError(path, "is not a checkpoint's extra_state.json (rank / per_rank fields)")
    return doc


def _parse_checked(path: str, raw: bytes) -> ExtraStateFile:
    """``raw`` (the bytes of file ``path``) parsed by the schema and its ``sha256`` checked.

    Raises:
        CorruptCheckpointError: not JSON or not the schema.
        ChecksumMismatchError: ``sha256`` differs from the entries' digest.
    """
    try:
        doc = ExtraStateFile.model_validate_json(raw)
    except (ValidationError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(path, f"does not follow the extra_state schema: {e}") from e
    try:
        actual = _digest(doc.entries, doc.per_rank, doc.rank)
    except ValueError as e:  # an int over Python's int / str conversion limit (json.dumps refuses it)
        raise CorruptCheckpointError(path, f"does not follow the extra_state schema: {e}") from e
    if actual != doc.sha256:
        raise ChecksumMismatchError(path, doc.sha256, actual)
    return doc


def read_rank_file(root: str, doc: ExtraStateFile, rank: int) -> ExtraStateFile:
    """Rank ``rank``'s per-rank file listed by ``doc`` (``root``'s ``extra_state.json``), checked.

    Raises:
        CorruptCheckpointError: the file is missing, a link, not the schema, or for another rank
            or other keys than ``extra_state.json`` lists.
        ChecksumMismatchError: its ``sha256`` differs from its entries' digest.
    """
    assert doc.per_rank is not None and 0 <= rank < doc.per_rank.world_size
    path = os.path.join(root, rank_file_name(rank, doc.per_rank.world_size))
    raw = _member_bytes(root, rank_file_name(rank, doc.per_rank.world_size))
    if raw is None:
        raise CorruptCheckpointError(path, "is listed in extra_state.json but missing (or a link)")
    rf = _parse_checked(path, raw)
    if rf.rank != rank or rf.per_rank is not None or sorted(rf.entries) != sorted(doc.per_rank.keys):
        raise CorruptCheckpointError(path, f"is not rank {rank}'s per-rank file of this checkpoint")
    return rf


def checked_extra_state_files(root: str) -> dict[str, bytes]:
    """The extra-state files of the checkpoint at ``root`` as they are (``extra_state.json`` and
    every per-rank file it lists), each checked, for a copy into another checkpoint (``migrate``)
    or a check (``verify``); ``{}`` when it has none.

    Raises what :func:`read_extra_state_file` and :func:`read_rank_file` raise."""
    doc = read_extra_state_file(root)
    if doc is None:
        return {}
    names = [EXTRA_STATE_FILE]
    if doc.per_rank is not None:
        for r in range(doc.per_rank.world_size):
            read_rank_file(root, doc, r)
            names.append(rank_file_name(r, doc.per_rank.world_size))
    return {name: _member_bytes(root, name) for name in names}


def _recorded_object(root: str, name: str) -> str | None:
    """The object the model index's record (``metadata.fqnckpt.objects``) names for file ``name``
    of the checkpoint at ``root``; None without such a record or entry."""
    if is_url(root):
        from .views import current_view

        view = current_view(root)
        index = view.index if view is not None else None
    else:
        raw = LocalStore(root).get(MODEL_INDEX)
        index = parse_index(raw) if raw is not None else None
    meta = index.metadata.fqnckpt if index is not None else None
    return meta.objects.get(name) if meta is not None and meta.objects is not None else None


def _member_bytes(root: str, name: str) -> bytes | None:
    """Bytes of file ``name`` of the checkpoint at ``root``; None when absent (or a symlink).
    A URL is read from the checkpoint this thread holds open (its model index names the object:
    :func:`checkpoint.storage.views.checkpoint_view`)."""
    if is_url(root):
        from .views import current_view

        view = current_view(root)
        if view is None:
            raise RuntimeError(f"reading {root}/{name} outside checkpoint_view({root!r})")
        return view.member_bytes(name)
    store = LocalStore(root)
    raw = store.get(MODEL_INDEX)
    obj = recorded_object(parse_index(raw) if raw is not None else None, name)
    if obj is not None:  # a record naming "../x" or an absolute path: UnsafePathError, as at a URL
        check_name(root, obj)
    return store.get(obj) if obj is not None else None  # None for a symlink or a directory too

