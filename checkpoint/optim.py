"""Optimizer state by eager FQN: ``state.<fqn>.<name>`` tensors (``exp_avg``, ``step``, ...) and the
param groups (hyper-parameters, ``params`` as FQNs) in the optimizer index metadata.

Restores by name, never by position: each target param group is matched to the saved group with
the same FQN set, and state tensors of DTensor parameters are read as the slices this rank owns
and rebuilt as DTensors with the parameter's mesh and placements (resharding).
"""

from __future__ import annotations

import math
import numbers

import torch
from torch.distributed.tensor import DTensor

from .errors import CheckpointError
from .state import Entry, ModuleState
from .storage.format import OptimizerMeta, ParamGroup
from .storage.reader import CheckpointReader


class OptimizerMismatchError(CheckpointError):
    """The optimizer does not match the saved optimizer state (param not in the model, group sets differ)."""


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


def _hyper(v: object) -> object:
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, tuple):
        return [_hyper(x) for x in v]
    return v


def optimizer_entries(
    optimizer: torch.optim.Optimizer, state: ModuleState
) -> tuple[list[Entry], OptimizerMeta]:
    """State tensors of ``optimizer`` as entries ``state.<fqn>.<name>`` plus the index metadata.

    Python numbers in the state are stored as 0-dim tensors (float64 / int64) and listed in
    ``python_scalars`` so they come back as numbers.

    Raises:
        OptimizerMismatchError: an optimizer parameter is not a parameter of the model.
        TypeError: a state value is neither a tensor nor a number (names the key).
    """
    names = _param_names(optimizer, state)
    entries: list[Entry] = []
    scalars: list[str] = []
    groups: list[ParamGroup] = []
    for group in optimizer.param_groups:
        hyper = {k: _hyper(v) for k, v in group.items() if k != "params"}
        groups.append(ParamGroup(params=[names[id(p)] for p in group["params"]], **hyper))
        for p in group["params"]:
            for k, v in optimizer.state.get(p, {}).items():
                key = f"state.{names[id(p)]}.{k}"
                if isinstance(v, torch.Tensor):
                    entries.append(Entry(key, v))
                elif isinstance(v, numbers.Number) and not isinstance(v, complex):
                    dt = torch.int64 if isinstance(v, numbers.Integral) else torch.float64
                    entries.append(Entry(key, torch.tensor(v, dtype=dt)))
                    scalars.append(key)
                else:
                    raise TypeError(
                        f"optimizer state {key!r} is a {type(v).__name__}, not a tensor or number"
                    )
    meta = OptimizerMeta(
        optimizer_class=type(optimizer).__name__, param_groups=groups, python_scalars=scalars
    )
    return entries, meta


def _read_like(reader: CheckpointReader, key: str, param: torch.Tensor) -> torch.Tensor:
    spec = reader.spec(key)
    if isinstance(param, DTensor) and spec.shape == tuple(param.shape) and spec.shape:
        from .ranks.shards import read_local

        local = read_local(reader, key, param)
        return DTensor.from_local(
            local.to(param.device), param.device_mesh, param.placements, run_check=False,
            shape=param.shape, stride=param.stride(),
        )  # fmt: skip
    device = param.to_local().device if isinstance(param, DTensor) else param.device
    return reader.get(key).to(device)


def load_optimizer(optimizer: torch.optim.Optimizer, reader: CheckpointReader, state: ModuleState) -> None:
    """Restore ``optimizer`` from an optimizer checkpoint part, by FQN.

    Raises:
        OptimizerMismatchError: no saved state, or param groups whose FQN sets differ.
    """
    meta = reader.meta.optimizer if reader.meta else None
    if meta is None:
        raise OptimizerMismatchError(
            f"{reader.index_path or reader.root} holds no fqnckpt optimizer metadata"
        )
    names = _param_names(optimizer, state)
    by_name = state.by_name()

    def canon(n: str) -> str:
        return by_name[n].fqn if n in by_name else n

    saved_groups = {frozenset(canon(n) for n in g.params): g for g in meta.param_groups}
    saved_fqns = sorted({canon(n) for g in meta.param_groups for n in g.params}, key=len, reverse=True)
    per_param: dict[str, dict[str, str]] = {}
    for key in reader.keys():
        if not key.startswith("state."):
            continue
        rest = key[len("state.") :]
        fqn = next((f for f in saved_fqns if rest.startswith(f + ".")), None)
        if fqn is None:
            fqn, _, name = rest.rpartition(".")
        else:
            name = rest[len(fqn) + 1 :]
        per_param.setdefault(canon(fqn), {})[name] = key

    new_groups, new_state, idx = [], {}, 0
    for gi, group in enumerate(optimizer.param_groups):
        fqns = [names[id(p)] for p in group["params"]]
        saved = saved_groups.get(frozenset(fqns))
        if saved is None:
            raise OptimizerMismatchError(
                f"optimizer group {gi} holds {sorted(fqns)[:5]}... ({len(fqns)} params); "
                f"no saved group has the same parameters (saved groups: {[len(g.params) for g in meta.param_groups]} params)"
            )
        hyper = saved.model_dump(exclude={"params"})
        for k, v in group.items():
            if k != "params" and isinstance(v, tuple) and isinstance(hyper.get(k), list):
                hyper[k] = tuple(hyper[k])
        ids = []
        for p, fqn in zip(group["params"], fqns):
            entries = {}
            for name, key in per_param.get(fqn, {}).items():
                v = _read_like(reader, key, p) if name != "step" or isinstance(p, torch.Tensor) else None
                if key in meta.python_scalars:
                    v = v.item()
                    if isinstance(v, float) and v.is_integer() and not math.isinf(v):
                        v = float(v)
                entries[name] = v
            if entries:
                new_state[idx] = entries
            ids.append(idx)
            idx += 1
        new_groups.append({**hyper, "params": ids})
    optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})
