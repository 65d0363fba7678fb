"""Strict dynamo capture of a private copy of the model, with the FQN map recorded by tensor identity.

Uses ``torch._dynamo.functional_export._dynamo_graph_capture_for_export`` ("dgc"): unlike
``torch.export.export(strict=True)`` (which fails on activation checkpointing in torch 2.13) it
keeps ``torch.ops.higher_order.tag_activation_checkpoint`` for ``checkpoint(use_reentrant=False)``
(with or without ``context_fn``) and ``checkpoint_wrapper``. Facts: docs/capture-names.md.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.utils import parametrize
from torch.utils import _pytree as pytree

from fqn import FQNMap

from .data import InputSignature
from .errors import CaptureError
from .mixed_precision import CastToDtype, apply_mixed_precision


@dataclass
class Captured:
    """Result of :func:`capture`.

    ``gm``: the captured GraphModule, called as ``gm(*args, **kwargs)``; its attributes are named
    by the private copy's own FQNs (``lin.parametrizations.weight.original`` under mixed precision).
    ``fqn_map``: eager FQN <-> graph attribute names. ``attr_of``: ``{eager FQN: graph attribute}``
    for every tensor the graph holds. ``device``: device the graph was traced for (its fake
    tensors'). ``n_casts``: number of cast parametrizations registered. ``cast_fqns``: eager
    FQNs of the parameters every use of which the graph casts to ``param_dtype``. ``inputs``: the
    example inputs' structure, shapes, dtypes and constants. ``training``: each module's
    ``training`` flag at capture, in ``model.named_modules(remove_duplicate=False)`` order.
    """

    gm: torch.fx.GraphModule
    fqn_map: FQNMap
    attr_of: dict[str, str]
    device: torch.device
    n_casts: int
    cast_fqns: frozenset[str] = field(default_factory=frozenset)
    inputs: InputSignature | None = None
    training: tuple[bool, ...] | None = None


def model_device(model: nn.Module) -> torch.device | None:
    """Device of the first parameter or buffer of ``model`` (``None`` if it has none)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return None


def _to_fake(model: nn.Module, device: torch.device) -> dict[int, torch.Tensor]:
    """Replace every parameter / buffer of ``model`` (in place) by an empty tensor on ``device``
    (fake, under the caller's FakeTensorMode), one per tensor object: tied tensors stay tied
    (``nn.Module.to_empty`` would untie them, making a new Parameter per owning module).
    Returns ``{id(new tensor): the tensor it replaced}`` (see :func:`_restore_tensors`)."""
    made: dict[int, torch.Tensor] = {}
    was: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            for key, t in store.items():
                if t is None:
                    continue
                new = made.get(id(t))
                if new is None:
                    new = torch.empty_like(t, device=device)
                    if isinstance(t, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=t.requires_grad)
                    made[id(t)] = new
                    was[id(new)] = t
                store[key] = new
    return was


def _restore_tensors(gm: nn.Module, was: dict[int, torch.Tensor]) -> None:
    """Put the tensors :func:`_to_fake` replaced back into ``gm`` (in place), so that the graph
    module computes with the model's values when called directly (``meta`` ones stay meta)."""
    for mod in gm.modules():
        for store in (mod._parameters, mod._buffers):
            for key, t in store.items():
                if t is not None and id(t) in was:
                    store[key] = was[id(t)]


def capture_device(model: nn.Module, device: torch.device | str | None = None) -> torch.device:
    """The device :func:`capture` traces for: ``device`` if given, else the model's, else (a meta
    model, or one without tensors) torch's default device."""
    if device is not None:
        return torch.device(device)
    found = model_device(model)
    return found if found is not None and found.type != "meta" else torch.get_default_device()


def capture(
    model: nn.Module,
    args: tuple = (),
    kwargs: dict | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    device: torch.device | str | None = None,
) -> Captured:
    """Capture ``model(*args, **kwargs)`` with strict dynamo, on a private deep copy whose
    parameters and buffers are fake tensors on ``device`` (:func:`capture_device`; AutoParallel
    passes its mesh's device type).

    Device-faithful: the model runs at capture as it will run on ``device``, so code that
    branches on the device (transformers' MoE ``histc`` on CPU, kernels chosen per device) takes
    the branch of the device the graph runs on, also for a model built on meta; fake tensors hold
    no memory. ``model`` is never mutated: the copy gets the mixed-precision casts
    (:func:`autoparallel.mixed_precision.apply_mixed_precision`). ``args`` / ``kwargs`` may nest
    tuples, lists and dicts of tensors (global shapes); they are faked on ``device`` too. The FQN
    map is built by tensor identity (:meth:`fqn.FQNMap.from_capture`); its eager side never shows
    ``parametrizations.*.original``.

    Raises:
        CaptureError: dynamo could not capture the model in one graph, or a graph tensor has no
            eager FQN.
    """
    from torch._dynamo.functional_export import _dynamo_graph_capture_for_export
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.export._trace import _restore_state_dict

    kwargs = kwargs or {}
    private = copy.deepcopy(model)
    n_casts = apply_mixed_precision(private, mp_policy)
    device = capture_device(private, device)
    signature = InputSignature.of(args, kwargs)
    # Non-fake inputs allowed: to_empty reads the meta / real tensors it replaces (shapes only).
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        was = _to_fake(private, device)
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: fake_mode.from_tensor(t).to(device), (args, kwargs)
        )
    try:
        # A Python side effect under activation checkpointing (transformers 5.25's `kernels` layers
        # set and reset a global in every attention forward) is refused by dynamo because eager AC
        # replays it in backward; an exported graph never replays Python side effects, so the
        # replay cannot be kept anyway (torchtitan sets the same flag for compile with AC).
        with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
            gm = _dynamo_graph_capture_for_export(private)(*args, **kwargs)
    except Exception as e:  # dynamo raises many types; give one with the model's class
        raise CaptureError(_capture_failure(type(model).__name__, e)) from e
    # Attribute names become the copy's FQNs (and the raw graph becomes callable).
    _restore_state_dict(private, gm)
    fqn_map = FQNMap.from_capture(private, gm)
    attr_of: dict[str, str] = {}
    for name, _ in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        if name not in fqn_map:
            raise CaptureError(f"graph attribute {name!r} is not a tensor of {type(model).__name__}")
        attr_of.setdefault(fqn_map.to_eager(name), name)
    cast_ids = _cast_parameter_ids(private)
    cast_fqns = frozenset(fqn for fqn, attr in attr_of.items() if id(_get_tensor(gm, attr)) in cast_ids)
    _restore_tensors(gm, was)
    return Captured(
        gm,
        fqn_map,
        attr_of,
        device,
        n_casts,
        cast_fqns,
        signature,
        tuple(m.training for _, m in model.named_modules(remove_duplicate=False)),
    )


# dynamo's message for an output it cannot return, e.g. a transformers ``DynamicCache``.
_UNRECOGNIZED_OUTPUT = re.compile(r"unrecognized type \w+\((\w+)\) at output (\d+)")


def _capture_failure(model_name: str, e: Exception) -> str:
    hit = _UNRECOGNIZED_OUTPUT.search(str(e))
    if hit:
        return (
            f"{model_name} returns a {hit.group(1)} (output #{hit.group(2)}), which is not a tensor: the parallel "
            "module returns tensors (in lists, tuples, dicts, dataclasses) only. For a transformers model "
            "pass use_cache=False (in its config or as a forward argument): a KV cache serves generation, "
            f"not training. (dynamo: {e})"
        )
    return f"strict dynamo capture of {model_name} failed: {e}"


def _get_tensor(root: nn.Module, name: str) -> torch.Tensor:
    mod_name, _, leaf = name.rpartition(".")
    mod = root.get_submodule(mod_name) if mod_name else root
    return getattr(mod, leaf)


def _cast_parameter_ids(model: nn.Module) -> set[int]:
    """ids of the parameters of ``model`` that every use reads through a :class:`CastToDtype`."""
    cast: set[int] = set()
    direct: set[int] = set()
    for mod in model.modules():
        if isinstance(mod, parametrize.ParametrizationList):
            if any(isinstance(p, CastToDtype) for p in mod):
                cast.add(id(mod.original))
                continue
        for p in mod._parameters.values():
            if p is not None:
                direct.add(id(p))
    return cast - direct
