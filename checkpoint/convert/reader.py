"""A checked :class:`~checkpoint.convert.plan.ConversionPlan` as the reader of
:func:`checkpoint.plan.model.plan_load`: ``load(module, path, recipe=...)`` converts while loading,
with no temporary checkpoint.

Each target is computed by its rule group from the group's source tensors only (memory: one group,
e.g. one layer's experts); the outputs of the last :data:`GROUPS_KEPT` groups are kept, because the
value checks and the copies ask for the same targets one after the other. A rank holding a block
of a target (a DTensor shard) reads only that block where the rule allows it (renames, one expert
of a stacked tensor, some experts of a stack or of transformers' fused ``gate_up_proj``, whole
heads of a RoPE row permute, whole KV groups of a fused QKV: :meth:`ConvertedReader.get_slice`);
for the other ops (gate/up chunks, joins of model-parallel shards, a block cutting a head or a
group) the target is computed
whole from its group's sources and cut, so a rank still reads no tensor its targets do not need.
"""

from __future__ import annotations

import contextlib

import math
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..storage.layout import TensorSpec
from .ops import Concat, PermuteRope, SplitQKV, Stack, Unstack
from .plan import ConversionPlan

GROUPS_KEPT = 2


class ConvertedReader:
    """``keys`` / ``spec`` / ``get`` / ``get_slice`` / ``file_of`` over a conversion's targets (see
    the module docstring). No checksums (the source is read through its own format's checks) and
    no alias groups (tied targets are the plan's, one name each)."""

    index_path = None
    meta = None
    alias_groups: list[list[str]] = []
    resolve_names = False  # the plan named the targets after the model's FQNs already

    def __init__(self, plan: ConversionPlan):
        self.plan = plan
        self.root = str(plan.catalog.path)
        self.files: list[str] = []
        self._specs: dict[str, TensorSpec] = {s.fqn: s for s in plan.specs}
        self._kept: OrderedDict[int | str, dict[str, torch.Tensor]] = OrderedDict()

    def keys(self) -> list[str]:
        return sorted(self._specs)

    def spec(self, key: str) -> TensorSpec:
        return self._specs[key]

    def __contains__(self, key: str) -> bool:
        return key in self._specs

    def nbytes(self, key: str) -> int:
        """Size of target ``key`` in bytes."""
        s = self._specs[key]
        return math.prod(s.shape) * s.dtype.itemsize

    def file_of(self, key: str) -> str:
        """The source file(s) the target is computed from, for messages."""
        gi = self.plan._group_of.get(key)
        keys = self.plan.groups[gi].source_keys() if gi is not None else [self.plan.unchanged[key]]
        return f"{keys[0]} (converted by {self.plan.recipe.name})"

    @contextlib.contextmanager
    def reading(self):
        """A span of reads (:meth:`~checkpoint.sources.protocol.TensorReader.reading`) over every
        source shard: the check of :meth:`check_first` and the reads of the conversion that
        follows see the same files."""
        with contextlib.ExitStack() as spans:
            for src in self.plan.catalog.sources:
                span = getattr(src, "reading", None)
                if span is not None:
                    spans.enter_context(span())
            yield self

    def check_first(self, keys: Iterable[str] = (), rows: Mapping[str, Any] | None = None) -> dict:
        """Check, before any target is written, the source tensors the targets ``keys`` (and
        ``rows``' keys: a converted block's bytes are not the target's rows, so its sources are
        checked whole) are computed from, in every source shard (``Source.check_first``)."""
        plan = self.plan
        need: list[str] = []
        for key in [*keys, *(rows or {})]:
            gi = plan._group_of.get(key)
            need += plan.groups[gi].source_keys() if gi is not None else [plan.unchanged[key]]
        need = list(dict.fromkeys(need))
        for src in plan.catalog.sources:
            check = getattr(src, "check_first", None)
            if check is not None:
                check(need)
        return {}

    def read_into(self, key: str, out: torch.Tensor) -> bool:
        """Stacked experts (``Stack(0)``, then at most one ``Concat`` along a later dim, as
        transformers' fused ``gate_up_proj`` / ``down_proj``) written straight into ``out``: each
        expert's source tensor copied into its slice, no stacked or concatenated tensor in between
        (a load otherwise holds the group's target twice more). ``out`` must have the target's shape
        and dtype (sources of another dtype are converted by the copy only after load's checks);
        False for any other target, or a target computed already (then :meth:`get`)."""
        plan = self.plan
        gi = plan._group_of.get(key)
        spec = self._specs[key]
        if gi is None or gi in self._kept or plan.catalog.shards != 1 or out.dtype != spec.dtype or tuple(out.shape) != spec.shape:
            return False
        g = plan.groups[gi]
        ops, pats = g.rule.ops, g.rule.source_patterns
        if len(g.rule.target_patterns) != 1 or not ops or ops[0] != Stack(0) or len(ops) > 2 or not all(p.gathered for p in pats):
            return False
        if len(ops) == 2 and not (isinstance(ops[1], Concat) and ops[1].dim >= 1):
            return False
        if any(plan.catalog.specs(k)[0].dtype != spec.dtype for m in g.members for k in m.values()):
            return False
        dim = ops[1].dim - 1 if len(ops) == 2 else None  # the concatenated dim of one expert's tensor
        width = spec.shape[dim + 1] // len(pats) if dim is not None else 0
        with torch.no_grad():
            for j, members in enumerate(g.members):
                for e in sorted(members):
                    row = out[e]
                    if dim is not None:
                        row = row.narrow(dim, j * width, width)
                    row.copy_(plan.catalog.get(members[e], 0))
        return True

    def get(self, key: str) -> torch.Tensor:
        gi: int | str = self.plan._group_of.get(key, key)
        out = self._kept.get(gi)
        if out is None:
            if isinstance(gi, int):
                out = dict(self.plan.compute(self.plan.groups[gi]))
            else:
                out = {key: self.plan.catalog.get(self.plan.unchanged[key], 0)}
            self._kept[gi] = out
            while len(self._kept) > GROUPS_KEPT:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(gi)
        return out[key]

    def get_slice(self, key: str, slices: Sequence[slice]) -> torch.Tensor:
        """Block ``target[slices]``. Read alone from the source where the rule allows it: a
        target the rule only renames (its block is the source's block), one expert of a stacked
        source (``Unstack``: a block of the source's row), a block of stacked experts (``Stack``:
        only the experts in ``slices[0]``, each only its block; the same under transformers' fused
        ``gate_up_proj`` concatenation), whole heads of a RoPE row permute, whole KV groups of q /
        k / v split from Megatron's ``linear_qkv``. Otherwise the target is computed whole by its
        group and cut."""
        slices = tuple(slices)
        plan, cat = self.plan, self.plan.catalog
        gi = plan._group_of.get(key)
        kept = self._kept.get(gi if gi is not None else key)
        if kept is not None:  # computed already (the checks and the copies read it in turn)
            return kept[key][slices]
        if cat.shards == 1:
            if gi is None:
                return cat.get_slice(plan.unchanged[key], slices)
            g = plan.groups[gi]
            ops, pats = tuple(op for op in g.rule.ops if not op.is_identity(plan.dims)), g.rule.source_patterns
            if len(pats) == 1 and len(g.rule.target_patterns) == 1:
                members = g.members[0]
                if not ops and pats[0].gathered is None:
                    return cat.get_slice(members[None], slices)
                if ops == (Unstack(0),) and pats[0].gathered is None and g.rule.target_patterns[0].gathered is not None:
                    e = g.targets.index(key)
                    return cat.get_slice(members[None], (slice(e, e + 1), *slices))[0]
                if len(ops) == 1 and isinstance(ops[0], PermuteRope) and pats[0].gathered is None and slices:
                    block = self._whole_heads(key, ops[0], members[None], slices)
                    if block is not None:
                        return block
            if len(g.rule.target_patterns) == 1 and slices and all(p.gathered is not None for p in pats):
                block = self._some_experts(key, g, slices)
                if block is not None:
                    return block
            if ops and isinstance(ops[0], SplitQKV) and len(ops) == 1 and pats[0].gathered is None and slices:
                block = self._whole_groups(key, g, ops[0], slices)
                if block is not None:
                    return block
        return self.get(key)[slices]

    def _some_experts(self, key: str, g, slices: tuple) -> torch.Tensor | None:
        """A block of stacked experts (``Stack(0)``, then any ``Concat`` along a later dim, as
        transformers' fused ``gate_up_proj``): only the experts in ``slices[0]`` are read, each only
        its block; the concatenated dims must be whole in ``slices``. None when the ops differ."""
        ops = g.rule.ops
        if not ops or ops[0] != Stack(0) or not all(isinstance(op, Concat) and op.dim >= 1 for op in ops[1:]):
            return None
        shape = self._specs[key].shape
        whole = {op.dim for op in ops[1:]}
        if any(d < len(slices) and slices[d].indices(shape[d]) != (0, shape[d], 1) for d in whole):
            return None
        src = tuple(slice(None) if d + 1 in whole else sl for d, sl in enumerate(slices[1:]))
        experts = range(len(g.members[0]))[slices[0]]
        values = [[self.plan.catalog.get_slice(m[e], src) for e in experts] for m in g.members]
        for op in ops:
            values = op.apply(values, self.plan.dims)
        return values[0]

    def _whole_groups(self, key: str, g, op: SplitQKV, slices: tuple) -> torch.Tensor | None:
        """Rows ``slices[0]`` of q, k or v split from a grouped-query fused tensor (Megatron
        ``linear_qkv``) when they are whole KV groups (a ``Shard(0)`` block on a world size
        dividing the groups): those groups' rows of the fused tensor are contiguous, read alone
        and split. None when the rows cut a group."""
        h, kv = self.plan.dims.get(op.heads), self.plan.dims.get(op.kv_heads)
        if not h or not kv or h % kv:
            return None
        src = g.members[0][None]
        fused_rows = self.plan.catalog.specs(src)[0].shape[0]
        hd, per = fused_rows // (h + 2 * kv), h // kv
        which = g.targets.index(key)  # q, k, v
        group_rows = (per if which == 0 else 1) * hd
        a, b, step = slices[0].indices(self._specs[key].shape[0])
        if step != 1 or b <= a or a % group_rows or b % group_rows:
            return None
        g0, g1 = a // group_rows, b // group_rows
        part = self.plan.catalog.get_slice(src, (slice(g0 * (per + 2) * hd, g1 * (per + 2) * hd), *slices[1:]))
        return op.apply([part], {**self.plan.dims, op.heads: (g1 - g0) * per, op.kv_heads: g1 - g0})[which]

    def _whole_heads(self, key: str, op: PermuteRope, src: str, slices: tuple) -> torch.Tensor | None:
        """Rows ``slices[0]`` of a RoPE-permuted target when they are whole heads (a ``Shard(0)``
        block of Q or K on a world size dividing the heads): the permute acts within each head,
        so the block is the permute of the same source rows. None when the rows cut a head."""
        n = self.plan.dims.get(op.heads)
        rows = self._specs[key].shape[0]
        if not n or rows % n:
            return None
        hd = rows // n
        a, b, step = slices[0].indices(rows)
        if step != 1 or a % hd or b % hd or b <= a:
            return None
        part = self.plan.catalog.get_slice(src, (slice(a, b), *slices[1:]))
        return op.apply([part], {**self.plan.dims, op.heads: (b - a) // hd})[0]

    def check_index_digest(self) -> None:  # pragma: no cover - load refuses verify= with a recipe
        raise AssertionError("a conversion has no index digest")

    def close(self) -> None:
        self._kept.clear()
        self.plan.catalog.close()

    def __enter__(self) -> ConvertedReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()



def pretrained_conversion(keys: Sequence[str], model: Any, known: Collection[str] = ()) -> Any:
    """The conversion ``from_pretrained`` would apply to a checkpoint of ``keys`` for ``model``
    (a :class:`~.rules.Recipe`, ``experts-to-fused`` from the model's own conversion mapping:
    :func:`~.transformers_rules.pretrained_recipe`), or None: ``model`` is no transformers model,
    its mapping changes none of the ``keys`` that are not its names (``known``), or fqnckpt cannot
    translate the mapping (scoped or regex patterns: the keys are then checked as they are). Its
    targets are not checked against the model while planning (``writes="hf"``): the caller's own
    name and shape checks report them (``load``: missing / unexpected / shapes, ``strict=False``
    honoured)."""
    from dataclasses import replace

    from .transformers_rules import changes_keys, pretrained_recipe

    unknown = [k for k in keys if k not in known]
    if not unknown:  # every key names a tensor of the model: nothing to convert, no mapping built
        return None
    try:
        rec = pretrained_recipe(model)
    except ValueError:
        return None
    if rec is None or not changes_keys(rec, unknown):
        return None
    return replace(rec, writes="hf")


def pretrained_reader(reader: Any, path: Any, model: Any, known: Collection[str] = (), *, verify: bool = False,
                      key: str | None = None, trusted_globals: Iterable[Any] = ()) -> Any:  # fmt: skip
    """``reader`` (the checkpoint at ``path`` opened by its format), or, where ``model`` is a
    transformers model whose own conversion mapping converts or renames some of ``reader``'s keys
    (:func:`pretrained_conversion`), a :class:`ConvertedReader` over that conversion: what
    ``from_pretrained`` reads (per-expert ``mlp.experts.{e}.gate_proj.weight`` stacked into the
    fused ``mlp.experts.gate_up_proj``, Mixtral's ``block_sparse_moe`` renamed ``mlp``, ...).
    ``reader`` is closed then. ``verify``: the checkpoint's index digest and files are checked on
    ``reader`` first (a conversion has no checksums of its own).

    The converted keys are checked against the model by ``load`` as any checkpoint's are (missing,
    unexpected, shapes: :class:`~checkpoint.errors.CheckpointMismatchError`, ``strict=False``
    honoured).

    Raises:
        RecipeError, ConversionError: the source does not fit the conversion (an expert missing,
            experts of different shapes; named); what ``reader.verify_file`` raises with
            ``verify``. ``reader`` is closed on every error.
    """
    try:
        rec = pretrained_conversion(reader.keys(), model, known)
        if rec is None:
            return reader
        if verify:
            reader.check_index_digest()
            for name in reader.files:
                reader.verify_file(name)
    except BaseException:
        reader.close()
        raise
    reader.close()
    converted = open_pretrained(path, rec, model, key=key, trusted_globals=trusted_globals)
    # The source's index record (its xxh3-128 digest names the content): ranks of a collective load
    # compare what they opened by it, so node-local copies of one checkpoint still agree.
    converted.meta = getattr(reader, "meta", None)
    return converted


def open_pretrained(path: Any, recipe: Any, model: Any, *, key: str | None = None, trusted_globals: Iterable[Any] = ()) -> ConvertedReader:
    """A :class:`ConvertedReader` of the checkpoint at ``path`` through ``recipe`` (from
    :func:`pretrained_conversion`), its dims and tied output taken from the transformers model under
    ``model``. Raises what :func:`~.api.open_conversion` raises."""
    from .api import open_conversion
    from .transformers_rules import transformers_model

    reader = ConvertedReader(open_conversion(path, recipe, model=transformers_model(model), key=key, trusted_globals=trusted_globals))
    # The targets were not checked against the model's names (writes="hf"): a base model's keys into
    # a model with a head, or the reverse, resolve by container prefix as any checkpoint's do.
    reader.resolve_names = True
    return reader


__all__ = ["ConvertedReader", "GROUPS_KEPT", "pretrained_conversion", "pretrained_reader", "open_pretrained"]
