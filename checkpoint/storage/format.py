"""On-disk schemas (pydantic) of the checkpoint index, and ``parse_size``.

The index follows Hugging Face's ``model.safetensors.index.json``
(``{"metadata": {"total_size": int, ...}, "weight_map": {fqn: file}}``, as written by
``transformers.PreTrainedModel.save_pretrained``); fqnckpt adds its own block under
``metadata["fqnckpt"]`` (format version, per-file byte size and digests, alias groups, FQN map,
optimizer param groups). Readers that do not know the block ignore it.

Format versions: 1 recorded a sha256 per file (:class:`FileRecord`); 2 records xxh3-128 digests
per tensor, per header and per file (:class:`FileRecordV2`) plus a digest of the index itself; 3
(written now) records the same, with each tensor of more than ``tensor_digest_chunk`` bytes
digested in chunks of that size (so the ranks of a distributed save hash their own bytes; see
:mod:`checkpoint.storage.digest` for the scheme and the measurements behind it). All verify.
"""

from __future__ import annotations

import operator
import re
from fractions import Fraction
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fqn import FQNMapFile

from . import digest as _digest

FORMAT_VERSION = 3
MODEL_PREFIX = "model"
OPTIMIZER_PREFIX = "optimizer"
EXTRA_STATE_FILE = "extra_state.json"  # schema: checkpoint.storage.extra_state


def index_name(prefix: str = MODEL_PREFIX) -> str:
    """``model`` -> ``model.safetensors.index.json`` (HF's name)."""
    return f"{prefix}.safetensors.index.json"


class FileRecord(BaseModel):
    """One shard file, format version 1: ``size`` in bytes, ``sha256`` hex digest of the whole file."""

    model_config = ConfigDict(extra="forbid")

    size: int = Field(ge=8)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @property
    def algorithm(self) -> str:
        return "sha256"

    @property
    def digest(self) -> str:
        return self.sha256


_HEX128 = r"^[0-9a-f]{32}$"


class FileRecordV2(BaseModel):
    """One shard file, format versions 2 and 3: ``size`` in bytes; xxh3-128 hex digests of the
    header bytes ``[0, data_start)`` (``header``), of each tensor's bytes (``tensors``, by FQN, in
    byte order; version 3: :func:`checkpoint.storage.digest.tensor_hexdigest` with the index's
    ``tensor_digest_chunk``) and ``digest`` = :func:`checkpoint.storage.digest.combine` of them."""

    model_config = ConfigDict(extra="forbid")

    size: int = Field(ge=8)
    algorithm: Literal["xxh3_128"] = "xxh3_128"
    digest: Annotated[str, Field(pattern=_HEX128)]
    header: Annotated[str, Field(pattern=_HEX128)]
    tensors: dict[str, Annotated[str, Field(pattern=_HEX128)]]


class ParamGroup(BaseModel):
    """An optimizer param group: hyper-parameters plus ``params`` as eager FQNs (never positions)."""

    model_config = ConfigDict(extra="allow")

    params: list[str]


class OptimizerMeta(BaseModel):
    """Optimizer part of the index: param groups and which state entries were Python scalars."""

    model_config = ConfigDict(extra="forbid")

    optimizer_class: str
    param_groups: list[ParamGroup]
    # "state.<fqn>.<name>" keys that were Python numbers (not tensors) in the optimizer state.
    python_scalars: list[str] = Field(default_factory=list)
    # 1: hyper-parameters as plain JSON (inf / nan were lost); 2: exact tagged values and
    # ``state_values`` (see checkpoint.optim.Value, which validates them).
    value_encoding: Literal[1, 2] = 1
    # fqn -> state name -> non-tensor optimizer state value (encoding 2).
    state_values: dict[str, dict[str, Any]] = Field(default_factory=dict)


class FqnckptMeta(BaseModel):
    """fqnckpt's own index metadata."""

    model_config = ConfigDict(extra="forbid")

    format_version: Literal[1, 2, 3] = FORMAT_VERSION
    # Version 3: bytes per chunk of a tensor's digest (checkpoint.storage.digest.tensor_hexdigest).
    tensor_digest_chunk: int | None = Field(default=None, ge=1)
    files: dict[str, FileRecordV2 | FileRecord]
    alias_groups: list[Annotated[list[str], Field(min_length=2)]] = Field(default_factory=list)
    fqn_map: FQNMapFile | None = None
    optimizer: OptimizerMeta | None = None
    # Object-store saves (checkpoint.storage.commit): {file name readers ask for (e.g.
    # "extra_state.json", "optimizer.safetensors.index.json"): the object holding it in this save}.
    objects: dict[str, str] | None = None
    # sha256 (hex) of the side files the save wrote ({object name: digest}: config.json, ...):
    # a removal deletes one only while its bytes are still these (checkpoint.storage.commit.removable).
    object_digests: dict[str, Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] | None = None
    # safetensors files of the save beside this part's shards, not in its weight_map (peft's
    # adapter_model.safetensors, checkpoint.peft_state): their records, checked as a shard's are
    # (header on open, tensors on read, every byte by verify).
    extra_shards: dict[str, FileRecordV2] | None = None
    # xxh3-128 of the index file's bytes with this value zeroed (version 2; set when serialized).
    index_xxh3_128: Annotated[str, Field(pattern=_HEX128)] | None = None

    @model_validator(mode="after")
    def _records_match_version(self) -> FqnckptMeta:
        want = FileRecord if self.format_version == 1 else FileRecordV2
        if self.extra_shards and self.format_version < 2:
            raise ValueError("extra_shards are not part of format version 1")
        for name, rec in self.files.items():
            if not isinstance(rec, want):
                raise ValueError(
                    f"file record of {name!r} does not follow format version {self.format_version}"
                )
        if self.format_version == 1 and self.index_xxh3_128 is not None:
            raise ValueError("index_xxh3_128 is not part of format version 1")
        if (self.tensor_digest_chunk is None) != (self.format_version < 3):
            raise ValueError(
                f"tensor_digest_chunk is {'required by' if self.format_version >= 3 else 'not part of'} "
                f"format version {self.format_version}"
            )
        return self

    def tensor_digests(self) -> dict[str, str]:
        """{FQN: tensor digest hex} over every file (empty for format version 1; chunked per
        :attr:`tensor_digest_chunk`)."""
        out: dict[str, str] = {}
        for rec in self.files.values():
            if isinstance(rec, FileRecordV2):
                out.update(rec.tensors)
        return out

    def record(self, name: str) -> FileRecordV2 | FileRecord | None:
        """The record of file ``name``: a shard of :attr:`files` or one of :attr:`extra_shards`."""
        rec = self.files.get(name)
        if rec is None and self.extra_shards:
            rec = self.extra_shards.get(name)
        return rec


class IndexMetadata(BaseModel):
    """HF's ``metadata`` block: ``total_size`` = sum of tensor data bytes (headers excluded)."""

    model_config = ConfigDict(extra="allow")

    total_size: int | None = Field(default=None, ge=0)
    fqnckpt: FqnckptMeta | None = None


class IndexFile(BaseModel):
    """``<prefix>.safetensors.index.json``: HF layout plus ``metadata.fqnckpt``."""

    model_config = ConfigDict(extra="allow")

    metadata: IndexMetadata = Field(default_factory=IndexMetadata)
    weight_map: dict[str, str]

    def files(self) -> list[str]:
        """Shard file names named by ``weight_map``, sorted, each once."""
        return sorted(set(self.weight_map.values()))

    def to_json_bytes(self) -> bytes:
        """The index file's bytes (weight_map sorted); a version-2 fqnckpt block gets its
        ``index_xxh3_128`` filled in over these bytes (and set on this object)."""
        import json

        data: dict[str, Any] = self.model_dump(mode="json", exclude_none=True)
        data["weight_map"] = dict(sorted(self.weight_map.items()))
        meta = data.get("metadata", {}).get("fqnckpt")

        def dumps(d: dict) -> bytes:
            # One item per line, without indentation: json's indent= runs the pure-Python encoder
            # (about 1 s for 20,000 tensors); custom separators keep the C encoder.
            return (json.dumps(d, separators=(",\n", ": ")) + "\n").encode()

        if meta is None or meta.get("format_version") == 1:
            return dumps(data)
        meta[_digest.INDEX_FIELD] = _digest.ZERO
        raw, value = _digest.index_bytes_with_digest(dumps(data))
        self.metadata.fqnckpt.index_xxh3_128 = value
        return raw


# An optional "+" and "_" between digits: what ``int()`` takes in transformers' parser.
_SIZE = re.compile(r"^\s*\+?(\d+(?:_\d+)*(?:\.\d+(?:_\d+)*)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip
_SIZE_FORMS = "an int (bytes) or a size string like '5GB', '500MB', '2GiB'"


def parse_size(size: int | str, path: str = "") -> int:
    """``"5GB"`` -> 5 * 10**9 bytes; ``"5GiB"`` -> 5 * 2**30; ``"1.5KB"`` -> 1500; ``"8Mb"`` ->
    10**6 (a lowercase final ``b`` after a decimal unit counts bits); an int (or any integer
    type, e.g. numpy's) is returned as is. ``path``: the checkpoint the size is for, named in
    the error.

    Semantics of ``transformers.utils.hub.convert_file_size_to_int`` (GB = 10**9, GiB = 2**30,
    ``"5Gb"`` / ``"5gb"`` = 5 * 10**9 bits), the number taken exactly (``"1.1GB"`` is
    1_100_000_000); also taken: ``"B"`` / ``"TB"`` / ``"TiB"`` and a bare number of bytes. A
    leading ``+`` and ``_`` between digits count as ``int()`` reads them there (``"+5GB"``,
    ``"5_000MB"``); an integer tensor or array of one element counts as its value.

    Raises:
        UnsavableTypeError: neither an integer nor a string (a float such as ``1.5``: bytes are
            whole, so a float is refused by its type, not truncated; a bool).
        UnsavableError: a string not ``<number><unit>`` (``"abc"``, ``"-1GB"``, ``"1.5XB"``) or
            naming a fraction of a byte (``"1.5"``, ``"0.5B"``), or a size that is not positive.
        Both are ``ValueError``; every message names ``max_shard_size`` and the value, and is
        raised before anything is written.
    """
    from ..errors import UnsavableError, UnsavableTypeError

    if isinstance(size, bool) or not isinstance(size, str) and not hasattr(size, "__index__"):
        raise UnsavableTypeError(
            "max_shard_size", f"must be {_SIZE_FORMS}, got {type(size).__name__} {size!r}", path
        )
    if not isinstance(size, str):
        try:  # a bool tensor or array is a bool, as ``True`` is
            n = None if "bool" in str(getattr(size, "dtype", "")) else operator.index(size)
        except TypeError:  # a float tensor, an array of more than one element
            n = None
        if n is None:
            raise UnsavableTypeError(
                "max_shard_size", f"must be {_SIZE_FORMS}, got {type(size).__name__} {size!r}", path
            )
    else:
        m = _SIZE.match(size)
        if not m:
            raise UnsavableError("max_shard_size", f"{size!r} is not {_SIZE_FORMS}", path)
        unit = m.group(2) or "B"
        exact = Fraction(m.group(1).replace("_", "")) * _UNITS[unit.upper()]
        if unit.endswith("b") and not unit.upper().endswith("IB"):
            exact /= 8  # bits, as transformers reads "5Gb"
        if exact.denominator != 1:
            raise UnsavableError("max_shard_size", f"{size!r} is not a whole number of bytes", path)
        n = int(exact)
    if n <= 0:
        raise UnsavableError("max_shard_size", f"must be positive, got {size!r}", path)
    return n
