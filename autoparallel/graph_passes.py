"""Graph rewrites that let a graph captured on one device with plain tensors run under DTensor."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

# Graph code can only reference picklable constants, so meshes are referred to by a key.
_MESHES: dict[int, DeviceMesh] = {}


def as_replicate(t: torch.Tensor, mesh_key: int) -> torch.Tensor:
    """``t`` as a ``Replicate()`` DTensor on the registered mesh (unchanged if already a DTensor)."""
    if isinstance(t, DTensor) or not isinstance(t, torch.Tensor):
        return t
    mesh = _MESHES[mesh_key]
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


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


def _is_tensor_node(mod: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    if node.op == "get_attr":
        obj = mod
        for seg in node.target.split("."):
            obj = getattr(obj, seg, None)
        return isinstance(obj, torch.Tensor)
    return isinstance(node.meta.get("example_value"), torch.Tensor)


def replicate_free_tensors(gm: torch.fx.GraphModule, mesh: DeviceMesh) -> int:
    """Wrap tensors the graph makes from nothing (masks, ``arange``) as ``Replicate()`` DTensors
    where they meet inputs or state, in ``gm`` and its nested graphs (AC bodies).

    Why not ``implicit_replication()``: it is a context, and the backward pass (including the
    activation-checkpoint recompute) runs outside it. Returns the number of wraps inserted.
    """
    key = id(mesh)
    _MESHES[key] = mesh
    inserted = 0
    for mod in gm.modules():
        if not isinstance(mod, torch.fx.GraphModule):
            continue
        graph = mod.graph
        dependent: set[torch.fx.Node] = set()
        for node in graph.nodes:
            if node.op == "placeholder" or (node.op == "get_attr" and _is_tensor_node(mod, node)):
                dependent.add(node)
            elif any(a in dependent for a in node.all_input_nodes):
                dependent.add(node)
        touched = False
        for node in list(graph.nodes):
            if node in dependent or node.op in ("output", "get_attr") or not _is_tensor_node(mod, node):
                continue
            users = [u for u in node.users if u in dependent or u.op == "output"]
            if not users:
                continue
            _reroute(graph, node, users, as_replicate, key)
            inserted += 1
            touched = True
        if touched:
            mod.recompile()
    return inserted


def _reroute(graph: torch.fx.Graph, node: torch.fx.Node, users, fn, key: int) -> None:
    """Insert ``fn(node, key)`` right after ``node`` and make ``users`` read it instead of ``node``."""
    with graph.inserting_after(node):
        wrapped = graph.call_function(fn, (node, key))
    wrapped.meta = dict(node.meta)
    for u in users:
        u.replace_input_with(node, wrapped)


def as_gathered(t: torch.Tensor, mesh_key: int) -> torch.Tensor:
    """``t`` redistributed to ``Replicate()`` on every mesh dim (differentiable: the backward
    reduce-scatters the gradient back to ``t``'s placements, in ``t``'s dtype)."""
    if not isinstance(t, DTensor) or all(p.is_replicate() for p in t.placements):
        return t
    return t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)


def gather_state_before_use(gm: torch.fx.GraphModule, mesh: DeviceMesh) -> int:
    """Insert :func:`as_gathered` after every state tensor ``get_attr`` of ``gm`` (FSDP semantics).

    Why: left to itself, DTensor picks per-op strategies by redistribution cost and can shard
    activations along dims smaller than the mesh (a ``view`` of 2 heads over 4 ranks fails). With
    state gathered where it is read (before the mixed-precision cast, so gradients are reduced in
    the parameter's dtype), the placement plan only decides storage, and every plan gives the
    same numbers. Returns the number of gathers inserted.
    """
    key = id(mesh)
    _MESHES[key] = mesh
    graph = gm.graph
    inserted = 0
    for node in list(graph.nodes):
        if node.op != "get_attr" or not _is_tensor_node(gm, node):
            continue
        users = list(node.users)
        _reroute(graph, node, users, as_gathered, key)
        inserted += 1
    if inserted:
        gm.recompile()
    return inserted
