"""Migration sources: readers for every checkpoint format fqnckpt migrates from (see ``readers``).

Names are imported from ``readers`` on first use (PEP 562): the readers import torch, and the
torch-free modules here (``sniffing``, ``base``, ``st_headers``) serve ``fqnckpt inspect`` of a
safetensors checkpoint without it."""

import importlib

__all__ = [
    "FORMATS",
    "OptimizerInfo",
    "Source",
    "SourceSpec",
    "open_source",
    "sniff",
    "unsafe_globals",
]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(".readers", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
