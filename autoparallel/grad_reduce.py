"""How gradients are combined over the data-parallel ranks: averaged (FSDP2 / DDP) or summed.

The averaging follows FSDP2's rule (``_get_gradient_divide_factors`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``, torch 2.13): a float32 / bfloat16
``reduce_dtype`` reduces with the backend's ``avg`` op (no separate division); any other
``reduce_dtype`` (float16, float64) sums, dividing by ``pre`` before the collective and by ``post``
after it, ``pre`` about ``sqrt(world)`` (FSDP2's loop: doubled while it divides ``world`` and is
below ``world / pre``), so float16's small range neither overflows in the sum nor underflows in
the division. One data-parallel rank reduces nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Reduce = Literal["mean", "sum"]
REDUCE_MODES: tuple[str, ...] = ("mean", "sum")
_BACKEND_AVG = (torch.float32, torch.bfloat16)  # FSDP2: "no overflow risk", the backend divides


@dataclass(frozen=True)
class GradReduce:
    """One gradient reduction: ``op`` (``"sum"`` / ``"avg"``, the collective's op), then the
    divisions before (``pre``) and after (``post``) it (``None``: none)."""

    op: str = "sum"
    pre: float | None = None
    post: float | None = None

    def before(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` divided by ``pre`` (in place; ``t`` is a buffer of ours)."""
        return t.div_(self.pre) if self.pre not in (None, 1) else t

    def after(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` divided by ``post`` (in place)."""
        return t.div_(self.post) if self.post not in (None, 1) else t


def check_reduce(reduce: str) -> str:
    """``reduce`` itself. Raises ``ValueError`` unless it is ``"mean"`` or ``"sum"``."""
    if reduce not in REDUCE_MODES:
        raise ValueError(f"reduce={reduce!r}: expected one of {', '.join(map(repr, REDUCE_MODES))}")
    return reduce


def grad_reduce(reduce: str, reduce_dtype: torch.dtype, world: int) -> GradReduce:
    """The reduction of gradients in ``reduce_dtype`` over ``world`` data-parallel ranks.

    ``reduce="sum"``: the plain sum (for a loss already normalised over the global batch).
    ``reduce="mean"``: the sum divided by ``world``, as FSDP2 does (see the module docstring).

    Raises:
        ValueError: ``reduce`` is neither ``"mean"`` nor ``"sum"``.
    """
    if check_reduce(reduce) == "sum" or world == 1:
        return GradReduce()
    if reduce_dtype in _BACKEND_AVG:
        return GradReduce(op="avg")
    pre = 1
    while world % pre == 0 and world / pre > pre:
        pre *= 2
    return GradReduce(pre=float(pre), post=world / pre)
