"""``init_weights`` of a transformers model as transformers runs it when it builds the model.

transformers (>= 5) initializes a model inside its constructor (``post_init`` -> ``init_weights``
-> ``initialize_weights``: ``_init_weights`` on every module not yet marked
``_is_hf_initialized``) while the tied parameters are still separate tensors, and ties them
afterwards (``tie_weights``: each target of ``all_tied_weights_keys`` becomes its source). So the
source's init is what a tied tensor holds (an embedding's zero padding row survives the
``lm_head``'s ``normal_``), and every module is marked initialized, which turns a later
``init_weights()`` into ``tie_weights()`` alone.

A parallel module, or an eager model built on CPU, holds the tie from the start, and an eager
model built on meta and materialized with ``to_empty`` holds none (``to_empty`` gives every slot
its own tensor). :func:`construction_init` makes ``init_weights`` on all of them run as the
constructor does: modules' ``_is_hf_initialized`` marks cleared, each tied target given a tensor of
its own (same placements, for a DTensor) for the duration of the call, and the shared tensor put
back afterwards (what ``tie_weights`` at the end of ``init_weights`` does too). Duck-typed on
``all_tied_weights_keys`` and ``tie_weights``: transformers is never imported here.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def is_transformers_model(module: nn.Module) -> bool:
    """``module`` carries transformers' tie mapping (``all_tied_weights_keys``) and ``tie_weights``."""
    return isinstance(getattr(module, "all_tied_weights_keys", None), dict) and callable(
        getattr(module, "tie_weights", None)
    )


def _slot(module: nn.Module, name: str) -> tuple[nn.Module, str, str] | None:
    path, _, attr = name.rpartition(".")
    try:
        owner = module.get_submodule(path) if path else module
    except AttributeError:
        return None
    for store in ("_parameters", "_buffers"):
        if getattr(owner, store).get(attr) is not None:
            return owner, store, attr
    return None


@contextlib.contextmanager
def construction_init(module: nn.Module):
    """Run the body (``module.init_weights()``) as transformers' constructor runs it (module doc);
    a no-op for other modules. Tied targets missing from the module are skipped."""
    if not is_transformers_model(module):
        yield
        return
    for mod in module.modules():
        mod.__dict__.pop("_is_hf_initialized", None)
    untied: list[tuple[nn.Module, str, str, torch.Tensor]] = []
    for target, source in module.all_tied_weights_keys.items():
        t_slot, s_slot = _slot(module, target), _slot(module, source)
        if t_slot is None or s_slot is None:
            continue
        owner, store, attr = t_slot
        shared = getattr(owner, store)[attr]
        if shared is not getattr(s_slot[0], s_slot[1])[s_slot[2]]:
            continue  # not tied now (to_empty untied it): nothing to separate
        own = torch.empty_like(shared)
        if isinstance(shared, nn.Parameter):
            own = nn.Parameter(own, requires_grad=shared.requires_grad)
        getattr(owner, store)[attr] = own
        untied.append((owner, store, attr, shared))
    try:
        yield
    finally:
        for owner, store, attr, shared in untied:
            getattr(owner, store)[attr] = shared
