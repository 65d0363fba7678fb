"""fqn: the naming layer of fqnckpt. Maps captured / wrapped tensor names to eager FQNs and back.

Pure naming: no module here imports torch's distributed package.
"""

from .eager import EagerTensor, TensorKind, eager_tensors, is_transparent_parametrization
from .errors import (
    AmbiguousFQNError,
    CaptureMismatchError,
    FlatParamError,
    FQNCollisionError,
    FQNError,
    UnknownNameError,
)
from .registry import FQN_MAP_SCHEMA_VERSION, FQNMap, FQNMapFile, Provenance, TensorRecord, dtype_name
from .resolve import NameMatch, Resolution, match_names, resolve, resolve_report
from .rules import WRAPPER_SEGMENTS, canonical_fqn, flatten_name, is_wrapper_module

__all__ = [
    "FQNMap",
    "FQNMapFile",
    "TensorRecord",
    "TensorKind",
    "Provenance",
    "EagerTensor",
    "eager_tensors",
    "is_transparent_parametrization",
    "canonical_fqn",
    "resolve",
    "match_names",
    "resolve_report",
    "Resolution",
    "NameMatch",
    "flatten_name",
    "is_wrapper_module",
    "dtype_name",
    "WRAPPER_SEGMENTS",
    "FQN_MAP_SCHEMA_VERSION",
    "FQNError",
    "UnknownNameError",
    "AmbiguousFQNError",
    "FlatParamError",
    "CaptureMismatchError",
    "FQNCollisionError",
]
