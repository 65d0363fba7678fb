"""Rules and recipes as data: a :class:`Rule` says which source keys one group combines, which
target keys it fills and the ops between them; a :class:`Recipe` is a named list of rules, and
``recipe.inverse()`` the other direction.

Key patterns are literal text with placeholders: ``{i}`` one name segment (``[^.]+``),
``{name:REGEX}`` a custom regex, ``{*e}`` a gathered index (digits): every key of the group with
any index goes into one list value, ordered by index, which must run 0..n-1 with no gap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Protocol

from .ops import Chunk, Concat, FuseQKV, Op, SplitQKV

from ..keypatterns import PLACEHOLDER as _PLACEHOLDER, Pattern  # noqa: E402 - torch-free home


def _count(op: Op, n: int) -> int:
    """Number of values after ``op`` given ``n`` before (count-preserving unless listed)."""
    if isinstance(op, Concat):
        return 1
    if isinstance(op, FuseQKV):
        return 1
    if isinstance(op, SplitQKV):
        return 3
    if isinstance(op, Chunk) and not op.gathered:
        return op.parts
    return n


@dataclass(frozen=True)
class Rule:
    """Source patterns -> ``ops`` -> target patterns (one value per pattern, in order).

    ``shard_dim`` says how a tensor split over model-parallel shards (Meta ``consolidated.NN.pth``)
    is joined before the ops (read) or split after them (written): the dim to concatenate, ``None``
    for a replicated tensor; ``shard_heads`` the head count each shard holds whole pieces of. A
    :class:`~checkpoint.convert.ops.Chunk` with ``parts=0`` is given the count it must produce.

    ``when_present`` / ``when_absent``: a source key pattern (formatted with the match's
    placeholders) that must be / must not be in the source for the rule to take a key; they tell
    apart two layouts sharing a name (torchtitan's ``attention.q_norm`` is Qwen3's per-head Q norm,
    but DeepSeek-V3's ``q_a_layernorm`` when ``attention.wq_a`` is there). The inverse has none:
    its sources are the other layout's distinct names (a key matching two rules is still refused).

    ``count_of=("e", 0)``: the size along dim 0 of the rule's (single) source is the count of the
    gathered placeholder ``{*e}`` of the same layer (a router's rows are its expert count): the
    plan checks it against every stack of that layer.

    Raises:
        ValueError: the ops do not turn ``len(sources)`` values into ``len(targets)``, or the
            target patterns use a placeholder the sources do not bind.
    """

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    ops: tuple[Op, ...] = ()
    shard_dim: int | None = 0
    shard_heads: str | None = None
    when_present: str | None = None
    when_absent: str | None = None
    count_of: tuple[str, int] | None = None
    # A rule of one form of a layout only (``"fused-qkv"`` / ``"separate-qkv"``): the recipe for a
    # form keeps the rules of that form and those of none (checkpoint.convert.layouts.qkv_form).
    only: str | None = None

    def __post_init__(self) -> None:
        for k in ("sources", "targets"):
            v = getattr(self, k)
            object.__setattr__(self, k, (v,) if isinstance(v, str) else tuple(v))
        ops = list(self.ops)
        need = len(self.targets)
        for j in range(len(ops) - 1, -1, -1):  # fill Chunk(parts=0) from the end, where the count is known
            op = ops[j]
            if isinstance(op, Chunk) and not op.gathered and op.parts == 0:
                ops[j] = replace(op, parts=need)
                need = 1
            elif isinstance(op, (Concat, FuseQKV, SplitQKV, Chunk)):
                break
        object.__setattr__(self, "ops", tuple(ops))
        n = len(self.sources)
        for op in self.ops:
            n = _count(op, n)
        if n != len(self.targets):
            raise ValueError(f"rule {self.describe()}: its ops make {n} values for {len(self.targets)} targets")
        bound = {name for p in self.source_patterns for name in p.names}
        for p in self.target_patterns:
            unbound = set(p.names) - bound - {p.gathered}
            if unbound:
                raise ValueError(f"rule {self.describe()}: target {p.text!r} uses {sorted(unbound)} the sources do not bind")

    def applies(self, values: dict[str, str], present: set[str] | frozenset[str]) -> bool:
        """Whether a match with ``values`` is taken, given the source's keys ``present``."""
        if self.when_present is not None and Pattern(self.when_present).format(values) not in present:
            return False
        return self.when_absent is None or Pattern(self.when_absent).format(values) not in present

    @cached_property
    def source_patterns(self) -> tuple[Pattern, ...]:
        return tuple(Pattern(s) for s in self.sources)

    @cached_property
    def target_patterns(self) -> tuple[Pattern, ...]:
        return tuple(Pattern(t) for t in self.targets)

    def inverse(self) -> Rule:
        """Targets -> sources with every op inverted, in reverse order; a placeholder keeps the
        regex the sources gave it (``{h:(?:.*\\.)?}``) when the targets become the sources."""
        regex = {}
        for s in self.sources:
            for m in _PLACEHOLDER.finditer(s):
                if m.group(3):
                    regex[m.group(2)] = m.group(3)

        def with_regex(text: str) -> str:
            def sub(m: re.Match) -> str:
                star, name, rx = m.groups()
                rx = rx or regex.get(name)
                return f"{{{star}{name}{':' + rx if rx and not star else ''}}}"

            return _PLACEHOLDER.sub(sub, text)

        def plain(text: str) -> str:  # a target only formats: its regex is not needed
            return _PLACEHOLDER.sub(lambda m: f"{{{m.group(1)}{m.group(2)}}}", text)

        new_sources = tuple(with_regex(t) for t in self.targets)
        return Rule(new_sources, tuple(plain(s) for s in self.sources), tuple(op.inverse() for op in reversed(self.ops)), self.shard_dim, self.shard_heads,
                    count_of=self.count_of, only=self.only)

    def describe(self) -> str:
        ops = ", ".join(op.describe() for op in self.ops)
        return f"{' + '.join(self.sources)} -> {' + '.join(self.targets)}" + (f" [{ops}]" if ops else "")


class KeyRename(Protocol):
    """A rename applied to whole keys before (``Recipe.pre``) or after (``Recipe.post``) the rules."""

    def apply(self, key: str) -> str: ...

    def inverse(self) -> KeyRename: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class Recipe:
    """A named, invertible list of rules.

    ``passthrough``: a key no rule matches is copied unchanged (else it stops the conversion).
    ``drop``: patterns of source entries that are not weights (Meta's ``rope.freqs``): consumed,
    reported, not written; the inverse cannot recreate them. ``pre`` / ``post``: key renames before
    matching the rules / after naming the targets (transformers' ``WeightRenaming``).
    ``writes``: ``"hf-model"`` when the targets are exactly the ``model=``'s FQNs (checked; its
    ``config.json`` written beside them), ``"hf"`` for another layout transformers loads (config
    written, targets not checked against the model), ``"meta"`` for Meta's (``params.json``);
    ``reads`` the same for the sources.
    """

    name: str
    inverse_name: str
    rules: tuple[Rule, ...]
    passthrough: bool = False
    drop: tuple[str, ...] = ()
    pre: tuple[Any, ...] = ()
    post: tuple[Any, ...] = ()
    writes: str | None = None
    reads: str | None = None
    summary: str = ""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def inverse(self) -> Recipe:
        """The other direction: every rule inverted, ``pre`` / ``post`` swapped and inverted. The
        inverse of an inverse is the recipe itself (rules keep their ``when_present`` /
        ``when_absent``, which an inverted rule drops)."""
        if "inverse_of" in self.meta:
            return self.meta["inverse_of"]
        return Recipe(
            name=self.inverse_name, inverse_name=self.name, rules=tuple(r.inverse() for r in self.rules),
            passthrough=self.passthrough, drop=(), pre=tuple(r.inverse() for r in reversed(self.post)),
            post=tuple(r.inverse() for r in reversed(self.pre)), writes=self.reads, reads=self.writes,
            summary=self.summary, meta={k: v for k, v in self.meta.items() if k != "inverse_of"} | {"inverse_of": self},
        )  # fmt: skip


__all__ = ["Pattern", "Rule", "Recipe", "KeyRename"]
