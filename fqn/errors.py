"""Exceptions of the naming layer. Every message names the offending key."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class FQNError(Exception):
    """Base class of every naming error raised by :mod:`fqn`."""


class UnknownNameError(FQNError, KeyError):
    """A name is not known to the registry / model. ``closest`` lists the nearest known names.

    Subclasses :class:`KeyError` so ``except KeyError`` callers keep working.
    """

    def __init__(self, name: str, known: Iterable[str] = (), what: str = "name"):
        self.name = name
        self.closest = closest_names(name, known)
        hint = f"; closest known: {self.closest}" if self.closest else ""
        self.message = f"unknown {what} {name!r}{hint}"
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError would quote the whole message
        return self.message


class AmbiguousFQNError(FQNError):
    """A captured / flattened name matches more than one eager FQN; ``candidates`` lists them."""

    def __init__(self, name: str, candidates: Iterable[str], why: str = ""):
        self.name = name
        self.candidates = sorted(candidates)
        extra = f" ({why})" if why else ""
        super().__init__(f"name {name!r} is ambiguous{extra}: candidates {self.candidates}")


class FlatParamError(FQNError):
    """An FSDP1 ``_flat_param`` key: its storage holds many parameters flattened together, so no
    single eager FQN exists. Re-save with ``FullStateDictConfig`` / ``get_model_state_dict``."""

    def __init__(self, name: str, where: str = ""):
        self.name, self.where = name, where
        at = f" in {where}" if where else ""
        super().__init__(
            f"key {name!r}{at} is an FSDP1 _flat_param (many parameters flattened into one tensor); "
            "it has no eager FQN. Save it again with a full or sharded state_dict "
            "(get_model_state_dict of torch's distributed checkpoint state_dict API)."
        )


class CaptureMismatchError(FQNError):
    """Two sources of naming evidence (tensor identity, export signature, dynamo meta) disagree."""


class FQNCollisionError(FQNError):
    """Two different source names map to the same eager FQN (or one record claims a taken name)."""

    def __init__(self, target: str, sources: Iterable[str]):
        self.target = target
        self.sources = sorted(sources)
        super().__init__(f"names {self.sources} all map to {target!r}")


def closest_names(name: str, known: Iterable[str], n: int = 5) -> list[str]:
    """Up to ``n`` known names closest to ``name`` (difflib ratio), best first."""
    return difflib.get_close_matches(name, list(known), n=n, cutoff=0.3)
