"""Migration sources: readers for every checkpoint format fqnckpt migrates from (see ``readers``)."""

from .readers import FORMATS, OptimizerInfo, Source, SourceSpec, open_source, opened, sniff, unsafe_globals

__all__ = [
    "FORMATS",
    "OptimizerInfo",
    "Source",
    "SourceSpec",
    "open_source",
    "opened",
    "sniff",
    "unsafe_globals",
]
