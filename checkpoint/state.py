"""Where names are mapped: a module or state_dict -> entries under eager FQNs.

A module with an ``fqn_map`` attribute (an :class:`fqn.FQNMap`, e.g. a captured / parallel module)
is named through it; otherwise :func:`fqn.eager_tensors` (which applies :func:`fqn.canonical_fqn`,
removing ``_orig_mod.``, ``module.``, ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``).
Tied tensors become one entry (canonical FQN + aliases). Non-persistent buffers are kept apart:
never saved, reported as ignorable on load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fqn import FQNMap, TensorKind, canonical_fqn, eager_tensors


@dataclass
class Entry:
    """One stored tensor: canonical eager ``fqn``, its ``aliases``, the live ``tensor`` (maybe a DTensor)."""

    fqn: str
    tensor: torch.Tensor
    kind: TensorKind = TensorKind.parameter
    aliases: list[str] = field(default_factory=list)

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
        return {n: e for e in self.entries for n in e.names}

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
    for et in eager_tensors(model):
        names = _dedupe([eager(n) for n in et.names])
        if fmap is not None and names[0] in fmap:
            names = _dedupe([*names, *fmap.record(names[0]).eager_names])
        if et.kind == TensorKind.non_persistent_buffer:
            nonp.update({n: et.tensor for n in names})
            continue
        entries.append(Entry(names[0], et.tensor, et.kind, names[1:]))
    return ModuleState(entries, nonp, fmap)


def _storage_key(t: torch.Tensor) -> tuple | None:
    """Identity of the bytes a tensor shows; None for empty tensors (all share data_ptr 0)."""
    if t.numel() == 0 or t.layout != torch.strided:
        return None  # sparse tensors are refused by name in TensorSpec.of
    base = t._local_tensor if isinstance(t, DTensor) else t
    extra = (t.placements, t.shape) if isinstance(t, DTensor) else ()
    return (base.data_ptr(), tuple(base.shape), tuple(base.stride()), base.dtype, str(base.device), *extra)


def dict_state(sd: Mapping[str, object]) -> ModuleState:
    """Entries of a flat state_dict. Tensors showing exactly the same bytes (same storage, offset,
    shape, strides) are one entry with aliases; disjoint views of one buffer stay separate.

    Raises:
        TypeError: a value is not a tensor (names the key) or a key is not a string.
    """
    entries: list[Entry] = []
    seen: dict[tuple, Entry] = {}
    for k, v in sd.items():
        if not isinstance(k, str):
            raise TypeError(f"state_dict key {k!r} is not a string")
        if not isinstance(v, torch.Tensor):
            raise TypeError(
                f"state_dict value of {k!r} is a {type(v).__name__}, not a tensor; only tensors can be saved"
            )
        name = canonical_fqn(k)
        key = _storage_key(v)
        if key is not None and key in seen:
            if name not in seen[key].names:
                seen[key].aliases.append(name)
            continue
        e = Entry(name, v, TensorKind.parameter)
        entries.append(e)
        if key is not None:
            seen[key] = e
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
