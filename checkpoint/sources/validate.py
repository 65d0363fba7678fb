"""The structure of an optimizer state_dict found in a pickle, checked before any of it is used
(pydantic schema of ``torch.optim.Optimizer.state_dict()``); a failure names the file and field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from ..errors import CorruptCheckpointError


class _ParamGroup(BaseModel):
    """One entry of ``param_groups``: ``params`` are ids (ints as torch writes them, or strings),
    ``param_names`` (torch >= 2.5, optional) one name per id; other fields are hyper-parameters."""

    model_config = ConfigDict(extra="allow", arbitrary_types_allowed=True)

    params: list[int | str]
    param_names: list[str] | None = None

    @model_validator(mode="after")
    def _names_match(self) -> _ParamGroup:
        if self.param_names is not None and len(self.param_names) != len(self.params):
            raise ValueError(f"{len(self.param_names)} param_names for {len(self.params)} params")
        return self


class _OptimizerStateDict(BaseModel):
    """``torch.optim.Optimizer.state_dict()``: ``{"state": {id: {slot: value}}, "param_groups": [...]}``
    (torch/optim/optimizer.py, ``Optimizer.state_dict``)."""

    model_config = ConfigDict(extra="allow", arbitrary_types_allowed=True)

    state: dict[int | str, dict[str, Any]]
    param_groups: list[_ParamGroup]


def validate_optimizer_state_dict(osd: Mapping, file: str) -> None:
    """Raise :class:`CorruptCheckpointError` (``key`` = the field at fault, e.g.
    ``param_groups.0.params``) unless ``osd`` has the structure of an optimizer state_dict."""
    try:
        _OptimizerStateDict.model_validate(dict(osd))
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(map(str, err["loc"])) or "state_dict"
        got = type(err.get("input")).__name__
        raise CorruptCheckpointError(
            file, f"optimizer state_dict field {loc!r}: {err['msg']} (got a {got})", key=loc
        ) from None
