"""What a safetensors file can hold, checked before a save writes its first byte.

A checkpoint that no reader can open must never be committed (it would replace a good one with
``overwrite=True``), so every rule the safetensors reader enforces on names, dtypes and headers is
checked here, from the planned layout, in time linear in the number of tensors:

- a tensor name is a non-empty ``str`` that encodes to UTF-8 (a lone surrogate such as
  ``"\\ud800"`` does not: ``json.dumps`` writes it as ``\\ud800`` and serde_json, which safetensors
  uses, rejects that escape), and not ``__metadata__`` (the header's reserved key);
- the dtype is one safetensors stores (:data:`checkpoint.storage.layout.DTYPE_TO_ST`), the layout
  dense (strided);
- the JSON header of each file is at most :data:`MAX_HEADER_BYTES` bytes (safetensors'
  ``MAX_HEADER_SIZE`` in ``safetensors/src/tensor.rs``: ``read_metadata`` refuses ``n >
  100_000_000``, ``n`` being the header length after the 8-byte prefix, padding included).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsavableError, UnsavableTypeError
from .layout import FilePlan

MAX_HEADER_BYTES = 100_000_000  # safetensors/src/tensor.rs MAX_HEADER_SIZE
RESERVED_NAME = "__metadata__"


def json_int_problem(v: int) -> str | None:
    """Why int ``v`` cannot be written as a JSON number (side files: extra state, optimizer
    values), or None: its decimal form is over Python's int / str conversion limit
    (``sys.get_int_max_str_digits()``, 4300 digits by default), so ``json.dumps`` raises a bare
    ``ValueError`` (and readers could not parse it back). Cheap: the conversion is tried only
    near the limit."""
    import sys

    limit = sys.get_int_max_str_digits()
    if not limit or v.bit_length() <= 3 * limit:  # 3 bits < 1 decimal digit: below this it fits
        return None
    try:
        str(v)
    except ValueError:
        return (
            f"is an int of {v.bit_length()} bits, more than {limit} decimal digits: over Python's int / str "
            "conversion limit for JSON (sys.get_int_max_str_digits()); store it as bytes (int.to_bytes) or a str"
        )
    return None


def check_name(name: Any, path: str = "") -> None:
    """Raise :class:`UnsavableError` unless ``name`` can be a tensor name in a safetensors header.

    Raises:
        UnsavableTypeError: ``name`` is not a ``str``.
        UnsavableError: empty, ``__metadata__``, or not encodable as UTF-8 (lone surrogates).
    """
    if not isinstance(name, str):
        raise UnsavableTypeError(name, f"tensor names must be str, not {type(name).__name__}", path)
    if not name:
        raise UnsavableError(name, "a tensor name must not be empty", path)
    if name == RESERVED_NAME:
        raise UnsavableError(name, "is the safetensors header's reserved key", path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UnsavableError(
            name,
            f"is not valid UTF-8 ({e.reason} at character {e.start}); safetensors' JSON header cannot hold it",
            path,
        ) from None


def check_tensor(name: str, tensor: torch.Tensor, path: str = "") -> None:
    """Raise :class:`UnsavableTypeError` unless ``tensor``'s layout (strided, not nested or
    quantized) and dtype can be stored (the rule of :mod:`checkpoint.tensor_checks`)."""
    from ..tensor_checks import tensor_problem

    why = tensor_problem(tensor, storable=True)
    if why is not None:
        raise UnsavableTypeError(name, why, path)


def check_header(plan: FilePlan, path: str = "") -> None:
    """Raise :class:`UnsavableError` naming ``plan``'s file if its header exceeds safetensors' limit,
    or its name is not one every reader takes (:func:`checkpoint.storage.paths.check_name`: e.g.
    over 255 bytes, from ``fqn_to_index_mapping``'s file indexes): such a checkpoint, committed
    on an object store that holds the name, could not be read back."""
    from ..errors import UnsafePathError
    from .paths import check_name as check_file_name

    try:
        # with the 13 bytes an object-store save adds to its names (".<12-hex token>", commit.stored_name)
        check_file_name(path, plan.name.replace(".", "." + "0" * 12 + ".", 1))
    except UnsafePathError as e:
        raise UnsavableError(plan.name[:60] + "...", f"its file name is refused by every reader: {str(e).split(' is refused: ', 1)[-1]}", path) from None
    n = len(plan.header) - 8
    if n > MAX_HEADER_BYTES:
        first = plan.slots[0].spec.fqn if plan.slots else ""
        raise UnsavableError(
            plan.name,
            f"its safetensors header would be {n} bytes, over safetensors' limit of {MAX_HEADER_BYTES} "
            f"({len(plan.slots)} tensor names, e.g. {first[:60]!r}...): use shorter names or a smaller "
            "max_shard_size",
            path,
        )
