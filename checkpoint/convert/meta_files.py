"""Meta's own layout written: ``consolidated.00.pth`` ... ``consolidated.NN.pth`` (one
``torch.save`` of a plain ``{key: tensor}`` dict per model-parallel shard, readable with
``torch.load(weights_only=True)``) beside ``params.json``, committed atomically like every
checkpoint (:class:`checkpoint.atomic.StagedCheckpoint`: nothing half-written on failure).

Layout: transformers ``convert_llama_weights_to_hf.py`` (the reader side) and
``../shared/reference/conversions.md`` (how shards split: Q / K / V, ``w1`` / ``w3``, ``output``
on dim 0 by whole heads; ``wo``, ``w2``, ``tok_embeddings`` on dim 1; norms replicated).
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import torch

from ..atomic import StagedCheckpoint, fsync_path
from ..storage.layout import TensorSpec

SHARD_FILE = "consolidated.{:02d}.pth"
_TARGET = re.compile(r"^consolidated\.(\d+)\.pth/(.+)$")


def shard_target(shard: int, key: str) -> str:
    """The plan's name for ``key`` in model-parallel shard ``shard``: ``consolidated.01.pth/key``."""
    return f"{SHARD_FILE.format(shard)}/{key}"


def split_shard_target(name: str) -> tuple[int, str]:
    """Inverse of :func:`shard_target`; a plain key belongs to shard 0 (a one-shard checkpoint)."""
    m = _TARGET.match(name)
    return (int(m.group(1)), m.group(2)) if m else (0, name)


def write_meta_checkpoint(path: str | os.PathLike, specs: Sequence[TensorSpec], fetch: Callable[[TensorSpec], torch.Tensor],
                          extra: Mapping[str, bytes], overwrite: bool) -> None:  # fmt: skip
    """Write ``specs`` (named by :func:`shard_target` when there are several shards) as Meta's
    ``consolidated.NN.pth`` files plus the ``extra`` files (``params.json``, the report) at ``path``.

    Every tensor is cloned into its own storage (a shard's piece of a joined tensor is a view; saved
    as is, its whole base would be pickled). Memory: up to the whole checkpoint, since each rule
    group yields every shard's piece at once and ``torch.save`` pickles a whole dict per file: the
    other shards' pieces wait (in the plan) until their file is written.

    Raises:
        CheckpointExistsError: ``path`` exists and ``overwrite`` is False (or is not a checkpoint).
        OSError: writing failed; nothing is committed at ``path``.
    """
    by_shard: dict[int, list[tuple[str, TensorSpec]]] = defaultdict(list)
    for spec in specs:
        shard, key = split_shard_target(spec.fqn)
        by_shard[shard].append((key, spec))
    with StagedCheckpoint(os.fspath(path), overwrite) as st:
        for shard in sorted(by_shard):
            part = {key: fetch(spec).clone() for key, spec in by_shard[shard]}
            f = os.path.join(st.dir, SHARD_FILE.format(shard))
            torch.save(part, f)
            del part
            fsync_path(f)
        for name, data in extra.items():
            st.write_file(name, data)
        st.commit()


__all__ = ["SHARD_FILE", "shard_target", "split_shard_target", "write_meta_checkpoint"]
