"""torch's semantics of the random fills that mesh-independent init replaces (torch 2.13), so that a
fill there takes and refuses what torch's takes and refuses and returns values in torch's range.

Sources (aten/src/ATen): ``native/DistributionTemplates.h`` (``random_from_to_impl``,
``update_from`` / ``update_to``, argument checks), ``native/cpu/DistributionTemplates.h``
(``uniform_kernel``: the value is computed in the op-math type, cast to the tensor's dtype, and one
that the cast rounds up to ``to`` is replaced by ``from``; CUDA does the same) and
``core/TransformationHelper.h`` (``uniform_int``: ``random_()``'s default ranges).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import _disable_current_modes

_INT64_MIN = -(2**63)


def check_like_torch(op: str, dtype: torch.dtype, a: dict[str, Any]) -> None:
    """Run torch's own ``op`` (an in-place fill, e.g. ``"uniform_"``) with the call's arguments ``a``
    on a 1-element CPU tensor of ``dtype`` with a fresh generator: torch raises what it raises for
    this dtype and these arguments (``uniform_`` on an integer tensor, ``std < 0``, ``p`` outside
    [0, 1], ``from >= to``, ...); nothing else is touched. A tensor ``p`` (``bernoulli_``) is checked
    element by element here (torch checks it in its kernel).

    Raises:
        RuntimeError, NotImplementedError: torch's own, with torch's message.
    """
    probe = torch.empty(1, dtype=dtype)
    gen = torch.Generator()
    with torch.no_grad(), _disable_current_modes():
        if op == "random_":
            if "from" in a:
                probe.random_(a["from"], a.get("to"), generator=gen)
            elif "to" in a:
                probe.random_(a["to"], generator=gen)
            else:
                probe.random_(generator=gen)
        elif op == "bernoulli_":
            p = a["p"]
            if isinstance(p, torch.Tensor):
                local = p._local_tensor if isinstance(p, DTensor) else p
                if local.numel() and not bool(((local >= 0) & (local <= 1)).all()):
                    raise RuntimeError("bernoulli_ expects all elements of p to be in [0, 1]")
                p = torch.full((1,), 0.5, dtype=p.dtype)
            probe.bernoulli_(p, generator=gen)
        elif op == "trunc_normal_":
            probe.uniform_(0.0, 1.0, generator=gen)  # torch's trunc_normal_ is a uniform_ and a transform
        else:
            args = {
                "normal_": ("mean", "std"),
                "uniform_": ("from", "to"),
                "exponential_": ("lambd",),
                "log_normal_": ("mean", "std"),
                "cauchy_": ("median", "sigma"),
                "geometric_": ("p",),
            }[op]
            getattr(probe, op)(*(a[k] for k in args), generator=gen)


def uniform_bounds(dtype: torch.dtype, lo: float, hi: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(from, to)`` cast to ``dtype`` (0-dim tensors): a value equal to ``to`` after the cast to
    ``dtype`` is replaced by ``from``, as torch's ``uniform_kernel`` does."""
    return torch.tensor(lo, dtype=dtype), torch.tensor(hi, dtype=dtype)


def half_open(values: torch.Tensor, bounds: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``values`` (already in the tensor's dtype) with each ``to`` replaced by ``from`` (in place)."""
    lo, hi = bounds
    return values.masked_fill_(values == hi.to(values.device), lo.item())


def _digits(dtype: torch.dtype) -> int:
    return 1 - int(math.log2(torch.finfo(dtype).eps))  # std::numeric_limits<T>::digits (eps = 2^(1 - digits))


def _cast_int(x: int, dtype: torch.dtype) -> int:
    # static_cast<int64_t>(static_cast<scalar_t>(x))
    return int(torch.tensor(x, dtype=torch.int64).to(dtype).item())


def _update_from(lo: int, dtype: torch.dtype) -> int:
    up = _cast_int(lo + 1, dtype)
    if up < lo:
        n = max(abs(lo + 1).bit_length() - 1, 0)
        lo = up + (1 << (n - _digits(dtype) + 1))
    return lo


def _update_to(hi: int, dtype: torch.dtype) -> int:
    down = _cast_int(hi - 1, dtype)
    if down >= hi:
        n = max(abs(hi - 1).bit_length() - 1, 0)
        hi = down - (1 << (n - _digits(dtype) + 1))
    return hi


def random_range(dtype: torch.dtype, a: dict[str, Any]) -> tuple[int, int]:
    """``(from, range)`` of ``random_`` as torch computes them: values ``from + v mod range``, cast
    to ``dtype``. ``a`` holds ``from`` / ``to`` as the overload got them (``random_()``: neither;
    ``random_(to)``: ``to``; ``random_(from, to)``: both, ``to`` may be ``None``).

    ``random_()``: [0, 2^digits] on floating dtypes, [0, max] on integer ones, {0, 1} on bool.
    ``random_(from, to)`` on floating dtypes: ``from`` / ``to`` moved inwards to values the cast
    keeps inside [from, to) (``update_from`` / ``update_to``); ``to=None``: up to ``2^digits``
    (floating) or the dtype's max (inclusive); ``from`` = int64 min with ``to=None``: all 2^64 values.
    Checks are left to :func:`check_like_torch` (call it first).
    """
    floating = dtype.is_floating_point
    if "from" not in a and "to" not in a:  # random_(): uniform_int in TransformationHelper.h
        if floating:
            return 0, 2 ** _digits(dtype) + 1
        if dtype == torch.bool:
            return 0, 2
        return 0, torch.iinfo(dtype).max + 1
    lo = a.get("from", 0)
    hi = a.get("to")
    if hi is not None:
        if floating:
            lo, hi = _update_from(lo, dtype), _update_to(hi, dtype)
        return lo, hi - lo
    if lo == _INT64_MIN:
        return lo, 2**64
    if floating:
        lo = _update_from(lo, dtype)
        to_inc = min(2 ** _digits(dtype), 2**63 - 1)
    else:
        to_inc = 1 if dtype == torch.bool else torch.iinfo(dtype).max
    return lo, to_inc - lo + 1


def random_kind(span: int) -> str:
    """The variate kind :func:`random_transform` needs for a range of ``span`` values."""
    return "int63" if span <= 2**63 else "int64"


def random_transform(lo: int, span: int):
    """``v -> lo + v mod span`` on int64 variates of :func:`random_kind` (``int63``: v in
    [0, 2^63); ``int64``: every int64, read as unsigned), exact in int64 arithmetic."""
    if span < 2**63:
        return lambda v, p: v.remainder_(span).add_(lo)
    if span == 2**63:
        return lambda v, p: v.add_(lo)
    if span == 2**64:
        return lambda v, p: v
    # span in (2^63, 2^64): u (unsigned) < 2 span, so u mod span = u - span * (u >= span); the
    # unsigned comparison is the signed one of both sides xor the sign bit; sums wrap mod 2^64.
    def tf(v, p):
        big = v.bitwise_xor(_INT64_MIN) >= span - 2**63
        return v.add_(lo).add_(big.long().mul_(2**64 - span))

    return tf
