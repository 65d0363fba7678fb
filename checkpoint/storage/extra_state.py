"""``extra_state``: the rest of a training state (step, LR scheduler, dataloader, RNG states) saved
beside the model as one JSON file, ``extra_state.json``, inside the checkpoint's atomic commit.

Each entry of the caller's ``Mapping[str, Any]`` is either

- an object with ``state_dict()`` and ``load_state_dict()`` (LR schedulers, dataloaders, user
  objects): saved as its ``state_dict()``, restored in place with ``load_state_dict``; or
- a plain value: ``None``, ``bool``, ``int`` (any size), ``float`` (including inf, -inf, nan and
  -0.0, stored bit-exactly as ``float.hex``), ``str``, a tensor (e.g. ``torch.get_rng_state()``:
  dtype, shape and bytes stored exactly, read back on CPU), and lists, tuples and dicts (str or
  int keys) of these; on load the caller's dict gets the saved value under the same key.

On many ranks the file holds rank 0's entries (written once, like the index); a save whose
ranks pass different extra state warns, naming the ranks (per-rank values such as the RNG states
of ranks seeded apart would come back as rank 0's everywhere).

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
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from ..errors import ChecksumMismatchError, CorruptCheckpointError
from ..storage.layout import DTYPE_TO_ST, ST_TO_DTYPE

EXTRA_STATE_FILE = "extra_state.json"
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


class TensorNode(_Node):
    """A dense tensor: safetensors ``dtype`` name, ``shape`` (elements), base64 of its bytes."""

    kind: Literal["tensor"] = "tensor"
    dtype: StrictStr
    shape: list[Annotated[int, Field(ge=0)]]
    data: StrictStr


class ListNode(_Node):
    kind: Literal["list", "tuple"] = "list"
    items: list[Node]


class DictNode(_Node):
    """Keys in insertion order; a key is a str or an int (JSON keeps them apart)."""

    kind: Literal["dict"] = "dict"
    items: list[tuple[StrictStr | StrictInt, Node]]


Node = Annotated[
    NoneNode | BoolNode | IntNode | FloatNode | StrNode | TensorNode | ListNode | DictNode,
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


class ExtraStateFile(BaseModel):
    """``extra_state.json``. ``sha256``: hex digest of the canonical JSON of ``entries``."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["fqnckpt-extra-state"] = "fqnckpt-extra-state"
    version: Literal[1] = 1
    entries: dict[str, ExtraStateEntry]
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


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
        return IntNode(value=int(v))
    if isinstance(v, float):
        return FloatNode(hex=float(v).hex())
    if isinstance(v, str):
        return StrNode(value=v)
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
        f"extra_state {where!r} is a {type(v).__name__}: not a number, str, tensor, list, dict or an "
        "object with state_dict() and load_state_dict()"
    )


def _decode(n: _Node, where: str) -> Any:
    if isinstance(n, NoneNode):
        return None
    if isinstance(n, (BoolNode, IntNode, StrNode)):
        return n.value
    if isinstance(n, FloatNode):
        try:
            return float.fromhex(n.hex)
        except (ValueError, OverflowError) as e:
            raise ValueError(f"{where}: float {n.hex!r} is not a float.hex() value") from e
    if isinstance(n, TensorNode):
        if n.dtype not in ST_TO_DTYPE:
            raise ValueError(f"{where}: unknown tensor dtype {n.dtype!r}")
        dtype = ST_TO_DTYPE[n.dtype]
        raw = base64.b64decode(n.data, validate=True)
        want = math.prod(n.shape) * torch.empty((), dtype=dtype).element_size()
        if len(raw) != want:
            raise ValueError(f"{where}: {len(raw)} data bytes, shape {n.shape} {n.dtype} needs {want}")
        if not raw:
            return torch.empty(n.shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(n.shape).clone()
    if isinstance(n, ListNode):
        items = [_decode(x, f"{where}[{i}]") for i, x in enumerate(n.items)]
        return tuple(items) if n.kind == "tuple" else items
    if isinstance(n, DictNode):
        return {k: _decode(x, f"{where}[{k!r}]") for k, x in n.items}
    raise AssertionError(type(n))


def _digest(entries: Mapping[str, ExtraStateEntry]) -> str:
    canon = json.dumps(
        {k: e.model_dump(mode="json") for k, e in entries.items()}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(canon.encode()).hexdigest()


def snapshot_extra_state(extra_state: Mapping[str, Any]) -> dict[str, ExtraStateEntry]:
    """Validated, encoded copy of ``extra_state`` at this moment (stateful objects through
    ``state_dict()``). Later changes to the caller's objects do not reach it.

    Raises:
        TypeError: a key is not a str, or a value (named by its path) cannot be saved.
        ValueError: nesting deeper than 64 levels.
    """
    if not isinstance(extra_state, Mapping):
        raise TypeError(f"extra_state must be a Mapping[str, Any], got {type(extra_state).__name__}")
    out: dict[str, ExtraStateEntry] = {}
    for k, v in extra_state.items():
        if not isinstance(k, str) or not k:
            raise TypeError(f"extra_state key {k!r} is not a non-empty str")
        if is_stateful(v):
            out[k] = ExtraStateEntry(
                stateful=True, class_name=type(v).__name__, value=_encode(v.state_dict(), k)
            )
        else:
            out[k] = ExtraStateEntry(stateful=False, value=_encode(v, k))
    return out


def extra_state_file_bytes(entries: Mapping[str, ExtraStateEntry]) -> dict[str, bytes]:
    """``{"extra_state.json": bytes}`` for ``save``'s ``extra_files`` (written in the staging dir)."""
    doc = ExtraStateFile(entries=dict(entries), sha256=_digest(entries))
    return {EXTRA_STATE_FILE: (doc.model_dump_json(indent=1) + "\n").encode()}


def read_extra_state_file(root: str) -> ExtraStateFile | None:
    """Parse and check ``root/extra_state.json``; None if the checkpoint has none.

    Raises:
        CorruptCheckpointError: not JSON or not the schema.
        ChecksumMismatchError: ``sha256`` differs from the entries' digest.
    """
    path = os.path.join(root, EXTRA_STATE_FILE)
    if not os.path.isfile(path) or os.path.islink(path):
        return None
    with open(path, "rb") as f:
        raw = f.read()
    try:
        doc = ExtraStateFile.model_validate_json(raw)
    except (ValidationError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(path, f"does not follow the extra_state schema: {e}") from e
    actual = _digest(doc.entries)
    if actual != doc.sha256:
        raise ChecksumMismatchError(path, doc.sha256, actual)
    return doc


