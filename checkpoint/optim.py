"""Optimizer state by eager FQN: ``state.<fqn>.<name>`` tensors (``exp_avg``, ``step``, ...) and the
param groups (hyper-parameters, ``params`` as FQNs) in the optimizer index metadata.

Restores by name, never by position: each target param group is matched to the saved group with
the same FQN set, and state tensors of DTensor parameters are read as the slices this rank owns
and rebuilt as DTensors with the parameter's mesh and placements (resharding).

Values round-trip exactly (``value_encoding`` 2): hyper-parameters and non-tensor state are JSON
in the index, with tags where JSON has no exact form (:data:`Value`): ``{"$float": "inf"}``,
``{"$none": true}`` (the index is written with ``exclude_none``, which drops a bare null),
``{"$tuple": [...]}``, ``{"$tensor": {dtype, shape, data (base64 of the bytes)}}``,
``{"$dict": [[key, value], ...]}``, and ``{"$ref": key}`` for a tensor nested in a state value
(stored as its own tensor ``key``). Checkpoints of encoding 1 (plain JSON, lists for tuples,
numbers in ``python_scalars``) still load.
"""

from __future__ import annotations

import base64
import math
import numbers
from collections.abc import Callable
from typing import Annotated, Any, Literal, Union

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
)
from torch.distributed.tensor import DTensor
from typing_extensions import TypeAliasType

from .errors import CheckpointError, CorruptCheckpointError
from .state import Entry, ModuleState
from .storage.format import OptimizerMeta, ParamGroup
from .storage.limits import json_int_problem


class OptimizerMismatchError(CheckpointError):
    """The optimizer does not match the saved optimizer state (param not in the model, group sets differ)."""


# -- exact JSON values (pydantic schema of the tags) ---------------------------------------------


class _Tag(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class FloatTag(_Tag):
    """A float JSON cannot write: ``inf``, ``-inf``, ``nan``."""

    value: str = Field(alias="$float", pattern=r"^(inf|-inf|nan)$")


class NoneTag(_Tag):
    """``None`` (a plain JSON null would be dropped: the index is written with exclude_none)."""

    value: Literal[True] = Field(alias="$none")


class TupleTag(_Tag):
    items: list[Value] = Field(alias="$tuple")


class DictTag(_Tag):
    """A dict with string keys, in insertion order."""

    items: list[tuple[StrictStr, Value]] = Field(alias="$dict")


class TensorData(_Tag):
    """A tensor's exact bytes: ``dtype`` (torch name, e.g. ``float32``), ``shape`` (elements),
    ``data`` base64 of the C-contiguous little-endian bytes."""

    dtype: StrictStr
    shape: list[Annotated[StrictInt, Field(ge=0)]]
    data: StrictStr


class TensorTag(_Tag):
    tensor: TensorData = Field(alias="$tensor")


class RefTag(_Tag):
    """A tensor stored in the optimizer shards under ``key`` (nested in a state value)."""

    key: StrictStr = Field(alias="$ref")


FiniteFloat = Annotated[StrictFloat, Field(allow_inf_nan=False)]
# A named recursive type (PEP 695 style) so pydantic can validate nested values.
Value = TypeAliasType(
    "Value",
    Union[  # noqa: UP007
        None, StrictBool, StrictInt, FiniteFloat, StrictStr, list["Value"],
        NoneTag, FloatTag, TupleTag, DictTag, TensorTag, RefTag,
    ],
)  # fmt: skip
for _m in (TupleTag, DictTag):
    _m.model_rebuild()
_VALUE = TypeAdapter(Value)


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def encode_value(v: object, where: str, store: Callable[[str, torch.Tensor], None] | None = None) -> object:
    """``v`` as exact JSON (see module docstring). ``store(key, tensor)``: where tensors nested in
    state values go (``$ref``); without it tensors are inlined as ``$tensor`` (bytes).

    Raises:
        TypeError: a value with no exact encoding (names ``where``).
    """
    if v is None:
        return {"$none": True}
    if isinstance(v, (bool, str)):
        return v
    if isinstance(v, numbers.Integral):
        why = json_int_problem(int(v))
        if why is not None:
            raise TypeError(f"{where} {why}")
        return int(v)
    if isinstance(v, float):
        if math.isfinite(v):
            return v
        return {"$float": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
    if isinstance(v, torch.Tensor):
        if isinstance(v, DTensor) or v.layout != torch.strided:
            raise TypeError(f"{where}: {type(v).__name__} with layout {v.layout} has no exact encoding")
        if store is not None:
            store(where, v)
            return {"$ref": where}
        flat = v.detach().to("cpu").contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        name = str(v.dtype).removeprefix("torch.")
        return {"$tensor": {"dtype": name, "shape": list(v.shape), "data": base64.b64encode(data).decode()}}
    if isinstance(v, tuple):
        return {"$tuple": [encode_value(x, f"{where}[{i}]", store) for i, x in enumerate(v)]}
    if isinstance(v, list):
        return [encode_value(x, f"{where}[{i}]", store) for i, x in enumerate(v)]
    if isinstance(v, dict):
        bad = [k for k in v if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{where}: dict key {bad[0]!r} is not a string")
        return {"$dict": [[k, encode_value(x, f"{where}[{k!r}]", store)] for k, x in v.items()]}
    raise TypeError(
        f"{where} is a {type(v).__name__}: no exact encoding (numbers, str, bool, None, tensors, tuples, lists, dicts)"
    )


def decode_value(raw: object, where: str, read: Callable[[str], torch.Tensor] | None = None) -> object:
    """Inverse of :func:`encode_value`; ``read(key)`` fetches ``$ref`` tensors.

    Raises:
        CorruptCheckpointError: ``raw`` does not follow :data:`Value` (names ``where``).
    """
    try:
        v = _VALUE.validate_python(raw)
    except ValidationError as e:
        raise CorruptCheckpointError(where, f"optimizer value does not follow the schema: {e}") from e
    return _decode(v, where, read)


def _decode(v: object, where: str, read) -> object:
    if isinstance(v, NoneTag):
        return None
    if isinstance(v, FloatTag):
        return float(v.value)
    if isinstance(v, TupleTag):
        return tuple(_decode(x, where, read) for x in v.items)
    if isinstance(v, list):
        return [_decode(x, where, read) for x in v]
    if isinstance(v, DictTag):
        return {k: _decode(x, where, read) for k, x in v.items}
    if isinstance(v, TensorTag):
        t = v.tensor
        try:
            dt = _dtype(t.dtype)
            data = base64.b64decode(t.data, validate=True)
            n = math.prod(t.shape)
            if len(data) != n * torch.empty((), dtype=dt).element_size():
                raise ValueError(f"{len(data)} bytes for shape {t.shape} {t.dtype}")
            if not n:
                return torch.empty(t.shape, dtype=dt)
            return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).reshape(t.shape).clone()
        except (ValueError, RuntimeError) as e:
            raise CorruptCheckpointError(where, f"bad tensor value: {e}") from e
    if isinstance(v, RefTag):
        if read is None:
            raise CorruptCheckpointError(where, f"$ref {v.key!r} is not allowed here")
        return read(v.key)
    return v


# -- save ------------------------------------------------------------------------------------------


def optimizer_param_names(optimizer: torch.optim.Optimizer, state: ModuleState) -> dict[int, str]:
    by_id = {id(e.tensor): e.fqn for e in state.entries}
    out: dict[int, str] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) not in by_id:
                raise OptimizerMismatchError(
                    f"optimizer param {pi} of group {gi} (shape {tuple(p.shape)}) is not a parameter of the model"
                )
            out[id(p)] = by_id[id(p)]
    return out


def optimizer_entries(
    optimizer: torch.optim.Optimizer, state: ModuleState
) -> tuple[list[Entry], OptimizerMeta]:
    """State tensors of ``optimizer`` as entries ``state.<fqn>.<name>`` plus the index metadata.

    Hyper-parameters and non-tensor state values (Python numbers, lists of tensors as in LBFGS,
    ...) are stored exactly in the metadata (``value_encoding`` 2; tensors nested in state values
    are stored as entries ``state.<fqn>.<name>[i]`` and referenced).

    Raises:
        OptimizerMismatchError: an optimizer parameter is not a parameter of the model.
        TypeError: a value has no exact encoding (names the group / key).
    """
    names = optimizer_param_names(optimizer, state)
    entries: list[Entry] = []
    groups: list[ParamGroup] = []
    values: dict[str, dict[str, Any]] = {}

    def store(key: str, t: torch.Tensor) -> None:
        entries.append(Entry(key, t))

    for gi, group in enumerate(optimizer.param_groups):
        hyper = {
            k: encode_value(v, f"optimizer param group {gi} {k!r}") for k, v in group.items() if k != "params"
        }
        if "params" in hyper:
            raise TypeError(f"optimizer param group {gi}: reserved key 'params'")
        groups.append(ParamGroup(params=[names[id(p)] for p in group["params"]], **hyper))
        for p in group["params"]:
            fqn = names[id(p)]
            for k, v in optimizer.state.get(p, {}).items():
                key = f"state.{fqn}.{k}"
                if isinstance(v, torch.Tensor):
                    entries.append(Entry(key, v))
                else:
                    values.setdefault(fqn, {})[k] = encode_value(v, key, store)
    meta = OptimizerMeta(
        optimizer_class=type(optimizer).__name__, param_groups=groups, value_encoding=2, state_values=values
    )
    return entries, meta


# -- load ------------------------------------------------------------------------------------------


