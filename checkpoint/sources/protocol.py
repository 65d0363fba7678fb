"""The one reading interface of fqnckpt: :class:`TensorReader`, what every reader of every format
gives, whatever reads it (``load``'s planning and copies, ``migrate``, conversions, ``verify``).

One implementation per format:

* fqnckpt's safetensors checkpoints, plain Hugging Face safetensors (one file, shards with or
  without an index), peft's adapter file: :class:`checkpoint.storage.reader.CheckpointReader`
  (on object storage its subclass
  :class:`checkpoint.storage.remote_reader.RemoteCheckpointReader`);
* DCP directories and ``torch.save`` pickles (zip or legacy): :class:`checkpoint.sources.base.Source`
  (DCP as its subclass :class:`checkpoint.sources.dcp.DCPSource`), which also wraps a
  safetensors checkpoint as a migration source (its reads are a ``CheckpointReader``'s);
* any of these through a conversion (Meta's model-parallel shards joined, experts stacked, ...):
  :class:`checkpoint.convert.reader.ConvertedReader`; FP8 / MXFP4 weights dequantized while read:
  :class:`checkpoint.convert.dequant.DequantizingReader`.

Keys are the names the checkpoint stores (a DCP container's tensors without the container
prefix, see :meth:`~checkpoint.sources.base.Source.stored_key`). Beyond the protocol a reader may
offer fast paths its callers look up by name: ``read_many`` / ``copy_into`` (several targets, or a
block, read straight into memory with ``preadv``), ``prefetch`` / ``read_block`` (DCP: one
collective read for every target), ``expect`` (object storage: read ahead). Torch-free at run time.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class TensorSpecLike(Protocol):
    """Shape (elements, torch's) and dtype of a stored tensor, from headers or metadata only."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...


@runtime_checkable
class TensorReader(Protocol):
    """Reads the tensors of one checkpoint, one at a time or a block at a time.

    Every method below raises :class:`KeyError` (or ``fqn.errors.UnknownNameError``, a
    ``KeyError``) for a key the checkpoint does not hold; errors of the format, torch or the OS
    are the package's own (:mod:`checkpoint.errors`), naming the file and the key.
    """

    def keys(self) -> list[str]:
        """The tensor keys of the checkpoint (each once)."""
        ...

    def spec(self, key: str) -> TensorSpecLike:
        """Shape and dtype of ``key`` from headers / metadata alone: no tensor byte is read."""
        ...

    def file_of(self, key: str) -> str:
        """The file holding ``key`` (relative to the checkpoint's directory), for messages."""
        ...

    def check_first(
        self, keys: Iterable[str] = (), rows: Mapping[str, Sequence[tuple[int, int]]] | None = None
    ) -> dict[str, dict[int, bytes]]:
        """The check before any target is written: the tensors ``keys`` (and those of ``rows``,
        byte ranges of a rank's ``Shard(0)`` rows) are hashed and compared with the digests the
        checkpoint records (from a leased mapping inside :meth:`reading`, else through a small
        buffer), never into a target; a tensor found intact
        is not hashed again by a later read. Returns the format-3 chunk digests of ``rows`` that
        the ranks gather (``CheckpointReader.check_chunks``), ``{}`` where none are hashed in
        chunks. Nothing is checked for a format that records no digests (pickles, DCP, plain
        Hugging Face files), and whatever reads a tensor whole checks it there too.

        Raises:
            CorruptCheckpointError: a tensor's bytes differ from its digest, or its file ends
                early (file and tensor named); no target was written.
        """
        ...

    def get(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` as a new contiguous CPU tensor of its stored shape and dtype
        (checked against its recorded digest where there is one)."""
        ...

    def get_slice(self, key: str, slices: Sequence[slice]) -> torch.Tensor:
        """The block ``tensor[slices]`` of ``key`` (one ``slice`` per leading dim, missing ones
        whole) as a new CPU tensor: only the block's bytes where the format allows it
        (safetensors), else cut from the whole tensor."""
        ...

    def read_into(self, key: str, out: torch.Tensor) -> bool:
        """Tensor ``key`` read straight into the target ``out`` (a contiguous CPU tensor of the
        stored shape and dtype) with no tensor in between; False, nothing read, where this reader
        cannot (another target, or a format read through its own library): then :meth:`get`."""
        ...

    def reading(self) -> AbstractContextManager:
        """A span of reads: one load's check and copies. Inside it a reader of local files maps
        each large file under a read lease, so no writer changes it between the check and the
        copies (:mod:`checkpoint.storage.leased`); other readers read as they do outside it.
        Spans nest; the leases are given back when the outermost one ends."""
        ...

    def close(self) -> None:
        """Release the files the reader holds open (idempotent)."""
        ...


__all__ = ["TensorReader", "TensorSpecLike"]
