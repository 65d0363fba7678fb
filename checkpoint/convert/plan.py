"""Planning a conversion apart from bytes, then streaming it group by group.

:func:`plan_conversion` matches every source key to exactly one rule (or a ``drop`` pattern, or
passthrough), forms the groups, runs each group's ops on meta tensors (shapes and dtypes checked,
no data read), names the targets, and checks that each target is filled exactly once and, with a
``model``, that the targets are exactly the model's tensors with its shapes. Any problem stops it
before a byte is read, naming the keys. :class:`ConversionPlan` then yields the target tensors,
reading one group at a time (memory bounded by the largest group: one layer's experts).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fqn import TensorKind, eager_tensors

from ..storage.layout import TensorSpec
from .catalog import Catalog
from .layers import layer_problems
from .recipes import RecipeError
from .meta_files import shard_target
from .ops import JoinShards, MissingDim, OpError, SplitShards, Value
from .report import ConversionError, ConversionReport, GroupEntry, Problem, RuleUse
from .rules import Pattern, Recipe, Rule


@dataclass
class Group:
    """One application of a rule: per source pattern its key (or, gathered, its keys by index)."""

    rule_index: int
    rule: Rule
    values: dict[str, str]
    members: list[dict[int | None, str]]
    targets: list[str] = field(default_factory=list)
    specs: list[TensorSpec] = field(default_factory=list)

    def source_keys(self) -> list[str]:
        return [m[i] for m in self.members for i in sorted(m, key=lambda x: -1 if x is None else x)]


def _ops(rule: Rule, shards: int, out_shards: int = 1) -> tuple:
    """The rule's ops, after joining the source's model-parallel shards and before splitting
    into the target's (Meta ``consolidated.NN.pth``)."""
    join = (JoinShards(rule.shard_dim, rule.shard_heads),) if shards > 1 else ()
    split = (SplitShards(rule.shard_dim, rule.shard_heads),) if out_shards > 1 else ()
    return join + rule.ops + split


def writes_shards(recipe: Recipe, dims: Mapping[str, int]) -> int:
    """How many model-parallel shards the target gets: ``dims["shards"]`` for Meta's layout, else 1."""
    return int(dims.get("shards", 1)) if recipe.writes == "meta" else 1


def _inputs(group: Group, shards: int, read) -> list[Value]:
    """The group's values; ``read(key, shard)`` gives each tensor (meta or real)."""
    out: list[Value] = []
    for pat, m in zip(group.rule.source_patterns, group.members):
        if pat.gathered is None:
            key = m[None]
            out.append([read(key, s) for s in range(shards)] if shards > 1 else read(key, 0))
        else:
            out.append([read(m[i], 0) for i in range(len(m))])
    return out


def _outputs(group: Group, values: list[Value], out_shards: int = 1) -> list[tuple[str, torch.Tensor]]:
    """Name the op results after the target patterns (a gathered target takes a list; with
    ``out_shards`` > 1 each target is a list of shards, named by :func:`shard_target`)."""
    out = []
    for pat, v in zip(group.rule.target_patterns, values):
        if out_shards > 1:
            out += [(shard_target(s, pat.format(group.values)), t) for s, t in enumerate(v)]
        elif pat.gathered is None:
            if isinstance(v, list):
                raise OpError(f"target {pat.text!r} is one tensor but the ops made a list of {len(v)}")
            out.append((pat.format(group.values), v))
        else:
            if not isinstance(v, list):
                raise OpError(f"target {pat.text!r} gathers a list but the ops made one tensor")
            out += [(pat.format(group.values, i), t) for i, t in enumerate(v)]
    return out


def _meta_apply(group: Group, catalog: Catalog, shards: int, dims: Mapping[str, int], out_shards: int) -> list[Value]:
    """The group's ops on meta tensors: output shapes and dtypes, no data read."""

    def meta(key: str, shard: int) -> torch.Tensor:
        s = catalog.specs(key)[shard]
        return torch.empty(s.shape, dtype=s.dtype, device="meta")

    values = _inputs(group, shards, meta)
    for op in _ops(group.rule, shards, out_shards):
        if isinstance(op, JoinShards) and op.dim is None:  # equality is checked on the data
            values = [v[0] if isinstance(v, list) else v for v in values]
            continue
        values = op.apply(values, dims)
    return values


def _apply_renames(key: str, renames, present=frozenset()) -> str:
    """``renames`` in order; one with ``apply_in`` also sees the other names (``present``)."""
    for r in renames:
        key = r.apply_in(key, present) if hasattr(r, "apply_in") else r.apply(key)
    return key


class ConversionPlan:
    """The checked plan: ``specs`` (target TensorSpecs in group order), ``fetch(spec)`` for the
    writer (one group computed at a time, its other outputs kept until asked for), ``tensors()``
    to iterate ``(target, tensor)``, and the ``report``."""

    def __init__(self, catalog: Catalog, recipe: Recipe, dims: dict[str, int], groups: list[Group],
                 unchanged: dict[str, str], report: ConversionReport):  # fmt: skip
        self.catalog, self.recipe, self.dims = catalog, recipe, dims
        self.groups, self.unchanged, self.report = groups, unchanged, report
        self.out_shards = writes_shards(recipe, dims)
        self.model: Any = None  # the target model: given, or built from the source's config.json (api.open_conversion)
        self.side: dict[str, bytes] | None = None  # side files, built and checked while planning (api.verify_plan)
        self._group_of: dict[str, int] = {}
        self.specs: list[TensorSpec] = []
        for gi, g in enumerate(groups):
            for s in g.specs:
                self._group_of[s.fqn] = gi
                self.specs.append(s)
        for tgt, src in unchanged.items():
            spec = catalog.specs(src)[0]
            self.specs.append(TensorSpec(tgt, tuple(spec.shape), spec.dtype))
        self._cache: dict[str, torch.Tensor] = {}
        self._post_present: frozenset[str] = frozenset()  # target names before Recipe.post (set by plan_conversion)
        self.aliases: set[str] = set()  # targets that copy another (a tied model's output weight)

    def compute(self, group: Group) -> list[tuple[str, torch.Tensor]]:
        """Read the group's source tensors and apply its ops: ``[(target, tensor)]``."""
        shards = self.catalog.shards
        values = _inputs(group, shards, self.catalog.get)
        for op in _ops(group.rule, shards, self.out_shards):
            values = op.apply(values, self.dims)
        return [(_apply_renames(n, self.recipe.post, self._post_present), t) for n, t in _outputs(group, values, self.out_shards)]

    def fetch(self, spec: TensorSpec) -> torch.Tensor:
        name = spec.fqn
        if name in self._cache:
            return self._cache.pop(name)
        gi = self._group_of.get(name)
        if gi is None:
            return self.catalog.get(self.unchanged[name], 0)
        out = dict(self.compute(self.groups[gi]))
        t = out.pop(name)
        self._cache.update(out)
        return t

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for g in self.groups:
            yield from self.compute(g)
        for tgt, src in self.unchanged.items():
            yield tgt, self.catalog.get(src, 0)


def _respelled(pattern: str, renames) -> str:
    """A key pattern through a recipe's version renames (:class:`~checkpoint.layout_versions.Respell`;
    other renames, such as DeepSeek's layer shift, leave a pattern's ``{i}`` alone)."""
    from ..layout_versions import Respell

    for r in renames:
        if isinstance(r, Respell):
            pattern = Respell(r.frm, r.to).apply(pattern)  # a rule pattern stands for every key it names
    return pattern


def describe_rule(recipe: Recipe, rule: Rule, sources_present=None, targets_present=None) -> str:
    """``rule`` as the checkpoints spell it: the rules are written in a framework's canonical
    names, so a source read in a later layout version (``recipe.pre`` renames it) or a target
    written in one (``recipe.post``) is shown in that version's names (torchtitan 3101b42's
    ``lm_head.weight``, not ``output.weight``). Given the keys present on a side, a respelling
    no key there has is not shown (DeepSeek-V3 keeps ``attention.wq`` where Llama's is
    ``qkv_linear.wq``: that rename needs a ``wk`` beside it)."""

    def spelled(p: str, renames, present) -> str:
        out = _respelled(p, renames)
        if out != p and present is not None and not any(Pattern(out).match(k) is not None for k in present):
            return p
        return out

    back = [r.inverse() for r in reversed(recipe.pre)]
    sources = tuple(spelled(p, back, sources_present) for p in rule.sources)
    targets = tuple(spelled(p, recipe.post, targets_present) for p in rule.targets)
    if (sources, targets) == (rule.sources, rule.targets):
        return rule.describe()
    ops = ", ".join(op.describe() for op in rule.ops)
    return f"{' + '.join(sources)} -> {' + '.join(targets)}" + (f" [{ops}]" if ops else "")


def plan_conversion(catalog: Catalog, recipe: Recipe, dims: Mapping[str, int], *, model: Any = None,
                    source: str = "", tied: bool = False) -> ConversionPlan:  # fmt: skip
    """Plan ``recipe`` over ``catalog`` (see the module docstring).

    Args:
        dims: model dimensions the ops need (``n_heads``, ``n_kv_heads``, ...).
        model: target eager module; its state_dict names and shapes must be exactly the targets.
        tied: the model ties its output projection to its embeddings (``tie_word_embeddings``):
            a framework layout that keeps both (``recipe.meta["tied"]``) gets the copy it lacks.

    Raises:
        ConversionError: unmatched / ambiguous / incomplete source keys, an op that does not fit
            the shapes, targets filled twice, or (with ``model``) missing / unexpected / differently
            shaped targets. ``.report.problems`` names every key; nothing was read or written.
    """
    dims = dict(dims)
    shards, out_shards = catalog.shards, writes_shards(recipe, dims)
    if out_shards < 1:
        raise RecipeError(f"recipe {recipe.name!r}: shards={out_shards}; Meta's layout has 1 or more consolidated.NN.pth files")
    if "meta" not in (recipe.reads, recipe.writes) and int(dims.get("shards", 1)) != 1:
        raise RecipeError(f"recipe {recipe.name!r}: shards={dims['shards']} applies to Meta's layout only (hf-to-meta-llama)")
    if out_shards > 1 and (recipe.passthrough or recipe.post):
        raise RecipeError(f"recipe {recipe.name!r}: model-parallel shards need every key named by a rule (no passthrough)")
    report = ConversionReport(recipe=recipe.name, source=source or str(catalog.path), source_format=catalog.format,
                              shards=shards, dims=dims, rules=[RuleUse(rule=describe_rule(recipe, r)) for r in recipe.rules])  # fmt: skip
    problems = report.problems
    drops = [Pattern(d) for d in recipe.drop]
    groups: dict[tuple, Group] = {}
    unchanged: dict[str, str] = {}
    renamed: dict[str, str] = {}
    raw = frozenset(catalog.keys())
    present = {_apply_renames(k, recipe.pre, raw) for k in raw}  # for Rule.when_present / when_absent
    for key in catalog.keys():
        name = _apply_renames(key, recipe.pre, raw)
        if name in renamed:
            problems.append(Problem(kind="collision", keys=[renamed[name], key], message=f"{renamed[name]!r} and {key!r} are both renamed to {name!r}"))
            continue
        renamed[name] = key
        if any(d.match(name) is not None for d in drops):
            report.dropped.append(key)
            continue
        hits = []
        for ri, rule in enumerate(recipe.rules):
            for pi, pat in enumerate(rule.source_patterns):
                vals = pat.match(name)
                if vals is not None and rule.applies(vals, present):
                    hits.append((ri, pi, pat, vals))
        if len(hits) > 1:
            problems.append(Problem(kind="ambiguous", keys=[key], message=f"{key!r} matches {len(hits)} rules: {[recipe.rules[h[0]].describe() for h in hits]}"))
            continue
        if not hits:
            if recipe.passthrough:
                unchanged[_apply_renames(name, recipe.post)] = key
            else:
                problems.append(Problem(kind="unmatched", keys=[key], message=f"{key!r} matches no rule of {recipe.name!r}"))
            continue
        ri, pi, pat, vals = hits[0]
        index = None
        if pat.gathered is not None:
            index = int(vals.pop(pat.gathered))
        gkey = (ri, tuple(sorted(vals.items())))
        g = groups.get(gkey)
        if g is None:
            rule = recipe.rules[ri]
            g = groups[gkey] = Group(ri, rule, vals, [{} for _ in rule.sources])
        if index in g.members[pi]:
            problems.append(Problem(kind="collision", keys=[g.members[pi][index], key], message=f"{key!r} and {g.members[pi][index]!r} fill one slot"))
            continue
        g.members[pi][index] = key
    report.unchanged = sorted(unchanged.values())
    if model is None:  # with a model, _check_model compares the targets with it exactly
        dropped = set(report.dropped)
        kept = [n for n, k in renamed.items() if k not in dropped]
        problems.extend(layer_problems(kept, dims))
    # Complete groups only; then shapes from the ops run on meta tensors.
    owner: dict[str, str] = {tgt: src for tgt, src in unchanged.items()}
    meta_results: dict[tuple, list[Value]] = {}
    meta_of: dict[int, list[Value]] = {}
    staged: list[tuple[Group, list]] = []
    ok_groups: list[Group] = []
    missing_dims: dict[str, list[str]] = {}  # dim -> rules that need it
    for g in groups.values():
        bad = None
        for pat, m in zip(g.rule.source_patterns, g.members):
            if not m:
                bad = f"no key for {pat.text!r}"
            elif pat.gathered is not None and sorted(m) != list(range(len(m))):
                bad = f"{pat.text!r} indices {sorted(m)} are not 0..{len(m) - 1}"
        counts = {len(m) for pat, m in zip(g.rule.source_patterns, g.members) if pat.gathered is not None}
        if bad is None and len(counts) > 1:
            bad = f"gathered patterns have different counts {sorted(counts)}"
        if bad is not None:
            problems.append(Problem(kind="incomplete", keys=g.source_keys(), message=f"rule {g.rule.describe()}: {bad}"))
            continue
        try:
            # Same rule and input specs give the same output specs: run the ops once per kind.
            sig = (g.rule_index, tuple((len(m), *(tuple(s.shape) + (s.dtype,) for k in m.values() for s in catalog.specs(k))) for m in g.members))
            values = meta_results.get(sig)
            if values is None:
                values = meta_results[sig] = _meta_apply(g, catalog, shards, dims, out_shards)
            outs = _outputs(g, values, out_shards)
            meta_of[id(g)] = values
        except MissingDim as e:  # said once for the whole plan (missing_dims_problem)
            rules = missing_dims.setdefault(e.name, [])
            if g.rule.sources[0] not in rules:
                rules.append(g.rule.sources[0])
            continue
        except (OpError, RuntimeError, ValueError) as e:
            problems.append(Problem(kind="op", keys=g.source_keys(), message=f"rule {g.rule.describe()}: {e}"))
            continue
        staged.append((g, outs))
    if missing_dims:
        problems.insert(0, missing_dims_problem(missing_dims))
    post_present = frozenset(tgt for _, outs in staged for tgt, _ in outs)  # what Recipe.post renames see
    aliases = _tied_fills(recipe, staged, post_present, tied, report)
    for g, outs in staged:
        for tgt, t in outs:
            tgt = _apply_renames(tgt, recipe.post, post_present)
            if tgt in owner:
                problems.append(Problem(kind="collision", keys=[tgt], message=f"target {tgt!r} filled twice (from {owner[tgt]!r} and {g.source_keys()[0]!r})"))
                continue
            owner[tgt] = g.source_keys()[0]
            g.targets.append(tgt)
            g.specs.append(TensorSpec(tgt, tuple(t.shape), t.dtype))
        ok_groups.append(g)
    problems.extend(_count_problems(ok_groups, meta_of, catalog))
    problems.extend(_agree_problems(recipe, renamed, catalog, staged, report))
    report.checks.append("every gathered stack / expert list and every rule with count_of agree per layer on the count (counts, shapes, dtypes of stacked parts checked by the ops on meta tensors)")
    if shards > 1:
        problems.extend(_replicated_problems(ok_groups, catalog))
        report.checks.append(f"replicated tensors equal bit for bit across the {shards} source shards; split tensors agree in dtype and in every dim but the split one")
    if not ok_groups and not problems and all(t == s for t, s in unchanged.items()):
        problems.append(Problem(kind="no-op", keys=[], message=(
            f"no rule of {recipe.name!r} matches a key of the source: nothing would change (already in "
            "the target layout, or another recipe is meant: `fqnckpt recipes`)")))  # fmt: skip
    if model is not None:
        _check_model(model, ok_groups, unchanged, catalog, problems, report)
    for g in ok_groups:
        use = report.rules[g.rule_index]
        use.groups += 1
        use.sources += len(g.source_keys())
        use.targets += len(g.targets)
        report.groups.append(GroupEntry(rule=g.rule_index, sources=g.source_keys(), targets=list(g.targets)))
    for copy, src_key in aliases.items():
        unchanged[_apply_renames(copy, recipe.post, post_present)] = src_key
    for use, rule in zip(report.rules, recipe.rules):  # in the names the keys on each side have
        use.rule = describe_rule(recipe, rule, raw, owner)
    plan = ConversionPlan(catalog, recipe, dims, ok_groups, unchanged, report)
    plan._post_present = post_present
    plan.aliases = {_apply_renames(c, recipe.post, post_present) for c in aliases}
    report.total_bytes = sum(s.nbytes for s in plan.specs)
    if problems:
        raise ConversionError(report)
    return plan


def missing_dims_problem(missing: Mapping[str, list[str]]) -> Problem:
    """One problem for every model dimension no source stated (``{dim: source patterns of the
    rules needing it}``), naming the ways to state it: the target model, ``dims=`` / ``--dim``, or
    Meta's ``params.json`` / transformers' ``config.json`` beside the source."""
    names = sorted(missing)
    rules = sorted({r for rs in missing.values() for r in rs})
    flags = " ".join(f"--dim {n}=N" for n in names)
    return Problem(kind="dims", keys=rules, message=(
        f"model dimension(s) {', '.join(names)} unknown (needed by {', '.join(rules[:4])}{' ...' if len(rules) > 4 else ''}): "
        f"pass model= (the target model), {flags} (dims=), or put params.json / config.json beside the source"))  # fmt: skip


def _count_problems(groups: list[Group], meta_of: dict[int, list[Value]], catalog: Catalog) -> list[Problem]:
    """Stacks of one layer must agree on their count: every gathered pattern ``{*e}`` (source keys
    or target list) and every rule's ``count_of`` dim (a router's rows), keyed by the layer's
    placeholder values. A stack one expert short otherwise converts into a checkpoint one tensor
    short (w1 of 3 experts beside w3 / w2 of 4)."""
    seen: dict[tuple, list[tuple[str, int]]] = {}

    def note(g: Group, name: str, what: str, n: int) -> None:
        seen.setdefault((tuple(sorted(g.values.items())), name), []).append((what, n))

    for g in groups:
        for pat, m in zip(g.rule.source_patterns, g.members):
            if pat.gathered is not None:
                note(g, pat.gathered, f"{pat.text} {dict(g.values)}", len(m))
        values = meta_of.get(id(g), [])
        for pat, v in zip(g.rule.target_patterns, values):
            if pat.gathered is not None and isinstance(v, list):
                note(g, pat.gathered, f"{g.source_keys()[0]} (as {pat.text})", len(v))
        if g.rule.count_of is not None:
            name, dim = g.rule.count_of
            key = g.source_keys()[0]
            shape = catalog.specs(key)[0].shape
            if len(shape) > dim:
                note(g, name, f"{key} (dim {dim})", int(shape[dim]))
    out = []
    for (_, name), obs in seen.items():
        if len({n for _, n in obs}) > 1:
            out.append(Problem(kind="inconsistent", keys=[w for w, _ in obs],
                               message=f"stacks of one layer disagree on the {{*{name}}} count: " + ", ".join(f"{w} has {n}" for w, n in obs)))  # fmt: skip
    return out


def _agree_problems(recipe: Recipe, renamed: dict[str, str], catalog: Catalog, staged, report: ConversionReport) -> list[Problem]:
    """``recipe.meta["agree"]``: ``(pattern a, pattern b, permutation)`` in the names of the
    framework side (source names after ``pre`` when it reads the framework, target names before
    ``post`` when it writes it): every tensor matching ``a`` and its ``b`` have the same dtype and
    ``b``'s shape is ``a``'s permuted (``w1`` / ``w3`` stacks equal, ``w2`` with its last two dims
    swapped). Stacks of one layer that differ would give per-expert tensors no model loads."""
    pairs = recipe.meta.get("agree") or (recipe.meta.get("inverse_of") or recipe).meta.get("agree") or ()
    if not pairs:
        return []
    if recipe.writes in ("hf", "hf-model"):
        specs = {n: (tuple(catalog.specs(k)[0].shape), str(catalog.specs(k)[0].dtype)) for n, k in renamed.items()}
    else:
        specs = {n: (tuple(t.shape), str(t.dtype)) for _, outs in staged for n, t in outs if not isinstance(t, list)}
    out = []
    for a, b, perm in pairs:
        pa, pb = Pattern(a), Pattern(b)
        for name, (shape, dtype) in specs.items():
            vals = pa.match(name)
            if vals is None:
                continue
            other = pb.format(vals)
            if other not in specs:
                continue
            want = tuple(shape[i] for i in perm) if perm else shape
            oshape, odtype = specs[other]
            if oshape != want or odtype != dtype:
                out.append(Problem(kind="inconsistent", keys=[name, other], message=(
                    f"{name!r} is {list(shape)} {dtype} but {other!r} is {list(oshape)} {odtype} "
                    f"(expected {list(want)} {dtype}): the stacks of one layer must agree")))  # fmt: skip
    report.checks.append(f"stacks that must agree in shape and dtype: {[(a, b) for a, b, _ in pairs]}")
    return out


def _replicated_problems(groups: list[Group], catalog: Catalog) -> list[Problem]:
    """Replicated tensors (norms) read from every shard and compared bit for bit; shapes first
    (the meta pass keeps shard 0's only). Small tensors: read while planning, so a differing
    shard stops the conversion before anything is written."""
    from .ops import same_bits

    out = []
    for g in groups:
        if g.rule.shard_dim is not None:
            continue
        for pat, m in zip(g.rule.source_patterns, g.members):
            if pat.gathered is not None:
                continue
            key = m[None]
            specs = catalog.specs(key)
            if len({(tuple(s.shape), s.dtype) for s in specs}) > 1:
                out.append(Problem(kind="inconsistent", keys=[key], message=f"replicated {key!r} has shapes / dtypes {[(list(s.shape), str(s.dtype)) for s in specs]} across shards"))
                continue
            first = catalog.get(key, 0)
            bad = [i for i in range(1, catalog.shards) if not same_bits(first, catalog.get(key, i))]
            if bad:
                out.append(Problem(kind="inconsistent", keys=[key], message=f"replicated {key!r} differs bit for bit between shard 0 and shard(s) {bad}"))
    return out


def _tied_fills(recipe: Recipe, staged, present: frozenset[str], tied: bool, report: ConversionReport) -> dict[str, str]:
    """``{copy target (before Recipe.post): source key}`` for each ``(copy, original)`` of
    ``recipe.meta["tied"]`` whose copy no source fills, for a tied model written in a layout that
    keeps both (torchtitan's ``from_hf`` fills ``lm_head.weight`` from the embeddings when
    ``enable_weight_tying``). The original must be a plain rename of one source key."""
    if not tied or recipe.writes in ("hf", "hf-model"):
        return {}
    out = {}
    for copy, orig in recipe.meta.get("tied", ()):
        if copy in present or orig not in present:
            continue
        g = next(g for g, outs in staged if any(t == orig for t, _ in outs))
        if g.rule.ops or len(g.rule.targets) != 1:
            continue
        out[copy] = g.source_keys()[0]
        report.checks.append(f"tied model: {copy!r} written as a copy of {g.source_keys()[0]!r} (as torchtitan's from_hf fills it)")
    return out


def _tied_drop(groups: list[Group], keep: str, others: list[str], catalog: Catalog, report: ConversionReport) -> str | None:
    """A tied model (HF ``tie_word_embeddings``) holds one tensor under ``keep`` and ``others``;
    a source with a copy under each (torchtitan writes ``lm_head.weight`` beside the embeddings)
    fills ``keep`` and its copies are dropped, as torchtitan's adapter drops ``lm_head`` on
    ``to_hf``, once they are the same bits (read now: nothing is written from a copy that
    differs). Returns why it cannot, or None (the copies' groups removed, their keys reported
    dropped)."""
    from .ops import same_bits

    by_target = {tgt: g for g in groups for tgt in g.targets}
    kept = by_target.get(keep)
    for name in others:
        g = by_target.get(name)
        if kept is None or g is None or len(g.targets) != 1 or g.rule.ops or kept.rule.ops or catalog.shards != 1:
            return "one tensor filled twice (not two plain copies this conversion can compare)"
        a, b = kept.source_keys()[0], g.source_keys()[0]
        if not same_bits(catalog.get(a), catalog.get(b)):
            return f"the model ties them but the source's {a!r} and {b!r} differ: one tensor filled twice"
    for name in others:
        g = by_target[name]
        groups.remove(g)
        report.dropped += g.source_keys()
        report.checks.append(f"{g.source_keys()[0]!r} equals {kept.source_keys()[0]!r} bit for bit: dropped, the model ties {name!r} to {keep!r}")
    return None


def _check_model(model, groups: list[Group], unchanged: dict[str, str], catalog: Catalog, problems: list[Problem], report: ConversionReport) -> None:
    """Targets must be exactly the model's persistent tensors (one name per tied group, a tied
    copy dropped by :func:`_tied_drop`), same shapes."""
    shape_of = {s.fqn: s.shape for g in groups for s in g.specs}
    for tgt, src in unchanged.items():
        shape_of[tgt] = tuple(catalog.specs(src)[0].shape)
    known: set[str] = set()
    missing = []
    for t in eager_tensors(model):
        known.update(t.names)
        if t.kind == TensorKind.non_persistent_buffer:
            continue
        filled = [n for n in t.names if n in shape_of]
        if not filled:
            missing.append(t.fqn)
        elif len(filled) > 1:
            keep = t.fqn if t.fqn in filled else filled[0]
            why = _tied_drop(groups, keep, [n for n in filled if n != keep], catalog, report)
            if why is not None:
                problems.append(Problem(kind="collision", keys=filled, message=f"tied names {filled} are all targets: {why}"))
            elif shape_of[keep] != tuple(t.tensor.shape):
                problems.append(Problem(kind="shape", keys=[keep], message=f"{keep!r} would be {list(shape_of[keep])}, the model has {list(t.tensor.shape)}"))
        elif shape_of[filled[0]] != tuple(t.tensor.shape):
            problems.append(Problem(kind="shape", keys=[filled[0]], message=f"{filled[0]!r} would be {list(shape_of[filled[0]])}, the model has {list(t.tensor.shape)}"))
    if missing:
        problems.append(Problem(kind="missing", keys=sorted(missing), message=f"model tensors no rule fills: {sorted(missing)[:10]}"))
    extra = sorted(set(shape_of) - known)
    if extra:
        problems.append(Problem(kind="unexpected", keys=extra, message=f"targets the model does not have: {extra[:10]}"))


__all__ = ["ConversionPlan", "Group", "plan_conversion"]
