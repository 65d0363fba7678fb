"""``conversion_report.json``: each rule applied and how often, every group (source keys ->
target keys), what was dropped or copied unchanged, and what stopped the conversion."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import CheckpointError

CONVERSION_REPORT_NAME = "conversion_report.json"


class RuleUse(BaseModel):
    """One rule of the recipe: ``groups`` times applied, over ``sources`` keys into ``targets``."""

    model_config = ConfigDict(extra="forbid")

    rule: str
    groups: int = 0
    sources: int = 0
    targets: int = 0


class GroupEntry(BaseModel):
    """One application of a rule: these source keys became these target keys."""

    model_config = ConfigDict(extra="forbid")

    rule: int
    sources: list[str]
    targets: list[str]


class Problem(BaseModel):
    """Why the conversion stopped: ``kind`` and the keys concerned."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["unmatched", "ambiguous", "incomplete", "shape", "collision", "missing", "unexpected", "op", "no-op",
                  "dims", "inconsistent", "side-file", "inverse"]
    keys: list[str]
    message: str


class ConversionReport(BaseModel):
    """The whole account of one conversion (``written`` False for a dry run or a refusal)."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    recipe: str
    source: str
    source_format: str
    shards: int = 1
    destination: str | None = None
    dry_run: bool = False
    written: bool = False
    dims: dict[str, int] = Field(default_factory=dict)
    rules: list[RuleUse] = Field(default_factory=list)
    groups: list[GroupEntry] = Field(default_factory=list)
    unchanged: list[str] = Field(default_factory=list)
    dropped: list[str] = Field(default_factory=list)
    problems: list[Problem] = Field(default_factory=list)
    total_bytes: int = 0
    # Where each dimension came from ({source: {dim: value}}; all agree, else refused), the
    # layout version read and written, and every check made before writing (one line each).
    dim_sources: dict[str, dict[str, int]] = Field(default_factory=dict)
    layouts: dict[str, str] = Field(default_factory=dict)
    checks: list[str] = Field(default_factory=list)
    # Head counts / sizes only the caller stated (dims= / --dim), as "name=value": no config, model
    # or params.json states them, and the tensors' shapes fit other head counts too.
    unchecked: list[str] = Field(default_factory=list)
    # What the output lacks that a reader may expect, and why (no config.json for transformers).
    notes: list[str] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def mapping(self) -> dict[str, list[str]]:
        """``{source key: target keys it went into}``."""
        out: dict[str, list[str]] = {k: [k] for k in self.unchanged}
        for g in self.groups:
            for s in g.sources:
                out[s] = list(g.targets)
        return out

    def unchecked_line(self) -> str | None:
        """One line saying which dims nothing could check (None when every one was)."""
        if not self.unchecked:
            return None
        return (f"unchecked: {', '.join(self.unchecked)} come from dims= alone; no config, model or params.json states them and "
                f"the tensors' shapes fit other head counts too, so a wrong value converts without error")  # fmt: skip

    def summary(self) -> str:
        return "; ".join(f"{p.kind}: {p.message}" for p in self.problems[:10])


class ForwardRecord(BaseModel):
    """What a later conversion reads back from the ``conversion_report.json`` an earlier one wrote
    beside its output (only these fields; the rest of the report is kept as written): the recipe
    that wrote it, the dimensions it used, the layout versions it read and wrote and how many
    model-parallel shards its source had. The reverse recipe takes the version the forward read as
    its default target, so a round trip comes back as it went."""

    model_config = ConfigDict(extra="ignore")

    recipe: str
    dims: dict[str, int] = Field(default_factory=dict)
    layouts: dict[str, str] = Field(default_factory=dict)
    shards: int = 1

    def version_read(self) -> str | None:
        """The one layout version the forward conversion read (``"llama2"`` of ``"meta llama2"``,
        ``"786e26f"`` of ``"torchtitan legacy..786e26f (read as 786e26f)"``); None when it read a
        range that it did not narrow, or names none."""
        parts = self.layouts.get("source", "").split()
        if len(parts) < 2 or (len(parts) > 2 and parts[2] == "/"):
            return None
        if ".." in parts[1]:
            m = re.match(r"\(read as ([^)\s]+)\)", " ".join(parts[2:]))
            return m.group(1) if m else None
        return parts[1]


class ConversionError(CheckpointError):
    """A conversion stopped before anything was written; ``report`` names every key concerned."""

    def __init__(self, report: ConversionReport, why: str | None = None):
        self.report = report
        super().__init__(f"conversion of {report.source} with recipe {report.recipe!r} stopped: {why or report.summary()}")


__all__ = ["ConversionReport", "ForwardRecord", "ConversionError", "RuleUse", "GroupEntry", "Problem", "CONVERSION_REPORT_NAME"]
