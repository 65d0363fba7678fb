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


class SavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` (same arguments) with ``_StridedShard`` DTensors planned block by
    block (see module docstring): ``dcp.save(sd, storage_writer=..., planner=SavePlanner())``."""

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
        if changed:
            plan = dataclasses.replace(plan, items=items)
            self.plan = plan
        return plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        lsl = self._block_slices.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
        if lsl is not None:
            return self.state_dict[write_item.index.fqn].to_local()[lsl]
        return super().resolve_data(write_item)


__all__ = ["SavePlanner"]
