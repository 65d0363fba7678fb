"""Wrapper and flat-parameter segment names (plain strings, no torch import; see :mod:`fqn.rules`)."""

from __future__ import annotations

WRAPPER_SEGMENTS = frozenset({"_orig_mod", "module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
# Class names of torch's pure wrappers, matched by name so this layer imports nothing distributed.
WRAPPER_CLASSES = frozenset(
    {
        "OptimizedModule",
        "DataParallel",
        "DistributedDataParallel",
        "FullyShardedDataParallel",
        "CheckpointWrapper",
        "OffloadWrapper",
        "ActivationWrapper",
    }
)
FLAT_PARAM_SEGMENTS = frozenset({"_flat_param", "flat_param"})

__all__ = ["FLAT_PARAM_SEGMENTS", "WRAPPER_CLASSES", "WRAPPER_SEGMENTS"]
