"""The one optimizer planner: saved optimizer state -> the ``state_dict`` for
``optimizer.load_state_dict``, by FQN, checked before anything changes (format:
:mod:`checkpoint.optim`)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError, CorruptCheckpointError, LoadError
from ..optim import OptimizerMismatchError, _param_names, decode_value
from ..ranks.shards import read_local
from ..state import ModuleState
from ..storage.reader import CheckpointReader
from .values import guarded_get


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
