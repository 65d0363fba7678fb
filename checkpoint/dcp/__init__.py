"""fqnckpt as a storage layer of ``torch.distributed.checkpoint`` (DCP).

DCP users keep their calls and change one argument::

    import torch.distributed.checkpoint as dcp
    from checkpoint.dcp import StorageReader, StorageWriter

    dcp.save(state_dict, storage_writer=StorageWriter("ckpt/step-100"))
    dcp.load(state_dict, storage_reader=StorageReader("ckpt/step-100"))

What :class:`StorageWriter` writes is an fqnckpt checkpoint (Hugging Face's layout, the keys of
the state_dict, an index with digests, committed atomically; non-tensor values in
``extra_state.json``): ``checkpoint.load``, every ``fqnckpt`` command, ``safetensors`` and
``transformers``' ``from_pretrained`` read it. :class:`StorageReader` reads it, any Hugging Face
checkpoint (hub-cache snapshots included) and the per-rank output of torch's
``HuggingFaceStorageWriter(save_distributed=True)``.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .reader import StorageReader
    from .planner import SavePlanner
    from .writer import StorageWriter

_LAZY = {"StorageWriter": "writer", "StorageReader": "reader", "SavePlanner": "planner"}


def __getattr__(name: str) -> Any:
    """Import on first use (PEP 562): ``import checkpoint.dcp`` does not pay for torch."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = ["StorageWriter", "StorageReader", "SavePlanner"]
