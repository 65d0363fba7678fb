"""Data passed from the planning stage to :mod:`checkpoint.apply`: what to copy where."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..reports import LoadReport
from ..state import Entry


@dataclass(slots=True)  # one per tensor: 10^4-10^5 per load
class CopyAction:
    """Fill target ``entry`` from checkpoint tensor ``key``; the target has dtype ``dtype`` when
    written (after ``load(dtype=...)``). ``assign``: replace the target instead of copying into it."""

    entry: Entry
    key: str
    dtype: torch.dtype
    assign: bool = False
    stored_dtype: torch.dtype | None = None  # dtype of ``key`` in the checkpoint



@dataclass
class LoadPlan:
    """Everything :func:`apply_load` does, decided and checked by :func:`plan_load`."""

    report: LoadReport
    copies: list[CopyAction] = field(default_factory=list)
    optimizer_state: dict[str, Any] | None = None
