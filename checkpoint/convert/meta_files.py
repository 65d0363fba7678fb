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
import shutil
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

    Every tensor gets its own storage (a shard's piece of a joined tensor is a view; saved as is,
    its whole base would be pickled). Memory: ``torch.save`` pickles a whole dict per file, so each
    tensor is first fetched in the plan's group order and spilled to a file in the staging
    directory, then mapped back privately (``UntypedStorage.from_file(shared=False)``: page cache,
    not anonymous memory) for ``torch.save``; anonymous memory stays bounded by one rule group, at
    the cost of writing each byte twice. The spill files are removed before the commit.

    Raises:
        CheckpointExistsError: ``path`` exists and ``overwrite`` is False (or is not a checkpoint).
        OSError: writing failed; nothing is committed at ``path``.
    """
    by_shard: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    with StagedCheckpoint(os.fspath(path), overwrite) as st:
        spill = os.path.join(st.dir, ".spill")
        os.mkdir(spill)
        for i, spec in enumerate(specs):  # group order: the plan computes each group once
            shard, key = split_shard_target(spec.fqn)
            by_shard[shard][key] = _spilled(fetch(spec), os.path.join(spill, str(i)))
        for shard in sorted(by_shard):
            f = os.path.join(st.dir, SHARD_FILE.format(shard))
            torch.save(by_shard.pop(shard), f)
            fsync_path(f)
        shutil.rmtree(spill)
        for name, data in extra.items():
            st.write_file(name, data)
        st.commit()


def _spilled(t: torch.Tensor, f: str) -> torch.Tensor:
    """``t``'s values in a new tensor backed by a private mapping of file ``f`` (written here)."""
    t = t.detach().contiguous()
    if t.nbytes == 0:
        return t.clone()
    with open(f, "wb") as fh:
        fh.write(t.reshape(-1).view(torch.uint8).numpy().data)
    storage = torch.UntypedStorage.from_file(f, shared=False, nbytes=t.nbytes)
    return torch.empty(0, dtype=t.dtype).set_(storage, 0, t.shape, t.stride())


__all__ = ["SHARD_FILE", "shard_target", "split_shard_target", "write_meta_checkpoint"]
