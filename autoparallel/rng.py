"""Counter-based random variates for any box of a tensor's global index space (mesh-independent init).

Generator: Philox4x32-10, from J. K. Salmon, M. A. Moraes, R. O. Dror, D. E. Shaw, "Parallel random
numbers: as easy as 1, 2, 3", SC'11 (2011), doi:10.1145/2063384.2063405; constants and round function
as in the Random123 reference (``philox.h``), checked against its ``kat_vectors``. Written by hand
with torch int64 ops (no library offers a counter-based generator over an arbitrary index box on any
torch device): a 32x32-bit product fits the 64 bits of an int64 (it wraps, keeping the low 64 bits,
which is the exact unsigned product), so every word stays exact on CPU and GPU alike.

Layout: element ``g`` (row-major linear index in the *global* shape) of a stream takes lane
``g % V`` of block ``g // V``; block ``b`` is ``philox(counter=(b mod 2^32, b >> 32, s2, s3),
key=(k0, k1))`` with ``(k0, k1, s2, s3)`` the stream's 128-bit id. So an element's value depends on
the stream and ``g`` only, never on which box (shard) is computed. ``V`` and the variate per lane:

========== === =================================================================================
kind        V   variate (float64 unless said)
========== === =================================================================================
uniform     4   ``w * 2^-32`` in [0, 1), one 32-bit word per element
uniform32   4   float32 ``(w >> 8) * 2^-24`` in [0, 1) (float32 / bf16 / fp16 targets)
uniform53   2   53-bit ``(w0 * 2^21 + w1 >> 11) * 2^-53`` in [0, 1) (float64 targets)
open        4   ``(w + 0.5) * 2^-32`` in (0, 1): inverse-CDF methods that take a log or a tangent
normal      4   Box-Muller (G. E. P. Box, M. E. Muller, Ann. Math. Statist. 29(2), 1958):
                words (w0, w1) -> ``r cos t, r sin t``, (w2, w3) likewise, with
                ``r = sqrt(-2 ln u1)``, ``u1 = (w0 + 1) 2^-32`` in (0, 1], ``t = 2 pi w1 2^-32``
                (torch ``log``, ``sqrt``, ``cos``, ``sin`` in float64)
normal32    4   the same Box-Muller in float32 (float32 / bf16 / fp16 targets) from ``+ - * /
                sqrt`` only (below): ``u1 = (w0 + 1) 2^-32`` rounded to float32 (24 bits),
                ``t = 2 pi (w1 - 2^31) 2^-32`` in [-pi, pi) (so ``z32 ~ -z`` of ``normal``)
int63       2   int64 ``(w1 & 0x7fffffff) << 32 | w0`` in [0, 2^63)
int64       2   int64 ``w1 << 32 | w0``: all 64 bits, two's complement (every int64 value)
========== === =================================================================================

``normal32`` without ``log`` / ``cos`` / ``sin``: the float32 bits of ``x = w0 + 1`` give
``x = 2^e m``, ``m`` in [1, 2), exactly (integer ops on the bits), and ``-2 ln u1 = 2 (32 - e) ln 2
- 4 atanh(s)``, ``s = (m - 1) / (m + 1)`` in [0, 1/3), ``atanh(s) = sum s^(2k+1) / (2k + 1)``
(Abramowitz & Stegun, Handbook of Mathematical Functions, 1964, 4.1.27), 7 terms: truncation
< 3e-8 on ``r^2``. ``cos t`` and ``sin t`` from the half angle ``h = t / 2`` in [-pi/2, pi/2]
(A&S 4.3.24-25: ``cos t = (cos h - sin h)(cos h + sin h)``, ``sin t = 2 cos h sin h``), ``cos h``
and ``sin h`` by their Taylor series (A&S 4.3.65-66) to ``h^12`` / ``h^13``: truncation < 7e-9.
Against ``normal`` (float64 libm) the result is within 2e-6 where ``|z| > 0.1`` and within 3e-5
everywhere (the float32 ``u1`` coarsens small radii; measured on 2^22 samples, pinned by
tests/test_mesh_independent_init.py). Every step is an integer op, an
int-to-float conversion (round to nearest) or one of ``+ - * / sqrt``, each exactly rounded by
IEEE 754 in every torch kernel, vectorized body, scalar tail or thread sub-range alike, on CPU and
CUDA; no step is a fused multiply-add (Horner runs as separate ``mul`` and ``add``). So an element's
``normal32`` / ``uniform32`` bits depend on its words only: not on the box, piece, thread count, CPU
vector width or device type, by construction.

The float64 kinds (and the transforms of ops other than ``normal_`` / ``uniform_``) run torch's
``log``, ``cos``, ``ndtri``, ... whose CPU kernels use SLEEF in the vectorized body and libm in the
scalar tail (aten ``Loops.h``), which may differ in the last float64 bit; rounding to the target
dtype hides that except at a rounding boundary. Whole fills on shards vs full tensors are pinned
equal by tests/test_mesh_independent_init.py, but these kinds are not position-independent by
construction.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import torch

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers (Random123 philox.h)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments (golden ratio, sqrt(3) - 1)
_MASK = 0xFFFFFFFF
_INV32 = 2.0**-32
_INV53 = 2.0**-53

Word = torch.Tensor | int
LANES = {
    "uniform": 4,
    "uniform32": 4,
    "uniform53": 2,
    "open": 4,
    "normal": 4,
    "normal32": 4,
    "int63": 2,
    "int64": 2,
}
# Elements per piece computed at once: bounds the temporaries (~50 bytes an element, ~6 MiB) while
# keeping the ~150 torch ops per piece large enough that per-op overhead stays small (2^17 measured
# a little faster than 2^16 and 2^18 on a 1 MiB-L2 CPU); pieces never change values.
CHUNK = 1 << 17


def philox4x32_10(
    counter: Sequence[Word], key: tuple[int, int]
) -> tuple[torch.Tensor | int, torch.Tensor | int, torch.Tensor | int, torch.Tensor | int]:
    """Philox4x32 with 10 rounds: 4 counter words (int64 tensors holding [0, 2^32), broadcastable,
    or Python ints) and 2 key words (ints) -> 4 output words (int64 in [0, 2^32))."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        # The int64 product of two 32-bit words wraps to the exact unsigned 64-bit product. Its high
        # word (``p >> 32``) and low word (``p`` itself) keep junk above bit 31; only the words
        # that enter the next products are masked, the others at the end: 10 ops a round, not 12.
        p0, p1 = c0 * _M0, c2 * _M1
        c0, c2 = _xor_mask(p1 >> 32, c1, k0), _xor_mask(p0 >> 32, c3, k1)
        c1, c3 = p1, p0
        k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    return c0, c1 & _MASK, c2, c3 & _MASK


def _xor_mask(fresh: Word, a: Word, k: int) -> Word:
    # (fresh ^ a ^ k) & mask, in place on ``fresh`` when it is a tensor (it is owned by the round).
    if isinstance(fresh, torch.Tensor):
        return fresh.bitwise_xor_(a).bitwise_xor_(k).bitwise_and_(_MASK)
    if isinstance(a, torch.Tensor):
        return (a ^ (fresh ^ k)).bitwise_and_(_MASK)
    return (fresh ^ a ^ k) & _MASK


def stream_id(key: int, *parts: str | int) -> tuple[int, int, int, int]:
    """The 128-bit id ``(k0, k1, s2, s3)`` of a stream: BLAKE2b (hashlib) of the 64-bit init key and
    ``parts`` (FQN, op name, call number). A hash, not Python's ``hash`` (salted per process)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(int(key % 2**64).to_bytes(8, "little"))
    for p in parts:
        b = p.encode() if isinstance(p, str) else int(p).to_bytes(8, "little", signed=True)
        h.update(len(b).to_bytes(4, "little") + b)
    d = h.digest()
    return tuple(int.from_bytes(d[i : i + 4], "little") for i in range(0, 16, 4))  # type: ignore[return-value]


# Float32 Box-Muller with + - * / sqrt only (each exactly rounded by IEEE 754 on every torch device,
# vectorized or not); the series and their truncation errors are in the module doc.
_LN2X2 = 2.0 * math.log(2.0)
_ATANH4 = [4.0 / (2 * k + 1) for k in range(7)]  # 4 atanh(s) / s = sum 4 s^2k / (2k + 1)
_COS = [(-1) ** j / math.factorial(2 * j) for j in range(7)]  # cos x = sum (-1)^j x^2j / (2j)!
_SIN = [(-1) ** j / math.factorial(2 * j + 1) for j in range(7)]  # sin x / x
_HALF_TURN = math.pi * 2.0**-32  # half the angle per unit of a signed 32-bit word


def _horner(q: torch.Tensor, coeffs: Sequence[float]) -> torch.Tensor:
    # sum coeffs[j] q^j, one mul and one add a step (no fused multiply-add: exactly rounded ops).
    p = q * coeffs[-1]
    for c in reversed(coeffs[1:-1]):
        p.add_(c).mul_(q)
    return p.add_(coeffs[0])


def _radius32(w: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) -> float32 ``sqrt(-2 ln u)``, ``u = (w + 1) 2^-32`` in (0, 1]."""
    x = w.add(1).to(torch.float32)  # in [1, 2^32], rounded to 24 bits
    bits = x.view(torch.int32)
    k = (bits >> 23).neg_().add_(127 + 32).to(torch.float32)  # 32 - floor(log2 x), exact
    m = bits.bitwise_and_(0x7FFFFF).bitwise_or_(0x3F800000).view(torch.float32)  # x / 2^e in [1, 2)
    s = (m - 1.0).div_(m.add_(1.0))  # ln m = 2 atanh(s), s in [0, 1/3)
    r2 = k.mul_(_LN2X2).sub_(_horner(s * s, _ATANH4).mul_(s))  # -2 ln u = 2 k ln 2 - 4 atanh(s)
    return r2.clamp_min_(0.0).sqrt_()  # rounding can leave -0.0000001 where u is ~1


def _cos_sin32(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 words in [0, 2^32) -> float32 ``(cos t, sin t)``, ``t = 2 pi (w - 2^31) 2^-32`` in
    [-pi, pi), through the half angle ``h = t / 2`` in [-pi/2, pi/2]: ``cos t = (cos h - sin h)
    (cos h + sin h)``, ``sin t = 2 cos h sin h``."""
    h = w.sub(2**31).to(torch.float32).mul_(_HALF_TURN)
    q = h * h
    c, s = _horner(q, _COS), _horner(q, _SIN).mul_(h)
    return (c - s).mul_(c + s), c.mul_(s).mul_(2.0)


def _block_variates(kind: str, blocks: torch.Tensor, sid: tuple[int, int, int, int]) -> torch.Tensor:
    """``blocks`` int64 [n] -> variates of ``kind`` (see the module table), block-major [n, V]:
    element ``(i, lane)`` belongs to global index ``blocks[i] * V + lane``."""
    c1: Word = (blocks >> 32) if int(blocks.max()) > _MASK else 0
    w = philox4x32_10((blocks & _MASK, c1, sid[2], sid[3]), (sid[0], sid[1]))
    w = [x if isinstance(x, torch.Tensor) else torch.full_like(blocks, x) for x in w]
    n = blocks.numel()
    if kind == "normal32":
        r = _radius32(torch.stack([w[0], w[2]], 1))  # [n, 2]: pairs (w0, w1) and (w2, w3)
        cos, sin = _cos_sin32(torch.stack([w[1], w[3]], 1))
        out = torch.empty(n, 2, 2, dtype=torch.float32, device=blocks.device)
        torch.mul(r, cos, out=out[:, :, 0])
        torch.mul(r, sin, out=out[:, :, 1])
        return out.view(n, 4)
    if kind == "uniform32":
        return torch.stack(w, 1).bitwise_right_shift_(8).to(torch.float32).mul_(2.0**-24)
    if kind == "uniform":
        return torch.stack(w, 1).double().mul_(_INV32)
    if kind == "open":
        return torch.stack(w, 1).double().add_(0.5).mul_(_INV32)
    if kind == "uniform53":
        a = w[0].mul_(1 << 21).add_(w[1] >> 11)
        b = w[2].mul_(1 << 21).add_(w[3] >> 11)
        return torch.stack([a, b], 1).double().mul_(_INV53)
    if kind == "int63":
        return torch.stack(
            [
                w[1].bitwise_and_(0x7FFFFFFF).bitwise_left_shift_(32).bitwise_or_(w[0]),
                w[3].bitwise_and_(0x7FFFFFFF).bitwise_left_shift_(32).bitwise_or_(w[2]),
            ],
            1,
        )
    if kind == "int64":  # the shift wraps: bit 31 of w1 becomes the sign bit
        return torch.stack(
            [w[1].bitwise_left_shift_(32).bitwise_or_(w[0]), w[3].bitwise_left_shift_(32).bitwise_or_(w[2])], 1
        )
    if kind == "normal":
        out = torch.empty(n, 2, 2, dtype=torch.float64, device=blocks.device)
        for i in (0, 2):
            r = w[i].double().add_(1.0).mul_(_INV32).log_().mul_(-2.0).sqrt_()
            t = w[i + 1].double().mul_(2.0 * math.pi * _INV32)
            torch.mul(r, t.cos(), out=out[:, i // 2, 0])
            torch.mul(r, t.sin_(), out=out[:, i // 2, 1])
        return out.view(n, 4)
    raise ValueError(f"unknown variate kind {kind!r}")


def _runs(global_shape: Sequence[int], offset: Sequence[int], local_shape: Sequence[int], device):
    """The box as R runs of L consecutive global indices: (int64 starts [R], L). Trailing dims the
    box covers whole merge into one run, so Shard(0) and Replicate are a single run."""
    k = len(global_shape)
    if k == 0:
        return torch.zeros(1, dtype=torch.int64, device=device), 1
    gstride = [1] * k
    for d in range(k - 2, -1, -1):
        gstride[d] = gstride[d + 1] * global_shape[d + 1]
    j = k - 1
    while j > 0 and local_shape[j] == global_shape[j]:
        j -= 1
    length = math.prod(local_shape[j:])
    starts = torch.tensor(offset[j] * gstride[j], dtype=torch.int64, device=device)
    for d in range(j - 1, -1, -1):
        idx = torch.arange(offset[d], offset[d] + local_shape[d], dtype=torch.int64, device=device)
        starts = (idx * gstride[d]).view(-1, *([1] * (j - 1 - d))) + starts
    return starts.reshape(-1), length


def fill_box(
    out: torch.Tensor,
    global_shape: Sequence[int],
    offset: Sequence[int],
    sid: tuple[int, int, int, int],
    kind: str,
    transform: Callable[[torch.Tensor, tuple[torch.Tensor, ...]], torch.Tensor],
    params: Sequence[torch.Tensor] = (),
) -> None:
    """Write ``transform(variates, params)`` into ``out``, the box ``[offset, offset + out.shape)``
    of a tensor of ``global_shape``.

    ``out``: any dtype / device / strides; written in place piece by piece (no full tensor, no
    float64 copy of the whole box). ``params``: tensors of ``out.shape`` (per-element arguments,
    e.g. Bernoulli probabilities), sliced like the variates. ``transform`` gets float64 (int64 for
    ``int63`` / ``int64``, float32 for ``normal32`` / ``uniform32``) variates of a piece, ``[n, V]`` (element
    ``(i, lane)`` at global index ``V * block_i + lane``; int64 for ``int63`` / ``int64``), and
    returns that piece's values, cast by the write. Raises ValueError for an unknown ``kind``.
    """
    local_shape = tuple(out.shape)
    if out.numel() == 0:
        return
    starts, length = _runs(global_shape, offset, local_shape, out.device)
    rows = starts.numel()
    dst = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    dst2 = dst.view(rows, length)
    params2 = [p.expand(local_shape).reshape(rows, length) for p in params]
    lanes = LANES[kind]
    # Inference mode: the temporaries need no version counters or autograd metadata (~15% faster).
    with torch.inference_mode():
        _fill_runs(dst2, starts, length, sid, kind, transform, params2, lanes)
    if dst is not out:
        out.copy_(dst)


def _fill_runs(dst2, starts, length, sid, kind, transform, params2, lanes) -> None:
    """:func:`fill_box` on ``dst2`` [rows, length], row ``i`` holding global indices
    ``starts[i] + [0, length)``."""
    rows = starts.numel()
    device = dst2.device
    piece = min(length, CHUNK)
    rows_per = max(1, CHUNK // piece)
    for c0 in range(0, length, piece):
        n = min(piece, length - c0)
        nb = (n + 2 * lanes - 2) // lanes  # blocks covering n elements from any lane
        span = torch.arange(nb, dtype=torch.int64, device=device)
        for r0 in range(0, rows, rows_per):
            st = starts[r0 : r0 + rows_per] + c0
            rb = st.numel()
            blocks = (st.div(lanes, rounding_mode="floor")[:, None] + span).reshape(-1)
            var = _block_variates(kind, blocks, sid)  # [rb * nb, V]
            lane0 = st % lanes
            if not params2 and not bool(lane0.any()):
                # Runs start on a block boundary: write block-shaped views, no gather.
                m, rest = divmod(n, lanes)
                vals = transform(var, ()).view(rb, nb, lanes)
                dst2[r0 : r0 + rb, c0 : c0 + m * lanes].view(rb, m, lanes).copy_(vals[:, :m])
                if rest:
                    dst2[r0 : r0 + rb, c0 + m * lanes : c0 + n].copy_(vals[:, m, :rest])
                continue
            v = var.view(rb, nb * lanes)
            cols = lane0[:, None] + torch.arange(n, dtype=torch.int64, device=device)
            ps = tuple(p[r0 : r0 + rb, c0 : c0 + n] for p in params2)
            dst2[r0 : r0 + rb, c0 : c0 + n] = transform(v.gather(1, cols), ps)
