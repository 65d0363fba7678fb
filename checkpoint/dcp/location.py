"""Where a DCP storage writer / reader points: the one ``path`` / ``checkpoint_id`` rule of
:class:`~checkpoint.dcp.StorageWriter` and :class:`~checkpoint.dcp.StorageReader`."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any

from ..storage.location import resolve


class Located:
    """``path`` (a directory, file or URL), ``storage_options`` and ``transfer`` as for
    :func:`checkpoint.save` / :func:`checkpoint.load`; DCP's ``checkpoint_id`` replaces ``path``
    on ``reset``, which also draws a new ``run_id`` (DCP's ``save_id`` / ``load_id``)."""

    def _locate(self, path: str | os.PathLike | None, storage_options: Mapping[str, Any] | None, transfer: Any) -> None:
        self.path = os.fspath(path) if path is not None else None
        self.storage_options = dict(storage_options) if storage_options else None
        self.transfer = transfer
        self.run_id = uuid.uuid4().hex

    def _relocate(self, checkpoint_id: str | os.PathLike | None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.run_id = uuid.uuid4().hex

    def _require_path(self) -> str:
        if self.path is None:
            raise ValueError(f"checkpoint.dcp.{type(self).__name__}: no path (pass one, or checkpoint_id= to DCP)")
        return self.path

    def _where(self) -> Any:
        """The resolved path or remote location (raises ValueError without a path)."""
        return resolve(self._require_path(), self.storage_options, self.transfer)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
