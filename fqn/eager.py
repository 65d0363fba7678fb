"""Enumerate a module's tensors under their eager FQNs: the one place a module's own names are read.

A tensor reachable under several names (tied weights) gets one entry: the canonical FQN is the
first name in ``named_parameters()`` / ``named_buffers()`` order (what ``state_dict`` keeps first),
the others are its aliases. Wrapper segments are removed. A parametrization that fqnckpt itself
adds (marked ``_fqnckpt_transparent = True``, e.g. the mixed-precision cast) is transparent:
``X.parametrizations.W.original`` is named ``X.W``. User parametrizations keep their real names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .rules import canonical_fqn
from .schema import TensorKind


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass
class EagerTensor:
    """One tensor of a module: ``fqn`` (canonical), ``aliases`` (other FQNs), its ``kind``.

    ``module_names`` are the names the module itself uses for the tensor (``named_parameters`` /
    buffer names, wrapper segments and parametrization paths included), first one first.
    """

    fqn: str
    tensor: torch.Tensor
    kind: TensorKind
    aliases: list[str] = field(default_factory=list)
    module_names: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [self.fqn, *self.aliases]


def is_transparent_parametrization(module: nn.Module) -> bool:
    """True for a ``ParametrizationList`` whose every parametrization is fqnckpt's own."""
    plist = list(module) if isinstance(module, nn.ModuleList) else []
    return bool(plist) and all(getattr(p, "_fqnckpt_transparent", False) for p in plist)


def transparent_name(model: nn.Module, name: str) -> str:
    segs = name.split(".")
    if len(segs) >= 3 and segs[-1] == "original" and segs[-3] == "parametrizations":
        owner = model.get_submodule(".".join(segs[:-3])) if len(segs) > 3 else model
        plist = owner.parametrizations[segs[-2]]
        if is_transparent_parametrization(plist):
            return ".".join(segs[:-3] + [segs[-2]])
    return name


def eager_tensors(model: nn.Module) -> list[EagerTensor]:
    """Every parameter and buffer of ``model`` once, in ``state_dict`` order, with eager names.

    Non-persistent buffers are included with ``kind=non_persistent_buffer``.
    """
    by_id: dict[int, EagerTensor] = {}
    order: list[EagerTensor] = []

    def add(name: str, t: torch.Tensor, kind: TensorKind) -> None:
        fqn = canonical_fqn(transparent_name(model, name), model)
        rec = by_id.get(id(t))
        if rec is None:
            rec = by_id[id(t)] = EagerTensor(fqn, t, kind)
            order.append(rec)
        elif fqn != rec.fqn and fqn not in rec.aliases:
            rec.aliases.append(fqn)
        if name not in rec.module_names:
            rec.module_names.append(name)

    for name, p in model.named_parameters(remove_duplicate=False):
        add(name, p, TensorKind.parameter)
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for bname, b in mod._buffers.items():
            if b is None:
                continue
            kind = (
                TensorKind.non_persistent_buffer
                if bname in mod._non_persistent_buffers_set
                else TensorKind.persistent_buffer
            )
            add(f"{mod_name}.{bname}" if mod_name else bname, b, kind)
    return order
