"""The source stage of ``load``: any checkpoint as the reader :func:`checkpoint.plan.model.plan_load`
plans against (the interface of :class:`checkpoint.storage.reader.CheckpointReader` that
planning and applying use).

* fqnckpt / Hugging Face checkpoints (index, shards, one ``.safetensors`` file, a hub-cache
  snapshot): :func:`checkpoint.storage.opening.open_checkpoint`.
* DCP directories: the :class:`~.dcp.DCPSource` of :func:`~.dcp.open_dcp`.
* ``torch.save`` pickles (zip or legacy; a state_dict, ``{"model": ..., "optimizer": ...}``, a
  compiled / DDP module's state_dict): the :class:`~.base.Source` of
  :func:`~.pickle_files.open_pickle`, unpickled only by torch's ``weights_only`` unpickler after
  the exact-global scan (:mod:`.unpickle`). Names, values and the optimizer are then planned by
  the same modules as for every other source.

Every one is a :class:`~.protocol.TensorReader`: the reader a migration reads is the reader a
load reads.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, UnsupportedFormatError
from ..storage.location import local_path
from ..storage.opening import open_checkpoint
from .dcp import dcp_format, open_dcp
from .pickle_files import open_pickle
from .readers import DEFAULT_MMAP_WINDOW
from .sniffing import pickle_files, sniff


def open_target_reader(path: str | os.PathLike, read_optimizer: bool = True, *, key: str | None = None,
                       trusted_globals: Iterable[Any] = ()):  # fmt: skip
    """The reader ``load`` plans against for the checkpoint at ``path`` (see module docstring);
    ``read_optimizer``: also read a DCP checkpoint's optimizer param groups; ``key``: the
    container holding the model (pickle, DCP); ``trusted_globals``: the pickle allow-list.

    Raises what :func:`~checkpoint.storage.opening.open_checkpoint`, :func:`~.dcp.open_dcp` and
    :func:`~.pickle_files.open_pickle` raise; UnsupportedFormatError for a pickle that holds
    an optimizer state_dict alone (no model); TypeError for ``key`` with a safetensors checkpoint
    (it has no containers: nothing is opened)."""

    def safetensors_checkpoint():
        if key is not None:
            raise TypeError(f"key={key!r} picks a container of a torch.save pickle or DCP checkpoint; "
                            f"{path} is a safetensors checkpoint, which has none")  # fmt: skip
        return open_checkpoint(path)

    if local_path(path) is None:  # a byte store: fqnckpt / Hugging Face layouts through its methods
        return safetensors_checkpoint()
    path = os.fspath(path)
    fmt = dcp_format(path)
    if fmt is not None:
        return open_dcp(Path(path), fmt, key=key, read_optimizer=read_optimizer)
    pickled = pickle_path(path)
    if pickled is None:
        return safetensors_checkpoint()

    src = open_pickle(pickled[0], pickled[1], key, trusted_globals, DEFAULT_MMAP_WINDOW)
    if src.optimizer is not None and not src.optimizer.separate:
        src.close()
        raise UnsupportedFormatError(
            str(path), "holds an optimizer state_dict, not a model: pass it with the model "
            "({'model': ..., 'optimizer': ...}) or load it with torch.optim's load_state_dict",
        )  # fmt: skip
    return src


def pickle_path(path: str) -> tuple[Path, str] | None:
    """``(file, format)`` when ``path`` is a ``torch.save`` pickle (or a directory holding only
    one, beside no safetensors / index), else None."""

    p = Path(path)
    if not (p.is_file() or p.is_dir()):
        return None
    try:
        fmt = sniff(p)
    except CheckpointError:
        return None  # open_checkpoint names the problem its own way
    if fmt not in ("torch-zip", "torch-legacy"):
        return None
    if p.is_dir():
        p = pickle_files(p)[0]
    return p, fmt


__all__ = ["open_target_reader", "pickle_path"]
