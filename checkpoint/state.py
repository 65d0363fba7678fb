"""Where names are mapped: a module or state_dict -> entries under eager FQNs.

A module with an ``fqn_map`` attribute (an :class:`fqn.FQNMap`, e.g. a captured / parallel module)
is named through it; otherwise :func:`fqn.eager_tensors` (which applies :func:`fqn.canonical_fqn`
with the module, removing ``_orig_mod.``, ``module.``, ``_fsdp_wrapped_module.``,
``_checkpoint_wrapped_module.`` only where the module says that child is a wrapper).
A plain state_dict is taken with its keys exactly as given: without a module nothing says which
segment is a wrapper, so no name is changed by string alone.
Tied tensors become one entry (canonical FQN + aliases). Non-persistent buffers are kept apart:
never saved, reported as ignorable on load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fqn import FQNMap, TensorKind, eager_tensors


@dataclass(slots=True)  # one per tensor: 10^4-10^5 per load
class Entry:
    """One stored tensor: canonical eager ``fqn``, its ``aliases``, the live ``tensor`` (maybe a DTensor).

    ``module_names``: where the tensor lives in its module (``named_parameters`` / buffer names,
    wrapper segments included), used to replace it (``load(assign=True)``); for a state_dict the keys.
    """

    fqn: str
    tensor: torch.Tensor
    kind: TensorKind = TensorKind.parameter
    aliases: list[str] = field(default_factory=list)
    module_names: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [self.fqn, *self.aliases]


@dataclass
class ModuleState:
    """Entries of a module / state_dict: ``entries`` (saved / loaded), ``non_persistent`` buffer
    names (canonical and aliases), the module's ``fqn_map`` if any."""

    entries: list[Entry]
    non_persistent: dict[str, torch.Tensor]
    fqn_map: FQNMap | None = None

    def by_name(self) -> dict[str, Entry]:
        """Every eager name (canonical and alias) -> its entry."""
        entries = self.entries
        if not any(e.aliases for e in entries):  # no name list per entry (10^4-10^5 entries)
            return {e.fqn: e for e in entries}
        return {n: e for e in entries for n in e.names}

    @property
    def alias_groups(self) -> list[list[str]]:
        return [e.names for e in self.entries if e.aliases]

    @property
    def has_dtensor(self) -> bool:
        return any(isinstance(e.tensor, DTensor) for e in self.entries)


def _dedupe(names: list[str]) -> list[str]:
    return list(dict.fromkeys(names))


def module_state(model: nn.Module) -> ModuleState:
    """Entries of ``model`` in ``state_dict`` order (see module docstring)."""
    fmap = getattr(model, "fqn_map", None)
    if fmap is not None and not isinstance(fmap, FQNMap):
        fmap = None

    def eager(name: str) -> str:
        return fmap.to_eager(name) if fmap is not None and name in fmap else name

    entries: list[Entry] = []
    nonp: dict[str, torch.Tensor] = {}
    hooked = _hooked_names(model) if fmap is None else {}
    for et in eager_tensors(model):
        names = _dedupe([eager(n) for n in et.names])
        if fmap is not None and names[0] in fmap:
            names = _dedupe([*names, *fmap.record(names[0]).eager_names])
        if et.kind == TensorKind.non_persistent_buffer:
            nonp.update({n: et.tensor for n in names})
            continue
        renamed = hooked.get(id(et.tensor))
        if renamed and not set(renamed) & set(names):
            names = renamed  # a state_dict hook renamed it: saved and loaded as state_dict() names it
        entries.append(Entry(names[0], et.tensor, et.kind, names[1:], list(et.module_names)))
    return ModuleState(entries, nonp, fmap)


def _hooked_names(model: nn.Module) -> dict[int, list[str]]:
    """``{id(tensor): its keys in model.state_dict()}`` (wrapper segments removed, as for
    :func:`fqn.eager_tensors`' names) when a module of ``model`` has state_dict hooks, else {}.

    Why: the names fqnckpt saves and loads are the ones the model's own ``state_dict()`` gives,
    its hooks included (torch's ``nn.Module._register_state_dict_hook`` /
    ``register_state_dict_post_hook``: a module that hides a runtime-only level of its own, as
    quantization and fused wrappers do, renames its keys there, and pairs it with a
    ``load_state_dict`` pre-hook that renames them back). Tensors are matched by identity
    (``keep_vars=True``); a hook returning new tensors (a dequantized copy) names nothing here,
    and such tensors keep their parameter paths."""
    if not any(m._state_dict_hooks or m._state_dict_pre_hooks for m in model.modules()):
        return {}
    from fqn import canonical_fqn

    out: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            names = out.setdefault(id(value), [])
            name = canonical_fqn(key, model)
            if name not in names:
                names.append(name)
    return out


def alias_key(t: torch.Tensor) -> tuple | None:
    """What decides the values a tensor reads: storage and byte offset (``data_ptr``), shape,
    strides, dtype, device, and the lazy conjugate / negative bits. Two tensors with equal keys
    read the same values in every case (aliases); any difference makes them distinct tensors.
    None for empty or non-strided tensors (nothing to share; sparse ones are refused by
    ``TensorSpec.of``)."""
    if t.layout != torch.strided or t.numel() == 0:
        return None
    if isinstance(t, DTensor):
        base, extra = t._local_tensor, (tuple(t.placements), tuple(t.shape))
    else:
        base, extra = t, ()
    # torch.device and torch.Size hash and compare by value (str(device) costs ~1 us a tensor).
    return (
        base.data_ptr(), base.shape, base.stride(), base.dtype, base.device,
        base.is_conj(), base.is_neg(), *extra,
    )  # fmt: skip


def _data_ptr(t: torch.Tensor) -> int | None:
    """The first byte's address of ``t`` (its local shard for a DTensor); None where
    :func:`alias_key` is None."""
    if t.layout != torch.strided or t.numel() == 0:
        return None
    return (t._local_tensor if isinstance(t, DTensor) else t).data_ptr()


def dict_state(sd: Mapping[str, object]) -> ModuleState:
    """Entries of a flat state_dict, named by its keys exactly as given (no wrapper segment is
    removed: nothing says which is a wrapper). Tensors with equal :func:`alias_key` (same storage,
    offset, shape, strides, dtype, conj / neg bits) are one entry with aliases; any other view,
    e.g. disjoint views of one buffer or a ``.view(dtype)`` of it, stays a separate entry.

    Raises:
        TypeError: a value is not a tensor (names the key) or a key is not a string.
    """
    entries: list[Entry] = []
    # Aliases share data_ptr: the first entry at each address is kept in `first`; only on a shared
    # address are the full alias_keys (~3 us) built, in `shared` (state_dicts of 10^4-10^5 tensors).
    first: dict[int, Entry] = {}
    shared: dict[int, list[list]] = {}  # address -> [alias_key or None until needed, entry]
    param, strided, tensor_type = TensorKind.parameter, torch.strided, torch.Tensor
    for k, v in sd.items():
        if not isinstance(k, str):
            raise TypeError(f"state_dict key {k!r} is not a string")
        if not isinstance(v, tensor_type):
            raise TypeError(
                f"state_dict value of {k!r} is a {type(v).__name__}, not a tensor; only tensors can be saved"
            )
        # _data_ptr inline
        ptr = (v._local_tensor if isinstance(v, DTensor) else v).data_ptr() if v.layout is strided and v.numel() else None
        if ptr is not None and ptr in first:
            bucket = shared.get(ptr)
            if bucket is None:
                bucket = shared[ptr] = [[None, first[ptr]]]
            key = alias_key(v)
            same = None
            for item in bucket:
                if item[0] is None:
                    item[0] = alias_key(item[1].tensor)
                if item[0] == key:
                    same = item[1]
                    break
            if same is not None:
                same.aliases.append(k)
                same.module_names.append(k)
                continue
            e = Entry(k, v, param, [], [k])
            entries.append(e)
            bucket.append([key, e])
            continue
        e = Entry(k, v, param, [], [k])
        entries.append(e)
        if ptr is not None:
            first[ptr] = e
    return ModuleState(entries, {})


def object_state(obj: object) -> ModuleState:
    """:func:`module_state` for an ``nn.Module``, :func:`dict_state` for a mapping.

    Raises:
        TypeError: ``obj`` is neither.
    """
    if isinstance(obj, nn.Module):
        return module_state(obj)
    if isinstance(obj, Mapping):
        return dict_state(obj)
    raise TypeError(f"expected an nn.Module or a state_dict, got {type(obj).__name__}")
