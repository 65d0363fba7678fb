"""Tensor transforms as data, each with its exact inverse (``op.inverse()``).

An op maps the list of values of one rule group to another list. A value is a tensor, or a list of
tensors for a pattern with a gathered wildcard (``{*e}``: one tensor per expert / shard, in index
order). Ops are frozen dataclasses: comparable, printable, and applied to meta tensors at planning
time, so shapes are checked by the same code that later moves the data.

Formulas: ``docs/guides/conversions.md`` (RoPE permute from transformers'
``convert_llama_weights_to_hf.py``; grouped-query QKV from Megatron-Bridge ``param_mapping.py``;
stacked / fused experts from transformers 5 ``conversion_mapping.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:  # imported where an op runs: listing recipes (``fqnckpt recipes``) needs no torch
    import torch

Value = Union["torch.Tensor", list["torch.Tensor"]]


class OpError(ValueError):
    """An op cannot apply to the values it was given (count, shape, divisibility)."""


class Op:
    """Base class: ``apply(values, dims) -> values``; ``inverse()`` undoes it exactly."""

    def apply(self, values: list[Value], dims: Mapping[str, int]) -> list[Value]:
        raise NotImplementedError

    def inverse(self) -> Op:
        raise NotImplementedError

    def is_identity(self, dims: Mapping[str, int]) -> bool:
        """True where ``apply`` returns its values unchanged under ``dims`` (read as a rename)."""
        return False

    def describe(self) -> str:
        return repr(self)


def _each(values: list[Value], fn) -> list[Value]:
    """``fn`` on every tensor, inside lists too."""
    return [[fn(t) for t in v] if isinstance(v, list) else fn(v) for v in values]


def _tensor(v: Value, op: Op) -> torch.Tensor:
    if isinstance(v, list):
        raise OpError(f"{op.describe()} takes single tensors, got a list of {len(v)} (stack them first)")
    return v


def _same_dtype(parts: list[torch.Tensor], op: Op) -> None:
    """torch.cat / torch.stack promote mixed dtypes silently; a conversion must not."""
    kinds = {p.dtype for p in parts}
    if len(kinds) > 1:
        raise OpError(f"{op.describe()}: parts have different dtypes {sorted(map(str, kinds))}")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bytes (``torch.equal`` calls NaN unequal to itself and -0.0 equal
    to 0.0; a replicated tensor must be the same bits on every shard)."""
    import torch
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_meta or b.is_meta:
        return True
    return torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8), b.detach().contiguous().reshape(-1).view(torch.uint8))


class MissingDim(OpError):
    """An op needs a model dimension (``name``) that no source stated."""

    def __init__(self, msg: str, name: str):
        super().__init__(msg)
        self.name = name


def _dim(dims: Mapping[str, int], name: str, op: Op) -> int:
    if name not in dims:
        raise MissingDim(f"{op.describe()} needs the model dimension {name!r} (from model= config or params.json)", name)
    return int(dims[name])


@dataclass(frozen=True)
class Transpose(Op):
    """``t.transpose(dim0, dim1)`` on every tensor (GPT-2 ``Conv1D`` (in, out) <-> ``nn.Linear``
    (out, in)). Its own inverse."""

    dim0: int = 0
    dim1: int = 1

    def apply(self, values, dims):
        return _each(values, lambda t: t.transpose(self.dim0, self.dim1).contiguous())

    def inverse(self):
        return self


@dataclass(frozen=True)
class Stack(Op):
    """Each list value -> ``torch.stack(list, dim)`` (per-expert -> stacked experts)."""

    dim: int = 0

    def apply(self, values, dims):
        import torch
        out = []
        for v in values:
            if not isinstance(v, list):
                raise OpError(f"{self.describe()} takes a gathered pattern ({{*e}}), got one tensor")
            _same_dtype(v, self)
            shapes = {tuple(t.shape) for t in v}
            if len(shapes) > 1:
                raise OpError(f"{self.describe()}: parts have different shapes {sorted(shapes)}")
            out.append(torch.stack(v, self.dim))
        return out

    def inverse(self):
        return Unstack(self.dim)


@dataclass(frozen=True)
class Unstack(Op):
    """Each tensor -> the list of its slices along ``dim`` (stacked experts -> per-expert)."""

    dim: int = 0

    def apply(self, values, dims):
        return [[s.contiguous() for s in _tensor(v, self).unbind(self.dim)] for v in values]

    def inverse(self):
        return Stack(self.dim)


@dataclass(frozen=True)
class Concat(Op):
    """All values -> one ``torch.cat(values, dim)``; a single list value is concatenated in itself
    (model-parallel shards). Parts must be equal along ``dim`` so that :class:`Chunk`, the
    inverse, restores them exactly (gate/up, Meta shards); unequal parts are refused."""

    dim: int = 0

    def apply(self, values, dims):
        import torch
        parts = values[0] if len(values) == 1 and isinstance(values[0], list) else values
        parts = [_tensor(v, self) for v in parts]
        _same_dtype(parts, self)
        sizes = {p.shape[self.dim] for p in parts}
        if len(sizes) > 1:
            raise OpError(f"{self.describe()}: parts differ along dim {self.dim} ({sorted(sizes)}): not invertible")
        cat = torch.cat(parts, self.dim)
        return [cat]

    def inverse(self):
        return Chunk(self.dim)


@dataclass(frozen=True)
class Chunk(Op):
    """One tensor -> ``parts`` equal pieces along ``dim``; ``parts=0`` means as many as the rule's
    remaining patterns (filled in by :class:`~checkpoint.convert.rules.Rule`). With
    ``gathered=True`` the pieces form one list value (shards) instead of separate values."""

    dim: int = 0
    parts: int = 0
    gathered: bool = False

    def apply(self, values, dims):
        if len(values) != 1:
            raise OpError(f"{self.describe()} takes one value, got {len(values)}")
        t = _tensor(values[0], self)
        n = self.parts
        if n <= 0 or t.shape[self.dim] % n:
            raise OpError(f"{self.describe()}: size {t.shape[self.dim]} along dim {self.dim} does not split in {n}")
        pieces = [c.contiguous() for c in t.chunk(n, self.dim)]
        return [pieces] if self.gathered else pieces

    def inverse(self):
        return Concat(self.dim)


@dataclass(frozen=True)
class PermuteRope(Op):
    """Rows of each head: interleaved RoPE pairs (Meta, torchtitan Llama) -> half-split
    (HF ``rotate_half``) when ``to_half``, else back. ``heads`` names the head count in the dims
    (``n_heads`` for Q, ``n_kv_heads`` for K). Shape ``(n * head_dim, dim)`` (or 1-D) unchanged.

    to HF: ``W.view(n, hd // 2, 2, d2).transpose(1, 2).reshape(d1, d2)``; from HF:
    ``W.view(n, 2, hd // 2, d2).transpose(1, 2)...`` (transformers ``convert_llama_weights_to_hf``)."""

    heads: str
    to_half: bool = True

    def apply(self, values, dims):
        import torch
        n = _dim(dims, self.heads, self)

        def permute(t: torch.Tensor) -> torch.Tensor:
            d1 = t.shape[0]
            if d1 % (2 * n):
                raise OpError(f"{self.describe()}: {d1} rows are not {n} heads of an even size")
            rest = tuple(t.shape[1:])
            pair = (d1 // n // 2, 2) if self.to_half else (2, d1 // n // 2)
            return t.reshape(n, *pair, *rest).transpose(1, 2).reshape(d1, *rest).contiguous()

        return [permute(_tensor(v, self)) for v in values]

    def inverse(self):
        return PermuteRope(self.heads, not self.to_half)


@dataclass(frozen=True)
class PermuteRopeTail(Op):
    """DeepSeek-V3 MLA: the last ``dims["qk_rope_head_dim"]`` rows of each of ``dims[heads]`` row
    blocks (one block when ``heads`` is None: ``wkv_a``, whose k_pe rows follow the compressed kv)
    go from interleaved RoPE pairs (torchtitan ``ComplexRoPE``) to half-split (HF ``rotate_half``)
    when ``to_half``, else back. Only when ``dims["rope_interleave"] == 0`` (an HF config with
    ``rope_interleave: false``); otherwise, as for transformers' default ``true`` (DeepSeek's
    published layout, which HF rotates as pairs), the rows already match and are left as they are.

    Raises:
        OpError: rows not ``heads`` blocks each holding at least ``qk_rope_head_dim`` (even) rows."""

    heads: str | None = "n_heads"
    to_half: bool = True

    def is_identity(self, dims):
        return dims.get("rope_interleave", 1) != 0

    def apply(self, values, dims):
        import torch
        if self.is_identity(dims):
            return values
        r = _dim(dims, "qk_rope_head_dim", self)
        n = 1 if self.heads is None else _dim(dims, self.heads, self)

        def permute(t: torch.Tensor) -> torch.Tensor:
            rows, rest = t.shape[0], tuple(t.shape[1:])
            if rows % n or r % 2 or rows // n < r:
                raise OpError(f"{self.describe()}: {rows} rows are not {n} blocks ending in {r} (even) RoPE rows")
            blocks = t.reshape(n, rows // n, *rest)
            pair = (r // 2, 2) if self.to_half else (2, r // 2)
            tail = blocks[:, -r:].reshape(n, *pair, *rest).transpose(1, 2).reshape(n, r, *rest)
            return torch.cat([blocks[:, :-r], tail], 1).reshape(rows, *rest).contiguous()

        return [permute(_tensor(v, self)) for v in values]

    def inverse(self):
        return PermuteRopeTail(self.heads, not self.to_half)


@dataclass(frozen=True)
class PermuteQK(Op):
    """q, k, v -> q and k RoPE-permuted as :class:`PermuteRope` (``n_heads`` for q, ``n_kv_heads``
    for k), v unchanged: a fused QKV projection split into three, then each into HF's rotation."""

    to_half: bool = True

    def apply(self, values, dims):
        if len(values) != 3:
            raise OpError(f"{self.describe()} takes q, k, v, got {len(values)} values")
        q = PermuteRope("n_heads", self.to_half).apply([values[0]], dims)[0]
        k = PermuteRope("n_kv_heads", self.to_half).apply([values[1]], dims)[0]
        return [q, k, _tensor(values[2], self)]

    def inverse(self):
        return PermuteQK(not self.to_half)


@dataclass(frozen=True)
class FuseQKV(Op):
    """q, k, v -> the grouped-query fused tensor of Megatron / torchtitan: per KV group g the rows
    ``[q heads of g (H/G); k_g; v_g]``, shape ``((H + 2G) * head_dim, *rest)``. 1-D biases too."""

    heads: str = "n_heads"
    kv_heads: str = "n_kv_heads"

    def apply(self, values, dims):
        import torch
        h, g = _dim(dims, self.heads, self), _dim(dims, self.kv_heads, self)
        if len(values) != 3 or h % g:
            raise OpError(f"{self.describe()} takes q, k, v with {h} heads in {g} groups, got {len(values)} values")
        q, k, v = (_tensor(x, self) for x in values)
        hd = k.shape[0] // g
        rest = tuple(q.shape[1:])
        if q.shape[0] != h * hd or v.shape != k.shape:
            raise OpError(f"{self.describe()}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit {h}/{g} heads")
        parts = [q.reshape(g, h // g, hd, *rest), k.reshape(g, 1, hd, *rest), v.reshape(g, 1, hd, *rest)]
        return [torch.cat(parts, 1).reshape((h + 2 * g) * hd, *rest)]

    def inverse(self):
        return SplitQKV(self.heads, self.kv_heads)


@dataclass(frozen=True)
class SplitQKV(Op):
    """The grouped-query fused tensor -> q, k, v (inverse of :class:`FuseQKV`)."""

    heads: str = "n_heads"
    kv_heads: str = "n_kv_heads"

    def apply(self, values, dims):
        h, g = _dim(dims, self.heads, self), _dim(dims, self.kv_heads, self)
        if len(values) != 1 or h % g:
            raise OpError(f"{self.describe()} takes one fused tensor with {h} heads in {g} groups")
        t = _tensor(values[0], self)
        if t.shape[0] % (h + 2 * g):
            raise OpError(f"{self.describe()}: {t.shape[0]} rows are not {h + 2 * g} heads")
        hd = t.shape[0] // (h + 2 * g)
        rest = tuple(t.shape[1:])
        blocks = t.reshape(g, h // g + 2, hd, *rest)
        q = blocks[:, : h // g].reshape(h * hd, *rest).contiguous()
        k = blocks[:, h // g].reshape(g * hd, *rest).contiguous()
        v = blocks[:, h // g + 1].reshape(g * hd, *rest).contiguous()
        return [q, k, v]

    def inverse(self):
        return FuseQKV(self.heads, self.kv_heads)


@dataclass(frozen=True)
class JoinShards(Op):
    """Each list value (one tensor per model-parallel shard, Meta ``consolidated.NN.pth`` order)
    -> ``torch.cat(shards, dim)``; ``dim=None`` for a replicated tensor (norms): the shards must be
    equal (``torch.equal``) and one is kept. ``heads`` names the head count a shard must hold whole
    pieces of (Q: ``n_heads``; K / V: ``n_kv_heads``), checked by the inverse split."""

    dim: int | None = 0
    heads: str | None = None

    def apply(self, values, dims):
        import torch
        out = []
        for v in values:
            shards = v if isinstance(v, list) else [v]
            _same_dtype(shards, self)
            if self.dim is None:
                bad = [i for i, s in enumerate(shards[1:], 1) if not same_bits(shards[0], s)]
                if bad:
                    raise OpError(f"{self.describe()}: a replicated tensor differs between shards 0 and {bad} (compared bit for bit)")
                out.append(shards[0])
            else:
                sizes = [s.shape[self.dim] if s.dim() > self.dim else None for s in shards]
                if len(set(sizes)) > 1:  # Meta's parallel layers split evenly; SplitShards could not give these back
                    raise OpError(f"{self.describe()}: shards differ along dim {self.dim} ({sizes}): not an even model-parallel split")
                out.append(torch.cat(shards, self.dim))
        return out

    def inverse(self):
        return SplitShards(self.dim, self.heads)


@dataclass(frozen=True)
class SplitShards(Op):
    """Each tensor -> ``dims["shards"]`` model-parallel pieces along ``dim`` (the same tensor for
    each when ``dim=None``); inverse of :class:`JoinShards`. With ``heads``, every shard must get
    whole heads (``dims[heads]`` divisible by the shard count), as Meta's model parallelism splits
    Q / K / V by heads.

    Raises:
        OpError: the size along ``dim`` or the head count does not divide by the shard count."""

    dim: int | None = 0
    heads: str | None = None

    def apply(self, values, dims):
        n = _dim(dims, "shards", self)
        if self.heads is not None and self.dim is not None and _dim(dims, self.heads, self) % n:
            raise OpError(f"{self.describe()}: {self.heads}={dims[self.heads]} heads do not split in {n} shards")
        out = []
        for v in values:
            t = _tensor(v, self)
            if self.dim is None:
                out.append([t] * n)
            elif t.shape[self.dim] % n:
                raise OpError(f"{self.describe()}: size {t.shape[self.dim]} along dim {self.dim} of shape {list(t.shape)} does not split in {n} shards")
            else:
                out.append(list(t.chunk(n, self.dim)))  # views: the writer clones each
        return out

    def inverse(self):
        return JoinShards(self.dim, self.heads)


@dataclass(frozen=True)
class Refuse(Op):
    """A key the target layout has no place for: planning stops with ``why`` (the key named by
    the plan's problem) instead of writing it where the target would ignore or reject it."""

    why: str

    def apply(self, values, dims):
        raise OpError(self.why)

    def inverse(self):
        return self


__all__ = ["Refuse", "same_bits", "JoinShards", "SplitShards", "Op", "OpError", "Value", "Transpose", "Stack", "Unstack", "Concat", "Chunk", "PermuteRope", "PermuteRopeTail", "PermuteQK", "FuseQKV", "SplitQKV"]
