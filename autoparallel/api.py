"""``AutoParallel``: the user-facing flow, shaped like meta-pytorch/autoparallel's API."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.placement_types import Placement

from .capture import Captured, capture
from .data import InputSignature, local_inputs
from .errors import StateError
from .grad_reduce import Reduce, check_reduce
from .mixed_precision import resolve_policy
from .parallel_module import build_parallel_module
from .placement import Plan, apply_overrides, default_plan, validate_placements


def _split_inputs(inputs: Any) -> tuple[tuple, dict]:
    """``input_fn()`` result -> ``(args, kwargs)``: a tuple is positional args, a dict with exactly
    the keys ``args``/``kwargs`` is both, anything else (tensor, list, dict) is one argument."""
    if isinstance(inputs, tuple):
        return inputs, {}
    if isinstance(inputs, dict) and set(inputs) == {"args", "kwargs"}:
        return tuple(inputs["args"]), dict(inputs["kwargs"])
    return (inputs,), {}


class AutoParallel:
    """Capture ``model`` with strict dynamo and build its DTensor parallel module on ``mesh``.

    Usage::

        with AutoParallel(model, input_fn, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)) as autop:
            autop.add_input_constraints([(Shard(0),)])
            autop.add_output_constraints([(Shard(0),)])
            plan = autop.optimize_placement()
            pmod = autop.apply_placement(plan)
        pmod.to_empty(device="cpu"); pmod.init_weights(); out = pmod(local_batch)

    ``model`` may live on the meta device; it is never mutated. ``input_fn()`` returns example
    inputs with GLOBAL shapes: a tuple of positional args, ``{"args": (...), "kwargs": {...}}``, or
    a single argument (tensor or nested list / tuple / dict of tensors). Constraints list one
    placement tuple (one entry per mesh dim) per tensor leaf, in ``torch.utils._pytree`` flattening
    order of ``(args, kwargs)`` / of the output. Inputs are split on the batch (dim 0) only:
    ``Shard(0)`` or ``Replicate()`` per mesh dim (default ``Shard(0)`` on every mesh dim).

    Gradients (``reduce``): ``"mean"`` (default) averages them over the data-parallel ranks, as
    FSDP2 and DDP do (divided by the data-parallel world size, in ``reduce_dtype``, where FSDP2
    divides: see :mod:`autoparallel.grad_reduce`): a per-rank mean loss (transformers'
    ``out.loss``) then gives the gradient of the global batch's mean on 1, 2 or N ranks alike.
    ``"sum"`` sums them, for a loss already normalised over the global batch (each rank's
    ``loss_sum / global_tokens``).

    The model is captured for the per-rank (local) inputs: on entering the block for the default
    input placements, again in :meth:`apply_placement` if the constraints change the local shapes.
    The parallel module then computes data-parallel with FSDP semantics (see
    :func:`autoparallel.parallel_module.build_parallel_module`).

    Raises (on entering the ``with`` block):
        autoparallel.errors.CaptureError: dynamo cannot capture the model in one graph, or the
            model returns a non-tensor (e.g. a transformers cache: the message says
            ``use_cache=False``).
        autoparallel.errors.PlacementError: an input's batch is not divisible by the ranks
            splitting it.
        ValueError: a mixed-precision ``reduce_dtype`` that is not a floating dtype; ``reduce``
            neither ``"mean"`` nor ``"sum"`` (raised by the constructor).
    """

    def __init__(
        self,
        model: nn.Module,
        input_fn: Callable[[], Any],
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy | None = None,
        reduce: Reduce = "mean",
    ):
        self.reduce = check_reduce(reduce)
        self.model = model
        self.input_fn = input_fn
        self.mesh = mesh
        self.mp_policy = resolve_policy(mp_policy)
        self._captured: Captured | None = None
        self._global: tuple[tuple, dict] | None = None
        self._inputs: list[tuple[Placement, ...]] | None = None
        self._outputs: list[tuple[Placement, ...]] | None = None
        self._overrides: dict[str, Sequence[Placement]] = {}

    def __enter__(self) -> AutoParallel:
        self._global = _split_inputs(self.input_fn())
        self._captured = self._capture()
        return self

    def __exit__(self, *exc) -> None:
        self._captured = None
        self._global = None

    def _local_inputs(self) -> tuple[tuple, dict]:
        assert self._global is not None
        return local_inputs(*self._global, self._inputs, tuple(self.mesh.shape))

    def _capture(self) -> Captured:
        args, kwargs = self._local_inputs()
        # On fake tensors of the mesh's device type: device-dependent code takes the branch the
        # graph will run on, also for a meta model.
        return capture(self.model, args, kwargs, self.mp_policy, device=self.mesh.device_type)

    @property
    def captured(self) -> Captured:
        """The capture (graph, FQN map). Raises :class:`StateError` outside the ``with`` block."""
        if self._captured is None:
            raise StateError("AutoParallel is used outside its `with` block (nothing captured)")
        return self._captured

    @property
    def fqn_map(self):
        """The :class:`fqn.FQNMap` recorded during capture."""
        return self.captured.fqn_map

    def add_input_constraints(self, constraints: Sequence[Sequence[Placement]]) -> None:
        """Placements of each input tensor leaf. Raises ``PlacementError`` on a malformed entry."""
        self._inputs = [
            validate_placements(f"input #{i}", c, 0, self.mesh) for i, c in enumerate(constraints)
        ]

    def add_output_constraints(self, constraints: Sequence[Sequence[Placement]]) -> None:
        """Placements of each output tensor leaf. Raises ``PlacementError`` on a malformed entry."""
        self._outputs = [
            validate_placements(f"output #{i}", c, 0, self.mesh) for i, c in enumerate(constraints)
        ]

    def set_placements(self, overrides: Mapping[str, Sequence[Placement]]) -> None:
        """Override plan entries by eager FQN or fnmatch glob (``{"layers.*.wq.weight": (Shard(0),)}``).
        Checked by :meth:`optimize_placement`."""
        self._overrides.update(overrides)

    def optimize_placement(self) -> Plan:
        """The placement plan ``{eager FQN: placements per mesh dim}``.

        Rule-based, NOT a cost-model solver: FSDP-style ``Shard(0)`` for parameters whose dim 0
        covers the mesh (see :func:`autoparallel.placement.fsdp_placements`), ``Replicate()`` for
        buffers and small tensors, then the :meth:`set_placements` overrides.

        Raises:
            PlacementError: an override matches no FQN or is malformed.
        """
        fmap = self.captured.fqn_map
        return apply_overrides(default_plan(fmap, self.mesh), self._overrides, fmap, self.mesh)

    def apply_placement(self, plan: Plan | None = None) -> nn.Module:
        """Build the parallel module (see :func:`autoparallel.parallel_module.build_parallel_module`).

        ``plan`` defaults to :meth:`optimize_placement`. Each call returns a new, independent module
        (they share the captured graph). Captures again if the input constraints give other local
        shapes than the capture's.

        Raises:
            PlacementError: see :func:`~autoparallel.parallel_module.build_parallel_module`, and an
                input's batch not divisible by the ranks splitting it.
        """
        plan = plan if plan is not None else self.optimize_placement()
        if InputSignature.of(*self._local_inputs()) != self.captured.inputs:
            self._captured = self._capture()
        return build_parallel_module(
            self.model,
            self.captured,
            plan,
            self.mesh,
            self._inputs,
            self._outputs,
            self.mp_policy,
            self.reduce,
        )
