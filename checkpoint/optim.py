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
import os
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

from .errors import CheckpointError, CorruptCheckpointError, LoadError
from .state import Entry, ModuleState
from .storage.format import OptimizerMeta, ParamGroup
from .storage.reader import CheckpointReader


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


def _param_names(optimizer: torch.optim.Optimizer, state: ModuleState) -> dict[int, str]:
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
    names = _param_names(optimizer, state)
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


def _read_like(reader: CheckpointReader, key: str, param: torch.Tensor) -> torch.Tensor:
    """State tensor ``key`` where ``param`` lives (this rank's slice for a DTensor of equal shape).

    Raises:
        LoadError: safetensors / torch fail to read or place it (names key and file).
    """
    try:
        return _read_like_unguarded(reader, key, param)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise LoadError(
            key, os.path.join(reader.root, reader.file_of(key)), f"{type(e).__name__}: {e}"
        ) from e


def _read_like_unguarded(reader: CheckpointReader, key: str, param: torch.Tensor) -> torch.Tensor:
    spec = reader.spec(key)
    if isinstance(param, DTensor) and spec.shape == tuple(param.shape) and spec.shape:
        from .ranks.shards import read_local

        local = read_local(reader, key, param)
        return DTensor.from_local(
            local.to(param.device), param.device_mesh, param.placements, run_check=False,
            shape=param.shape, stride=param.stride(),
        )  # fmt: skip
    device = param.to_local().device if isinstance(param, DTensor) else param.device
    if device.type == "meta":  # a meta parameter is replaced by load(assign=True) before use
        device = torch.device("cpu")
    return reader.get(key).to(device)


def _split_state_keys(keys: list[str], fqns: set[str]) -> dict[str, dict[str, str]]:
    """``state.<fqn>.<name>`` keys -> {fqn: {name: key}}; the longest saved FQN that prefixes the
    key wins (a state name may hold dots). Linear: one set lookup per dot of each key."""
    out: dict[str, dict[str, str]] = {}
    for key in keys:
        if not key.startswith("state."):
            continue
        rest = key[len("state.") :]
        dots = [i for i, c in enumerate(rest) if c == "."]
        fqn = next((rest[:i] for i in reversed(dots) if rest[:i] in fqns), None)
        if fqn is None:
            fqn, _, name = rest.rpartition(".")
        else:
            name = rest[len(fqn) + 1 :]
        out.setdefault(fqn, {})[name] = key
    return out


def plan_optimizer(
    optimizer: torch.optim.Optimizer, reader: CheckpointReader, state: ModuleState
) -> dict[str, Any]:
    """Read and check everything needed to restore ``optimizer`` from an optimizer checkpoint
    part, by FQN, without changing it: returns the ``state_dict`` to hand to
    ``optimizer.load_state_dict`` (see :func:`apply_optimizer`).

    Raises:
        OptimizerMismatchError: no saved state, a target group whose FQN set no saved group has,
            a saved group no target group takes, or a state entry of a parameter not in any group.
        CorruptCheckpointError: a stored value does not follow the schema (names the index).
    """
    meta = reader.meta.optimizer if reader.meta else None
    where = reader.index_path or reader.root
    if meta is None:
        raise OptimizerMismatchError(f"{where} holds no fqnckpt optimizer metadata")
    names = _param_names(optimizer, state)
    by_name = state.by_name()

    def canon(n: str) -> str:
        return by_name[n].fqn if n in by_name else n

    saved_groups = {frozenset(canon(n) for n in g.params): g for g in meta.param_groups}
    saved_fqns = {n for g in meta.param_groups for n in g.params}
    refs: set[str] = set()
    exact = meta.value_encoding >= 2

    def read_ref(key: str) -> torch.Tensor:
        if key not in reader:
            raise CorruptCheckpointError(where, f"$ref to tensor {key!r} that the optimizer shards lack")
        refs.add(key)
        from .load import guarded_get

        return guarded_get(reader, key)

    state_values = {
        canon(fqn): {
            name: decode_value(raw, f"{where} state {fqn!r} {name!r}", read_ref) for name, raw in d.items()
        }
        for fqn, d in meta.state_values.items()
    }
    keys = [k for k in reader.keys() if k not in refs]
    per_param = {canon(f): d for f, d in _split_state_keys(keys, saved_fqns).items()}

    new_groups, new_state, used, idx = [], {}, set(), 0
    for gi, group in enumerate(optimizer.param_groups):
        fqns = [names[id(p)] for p in group["params"]]
        saved = saved_groups.get(frozenset(fqns))
        if saved is None:
            raise OptimizerMismatchError(
                f"{where}: optimizer group {gi} holds {sorted(fqns)[:5]} ({len(fqns)} params); "
                f"no saved group has the same parameters (saved groups: {[len(g.params) for g in meta.param_groups]} params)"
            )
        used.add(id(saved))
        raw = saved.model_dump(exclude={"params"})
        if exact:
            hyper = {k: decode_value(v, f"{where} param group {gi} {k!r}") for k, v in raw.items()}
            for k, v in hyper.items():  # a tensor hyper-parameter goes where the target keeps it
                cur = group.get(k)
                if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor):
                    hyper[k] = v.to(cur.device)
        else:  # encoding 1: JSON as written (tuples became lists)
            hyper = raw
            for k, v in group.items():
                if k != "params" and isinstance(v, tuple) and isinstance(hyper.get(k), list):
                    hyper[k] = tuple(hyper[k])
        ids = []
        for p, fqn in zip(group["params"], fqns):
            entries: dict[str, Any] = {}
            for name, key in per_param.get(fqn, {}).items():
                v = _read_like(reader, key, p)
                if key in meta.python_scalars:  # encoding 1
                    v = v.item()
                entries[name] = v
            entries.update(state_values.get(fqn, {}))
            if entries:
                new_state[idx] = entries
            ids.append(idx)
            idx += 1
        new_groups.append({**hyper, "params": ids})
    unused = [sorted(g.params)[:5] for g in meta.param_groups if id(g) not in used]
    if unused:
        raise OptimizerMismatchError(
            f"{where}: saved param groups holding {unused} match no group of the target optimizer "
            "(their state would be dropped)"
        )
    return {"state": new_state, "param_groups": new_groups}


def apply_optimizer(optimizer: torch.optim.Optimizer, planned: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(planned)`` (``planned`` from :func:`plan_optimizer`)."""
    optimizer.load_state_dict(planned)


def load_optimizer(optimizer: torch.optim.Optimizer, reader: CheckpointReader, state: ModuleState) -> None:
    """:func:`plan_optimizer` then :func:`apply_optimizer`."""
    apply_optimizer(optimizer, plan_optimizer(optimizer, reader, state))
