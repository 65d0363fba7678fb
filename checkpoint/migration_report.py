"""``migration_report.json``: the pydantic schema of what :func:`checkpoint.migrate` decided.

Data passed between the planning stage (:mod:`checkpoint.plan.migration`, which fills it) and the
entry point (:mod:`checkpoint.migrating`, which writes it): it sits below both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


REPORT_NAME = "migration_report.json"



OPTIMIZER_GROUPS_NAME = "optimizer_param_groups.json"



REPORT_VERSION = 1



class KeyDecision(BaseModel):
    """One source key and the eager key it became; ``decided_by`` lists the steps that renamed it
    (empty when unchanged); ``shape`` in elements, ``dtype`` like ``"float32"``."""

    model_config = ConfigDict(extra="forbid")

    source: str
    target: str
    decided_by: list[str] = Field(default_factory=list)
    shape: list[int]
    dtype: str
    file: str



class Unresolved(BaseModel):
    """A source key that maps to no eager key (``reason``), with candidates when ambiguous."""

    model_config = ConfigDict(extra="forbid")

    source: str
    reason: str
    candidates: list[str] = Field(default_factory=list)



class Collision(BaseModel):
    """Several source keys mapped to one eager key: none of them is migrated."""

    model_config = ConfigDict(extra="forbid")

    target: str
    sources: list[str]



class ShapeMismatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str
    target: str
    source_shape: list[int]
    model_shape: list[int]



class MigrationReport(BaseModel):
    """``migration_report.json``: every source key -> eager key with the rule or provenance that
    decided it, plus what was refused. ``missing`` are model keys the source lacks, ``ignorable``
    source keys that are non-persistent buffers of the model (dropped), ``skipped`` non-tensor
    source entries (name -> type). ``written`` is False for a dry run or a refused migration."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = REPORT_VERSION
    source: str
    source_format: str
    container: str | None = None
    destination: str | None = None
    dry_run: bool = False
    written: bool = False
    entries: list[KeyDecision] = Field(default_factory=list)
    unresolved: list[Unresolved] = Field(default_factory=list)
    collisions: list[Collision] = Field(default_factory=list)
    shape_mismatched: list[ShapeMismatch] = Field(default_factory=list)
    missing: list[str] = Field(default_factory=list)
    ignorable: list[str] = Field(default_factory=list)
    alias_groups: list[list[str]] = Field(default_factory=list)
    # Source keys that hold one tied tensor: stored once, after their values were checked equal.
    tied_sources: list[list[str]] = Field(default_factory=list)
    skipped: dict[str, str] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)
    optimizer_param_groups: list[dict[str, Any]] | None = None
    # Optimizer state kept beside a model container ({"model", "optim"}): source key -> state.<fqn>.<slot>,
    # written to optimizer-*.safetensors + optimizer.safetensors.index.json (checkpoint.optim format).
    optimizer_entries: list[KeyDecision] = Field(default_factory=list)
    total_bytes: int = 0
    # DCP: kind of every top-level entry (model, optimizer, lr_scheduler, dataloader, train_state, other).
    entry_kinds: dict[str, str] = Field(default_factory=dict)
    # Keys written to extra_state.json (entries that are neither model nor optimizer).
    extra_state: list[str] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing was unresolved, colliding, shape-mismatched or missing."""
        return not (self.unresolved or self.collisions or self.shape_mismatched or self.missing)

    @property
    def mapping(self) -> dict[str, str]:
        """``{source key: eager key}`` of every migrated key."""
        return {e.source: e.target for e in self.entries}

    def counts(self) -> dict[str, int]:
        """Numbers of renamed / unchanged / unresolved (incl. collisions) / missing keys."""
        renamed = sum(e.source != e.target for e in self.entries)
        return {
            "renamed": renamed,
            "unchanged": len(self.entries) - renamed,
            "unresolved": len(self.unresolved) + sum(len(c.sources) for c in self.collisions),
            "shape_mismatched": len(self.shape_mismatched),
            "missing": len(self.missing),
        }

    def problems(self) -> str:
        parts = []
        if self.unresolved:
            parts.append(f"unresolved {[u.source for u in self.unresolved][:10]}")
        if self.collisions:
            parts.append(
                "collisions " + "; ".join(f"{c.sources} -> {c.target!r}" for c in self.collisions[:10])
            )
        if self.shape_mismatched:
            parts.append(
                f"shape-mismatched {[(m.source, m.source_shape, m.model_shape) for m in self.shape_mismatched][:10]}"
            )
        if self.missing:
            parts.append(f"missing from the source {self.missing[:10]}")
        return "; ".join(parts)



def read_report(path: str | os.PathLike) -> MigrationReport:
    """The :class:`MigrationReport` stored in a migrated checkpoint directory (or a report file)."""
    p = Path(path)
    if p.is_dir():
        p = p / REPORT_NAME
    return MigrationReport.model_validate_json(p.read_bytes())
