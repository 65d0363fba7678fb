"""Run the user's single-device ``init_weights`` unchanged on a module whose tensors are DTensors.

Three things make single-device code work (written by hand: no library does this):

* in-place ops mixing a DTensor with a plain tensor (``w.copy_(t)``, ``w.data[:] = t``) treat the
  plain tensor as the full (replicated) value: ``implicit_replication``; a copy into a
  ``Shard`` DTensor only keeps the local chunk. In-place inits (``nn.init.normal_``, ``fill_``,
  ``zero_``) run on the local shard only, so the full tensor is never built on a rank;
* reassignment (``self.w = nn.Parameter(t)``, ``self.buf = t``) of a DTensor attribute copies
  ``t`` into the existing DTensor, keeping its placement, tied aliases and registration;
* random fills (``normal_``, ``uniform_``, ``nn.init.*``, ``torch.randn``, ...) are
  mesh-independent (:mod:`autoparallel.mesh_init`): each element's value depends on a key drawn
  from the default generator, the tensor's eager FQN, the op and its arguments and the element's
  global index, never on the mesh or placements, and equals :func:`mesh_independent_init` on the
  eager model. Ranks must share the default generator's seed, as single-device init code run on
  every rank does after ``torch.manual_seed``. ``mesh_independent=False`` keeps the former rule
  (each shard drawn from its own torch stream: cheaper, values depend on the mesh);
* writes through indexing, slices and views (``nn.init.zeros_(w[padding_idx])``,
  ``w.data[i] = 0``) land on the ranks holding those elements, also where the view cuts across
  the shards (:mod:`autoparallel.shard_views`);
* a transformers model's ``init_weights`` runs as its constructor runs it: tied targets separate
  until the init returns, so the tie's source wins (:mod:`autoparallel.hf_init`);
* ``dtensor.data = t`` would swap the wrapper's metadata and silently drop the write, so it raises
  :class:`~autoparallel.errors.DataAssignmentError`; a DTensor ``t`` of the same shape and dtype
  (a tensor rebuilt from its own ``.data``) is copied in instead.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import DataAssignmentError
from .hf_init import construction_init
from .mesh_init import FullTensorWarning, current_state, mesh_independent_context
from .shard_views import ShardWrites
from .uninitialized import NoteWrites

_active = threading.local()
_DATA_SETTER = torch._C.TensorBase.data


class _RefuseDataSet(TorchFunctionMode):
    """Refuse ``dtensor.data = t`` (routed here as ``Tensor.data.__set__``), except where ``t`` is a
    DTensor of the same shape and dtype, as code rebuilding a tensor from its own ``.data`` makes
    (transformers' ``_adjust_bias`` in ``tie_weights``: ``bias.data = pad(bias.data, (0, 0))``):
    its values are copied into the DTensor, which keeps its placements (``t`` is not aliased)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) == "__set__" and getattr(func, "__self__", None) is _DATA_SETTER:
            if args and isinstance(args[0], DTensor):
                dst, value = args[0], args[1] if len(args) > 1 else None
                if isinstance(value, DTensor) and value.shape == dst.shape and value.dtype == dst.dtype:
                    with torch.no_grad():
                        dst.copy_(value)
                    return None
                raise DataAssignmentError(
                    f"`.data = ...` on a DTensor of shape {tuple(args[0].shape)} would silently lose the "
                    "write; use an in-place op (`with torch.no_grad(): w.copy_(t)`) or `w.data[:] = t`"
                )
        return func(*args, **(kwargs or {}))


class _ShardedRandom(TorchDispatchMode):
    """Former rule (``mesh_independent=False``): seeded random in-place ops on a DTensor's local
    shard with a per-shard generator; values depend on the mesh."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        dst = args[0] if args else None
        if (
            isinstance(dst, DTensor)
            and torch.Tag.nondeterministic_seeded in func.tags
            and func._schema.is_mutable
            and kwargs.get("generator") is None
        ):
            # One draw from the default generator per op: successive inits differ, ranks agree.
            base = int(torch.randint(0, 2**62, (1,)).item())
            shard_id = 0
            for dim, p in enumerate(dst.placements):
                if p.is_shard():
                    shard_id = shard_id * dst.device_mesh.size(dim) + dst.device_mesh.get_local_rank(dim)
            local = dst.to_local()
            gen = torch.Generator(device=local.device)
            gen.manual_seed((base + 1_000_003 * shard_id) % 2**63)
            with torch.no_grad():
                func(local, *args[1:], **{**kwargs, "generator": gen})
            return dst
        return func(*args, **kwargs)


def _name_of(t: DTensor, names: dict[int, str]) -> str | None:
    state = current_state()
    return (state.fqn_of(t) if state is not None else None) or names.get(id(t))


def _warn_full(t: DTensor, why: str) -> None:
    state = current_state()
    name = (state.fqn_of(t) if state is not None else None) or f"DTensor{tuple(t.shape)}"
    if state is not None:
        state.warn_full(name, why)
    else:
        message = f"init of {name!r} made its full tensor on every rank ({why})"
        warnings.warn(message, FullTensorWarning, stacklevel=6)


def _copy_into(dst: DTensor, value: torch.Tensor, where: str) -> None:
    if isinstance(value, nn.Parameter):
        value = value.detach()
    if tuple(value.shape) != tuple(dst.shape):
        raise ValueError(
            f"init_weights assigned {where} a tensor of shape {tuple(value.shape)}, expected {tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(value.to(dtype=dst.dtype, device=dst.device_mesh.device_type))


@contextlib.contextmanager
def dtensor_init_context(module: nn.Module, mesh_independent: bool = True, construction: bool = False):
    """Context in which single-device init code writes into ``module``'s DTensors (see module doc).

    ``construction``: for a transformers model, run the body as its constructor runs
    ``init_weights`` (:func:`autoparallel.hf_init.construction_init`: tied targets separate until
    the init returns, ``_is_hf_initialized`` marks cleared); no effect on other modules.
    Re-entrant: nested calls (a parent's ``init_weights`` calling its children's) share one context.
    Patches ``nn.Module.__setattr__`` for its duration (process-wide; not thread-safe for other
    threads building modules at the same time).
    """
    if getattr(_active, "depth", 0):
        _active.depth += 1
        try:
            yield
        finally:
            _active.depth -= 1
        return
    with contextlib.ExitStack() as stack:
        if construction:
            stack.enter_context(construction_init(module))
        stack.enter_context(_writes_into_dtensors(module, mesh_independent))
        yield


@contextlib.contextmanager
def _writes_into_dtensors(module: nn.Module, mesh_independent: bool):
    slots: dict[tuple[int, str], tuple[str, DTensor]] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for store in (mod._parameters, mod._buffers):
            for name, t in store.items():
                if isinstance(t, DTensor):
                    slots[(id(mod), name)] = (f"{mod_name}.{name}" if mod_name else name, t)
    original_setattr = nn.Module.__setattr__

    def setattr_into_dtensor(self, name, value):
        hit = slots.get((id(self), name))
        if hit is not None and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            _copy_into(hit[1], value, hit[0])
            return
        original_setattr(self, name, value)

    _active.depth = 1
    nn.Module.__setattr__ = setattr_into_dtensor
    try:
        rng = mesh_independent_context(module) if mesh_independent else _ShardedRandom()
        names = {id(t): fqn for fqn, t in slots.values()}
        # NoteWrites outside the random fills' mode; that mode reports its DTensor writes to it by
        # hand (its element-wise ops skip the modes below it, mesh_init._fill). ShardWrites
        # innermost: it sees views of sharded tensors, and writes through them, first.
        with implicit_replication(), _RefuseDataSet(), NoteWrites(), rng:
            with ShardWrites(lambda t: _name_of(t, names), _warn_full):
                yield
    finally:
        nn.Module.__setattr__ = original_setattr
        _active.depth = 0


def wrap_init_weights(root: nn.Module, method: str = "init_weights", mesh_independent: bool = True) -> int:
    """Make ``root.<method>`` and every submodule's ``<method>`` run in :func:`dtensor_init_context`
    (``mesh_independent`` passed on; ``construction`` for ``init_weights``, so a transformers
    model's ties and marks are those of its constructor).

    The bound method is wrapped per instance, so calling a submodule's ``init_weights`` directly
    works too. Returns the number of modules wrapped.
    """
    wrapped = 0
    for mod in root.modules():
        fn = getattr(type(mod), method, None)
        if callable(fn):
            run = _in_context(root, fn.__get__(mod), mesh_independent, method == "init_weights")
            object.__setattr__(mod, method, run)
            wrapped += 1
    return wrapped


def _in_context(root: nn.Module, bound, mesh_independent: bool, construction: bool):
    @functools.wraps(bound)
    def run(*args, **kwargs):
        with dtensor_init_context(root, mesh_independent, construction):
            return bound(*args, **kwargs)

    return run
