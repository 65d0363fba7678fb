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


def with_use_markers(gm: torch.fx.GraphModule, attrs: set[str], marker) -> torch.fx.GraphModule:
    """A new GraphModule running ``gm``'s graph (shared submodules, shared tensors) in which every
    use of each top-level ``get_attr`` of ``attrs`` reads ``marker(value, attr)`` instead, called
    just before the attribute's first user. ``gm`` is not modified.

    Why: autograd runs a node's backward in the reverse order of creation among the ready ones, so
    a node made where a parameter is first used (not where forward starts) runs as soon as that
    parameter's gradient is complete; see :class:`autoparallel.gather.BucketTape`. Copied with
    ``Graph.graph_copy`` (node metadata shared): ``copy.deepcopy`` trips over its fake tensors.
    """
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    val_map: dict[torch.fx.Node, torch.fx.Node] = {}
    out = graph.graph_copy(gm.graph, val_map)
    graph.output(out)
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "get_attr" or node.target not in attrs or not node.users:
            continue
        first = min(node.users, key=order.__getitem__)
        with graph.inserting_before(first):
            marked = graph.call_function(marker, (node, node.target))
        node.replace_all_uses_with(marked, delete_user_cb=lambda user, m=marked: user is not m)
    return torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
