"""Reports returned by :func:`checkpoint.load` and :func:`checkpoint.verify` (pydantic, eager names)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ShapeMismatch(BaseModel):
    """``key`` has ``checkpoint_shape`` in the file and ``target_shape`` in the model (elements)."""

    key: str
    checkpoint_shape: list[int]
    target_shape: list[int]


class DtypeConversion(BaseModel):
    """``key`` was stored as ``checkpoint_dtype`` and converted to the target's ``target_dtype``."""

    key: str
    checkpoint_dtype: str
    target_dtype: str


class LoadReport(BaseModel):
    """What :func:`checkpoint.load` found, computed before any copy (a load that raises changed
    nothing; one that returns did every copy listed). All names are eager FQNs.

    - ``missing_keys``: target tensors the checkpoint lacks (no name of their alias group stored).
    - ``unexpected_keys``: checkpoint tensors the target lacks.
    - ``ignorable_keys``: checkpoint tensors that are non-persistent buffers of the target, and
      stored extra-state entries the caller's ``extra_state`` does not name (not loaded).
    - ``shape_mismatched``: present in both with different shapes (not loaded).
    - ``dtype_converted``: loaded with a dtype conversion.
    - ``loaded_keys``: target tensors filled (canonical FQNs); never a no-op (meta targets are
      refused unless ``assign=True`` replaces them). ``filled_from`` maps a target FQN to the
      checkpoint key it was read from when they differ (tied aliases, wrapper spellings the
      module resolves).
    - ``dequantized``: target FQN -> what it was dequantized from, for quantized weights (FP8
      blocks, MXFP4) loaded into floating-point targets of another dtype
      (:mod:`checkpoint.convert.dequant`); their ``dtype_converted`` entry, if any, names float32,
      the dtype they are dequantized in.
    """

    path: str
    missing_keys: list[str] = Field(default_factory=list)
    unexpected_keys: list[str] = Field(default_factory=list)
    ignorable_keys: list[str] = Field(default_factory=list)
    shape_mismatched: list[ShapeMismatch] = Field(default_factory=list)
    dtype_converted: list[DtypeConversion] = Field(default_factory=list)
    loaded_keys: list[str] = Field(default_factory=list)
    filled_from: dict[str, str] = Field(default_factory=dict)
    dequantized: dict[str, str] = Field(default_factory=dict)
    optimizer_loaded: bool = False

    @property
    def ok(self) -> bool:
        """True when nothing is missing, unexpected or shape-mismatched."""
        return not (self.missing_keys or self.unexpected_keys or self.shape_mismatched)


class FileCheck(BaseModel):
    """One file checked by verify: sizes in bytes, file-level hex ``digest`` of ``algorithm``
    (``xxh3_128`` for format versions 2 and 3, ``sha256`` for version 1), ``expected`` from the index;
    ``ok`` is False when the size, header or any tensor's digest differs."""

    file: str
    size: int
    expected_size: int | None = None
    algorithm: str = "sha256"
    digest: str
    expected_digest: str | None = None
    ok: bool = True


class VerifyReport(BaseModel):
    """Result of :func:`checkpoint.verify`: per-file checks and every problem found, as text
    naming its file (``problems`` empty means the checkpoint is intact; ``notes`` are facts such
    as "not checksummed", never damage). ``total_size`` in bytes of tensor data."""

    path: str
    format: str = "safetensors-index"
    files: list[FileCheck] = Field(default_factory=list)
    problems: list[str] = Field(default_factory=list)
    # Facts that are not damage, e.g. "not checksummed" for an index written by another tool.
    notes: list[str] = Field(default_factory=list)
    # True when every file's sha256 was compared with a recorded one.
    checksummed: bool = True
    tensors: int = 0
    total_size: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def bad_files(self) -> list[str]:
        return sorted({f.file for f in self.files if not f.ok})
