"""The one optimizer planner: saved optimizer state -> the ``state_dict`` for
``optimizer.load_state_dict``, by FQN, checked before anything changes (format:
:mod:`checkpoint.optim`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError, CorruptCheckpointError, LoadError
from ..optim import OptimizerMismatchError, optimizer_param_names, decode_value
from ..ranks.shards import read_local
from ..sources.base import OptimizerInfo
from ..state import ModuleState
from ..storage.reader import CheckpointReader
from .optimizer_kind import StateKeyProbe, group_keys_problem, group_values_problem, state_keys_problem
from .values import guarded_get, stored_key


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
            stored_key(reader, key), os.path.join(reader.root, reader.file_of(key)), f"{type(e).__name__}: {e}"
        ) from e



def _read_like_unguarded(reader: Any, key: str, param: torch.Tensor) -> torch.Tensor:
    spec = reader.spec(key)
    block = getattr(reader, "read_block", None)  # prefetched by the source (DCP)
    if block is not None and (b := block(key, param)) is not None:
        if isinstance(param, DTensor) and spec.shape == tuple(param.shape) and spec.shape:
            return DTensor.from_local(
                b.to(param.device), param.device_mesh, param.placements, run_check=False,
                shape=param.shape, stride=param.stride(),
            )  # fmt: skip
        return b.to(param.to_local().device if isinstance(param, DTensor) else param.device)
    if isinstance(param, DTensor) and spec.shape == tuple(param.shape) and spec.shape:
        check = getattr(reader, "check_first", None)
        if check is not None:  # a block of some rows is checked by no read: the whole state tensor, first
            check([key])
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



@dataclass
class SavedOptimizer:
    """A saved optimizer, whatever the format: ``groups`` as ``(FQNs, hyper-parameters)``;
    ``tensors`` {FQN: {slot: source key}}; ``values`` {FQN: {slot: non-tensor value}};
    ``scalars``: keys read back as Python numbers; ``where``: for messages; ``class_name``: the
    saved optimizer's class where the format records it (fqnckpt), else None."""

    where: str
    groups: list[tuple[list[str], dict[str, Any]]]
    tensors: dict[str, dict[str, str]] = field(default_factory=dict)
    values: dict[str, dict[str, Any]] = field(default_factory=dict)
    scalars: set[str] = field(default_factory=set)
    class_name: str | None = None


def saved_fqnckpt_optimizer(reader: CheckpointReader) -> SavedOptimizer:
    """The optimizer part of an fqnckpt checkpoint (format :mod:`checkpoint.optim`), decoded.

    Raises:
        OptimizerMismatchError: the part holds no fqnckpt optimizer metadata.
        CorruptCheckpointError: a stored value does not follow the schema (names the index).
    """
    meta = reader.meta.optimizer if reader.meta else None
    where = reader.index_path or reader.root
    if meta is None:
        raise OptimizerMismatchError(f"{where} holds no fqnckpt optimizer metadata")
    refs: set[str] = set()

    def read_ref(key: str) -> torch.Tensor:
        if key not in reader:
            raise CorruptCheckpointError(where, f"$ref to tensor {key!r} that the optimizer shards lack")
        refs.add(key)
        return guarded_get(reader, key)

    values = {
        fqn: {name: decode_value(raw, f"{where} state {fqn!r} {name!r}", read_ref) for name, raw in d.items()}
        for fqn, d in meta.state_values.items()
    }
    groups = []
    for gi, g in enumerate(meta.param_groups):
        raw = g.model_dump(exclude={"params"})
        if meta.value_encoding >= 2:
            raw = {k: decode_value(v, f"{where} param group {gi} {k!r}") for k, v in raw.items()}
        groups.append((list(g.params), raw))  # encoding 1: JSON as written (tuples became lists)
    saved_fqns = {n for g in meta.param_groups for n in g.params}
    keys = [k for k in reader.keys() if k not in refs]
    return SavedOptimizer(
        where, groups, _split_state_keys(keys, saved_fqns), values, set(meta.python_scalars), meta.optimizer_class
    )


def plan_optimizer(
    optimizer: torch.optim.Optimizer,
    reader: Any,
    state: ModuleState,
    saved: SavedOptimizer | None = None,
    aliases: dict[str, str] | None = None,
    prefetch: Any = None,
) -> dict[str, Any]:
    """Read and check everything needed to restore ``optimizer`` by FQN, without changing it:
    returns the ``state_dict`` to hand to ``optimizer.load_state_dict``.

    ``saved``: the saved optimizer (default: the fqnckpt optimizer part behind ``reader``, see
    :func:`saved_fqnckpt_optimizer`); its state tensors are read through ``reader`` where each
    parameter lives (this rank's slice of a DTensor). ``aliases``: saved FQN -> target FQN where
    they differ (names the load resolved, e.g. a DCP container prefix). ``prefetch(pairs)``:
    called once with every ``(key, parameter)`` before any state tensor is read (DCP reads them
    in one collective ``dcp.load``).

    Raises:
        OptimizerMismatchError: no saved state, a target group whose FQN set no saved group has,
            a saved group no target group takes, a state entry of a parameter not in any group,
            or state of another optimizer kind (param-group keys or a parameter's state keys
            differ from the target class's own: :mod:`.optimizer_kind`, names class and key).
        CorruptCheckpointError: a stored value does not follow the schema (names the index).
    """
    saved = saved if saved is not None else saved_fqnckpt_optimizer(reader)
    where = saved.where
    names = optimizer_param_names(optimizer, state)
    by_name = state.by_name()
    aliases = aliases or {}

    def canon(n: str) -> str:
        n = aliases.get(n, n)
        return by_name[n].fqn if n in by_name else n

    held_by: dict[str, int] = {}  # a parameter is in one group once (torch's add_param_group rule)
    for gi, (fqns, _) in enumerate(saved.groups):
        for n in fqns:
            first = held_by.get(canon(n))
            if first is not None:
                twice = f"group {gi} names {n!r} twice" if first == gi else f"groups {first} and {gi} both hold {n!r}"
                raise CorruptCheckpointError(where, f"saved optimizer param {twice}: a parameter belongs to one group, once")
            held_by[canon(n)] = gi
    saved_groups = {frozenset(canon(n) for n in fqns): (fqns, hyper) for fqns, hyper in saved.groups}
    state_values = {canon(f): d for f, d in saved.values.items()}
    per_param = {canon(f): d for f, d in saved.tensors.items()}

    probe = StateKeyProbe(optimizer)
    new_groups, new_state, used, idx = [], {}, set(), 0
    reads: list[tuple[int, str, str, torch.Tensor]] = []
    for gi, group in enumerate(optimizer.param_groups):
        fqns = [names[id(p)] for p in group["params"]]
        match = saved_groups.get(frozenset(fqns))
        if match is None:
            raise OptimizerMismatchError(
                f"{where}: optimizer group {gi} holds {sorted(fqns)[:5]} ({len(fqns)} params); "
                f"no saved group has the same parameters (saved groups: {[len(g) for g, _ in saved.groups]} params)"
            )
        used.add(id(match))
        why = group_keys_problem(optimizer, gi, group, match[1], saved.class_name)
        why = why or group_values_problem(optimizer, gi, group, match[1], saved.class_name)
        if why is not None:
            raise OptimizerMismatchError(f"{where}: {why}")
        hyper = dict(match[1])
        for k, cur in group.items():
            v = hyper.get(k)
            if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor):
                hyper[k] = v.to(cur.device)  # a tensor hyper-parameter goes where the target keeps it
            elif isinstance(cur, tuple) and isinstance(v, list):
                hyper[k] = tuple(v)
        ids = []
        for p, fqn in zip(group["params"], fqns):
            held = set(per_param.get(fqn, {})) | set(state_values.get(fqn, {}))
            want = probe.keys(gi, match[1], p.dim()) if held else None
            why = state_keys_problem(optimizer, fqn, held, want, saved.class_name)
            if why is not None:
                raise OptimizerMismatchError(f"{where}: {why}")
            for name, key in per_param.get(fqn, {}).items():
                reads.append((idx, name, key, p))
            if per_param.get(fqn) or state_values.get(fqn):
                new_state[idx] = dict(state_values.get(fqn, {}))
            ids.append(idx)
            idx += 1
        new_groups.append({**hyper, "params": ids})
    unused = [sorted(g)[:5] for g, h in saved.groups if id(saved_groups.get(frozenset(canon(n) for n in g))) not in used]
    if unused:
        raise OptimizerMismatchError(
            f"{where}: saved param groups holding {unused} match no group of the target optimizer "
            "(their state would be dropped)"
        )
    if prefetch is not None:
        prefetch([(key, p) for _, _, key, p in reads])
    for i, name, key, p in reads:
        v = _read_like(reader, key, p)
        new_state[i][name] = v.item() if key in saved.scalars else v  # scalars: encoding 1
    return {"state": new_state, "param_groups": new_groups}


def saved_source_optimizer(
    info: OptimizerInfo, where: str, optimizer: torch.optim.Optimizer | None = None, state: ModuleState | None = None
) -> SavedOptimizer:
    """A :class:`SavedOptimizer` from the optimizer state a source found: DCP's
    ``get_state_dict`` layout (nested or flattened: state keyed by FQN), or a ``torch.optim``
    state_dict (a pickle) keyed by integer ids. Integer ids are named by the source's
    ``param_names`` where it carries them, else by position against ``optimizer`` (group ``i``'s
    ``j``-th id is the target's group ``i``'s ``j``-th parameter, the rule of
    ``torch.optim.Optimizer.load_state_dict``).

    Raises:
        OptimizerMismatchError: positional ids and the group count or sizes differ from the target's.
    """
    fqn_of: dict[Any, str] = {}
    if info.param_names is not None:
        fqn_of = dict(zip(info.param_ids, info.param_names))
    elif optimizer is not None and info.param_ids and not all(isinstance(i, str) for i in info.param_ids):
        names = optimizer_param_names(optimizer, state)
        sizes = [len(g["params"]) for g in optimizer.param_groups]
        saved_sizes = [len(ids) for ids in info.group_ids]
        if sizes != saved_sizes:
            raise OptimizerMismatchError(
                f"{where}: the saved optimizer state is keyed by position and its param groups hold "
                f"{saved_sizes} params, the target optimizer's {sizes}: the order cannot name them"
            )
        for ids, g in zip(info.group_ids, optimizer.param_groups):
            fqn_of.update((i, names[id(p)]) for i, p in zip(ids, g["params"]))
    groups = [([fqn_of.get(i, str(i)) for i in ids], dict(h)) for ids, h in zip(info.group_ids, info.groups)]
    tensors: dict[str, dict[str, str]] = {}
    for key, (pid, slot) in info.state.items():
        tensors.setdefault(fqn_of.get(pid, str(pid)), {})[slot] = key
    return SavedOptimizer(where, groups, tensors, {}, set(info.scalars))
