"""Mixed precision as a dtype-cast parametrization on a private copy of the model.

Why a parametrization: strict dynamo capture traces it, so every use of every parameter in the
captured graph goes through ``.to(param_dtype)`` (AC bodies included), while the stored parameter
keeps its own dtype. The class is marked ``_fqnckpt_transparent`` so :func:`fqn.eager_tensors`
names ``X.parametrizations.W.original`` as ``X.W``: the eager FQN is unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.utils import parametrize


class CastToDtype(nn.Module):
    """Parametrization ``w -> w.to(dtype)``; backward returns the gradient in ``w``'s own dtype."""

    _fqnckpt_transparent = True

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.to(self.dtype)

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}"


def resolve_policy(policy: MixedPrecisionPolicy | None) -> MixedPrecisionPolicy | None:
    """Normalize ``policy``: ``None`` or no ``param_dtype`` means no casts; ``reduce_dtype`` defaults
    to float32 (gradients are summed across ranks in it, then stored in the parameter's dtype).

    Raises:
        ValueError: ``reduce_dtype`` is not a floating-point dtype.
    """
    if policy is None or policy.param_dtype is None:
        return None
    reduce_dtype = policy.reduce_dtype if policy.reduce_dtype is not None else torch.float32
    if not reduce_dtype.is_floating_point:
        raise ValueError(f"reduce_dtype={reduce_dtype} is not a floating-point dtype")
    return MixedPrecisionPolicy(
        param_dtype=policy.param_dtype,
        reduce_dtype=reduce_dtype,
        output_dtype=policy.output_dtype,
        cast_forward_inputs=policy.cast_forward_inputs,
    )


def apply_mixed_precision(model: nn.Module, policy: MixedPrecisionPolicy | None) -> int:
    """Register a :class:`CastToDtype` on every floating-point parameter of ``model`` (in place).

    Tied parameters get one cast per owning module (each use is cast). Call it on a private copy,
    never on the user's model. Returns the number of parametrizations registered.
    """
    policy = resolve_policy(policy)
    if policy is None:
        return 0
    count = 0
    for mod in list(model.modules()):
        if parametrize.is_parametrized(mod) or isinstance(mod, parametrize.ParametrizationList):
            continue  # user parametrizations: leave their modules alone (their output is not a leaf)
        for name, p in list(mod.named_parameters(recurse=False)):
            if p.is_floating_point() and p.dtype != policy.param_dtype:
                parametrize.register_parametrization(mod, name, CastToDtype(policy.param_dtype), unsafe=True)
                count += 1
    return count


def count_param_casts(gm: torch.fx.GraphModule, dtype: torch.dtype) -> tuple[int, int]:
    """``(uses cast to dtype, all uses)`` of parameters in ``gm`` and its nested graphs.

    A "use" is a user node of a parameter's ``get_attr`` (top graph) or of the placeholder a
    higher-order op (e.g. ``tag_activation_checkpoint``) passes a parameter into (nested graph).
    """
    params = {id(p) for p in gm.parameters()}
    cast = total = 0

    def is_cast(node: torch.fx.Node) -> bool:
        if node.op == "call_method" and node.target == "to":
            return dtype in node.args[1:] or node.kwargs.get("dtype") == dtype
        return False

    def walk(graph_mod: torch.fx.GraphModule, param_nodes: list[torch.fx.Node]) -> None:
        nonlocal cast, total
        for pnode in param_nodes:
            for user in pnode.users:
                if user.op == "call_function" and isinstance(user.args[0], torch.fx.Node):
                    sub = _subgraph(graph_mod, user.args[0])
                    if sub is not None:  # higher-order op: follow the parameter into its body
                        operands = list(user.args[1:])
                        phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
                        walk(sub, [ph for ph, a in zip(phs, operands) if a is pnode])
                        continue
                total += 1
                cast += is_cast(user)

    def _subgraph(graph_mod, node):
        if node.op == "get_attr":
            sub = getattr(graph_mod, node.target, None)
            if isinstance(sub, torch.fx.GraphModule):
                return sub
        return None

    top = [n for n in gm.graph.nodes if n.op == "get_attr" and id(_get(gm, n.target)) in params]
    walk(gm, top)
    return cast, total


def _get(root: nn.Module, target: str):
    obj = root
    for seg in target.split("."):
        obj = getattr(obj, seg, None)
    return obj
