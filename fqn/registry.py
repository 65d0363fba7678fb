"""The bidirectional FQN registry: one record per tensor, captured names <-> eager FQNs."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
import torch
import torch.nn as nn

from .eager import dtype_name, eager_tensors
from .errors import CaptureMismatchError, FQNCollisionError, UnknownNameError
# The on-disk schemas live in .schema (no torch import: the CLI reads them without torch).
from .schema import FQNMapFile, Provenance, TensorRecord


class FQNMap:
    """Bidirectional registry of tensor names.

    ``to_eager(name)`` accepts any captured name or eager alias and returns the canonical eager
    FQN; ``to_captured(fqn)`` returns the captured names of an eager FQN (or alias). Unknown names
    raise :class:`fqn.UnknownNameError` (a ``KeyError``) listing the closest known names.

    Build it with :meth:`from_module` (eager names only), :meth:`from_capture` (a captured
    GraphModule, by tensor identity) or :meth:`from_exported_program` (export signature).
    """

    def __init__(self, records: Iterable[TensorRecord] = ()):
        self._records: dict[str, TensorRecord] = {}
        self._to_eager: dict[str, str] = {}
        for r in records:
            self.add(r)

    # -- building -----------------------------------------------------------------------------
    def add(self, record: TensorRecord) -> None:
        """Add a record. Raises :class:`FQNCollisionError` if any of its names is taken by another."""
        if record.fqn in self._records:
            raise FQNCollisionError(record.fqn, [record.fqn])
        for name in [*record.eager_names, *record.captured]:
            owner = self._to_eager.get(name)
            if owner is not None and owner != record.fqn:
                raise FQNCollisionError(name, [owner, record.fqn])
        self._records[record.fqn] = record
        for name in [*record.eager_names, *record.captured]:
            self._to_eager[name] = record.fqn

    def add_captured(self, fqn: str, name: str) -> None:
        """Record that capture named the tensor of eager ``fqn`` as ``name``."""
        rec = self.record(fqn)
        owner = self._to_eager.get(name)
        if owner is not None and owner != rec.fqn:
            raise CaptureMismatchError(f"captured name {name!r} is claimed by both {owner!r} and {rec.fqn!r}")
        if name not in rec.eager_names and name not in rec.captured:
            rec.captured.append(name)
        self._to_eager[name] = rec.fqn

    def add_alias(self, fqn: str, alias: str) -> None:
        """Record ``alias`` as another eager FQN of the tensor named ``fqn`` (tied weights).

        Raises:
            FQNCollisionError: ``alias`` already names a different tensor.
        """
        rec = self.record(fqn)
        owner = self._to_eager.get(alias)
        if owner is not None and owner != rec.fqn:
            raise FQNCollisionError(alias, [owner, rec.fqn])
        if alias not in rec.eager_names:
            rec.aliases.append(alias)
        self._to_eager[alias] = rec.fqn

    @classmethod
    def from_module(cls, model: nn.Module, provenance: Provenance = Provenance.rule) -> FQNMap:
        """Records for every parameter and buffer of ``model`` under eager names, no captured names."""
        return cls(
            TensorRecord(
                fqn=t.fqn,
                aliases=list(t.aliases),
                kind=t.kind,
                shape=list(t.tensor.shape),
                dtype=dtype_name(t.tensor.dtype),
                provenance=provenance,
            )
            for t in eager_tensors(model)
        )

    @classmethod
    def from_capture(cls, model: nn.Module, gm: torch.fx.GraphModule, example_inputs=None) -> FQNMap:
        """Registry of a captured graph, by tensor identity. See :func:`fqn.capture.fill_from_capture`
        (which fills the map made here; it does not import this module)."""
        from .capture import fill_from_capture

        fmap = cls.from_module(model, Provenance.identity)
        fill_from_capture(fmap, model, gm, example_inputs)
        return fmap

    @classmethod
    def from_exported_program(cls, ep, model: nn.Module | None = None) -> FQNMap:
        """Registry of an ``ExportedProgram``. See :func:`fqn.capture.fill_from_exported_program`."""
        from .capture import fill_from_exported_program

        fmap = cls()
        fill_from_exported_program(fmap, ep, model)
        return fmap

    # -- lookups ------------------------------------------------------------------------------
    def to_eager(self, name: str) -> str:
        """Canonical eager FQN for a captured name, an eager FQN or an alias."""
        try:
            return self._to_eager[name]
        except KeyError:
            raise UnknownNameError(name, self._to_eager, "captured or eager name") from None

    def to_captured(self, fqn: str) -> list[str]:
        """Captured names of the tensor named ``fqn`` (canonical or alias); may be empty."""
        return list(self.record(fqn).captured)

    def record(self, name: str) -> TensorRecord:
        """The record of any known name."""
        return self._records[self.to_eager(name)]

    def __contains__(self, name: object) -> bool:
        return name in self._to_eager

    def __iter__(self) -> Iterator[TensorRecord]:
        return iter(self._records.values())

    def __len__(self) -> int:
        return len(self._records)

    def eager_fqns(self, include_aliases: bool = False) -> list[str]:
        """Canonical eager FQNs in record order (plus aliases if asked)."""
        if include_aliases:
            return [n for r in self._records.values() for n in r.eager_names]
        return list(self._records)

    def alias_groups(self) -> list[list[str]]:
        """``[[canonical, alias, ...], ...]`` for tied tensors only."""
        return [r.eager_names for r in self._records.values() if r.aliases]

    def captured_to_eager(self) -> dict[str, str]:
        """``{captured name: canonical eager FQN}`` for every captured name."""
        return {c: r.fqn for r in self._records.values() for c in r.captured}

    # -- serialization ------------------------------------------------------------------------
    def to_model(self) -> FQNMapFile:
        return FQNMapFile(records=[r.model_copy(deep=True) for r in self._records.values()])

    def to_json(self, indent: int | None = None) -> str:
        """JSON text of :class:`FQNMapFile` (schema version included)."""
        return self.to_model().model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> FQNMap:
        """Inverse of :meth:`to_json`. Raises ``pydantic.ValidationError`` on a bad document."""
        return cls(FQNMapFile.model_validate_json(text).records)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FQNMap) and self.to_model() == other.to_model()

    def __repr__(self) -> str:
        return f"FQNMap({len(self)} tensors)"
