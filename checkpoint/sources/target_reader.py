"""A migration :class:`~.base.Source` as the reader :func:`checkpoint.plan.model.plan_load` plans
against (the interface of :class:`checkpoint.storage.reader.CheckpointReader` that planning and
applying use)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedFormatError
from .base import Source


class SourceTargetReader:
    """``keys`` / ``spec`` / ``get`` / ``file_of`` over the model tensors of a migration
    :class:`Source`, plus the optimizer state it found (``optimizer_info``). No checksums and
    no alias groups (the formats store neither). The plan stage checks every tensor read against
    the shape and dtype the source recorded (:func:`checkpoint.plan.values.guarded_get`)."""

    index_path = None
    meta = None
    alias_groups: list[list[str]] = []
    resolve_names = True  # names written by another tool: resolved against the model
    kind = "checkpoint"

    def __init__(self, source: Source):
        self.source = source
        # file_of() names a file relative to root (a single file: its directory)
        self.root = str(source.path if source.path.is_dir() else source.path.parent)
        self.files = list(source.files)
        self.where = str(source.path)  # the checkpoint, for messages

    def keys(self) -> list[str]:
        return self.source.keys()

    def spec(self, key: str):
        return self.source.spec(key)

    def __contains__(self, key: str) -> bool:
        try:
            self.source.spec(key)
        except KeyError:
            return False
        return True

    def file_of(self, key: str) -> str:
        return self.source.file_of(key)

    def stored_key(self, key: str) -> str:
        """``key`` as stored (DCP: with its container), for errors: :meth:`~.base.Source.stored_key`."""
        return self.source.stored_key(key)

    def get(self, key: str) -> torch.Tensor:
        return self.source.get(key)

    def get_slice(self, key: str, slices) -> torch.Tensor:
        """The block ``tensor[slices]`` of ``key`` (a DTensor target's local shard), through
        :meth:`~.base.Source.get_slice` (a pickle is mapped, not read, until touched)."""
        return self.source.get_slice(key, slices)

    def read_into(self, key: str, t: torch.Tensor) -> bool:
        return False

    @property
    def optimizer_info(self):
        """The optimizer state found beside the model (:class:`~.base.OptimizerInfo`), or None."""
        return self.source.optimizer

    def check_index_digest(self) -> None:
        raise UnsupportedFormatError(
            str(self.source.path), f"a {self.source.format} checkpoint stores no checksums, so verify=True cannot check it"
        )

    verify_file = check_index_digest

    def close(self) -> None:
        self.source.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["SourceTargetReader"]
