"""Errors raised by the autoparallel package (all subclass :class:`AutoParallelError`)."""

from __future__ import annotations


class AutoParallelError(RuntimeError):
    """Base class of autoparallel errors."""


class CaptureError(AutoParallelError):
    """Strict dynamo capture failed or its graph does not match the model (message names the FQN)."""


class PlacementError(AutoParallelError, ValueError):
    """A placement plan or constraint is invalid: unknown FQN, wrong number of mesh dims, bad dim."""


class DataAssignmentError(AutoParallelError):
    """``dtensor.data = t`` on a parallel module's DTensor, ``t`` not a DTensor of the same shape
    and dtype: the write would be silently lost."""


class StateError(AutoParallelError):
    """An :class:`AutoParallel` method was called out of order (e.g. outside its ``with`` block)."""


class InputError(AutoParallelError, ValueError):
    """The parallel module's forward got inputs unlike the captured ones (structure, local shape, constants)."""


class UninitializedStateError(AutoParallelError):
    """Forward read tensors materialized by ``to_empty`` and never written since.

    ``fqns``: all their eager FQNs (the message names the first few)."""

    def __init__(self, message: str, fqns: list[str]):
        super().__init__(message)
        self.fqns = list(fqns)


class InitWriteError(AutoParallelError):
    """``init_weights`` wrote a parallel module's DTensor in a way that cannot give the single-device
    values on every mesh (a write into overlapping view elements, a view of a tensor with
    placements other than Shard / Replicate, a view of a sharded tensor used after init): nothing
    was written. The message names the tensor."""
