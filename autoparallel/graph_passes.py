"""Graph rewrites that let a graph captured on one device (e.g. ``meta``) run on another."""

from __future__ import annotations

import torch


def retarget_devices(gm: torch.fx.GraphModule, src: torch.device, dst: torch.device) -> int:
    """Replace the constant ``src`` device in node args of ``gm`` and its nested graphs by ``dst``.

    Why: a graph traced on a meta model bakes ``device='meta'`` into factory calls
    (``torch.ones(..., device=...)``). Returns the number of nodes changed.
    """
    if src == dst:
        return 0
    changed = 0

    def fix(a):
        return dst if isinstance(a, torch.device) and a == src else a

    for mod in gm.modules():
        if not isinstance(mod, torch.fx.GraphModule):
            continue
        touched = False
        for node in mod.graph.nodes:
            new_args = torch.fx.node.map_aggregate(node.args, fix)
            new_kwargs = torch.fx.node.map_aggregate(node.kwargs, fix)
            if new_args != node.args or new_kwargs != node.kwargs:
                node.args, node.kwargs = new_args, new_kwargs
                touched = True
                changed += 1
        if touched:
            mod.recompile()
    return changed
