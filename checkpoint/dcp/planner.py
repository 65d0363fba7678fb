"""``SavePlanner``: DCP's ``DefaultSavePlanner`` that plans every DTensor placement correctly.

DCP describes a DTensor's local shard as one chunk placed by
``compute_local_shape_and_global_offset``, which returns only the first global offset. A
``_StridedShard`` shard (FSDP2 + TP, AutoParallel) is several blocks of the global tensor (rows
[0, 1, 4, 5] of 8), so ranks' chunks overlap and DCP's default planner refuses the save ("Failed
to validate global plan: ... overlapping chunks"). This planner plans such a shard as one write
item per block (:func:`checkpoint.ranks.shards.local_blocks`) and resolves each to its slice of
the local shard; every other value is planned as DCP plans it. It works with any storage writer
(ours, ``FileSystemWriter``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from ..ranks import shards


@dataclasses.dataclass(frozen=True)
class TiedKeys:
    """``SavePlan.storage_data`` set by :class:`SavePlanner`: keys of one tensor (same storage,
    offset, shape, strides, dtype; DTensors also the same placements), each group's first key
    the one planned; :class:`~checkpoint.dcp.StorageWriter` records the groups as the index's
    alias groups, as ``checkpoint.save`` does for tied weights."""

    groups: tuple[tuple[str, ...], ...]


def tied_groups(state_dict: dict[str, Any]) -> list[tuple[str, ...]]:
    """Groups of keys of ``state_dict`` (DCP's flattened one) holding the same tensor, in key
    order; tensors without elements are never grouped."""
    by: dict[tuple, list[str]] = {}
    for k, v in state_dict.items():
        if not isinstance(v, torch.Tensor):
            continue
        local, extra = (v.to_local(), (tuple(v.placements), id(v.device_mesh))) if isinstance(v, DTensor) else (v, ())
        if not local.numel() or local.is_meta:
            continue
        ident = (local.untyped_storage().data_ptr(), local.device, local.storage_offset(), tuple(local.shape),
                 tuple(local.stride()), local.dtype, tuple(v.shape), extra)  # fmt: skip
        by.setdefault(ident, []).append(k)
    return [tuple(g) for g in by.values() if len(g) > 1]


class SavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` (same arguments) with ``_StridedShard`` DTensors planned block by
    block (see module docstring), and tied tensors (one tensor under several keys: tied
    embeddings) planned once under their first key, the others recorded as its aliases
    (:class:`TiedKeys`): ``dcp.save(sd, storage_writer=..., planner=SavePlanner())``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._block_slices: dict[tuple[str, tuple[int, ...]], tuple[slice, ...]] = {}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self._block_slices = {}
        items: list[WriteItem] = []
        changed = False
        for it in plan.items:
            obj = self.state_dict.get(it.index.fqn) if it.type == WriteItemType.SHARD else None
            if not (isinstance(obj, DTensor) and any(isinstance(p, _StridedShard) for p in obj.placements)):
                items.append(it)
                continue
            changed = True
            for lsl, gsl in shards.local_blocks(obj):
                offsets = torch.Size(g.start for g in gsl)
                sizes = torch.Size(g.stop - g.start for g in gsl)
                self._block_slices[(it.index.fqn, tuple(offsets))] = lsl
                items.append(
                    WriteItem(
                        index=MetadataIndex(it.index.fqn, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                            properties=it.tensor_data.properties,
                            size=it.tensor_data.size,
                        ),
                    )
                )
        groups = tied_groups(self.state_dict)
        if groups:
            drop = {k for g in groups for k in g[1:]}
            items = [it for it in items if it.index.fqn not in drop]
            plan = dataclasses.replace(plan, items=items, storage_data=TiedKeys(tuple(groups)))
            self.plan = plan
        elif changed:
            plan = dataclasses.replace(plan, items=items)
            self.plan = plan
        return plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        lsl = self._block_slices.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
        if lsl is not None:
            return self.state_dict[write_item.index.fqn].to_local()[lsl]
        return super().resolve_data(write_item)


__all__ = ["SavePlanner", "TiedKeys", "tied_groups"]
