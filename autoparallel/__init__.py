"""autoparallel: strict dynamo capture with AC tags and mixed precision, and a parallel module whose
state is stored as DTensors (any placements) and whose per-rank graph runs data-parallel with FSDP
semantics (state all-gathered before use, gradients reduce-scattered back to the placements).

The FQN map recorded during capture is exposed on the result (``pmod.fqn_map``), so checkpoints
keep eager FQNs.
"""

from torch.distributed.fsdp import MixedPrecisionPolicy

from .api import AutoParallel
from .capture import Captured, capture
from .errors import (
    AutoParallelError,
    CaptureError,
    DataAssignmentError,
    InitWriteError,
    InputError,
    PlacementError,
    StateError,
    UninitializedStateError,
)
from .init_weights import dtensor_init_context, wrap_init_weights
from .mesh_init import FullTensorWarning, mesh_independent_context, mesh_independent_init
from .mixed_precision import CastToDtype, apply_mixed_precision, count_param_casts
from .parallel_module import build_parallel_module
from .placement import Plan, apply_overrides, default_plan, fsdp_placements

__all__ = [
    "AutoParallel",
    "MixedPrecisionPolicy",
    "Captured",
    "capture",
    "build_parallel_module",
    "Plan",
    "default_plan",
    "fsdp_placements",
    "apply_overrides",
    "CastToDtype",
    "apply_mixed_precision",
    "count_param_casts",
    "dtensor_init_context",
    "wrap_init_weights",
    "mesh_independent_init",
    "mesh_independent_context",
    "FullTensorWarning",
    "AutoParallelError",
    "CaptureError",
    "PlacementError",
    "DataAssignmentError",
    "StateError",
    "InputError",
    "InitWriteError",
    "UninitializedStateError",
]
