"""On-disk schema of an FQN map (pydantic, no torch import): :class:`FQNMapFile` and its records.

Kept apart from :mod:`fqn.registry` (which needs torch) so that readers of a checkpoint's index,
such as ``fqnckpt inspect``, validate the map without importing torch."""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TensorKind(str, Enum):
    """What a tensor is to its module (``named_parameters``, persistent or not buffers, lifted constants)."""

    parameter = "parameter"
    persistent_buffer = "persistent_buffer"
    non_persistent_buffer = "non_persistent_buffer"
    constant = "constant"


FQN_MAP_SCHEMA_VERSION = 1


class Provenance(str, Enum):
    """What decided a record's captured names."""

    identity = "identity"  # same tensor object seen in the graph and in the model
    export_signature = "export_signature"  # ExportedProgram.graph_signature.input_specs
    rule = "rule"  # a string rule (wrapper segments, parametrizations)
    user = "user"  # given by the caller


class TensorRecord(BaseModel):
    """One tensor (parameter, buffer or lifted constant).

    ``fqn`` is the canonical eager FQN, ``aliases`` the other eager FQNs of the same tensor (tied
    weights), ``captured`` every name a capture gave it (graph attribute / get_attr target,
    placeholder target, FX node name, export placeholder). ``shape`` in elements, ``dtype`` as
    ``str(torch.dtype)`` without the ``torch.`` prefix (``"float32"``).
    """

    model_config = ConfigDict(extra="forbid")

    fqn: str
    aliases: list[str] = Field(default_factory=list)
    captured: list[str] = Field(default_factory=list)
    kind: TensorKind
    shape: list[int]
    dtype: str
    provenance: Provenance

    @property
    def eager_names(self) -> list[str]:
        return [self.fqn, *self.aliases]


class FQNMapFile(BaseModel):
    """On-disk form of an :class:`FQNMap` (JSON). ``version`` is the schema version."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = FQN_MAP_SCHEMA_VERSION
    records: list[TensorRecord]


__all__ = ["FQN_MAP_SCHEMA_VERSION", "FQNMapFile", "Provenance", "TensorKind", "TensorRecord"]
