"""What the parallel module holds at forward, checked against what the captured graph needs.

A parameter / buffer may be replaced between forwards (``pmod.w = nn.Parameter(...)``,
``load_state_dict(assign=True)``, an optimizer wrapper): each one is checked where forward starts,
before any collective, so that a mismatch is named instead of failing deep inside autograd (case
A31). A DTensor with other placements on the module's mesh is gathered by its own placements (its
gradient reduced back to them); anything the graph cannot take is refused with a
:class:`~autoparallel.errors.StateError` naming the FQN.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import DTensor

from .errors import StateError
from .gather import GatherSpec


def _placements(ps) -> str:
    return "(" + ", ".join(map(str, ps)) + ")"


def held_spec(fqn: str, t: object, spec: GatherSpec) -> GatherSpec:
    """How forward gathers ``t``, the tensor the module holds at ``fqn`` (built with ``spec``).

    A DTensor on ``spec.mesh`` of the global shape and dtype the graph was captured for: ``spec``
    with ``t``'s own placements and strides (any ``Shard`` / ``Replicate`` / ``_StridedShard``).
    A plain tensor of that shape and dtype on the mesh's device type: ``spec`` (used as it is on
    each rank; its gradient is this rank's, not reduced).

    Raises:
        StateError: naming ``fqn``: ``t`` is not a tensor, or its global shape, dtype or device type
            differs from the capture's, it is a DTensor on another mesh, or with a ``Partial``
            placement (no value to gather).
    """
    if not isinstance(t, torch.Tensor):
        raise StateError(f"{fqn!r} is {type(t).__name__}, not a tensor: the graph reads it at forward")
    where = f"{fqn!r} is held as {'a DTensor' if isinstance(t, DTensor) else 'a plain tensor'}"
    if tuple(t.shape) != tuple(spec.shape):
        raise StateError(
            f"{where} of shape {tuple(t.shape)}; the graph was captured for {tuple(spec.shape)}"
        )
    if spec.dtype is not None and t.dtype != spec.dtype:
        raise StateError(f"{where} of dtype {t.dtype}; the graph was captured for {spec.dtype}")
    if t.device.type != spec.mesh.device_type:
        raise StateError(
            f"{where} on device {t.device}; the module runs on the mesh's {spec.mesh.device_type!r}"
        )
    if not isinstance(t, DTensor):
        return spec
    if t.device_mesh != spec.mesh:
        raise StateError(f"{where} on another DeviceMesh {t.device_mesh}; the module's is {spec.mesh}")
    if any(p.is_partial() for p in t.placements):
        raise StateError(
            f"{where} with placements {_placements(t.placements)}: Partial holds no value to gather"
        )
    if tuple(t.placements) == spec.placements and t.stride() == spec.stride:
        return spec
    return dataclasses.replace(spec, placements=tuple(t.placements), stride=t.stride())
