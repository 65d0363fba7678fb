"""Which tensors fqnckpt can read and store as flat bytes: strided, not nested or quantized, and
(to store) a dtype safetensors holds. Failures are :class:`UnsupportedTensorError` naming file and key."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .errors import UnsupportedTensorError


def tensor_problem(t: torch.Tensor, storable: bool = False) -> str | None:
    """Why ``t`` has no plain strided bytes (sparse / nested / mkldnn layout, quantized dtype) or,
    with ``storable``, why safetensors cannot hold its dtype (e.g. complex128); ``None`` if fine."""
    if t.is_nested:
        return "is a nested tensor; only dense (strided) tensors are supported"
    if t.layout != torch.strided:
        return f"has layout {t.layout}; only dense (strided) tensors are supported (convert with .to_dense())"
    if t.is_quantized:
        return f"is quantized ({t.dtype}); only plain dtypes are supported (convert with .dequantize())"
    if storable:
        return storable_problem(t.dtype, tuple(t.shape))
    return None


def storable_problem(dtype: torch.dtype, shape: tuple[int, ...]) -> str | None:
    """Why safetensors cannot hold a tensor of ``dtype`` and ``shape`` (elements): its dtype
    (:func:`dtype_problem`), or a 0-dim tensor of a dtype packing several values per byte
    (``float4_e2m1fn_x2``, safetensors ``F4``: its header shape counts them along the last
    dimension, :func:`checkpoint.storage.st_header.header_shape`); ``None`` if it can."""
    why = dtype_problem(dtype)
    if why is None and not shape:
        from .storage.layout import DTYPE_TO_ST
        from .storage.st_header import PACKED

        if DTYPE_TO_ST[dtype] in PACKED:
            return (f"is a 0-dim {str(dtype).removeprefix('torch.')}, which safetensors cannot store "
                    f"({DTYPE_TO_ST[dtype]} counts its values along the last dimension); give it one dimension")  # fmt: skip
    return why


def dtype_problem(dtype: torch.dtype) -> str | None:
    """Why safetensors cannot hold ``dtype`` (with the dtypes it can), or ``None``."""
    from .storage.layout import DTYPE_TO_ST

    if dtype in DTYPE_TO_ST:
        return None
    ok = ", ".join(sorted(str(d).removeprefix("torch.") for d in DTYPE_TO_ST))
    return f"dtype {str(dtype).removeprefix('torch.')} cannot be stored in safetensors (it holds {ok})"


def check_dense_tensors(tensors: Mapping[str, Any], file: str) -> None:
    """Raise :class:`UnsupportedTensorError` for the first tensor without plain strided bytes:
    fqnckpt reads and stores flat bytes only."""
    for key, t in tensors.items():
        why = tensor_problem(t) if isinstance(t, torch.Tensor) else None
        if why is not None:
            raise UnsupportedTensorError(file, key, why)


def check_storable(items: Any, file: str) -> None:
    """Raise :class:`UnsupportedTensorError` (``file``: the checkpoint being written) for the first
    ``(key, tensor)`` of ``items`` that cannot be saved, before anything is written."""
    for key, t in items:
        why = tensor_problem(t, storable=True) if isinstance(t, torch.Tensor) else None
        if why is not None:
            raise UnsupportedTensorError(file, key, why)
