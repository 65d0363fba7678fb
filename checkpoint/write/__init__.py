"""The write pipeline: every checkpoint fqnckpt writes goes through :func:`write_checkpoint`.

One module per stage, in order: :mod:`~checkpoint.write.plan` (which tensors go to which shard
file at which bytes, which rank writes which bytes, every check before the first byte),
:mod:`~checkpoint.write.parts` (the bytes: a local staging directory written with ``pwrite``,
each tensor hashed beside its write) or :mod:`~checkpoint.write.upload` (object storage),
:mod:`~checkpoint.write.digests` (fsync, read back what no writer held whole, every tensor's
digest), :mod:`~checkpoint.write.index` (records, indexes, commit). :mod:`~checkpoint.write.pipeline`
runs them; the front doors (``checkpoint.save``, ``async_save``, ``migrate``, conversions, DCP's
``StorageWriter``) only decide what to write.
"""

from .index import make_index, side_file_record, write_indexes_and_commit
from .parts import fetch_checked, fetch_tensor
from .pipeline import join_failed_prepare, write_checkpoint
from .plan import Part, check_same_arguments, layouts_of, plan_parts, refuse_nested, spec_of

__all__ = [
    "Part",
    "check_same_arguments",
    "fetch_checked",
    "fetch_tensor",
    "join_failed_prepare",
    "layouts_of",
    "make_index",
    "plan_parts",
    "refuse_nested",
    "side_file_record",
    "spec_of",
    "write_checkpoint",
    "write_indexes_and_commit",
]
