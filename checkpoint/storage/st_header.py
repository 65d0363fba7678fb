"""The torch-free half of reading safetensors checkpoints: safetensors' dtype names, a header
parsed and validated by ``safetensors.safe_open`` (any framework) and the index file parsed
through its pydantic schema (:mod:`checkpoint.storage.format`).

Nothing here imports torch, so ``fqnckpt inspect`` of a safetensors checkpoint starts in well
under a second (``import torch`` alone takes seconds on a small machine).
:mod:`checkpoint.storage.reader` builds the data path on top of it.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct

from pydantic import ValidationError
from pydantic_core import from_json
from safetensors import SafetensorError, safe_open

from ..errors import CorruptCheckpointError
from . import digest as _digest
from .format import IndexFile

# safetensors dtype strings (safetensors/src/tensor.rs ``Dtype``) -> (torch dtype attribute, bytes
# per element); checkpoint.storage.layout builds its torch.dtype tables from this one.
ST_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "C64": ("complex64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1), "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),  # MX block scales (DeepSeek FP4 experts); safetensors >= 0.6
    "F4": ("float4_e2m1fn_x2", 1),  # MX FP4 values, two per byte (see PACKED); safetensors >= 0.6
}  # fmt: skip
# safetensors dtypes of fewer than 8 bits -> elements per byte. safetensors' header shape counts
# those elements; torch's packed dtype holds one byte per element (float4_e2m1fn_x2: two FP4
# values), so its last dimension is the header's divided by this (safetensors/torch.py and
# safe_open do the same; a 0-dim tensor or a header's last dimension not ending in whole bytes
# is refused by safetensors: "does not end up at a byte boundary").
PACKED: dict[str, int] = {"F4": 2}


def torch_shape(st: str, shape: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """The torch shape of a header's ``shape`` of dtype ``st`` (:data:`PACKED` dtypes: the last
    dimension divided by the elements per byte).

    Raises:
        ValueError: a packed dtype's shape that does not end in whole bytes (or has no dims)."""
    per = PACKED.get(st)
    if per is None:
        return tuple(shape)
    if not shape or shape[-1] % per:
        raise ValueError(f"dtype {st} holds {per} elements per byte: shape {list(shape)} does not end in whole bytes")
    return (*shape[:-1], shape[-1] // per)


def header_shape(st: str, shape: tuple[int, ...]) -> list[int]:
    """The header ``shape`` of a torch tensor of ``shape`` stored as dtype ``st`` (the inverse of
    :func:`torch_shape`).

    Raises:
        ValueError: a 0-dim tensor of a packed dtype (safetensors has no shape for it)."""
    per = PACKED.get(st)
    if per is None:
        return list(shape)
    if not shape:
        raise ValueError(f"a 0-dim tensor of dtype {st} has no safetensors shape ({per} elements per byte "
                         "are counted along the last dimension); give it one dimension")  # fmt: skip
    return [*shape[:-1], shape[-1] * per]

_LFS_MAGIC = b"version https://git-lfs"


def _lfs_hint(raw: bytes) -> str:
    """A hint when a file's first bytes ``raw`` are a Git LFS pointer, else ''."""
    if raw.startswith(_LFS_MAGIC):
        return " - this is a git-lfs pointer file, not the data: run `git lfs pull` (or download the file)"
    return ""


def _header_problem(raw: bytes, size: int) -> str:
    """The tensor at fault in a header safetensors rejected (``raw``: the file's first bytes as
    read, ``size``: its length), for the message (safetensors' own errors often do not name it):
    the spec's rules checked in order; '' if none is found."""
    try:
        (n,) = struct.unpack("<Q", raw[:8])
        head = json.loads(raw[8 : 8 + n]) if n <= size - 8 and len(raw) >= 8 + n else None
    except (struct.error, ValueError, RecursionError):  # deeply nested JSON
        return ""
    if not isinstance(head, dict):
        return ""
    spans, data_len = [], size - 8 - n
    for key, v in head.items():
        if key == "__metadata__":
            continue
        try:
            st, shape, (b, e) = v["dtype"], [int(d) for d in v["shape"]], v["data_offsets"]
        except (TypeError, KeyError, ValueError, OverflowError):  # OverflowError: a dim of Infinity
            return f"; tensor {key!r} has a malformed entry"
        if not isinstance(st, str) or st not in ST_DTYPES:  # a dict or list is not hashable
            return f"; tensor {key!r} has dtype {st!r} unknown to fqnckpt"
        try:
            nbytes = math.prod(torch_shape(st, shape)) * ST_DTYPES[st][1]
        except ValueError as e:
            return f"; tensor {key!r}: {e}"
        if any(d < 0 for d in shape) or nbytes >= 2**64:
            return f"; tensor {key!r}: shape {shape} overflows"
        if not (isinstance(b, int) and isinstance(e, int) and 0 <= b <= e <= data_len):
            return f"; tensor {key!r}: data_offsets {[b, e]} out of range (data is {data_len} bytes)"
        if e - b != nbytes:
            return f"; tensor {key!r}: data_offsets span {e - b} bytes, shape {shape} {st} needs {nbytes}"
        spans.append((b, e, key))
    pos = 0
    for b, e, key in sorted(spans):
        if b != pos:
            return f"; tensor {key!r}: data_offsets {[b, e]} {'overlap' if b < pos else 'leave a hole before'} byte {pos}"
        pos = e
    return ""


INT64_MAX = (1 << 63) - 1  # torch sizes, strides and element counts are int64


def shape_problem(shape) -> str | None:
    """Why ``shape`` (a sequence of dims from any file: a safetensors header, extra state, DCP
    metadata, a conversion's dims) is not one torch can hold, or None: every dim a
    non-negative int (not bool) of at most ``2**63 - 1``, and the product of the dims (each at
    least 1, as torch computes strides and storage sizes) at most ``2**63 - 1`` too; torch
    raises a bare ``TypeError`` / ``RuntimeError`` ("Stride calculation overflowed")
    otherwise. Torch-free: the torch and the torch-free readers give the same verdict."""
    if not isinstance(shape, (list, tuple)):
        return f"has shape {shape!r}, not a list of dimensions"
    span = 1
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            return f"has dimension {d!r} in shape {list(shape)}, not a non-negative integer"
        if d > INT64_MAX:
            return f"has a dimension torch cannot hold ({d} > 2**63 - 1) in shape {list(shape)}"
        span *= max(d, 1)
        if span > INT64_MAX:
            return f"has shape {list(shape)}, whose strides or size torch cannot hold (over 2**63 - 1 elements)"
    return None


def cover_problem(size, chunks) -> str | None:
    """Why ``chunks`` (``(offsets, sizes)`` pairs: DCP's stored chunks of one tensor, from its
    ``.metadata`` or ``DCP_SHARDING_INFO`` headers) do not cover a tensor of shape ``size``
    exactly once, or None: every chunk inside the tensor, no two overlapping, their elements
    summing to the tensor's. A load through chunks that leave a gap returns the gap's memory
    uninitialised (DCP fills only what is stored). Dims are checked by :func:`shape_problem`
    first. Torch-free."""
    size = list(size)
    total, boxes = 0, []
    for offsets, sizes in chunks:
        offsets, sizes = list(offsets), list(sizes)
        if len(offsets) != len(size) or len(sizes) != len(size) or any(o + n > d for o, n, d in zip(offsets, sizes, size)):
            return f"has a chunk at offsets {offsets} of sizes {sizes} outside its size {size}"
        n = math.prod(sizes)
        total += n
        if n:
            boxes.append((offsets, [o + k for o, k in zip(offsets, sizes)]))
    if total != math.prod(size):
        return f"has chunks holding {total} elements, not its {math.prod(size)} (size {size}): they leave a gap or overlap"
    if len(boxes) > 1 and size:
        # Disjoint boxes summing to the whole cover it. Sweep along the dim with the most distinct
        # starts, comparing each box only with those still open there (a grid: one row of boxes).
        d = max(range(len(size)), key=lambda i: len({b[0][i] for b in boxes}))
        boxes.sort(key=lambda b: b[0][d])
        open_: list = []
        for lo, hi in boxes:
            open_ = [b for b in open_ if b[1][d] > lo[d]]
            for olo, ohi in open_:
                if all(a < y and x < b for a, b, x, y in zip(lo, hi, olo, ohi)):
                    return f"has chunks at offsets {olo} and {lo} that overlap"
            open_.append((lo, hi))
    return None


def _plain_shapes(shapes: list) -> bool:
    """Whether :func:`shape_problem` passes every one of ``shapes``, decided over all of them at
    once (a header holds 10^4-10^5 tensors): lists of ints (no bools), none negative, and the
    largest dim to the power of the most dims at most ``2**63 - 1`` (so every dim and every
    product is). False where that bound fails: the exact check per shape decides then."""
    if any(type(s) is not list for s in shapes):
        return False
    dims = list(itertools.chain.from_iterable(shapes))
    if not dims:
        return True
    if set(map(type, dims)) != {int} or min(dims) < 0:
        return False
    return max(max(dims), 1) ** max(map(len, shapes)) <= INT64_MAX


def check_header_shapes(path: str, head: dict) -> None:
    """:func:`shape_problem` of every tensor of a parsed safetensors header.

    Raises:
        CorruptCheckpointError: a tensor's shape cannot be held by torch (file and tensor named).
    """
    if _plain_shapes([v.get("shape") for k, v in head.items() if k != "__metadata__" and isinstance(v, dict)]):
        return
    for k, v in head.items():
        if k == "__metadata__" or not isinstance(v, dict):
            continue
        why = shape_problem(v.get("shape"))
        if why is not None:
            raise CorruptCheckpointError(path, f"tensor {k!r} {why}")


_HEADER_MAX = 100_000_000  # safetensors' MAX_HEADER_SIZE: longer headers are rejected unread


def _pread_all(fd: int, n: int, pos: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = os.pread(fd, n - len(out), pos + len(out))
        if not got:
            break  # cut short: the copy is shorter, and safetensors says what is missing
        out += got
    return bytes(out)


def validate_header(raw: bytes, size: int, where: str, framework: str = "pt") -> object:
    """safetensors' own validation of a file's first bytes ``raw`` (the 8-byte length and the
    JSON header, or what there is of them) for a file of ``size`` bytes, without mapping that
    file: ``safe_open`` of a private copy holding ``raw``, extended to ``size`` bytes with a hole
    (no data bytes stored) and sealed against shrinking (``memfd_create``; a private temporary
    file where there is none). safetensors checks every rule (JSON, dtypes, shapes against byte
    sizes, offsets inside the data and covering it) on exactly these bytes, and the real file is
    never mapped: a mapping of a file cut short while in use kills the process with SIGBUS,
    which nothing in Python can catch. Returns the ``safe_open`` handle (of the copy: for keys
    and metadata only; tensor bytes are read from the real file with ``preadv``), opened with
    ``framework="numpy"`` whatever ``framework`` says: "pt" maps the copy through torch privately
    writable, which the kernel accounts, so a file larger than RAM + swap could not be opened.

    Raises:
        CorruptCheckpointError: safetensors rejects the bytes (names ``where``).
    """
    fd, tmp = -1, None
    try:
        if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
            fd = os.memfd_create("fqnckpt-header", os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0))
            copy = f"/proc/self/fd/{fd}"
        else:
            import tempfile

            fd, tmp = tempfile.mkstemp(suffix=".safetensors")
            copy = tmp
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view) :]
        os.ftruncate(fd, size)  # a hole: no data bytes
        if tmp is None:
            import fcntl

            seals = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0) | getattr(fcntl, "F_SEAL_WRITE", 0)
            if seals and hasattr(fcntl, "F_ADD_SEALS"):
                try:
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
                except OSError:
                    pass  # private to this process either way
        try:
            # "numpy" whatever ``framework``: the handle serves keys and metadata only, and "pt"
            # maps the copy through torch privately writable, which the kernel accounts: a file
            # larger than RAM + swap (a 64 GiB single-file checkpoint on a 23 GiB machine) failed
            # with a bare "RuntimeError: unable to mmap ... Cannot allocate memory".
            return safe_open(copy, framework="numpy")
        except (SafetensorError, OSError, ValueError) as e:
            raise CorruptCheckpointError(
                where, f"not a valid safetensors file (bad or truncated header or offsets): {str(e).replace(copy, where)}"
            ) from e
        except (MemoryError, RuntimeError) as e:  # no address space for a mapping of ``size`` bytes
            raise CorruptCheckpointError(
                where, f"its header cannot be validated: a file of {size} bytes cannot be mapped in this process ({e})"
            ) from e
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp is not None:
            os.unlink(tmp)


def read_header_bytes(fd: int, path: str) -> tuple[bytes, int]:
    """The first bytes of safetensors file ``path`` (open as ``fd``): its 8-byte length and JSON
    header, or what there is of them (at most safetensors' 100 MB header limit), and the file's
    size, read with ``pread`` (no mapping).

    Raises:
        CorruptCheckpointError: the file cannot be read (names ``path``).
    """
    try:
        size = os.fstat(fd).st_size
        first = _pread_all(fd, 8, 0)
        n = struct.unpack("<Q", first)[0] if len(first) == 8 else 0
        return (first + _pread_all(fd, min(n, _HEADER_MAX, max(0, size - 8)), 8) if len(first) == 8 else first), size
    except OSError as e:
        raise CorruptCheckpointError(path, f"not a valid safetensors file (cannot be read): {e}") from e


def header_of_bytes(
    raw: bytes, size: int, where: str, framework: str = "pt", header_digest: str | None = None
) -> tuple[object, dict]:
    """The checks of a safetensors header from its bytes ``raw`` (as :func:`read_header_bytes`
    reads them; ``size``: the file's length; ``where``: the file's path or URL, for messages):
    safetensors' own validation (:func:`validate_header`, no mapping of the file), the one check
    safetensors lacks (a tensor name twice in the JSON header), the shapes torch can hold
    (:func:`check_header_shapes`), and, when the index records it (``header_digest``: fqnckpt
    format versions 2 and 3, ``FileRecordV2.header``), the xxh3-128 digest of exactly these bytes
    ``[0, data_start)`` (:func:`check_header_digest`). Every reader of a shard opens it through
    here, so a header edited in a way safetensors accepts (a dtype ``"F32"`` -> ``"I32"``, a
    shape ``[4, 8]`` -> ``[8, 4]``: same byte sizes, data untouched) is refused on every path
    before any tensor byte is read. Returns ``(handle, header)``: the handle of the validated
    copy (keys and metadata only) and the parsed JSON header of the same bytes, so that shapes
    and dtypes of 10^5 tensors come from one ``json.loads`` instead of a call per tensor.

    Raises:
        CorruptCheckpointError: safetensors rejects the bytes (message names the tensor at fault
            where it can, and Git LFS pointers), the header repeats a tensor name, a shape is
            one torch cannot hold (:func:`shape_problem`), or the bytes differ from
            ``header_digest``.
    """
    try:
        handle = validate_header(raw, size, where, framework)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(where, f"{str(e).split(': ', 1)[-1]}{_header_problem(raw, size)}{_lfs_hint(raw)}") from e
    if header_digest is not None:
        check_header_digest(raw, where, header_digest)
    n = struct.unpack("<Q", raw[:8])[0]
    # The bytes safetensors validated, parsed once more for shapes, dtypes and offsets: pydantic's
    # JSON parser (jiter) builds the same objects as ``json.loads`` (big integers, NaN, the last of
    # repeated keys) in about two thirds of the time, which shows with 10^4-10^5 tensors a header.
    head = from_json(raw[8 : 8 + n])
    _check_unique_header_keys(where, raw[8 : 8 + n], head)
    check_header_shapes(where, head)  # safetensors holds u64 dims; torch int64 (every reader, inspect too)
    return handle, head


def open_safetensors_with_header(
    path: str, framework: str = "pt", fd: int | None = None, header_digest: str | None = None
) -> tuple[object, dict]:
    """:func:`header_of_bytes` of safetensors file ``path``'s header, read through descriptor
    ``fd`` when given (the file a reader holds open), else through one opened here; the file is
    never mapped. ``framework="numpy"`` validates the same header without importing torch
    (``fqnckpt inspect``); ``header_digest``: the index's digest of the header bytes, checked
    (see :func:`header_of_bytes`). Raises what :func:`read_header_bytes` and
    :func:`header_of_bytes` raise.
    """
    if fd is None:
        try:
            own = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise CorruptCheckpointError(path, f"not a valid safetensors file (cannot be read): {e}") from e
        try:
            raw, size = read_header_bytes(own, path)
        finally:
            os.close(own)
    else:
        raw, size = read_header_bytes(fd, path)
    return header_of_bytes(raw, size, path, framework, header_digest)


def check_header_digest(raw: bytes, where: str, want: str) -> None:
    """Check a shard's header bytes ``raw`` (the 8-byte length and the JSON header: bytes
    ``[0, data_start)``, as :func:`checkpoint.storage.digest.hash_file` hashes them) against
    ``want``, the index's xxh3-128 digest of them (``FileRecordV2.header``).

    Raises:
        CorruptCheckpointError: the digests differ (names ``where``): a dtype, shape, offset or
            name in the header was changed since the save, so its tensors would load as other
            values (``F32`` read as ``I32``: 1.0 as 1065353216) with every data byte intact.
    """
    got = _digest.hexdigest(raw)
    if got != want:
        raise CorruptCheckpointError(
            where,
            f"its header bytes differ from the index's xxh3-128 digest ({got} != {want}): a tensor's "
            "dtype, shape, offsets or name was changed since the save (`fqnckpt verify` names every changed file)",
        )


def _check_unique_header_keys(path: str, raw: bytes, head: dict) -> None:
    # Fast path: every tensor entry has exactly one "data_offsets" key (safe_open checked), so
    # without escapes (a key spelled "d\u0061ta_offsets" is that key too, uncounted) as many
    # occurrences as distinct tensors means no name repeats. Otherwise (a repeat, an escape, or the
    # word in __metadata__) the exact check runs.
    if b"\\" not in raw and raw.count(b'"data_offsets"') == len(head) - ("__metadata__" in head):
        return

    # Every object as its list of pairs; only the top level's keys name tensors (a key repeated in
    # __metadata__ or inside a tensor's entry is safetensors' to take, the last one, as it does).
    seen = set()
    for k, _ in json.loads(raw, object_pairs_hook=list):
        if k in seen:
            raise CorruptCheckpointError(path, f"header names tensor {k!r} twice")
        seen.add(k)


def read_index(path: str) -> IndexFile:
    """Parse and validate an index file.

    Raises:
        CorruptCheckpointError: not JSON, a git-lfs pointer, or not the HF index schema.
    """
    with open(path, "rb") as f:
        raw = f.read()
    return parse_index_bytes(raw, path)


def parse_index_bytes(raw: bytes, path: str) -> IndexFile:
    """:func:`read_index` of bytes already read (``path`` names them in errors)."""
    if raw.startswith(_LFS_MAGIC):
        raise CorruptCheckpointError(path, "is a git-lfs pointer file, not the index: run `git lfs pull`")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # not UTF-8 / JSON, an int over Python's 4300 digits; nesting
        raise CorruptCheckpointError(path, f"index is not JSON: {e}") from e
    try:
        return IndexFile.model_validate(data)
    except ValidationError as e:
        raise CorruptCheckpointError(path, f"index does not follow the schema: {e}") from e


__all__ = ["ST_DTYPES", "PACKED", "torch_shape", "header_shape", "INT64_MAX", "check_header_shapes", "check_header_digest", "cover_problem", "header_of_bytes", "open_safetensors_with_header", "read_header_bytes", "parse_index_bytes", "validate_header", "read_index", "shape_problem"]
