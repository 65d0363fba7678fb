"""Strict dynamo capture of a private copy of the model, with the FQN map recorded by tensor identity.

Uses ``torch._dynamo.functional_export._dynamo_graph_capture_for_export`` ("dgc"): unlike
``torch.export.export(strict=True)`` (which fails on activation checkpointing in torch 2.13) it
keeps ``torch.ops.higher_order.tag_activation_checkpoint`` for ``checkpoint(use_reentrant=False)``
(with or without ``context_fn``) and ``checkpoint_wrapper``. Facts: shared/reference/capture-names.md.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils import _pytree as pytree

from fqn import FQNMap

from .errors import CaptureError
from .mixed_precision import apply_mixed_precision


@dataclass
class Captured:
    """Result of :func:`capture`.

    ``gm``: the captured GraphModule, called as ``gm(*args, **kwargs)``; its attributes are named
    by the private copy's own FQNs (``lin.parametrizations.weight.original`` under mixed precision).
    ``fqn_map``: eager FQN <-> graph attribute names. ``attr_of``: ``{eager FQN: graph attribute}``
    for every tensor the graph holds. ``device``: device the graph was traced on (``meta`` for a
    meta model). ``n_casts``: number of cast parametrizations registered.
    """

    gm: torch.fx.GraphModule
    fqn_map: FQNMap
    attr_of: dict[str, str]
    device: torch.device
    n_casts: int


def model_device(model: nn.Module) -> torch.device | None:
    """Device of the first parameter or buffer of ``model`` (``None`` if it has none)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return None


def _to_device(tree: Any, device: torch.device | None) -> Any:
    if device is None:
        return tree
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device) if t.device != device else t, tree)


def capture(
    model: nn.Module,
    args: tuple = (),
    kwargs: dict | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> Captured:
    """Capture ``model(*args, **kwargs)`` with strict dynamo, on a private deep copy.

    ``model`` is never mutated: the copy gets the mixed-precision casts
    (:func:`autoparallel.mixed_precision.apply_mixed_precision`). Works on meta models (inputs are
    moved to the model's device, so no real memory is used). ``args`` / ``kwargs`` may nest tuples,
    lists and dicts of tensors (global shapes). The FQN map is built by tensor identity
    (:meth:`fqn.FQNMap.from_capture`); its eager side never shows ``parametrizations.*.original``.

    Raises:
        CaptureError: dynamo could not capture the model in one graph, or a graph tensor has no
            eager FQN.
    """
    from torch._dynamo.functional_export import _dynamo_graph_capture_for_export
    from torch.export._trace import _restore_state_dict

    kwargs = kwargs or {}
    private = copy.deepcopy(model)
    n_casts = apply_mixed_precision(private, mp_policy)
    device = model_device(private)
    args, kwargs = _to_device((args, kwargs), device)
    try:
        gm = _dynamo_graph_capture_for_export(private)(*args, **kwargs)
    except Exception as e:  # dynamo raises many types; give one with the model's class
        raise CaptureError(f"strict dynamo capture of {type(model).__name__} failed: {e}") from e
    # Attribute names become the copy's FQNs (and the raw graph becomes callable).
    _restore_state_dict(private, gm)
    fqn_map = FQNMap.from_capture(private, gm)
    attr_of: dict[str, str] = {}
    for name, _ in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        if name not in fqn_map:
            raise CaptureError(f"graph attribute {name!r} is not a tensor of {type(model).__name__}")
        attr_of.setdefault(fqn_map.to_eager(name), name)
    return Captured(gm, fqn_map, attr_of, device or torch.get_default_device(), n_casts)
