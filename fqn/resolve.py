"""Resolve tensor names seen without a graph (old checkpoints, logs) against a model's eager FQNs.

Never guesses: every spelling a name could have is generated *forward* from the model's own names
(eager FQNs, aliases, the module's names with wrapper / parametrization segments) for each known
naming scheme, and a source name is compared against those spellings. A source matching tensors
of more than one eager FQN raises :class:`AmbiguousFQNError`; one matching none is unknown.

A dynamo Source name (``L['self']._modules['inner']._parameters['w']``, attribute and index
spellings ``L['self'].inner[0].w``, a wrapper's child via ``.__dict__['_modules']['x']``) is
invertible and read step by step; ``L['x']`` (a user input) is not model state.

Schemes (torch 2.13 and older, see ``docs/capture-names.md``), after dynamo's own
lossy flattening (runs of non-alphanumerics -> ``_``), compared case-insensitively:

* plain flattened FQN ``inner_lin_weight``, graph attribute ``L__self___inner_lin_weight``,
  older ``getattr_getattr_L__self___layers___0___w``, dgc node ``l__self____export_root_inner_lin_weight``;
* compile placeholder ``L_self_modules_inner_modules_lin_parameters_weight_`` and the older
  ``self____modules__inner____parameters__weight``; wrapper children reached through
  ``__dict__['_modules']`` (``checkpoint_wrapper`` inside dynamo);
* export placeholders ``p_`` (parameters), ``b_`` (buffers);
* a collision suffix ``_0`` / ``_1`` / ... on any of those.

Dotted names go through the string rules of :mod:`fqn.rules` (wrapper segments removed where the
model says so; a transparent parametrization only where the target holds it: a stored
``parametrizations.W.original`` is the parametrization's input, never taken as a plain target's
``W``), the weight_norm spelling of the target model (``parametrizations.W.original0/1`` <-> ``W_g`` / ``W_v``), the spectral_norm spelling
(``parametrizations.W.original`` / ``.0._u`` / ``.0._v`` <-> ``W_orig`` / ``W_u`` / ``W_v``), and a container prefix that
every unresolved key agrees on (``model.`` added or removed, HF ``backbone.``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn as nn

from .eager import TensorKind, transparent_name, eager_tensors
from .errors import AmbiguousFQNError, FlatParamError, FQNCollisionError, FQNError, UnknownNameError
from .registry import dtype_name
from .rules import FLAT_PARAM_SEGMENTS, WRAPPER_SEGMENTS, canonical_fqn

Spelling = Literal["eager", "state_dict"]
ShapeSpec = tuple[tuple[int, ...], "torch.dtype | str"]

_RUNS = re.compile(r"[^a-zA-Z0-9]+")
_SUFFIX = re.compile(r"^(.*)_(\d+)$")
_WN_NEW = re.compile(r"^(.*\.)?parametrizations\.([^.]+)\.original([01])$")
_WN_OLD = re.compile(r"^(.*\.)?([^.]+)_([gv])$")
# spectral_norm: parametrization ``W.original`` / ``W.0._u`` / ``W.0._v`` <-> legacy hook
# ``W_orig`` / ``W_u`` / ``W_v`` (torch.nn.utils.parametrizations.spectral_norm vs
# torch.nn.utils.spectral_norm: the same raw weight and power-iteration vectors).
_SN_NEW = re.compile(r"^(.*\.)?parametrizations\.([^.]+)\.(original|0\._u|0\._v)$")
_SN_OLD = re.compile(r"^(.*\.)?([^.]+)_(orig|u|v)$")
_SN_PARTS = (("original", "orig"), ("0._u", "u"), ("0._v", "v"))
# Wrapper segments inside a normalized flat name (dynamo reaches checkpoint_wrapper's child via
# `__dict__['_modules']`). `module` is not listed: a real child may be called so.
_FLAT_WRAPPERS = re.compile(
    r"(?:(?<=_)|^)(?:dict_modules_|modules_)?(?:checkpoint_wrapped_module|fsdp_wrapped_module|orig_mod)_"
)


def _norm(name: str) -> str:
    """Dynamo's flattening (``torch/_dynamo/variables/builder.py``), runs collapsed, lower-cased."""
    return _RUNS.sub("_", name).strip("_").lower()


@dataclass
class NameMatch:
    """Outcome of :func:`resolve_report` (alias :func:`match_names`).

    ``mapping``: source name -> target name (eager FQN, or ``state_dict`` key if asked).
    ``unexpected``: source names with no candidate, sorted. ``missing``: target names of
    parameters / persistent buffers no source name reached, sorted. ``non_persistent``: source
    names that reached a non-persistent buffer (resolved; the caller decides whether to load).
    ``prefix``: the container prefix applied, ``("add", "model")`` / ``("strip", "backbone")``.
    ``refused``: with ``errors="report"``, each name's refusal (ambiguous, flat parameter) by name.
    """

    mapping: dict[str, str] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    non_persistent: list[str] = field(default_factory=list)
    prefix: tuple[str, str] | None = None
    refused: dict[str, FQNError] = field(default_factory=dict)


Hit = tuple[int, str]  # (tensor index in eager_tensors order, eager name of that tensor)


class _ModelNames:
    """Every spelling of every tensor of ``model``, indexed for lookup."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.tensors = eager_tensors(model)
        self.dotted: dict[str, set[Hit]] = {}
        self.flat: dict[str, set[Hit]] = {}
        receivers = self.receivers = {"self", _receiver(model)}
        for i, t in enumerate(self.tensors):
            prefixes = ("p",) if t.kind == TensorKind.parameter else ("b",)
            leaf = "parameters" if t.kind == TensorKind.parameter else "buffers"
            pairs = [(n, n) for n in t.names] + [(m, _eager_of(model, m, t.names)) for m in t.module_names]
            for spelled, eager in pairs:
                self.dotted.setdefault(spelled, set()).add((i, eager))
                for key in _encodings(spelled, leaf, prefixes, receivers):
                    self.flat.setdefault(key, set()).add((i, eager))
        self.known = sorted({n for t in self.tensors for n in t.names})

    def dotted_hits(self, name: str) -> set[Hit]:
        """Exact name, then the string rules (wrappers, weight_norm / spectral_norm spellings).

        ``X.parametrizations.W.original`` never becomes ``X.W`` by string: the stored value is the
        parametrization's input, the weight only for an identity one, and the string cannot say
        which (a target holding the parametrization names it so itself, via its module names)."""
        if name in self.dotted:
            return set(self.dotted[name])
        forms = {canonical_fqn(name, self.model), canonical_fqn(name)}
        forms |= {w for f in forms for w in self._weight_norm_forms(f) + self._spectral_norm_forms(f)}
        return {h for f in forms for h in self.dotted.get(f, ())}

    def flat_hits(self, name: str) -> set[Hit]:
        hits: set[Hit] = set()
        # The name as given, and with wrapper tokens removed (captured through checkpoint_wrapper /
        # FSDP1 / compile, loaded into a model without that wrapper).
        for key in {_norm(name), _FLAT_WRAPPERS.sub("", _norm(name))}:
            hits |= self.flat.get(key, set())
            m = _SUFFIX.match(key)
            # A collision suffix (_0 strict export / dynamo, _1 non-strict export) exists only where
            # several tensors share the base spelling; elsewhere `x_1` is just the name `x_1`.
            base = self.flat.get(m.group(1), set()) if m else set()
            if len({i for i, _ in base}) > 1:
                hits |= base
        return hits

    def _spectral_norm_forms(self, name: str) -> list[str]:
        # Only where the target model has the *other* spelling with all three names present.
        m = _SN_NEW.match(name)
        if m:
            owner, w = m.group(1) or "", m.group(2)
            old = {new: f"{owner}{w}_{o}" for new, o in _SN_PARTS}
            if all(n in self.dotted for n in old.values()):
                return [old[m.group(3)]]
        m = _SN_OLD.match(name)
        if m:
            owner, w = m.group(1) or "", m.group(2)
            new = {o: f"{owner}parametrizations.{w}.{n}" for n, o in _SN_PARTS}
            if all(n in self.dotted for n in new.values()):
                return [new[m.group(3)]]
        return []

    def _weight_norm_forms(self, name: str) -> list[str]:
        # Only where the target model has the *other* spelling with both halves present.
        m = _WN_NEW.match(name)
        if m:
            owner, w = m.group(1) or "", m.group(2)
            g, v = f"{owner}{w}_g", f"{owner}{w}_v"
            if g in self.dotted and v in self.dotted:
                return [g if m.group(3) == "0" else v]
        m = _WN_OLD.match(name)
        if m:
            owner, w = m.group(1) or "", m.group(2)
            new = [f"{owner}parametrizations.{w}.original{k}" for k in "01"]
            if all(n in self.dotted for n in new):
                return [new[0] if m.group(3) == "g" else new[1]]
        return []


def _receiver(model: nn.Module) -> str:
    """Name of ``forward``'s receiver: dynamo spells it into names (``def forward(s, x)`` -> ``L_s_``)."""
    try:
        params = list(inspect.signature(type(model).forward).parameters)
    except (TypeError, ValueError):
        return "self"
    return params[0] if params else "self"


def _eager_of(model: nn.Module, module_name: str, names: list[str]) -> str:
    fqn = canonical_fqn(transparent_name(model, module_name), model)
    return fqn if fqn in names else names[0]


def _encodings(name: str, leaf_tag: str, kind_prefixes: tuple[str, ...], receivers: set[str]) -> set[str]:
    """Every flattened spelling of dotted ``name`` under the known schemes (normalized keys)."""
    segs = name.split(".")
    mods, leaf = segs[:-1], segs[-1]
    plain_bodies = [[]]
    struct_bodies = [[]]
    for seg in mods:
        # A wrapper child inside dynamo is reached through ``__dict__['_modules']``.
        plain_opts = [[seg], ["dict_modules", seg]] if seg in WRAPPER_SEGMENTS else [[seg]]
        struct_opts = (
            [["modules", seg], ["dict_modules", seg]] if seg in WRAPPER_SEGMENTS else [["modules", seg]]
        )
        plain_bodies = [b + o for b in plain_bodies for o in plain_opts]
        struct_bodies = [b + o for b in struct_bodies for o in struct_opts]
    plain = ["_".join([*b, leaf]) for b in plain_bodies]
    struct = ["_".join([*b, leaf_tag, leaf]) for b in struct_bodies]
    prefixes_plain = ["", *kind_prefixes]
    for r in receivers:
        prefixes_plain += [f"l_{r}", f"l_{r}_export_root"]
        prefixes_plain += ["getattr_" * k + f"l_{r}" for k in range(1, len(mods) + 1)]
    prefixes_struct = [p for r in receivers for p in (f"l_{r}", r)]
    keys = {_norm(f"{p}_{b}") for p in prefixes_plain for b in plain}
    keys |= {_norm(f"{p}_{b}") for p in prefixes_struct for b in struct}
    return keys


def _check_flat_param(name: str) -> None:
    if "." in name:
        if any(seg in FLAT_PARAM_SEGMENTS for seg in name.split(".")):
            raise FlatParamError(name)
    elif re.search(r"(^|_)flat_param(_\d+)?$", _norm(name)):
        raise FlatParamError(name)


def _same_spec(t: torch.Tensor, spec: ShapeSpec) -> bool:
    shape, dtype = spec
    want = dtype if isinstance(dtype, str) else dtype_name(dtype)
    return tuple(t.shape) == tuple(shape) and dtype_name(t.dtype) == want.removeprefix("torch.")


def _pick(name: str, hits: set[Hit], idx: _ModelNames, shapes: Mapping | None) -> Hit | None:
    """The single tensor ``hits`` name, or raise :class:`AmbiguousFQNError`."""
    by_tensor: dict[int, list[str]] = {}
    for i, eager in sorted(hits):
        by_tensor.setdefault(i, []).append(eager)
    if not by_tensor:
        return None
    if len(by_tensor) > 1 and shapes is not None and name in shapes:
        fits = {i: n for i, n in by_tensor.items() if _same_spec(idx.tensors[i].tensor, shapes[name])}
        if not fits:
            raise AmbiguousFQNError(
                name, [n for ns in by_tensor.values() for n in ns], "and no candidate has its shape/dtype"
            )
        by_tensor = fits
    if len(by_tensor) > 1:
        raise AmbiguousFQNError(name, [n for ns in by_tensor.values() for n in ns])
    ((i, eager_names),) = by_tensor.items()
    # Several spellings of one tensor: prefer its canonical FQN.
    fqn = idx.tensors[i].fqn
    return i, fqn if fqn in eager_names else eager_names[0]


# dynamo's Source names (``VariableBuilder``): ``L['self']._modules['inner']._parameters['w']``,
# ``.__dict__['_modules']['x']`` for a wrapper's child, attribute / index spellings ``.inner[0]``.
_SOURCE_ROOT = re.compile(r"^L\[(['\"])([A-Za-z_]\w*)\1\]")
_SOURCE_STEP = re.compile(
    r"""\.(?:_modules|_parameters|_buffers|__dict__\[(['"])_modules\1\])\[(['"])([^'"\[\]]+)\2\]"""
    r"""|\.([A-Za-z_]\w*)|\[(\d+)\]|\[(['"])([^'"\[\]]+)\6\]"""
)


def _source_to_dotted(name: str, receivers: set[str]) -> str | None:
    """The dotted name a dynamo Source name spells (invertible: every step is explicit), or None
    when ``name`` is not one rooted at the model's receiver (``L['x']`` is a user input)."""
    m = _SOURCE_ROOT.match(name)
    if m is None or m.group(2) not in receivers:
        return None
    segs, pos = [], m.end()
    while pos < len(name):
        step = _SOURCE_STEP.match(name, pos)
        if step is None:
            return None
        segs.append(next(g for g in (step.group(3), step.group(4), step.group(5), step.group(7)) if g is not None))
        pos = step.end()
    return ".".join(segs) if segs else None


def _resolve_one(name: str, idx: _ModelNames, shapes: Mapping | None) -> Hit | None:
    dotted = _source_to_dotted(name, idx.receivers)
    if dotted is not None:
        _check_flat_param(dotted)
        return _pick(name, idx.dotted_hits(dotted), idx, shapes)
    _check_flat_param(name)
    if name in idx.dotted or "." in name:
        return _pick(name, idx.dotted_hits(name), idx, shapes)
    return _pick(name, idx.flat_hits(name), idx, shapes)


class _PrefixIndex:
    """Where a prefix can be added: ``{module path suffix: [paths P with P.suffix a module]}`` and
    ``{tensor leaf: [owner module paths]}``, built once, so each leftover name looks up its few
    candidate prefixes instead of trying every module of the model (quadratic: minutes for a few
    thousand keys)."""

    def __init__(self, idx: _ModelNames):
        paths = sorted({canonical_fqn(p, idx.model) for p, _ in idx.model.named_modules() if p} - {""})
        self.by_suffix: dict[str, set[str]] = {}
        for path in paths:
            segs = path.split(".")
            for i in range(1, len(segs)):
                self.by_suffix.setdefault(".".join(segs[i:]), set()).add(".".join(segs[:i]))
        known = set(paths)
        self.by_leaf: dict[str, set[str]] = {}
        for n in idx.known:
            owner, _, leaf = n.rpartition(".")
            if owner in known:
                self.by_leaf.setdefault(leaf, set()).add(owner)

    def candidates(self, name: str) -> set[str]:
        """Module paths ``P`` under which ``P.name`` may resolve (checked by the caller): the longest
        leading part of the name's module path (after wrapper / parametrization rules, which keep
        its leading segments) that some ``P.part`` spells."""
        out: set[str] = set()
        forms = {name, canonical_fqn(name)}
        for f in forms:
            segs = f.split(".")
            if len(segs) == 1:
                out |= self.by_leaf.get(segs[0], set())
                continue
            for j in range(len(segs) - 1, 0, -1):
                found = self.by_suffix.get(".".join(segs[:j]))
                if found:
                    out |= found
                    break
        return out


def _prefix_ops(name: str, idx: _ModelNames, where: _PrefixIndex) -> dict[tuple[str, str], str]:
    """Container-prefix edits that make ``name`` resolve: ``{(op, prefix): edited name}``.

    Only dotted rules apply to the edited name (a flattened name never gains a prefix)."""
    ops: dict[tuple[str, str], str] = {}
    segs = name.split(".")
    for k in range(1, len(segs)):
        prefix, rest = ".".join(segs[:k]), ".".join(segs[k:])
        if idx.dotted_hits(rest):
            ops[("strip", prefix)] = rest
    for path in sorted(where.candidates(name)):
        added = f"{path}.{name}"
        if idx.dotted_hits(added):
            ops[("add", path)] = added
    return ops


def resolve_report(
    names: Iterable[str],
    model: nn.Module,
    shapes: Mapping[str, ShapeSpec] | None = None,
    *,
    spelling: Spelling = "eager",
    errors: Literal["raise", "report"] = "raise",
) -> NameMatch:
    """Map source tensor ``names`` to ``model``'s eager FQNs; report what is left on both sides.

    Args:
        names: source names in any spelling listed in this module's docstring.
        model: the target ``nn.Module`` (wrappers allowed); its names, shapes and dtypes decide.
        shapes: optional ``{source name: (shape tuple in elements, dtype)}`` of the source tensors;
            used only to choose among several candidates.
        spelling: ``"eager"`` returns canonical eager FQNs (an eager alias stays itself);
            ``"state_dict"`` returns the key ``model.state_dict()`` uses for that tensor (e.g.
            ``module.x`` for a ``DataParallel`` target), or the eager FQN of a non-persistent buffer.
        errors: ``"raise"`` (below), or ``"report"``: each name's refusal goes to ``refused`` and
            the other names still resolve together (one pass over the model, however many names
            are refused); several prefixes fitting refuses the names they fit; two names on one
            target are both mapped (the caller compares their values).

    Raises (``errors="raise"``):
        FlatParamError: a name is an FSDP1 ``_flat_param`` (no eager FQN exists).
        AmbiguousFQNError: a name matches tensors of more than one eager FQN (after ``shapes``),
            or several container prefixes fit equally.
        FQNCollisionError: two source names resolve to the same target name.
    """
    if isinstance(names, str) or not isinstance(model, nn.Module):
        raise TypeError("resolve takes an iterable of names (not one string) and an nn.Module model")
    names = list(names)
    idx = _ModelNames(model)
    hits: dict[str, Hit] = {}
    unresolved: list[str] = []
    refused: dict[str, FQNError] = {}
    for name in names:
        try:
            hit = _resolve_one(name, idx, shapes)
        except FQNError as e:
            if errors == "raise":
                raise
            refused[name] = e
            continue
        if hit is None:
            unresolved.append(name)
        else:
            hits[name] = hit
    try:
        prefix = _apply_prefix(unresolved, idx, shapes, hits)
    except _PrefixAmbiguous as e:
        if errors == "raise":
            raise e.error from None
        prefix = None
        refused.update((n, e.error) for n in e.names)
    unexpected = sorted(n for n in unresolved if n not in hits and n not in refused)

    out = NameMatch(unexpected=unexpected, prefix=prefix, refused=refused)
    sd_names = _state_dict_names(model, idx) if spelling == "state_dict" else {}
    owners: dict[str, str] = {}
    for name in names:
        if name not in hits:
            continue
        i, eager = hits[name]
        target = sd_names.get((i, eager), sd_names.get((i, None), eager)) if sd_names else eager
        if target in owners and errors == "raise":
            raise FQNCollisionError(target, [owners[target], name])
        owners[target] = name
        out.mapping[name] = target
        if idx.tensors[i].kind == TensorKind.non_persistent_buffer:
            out.non_persistent.append(name)
    reached = {i for i, _ in hits.values()}
    for i, t in enumerate(idx.tensors):
        if i not in reached and t.kind != TensorKind.non_persistent_buffer:
            out.missing.append(sd_names.get((i, t.fqn), t.fqn) if sd_names else t.fqn)
    out.missing.sort()
    return out


class _PrefixAmbiguous(Exception):
    """Several container prefixes fit every leftover name: ``error`` for ``names``."""

    def __init__(self, error: AmbiguousFQNError, names: list[str]):
        self.error, self.names = error, names


def _apply_prefix(
    unresolved: list[str], idx: _ModelNames, shapes: Mapping | None, hits: dict[str, Hit]
) -> tuple[str, str] | None:
    """Apply the one container prefix every resolvable leftover name agrees on (B23, B28)."""
    # A single-segment key (``weight`` of a bare Linear) may need a prefix too.
    dotted = list(unresolved)
    if not dotted:
        return None
    where = _PrefixIndex(idx)
    per_name = {n: _prefix_ops(n, idx, where) for n in dotted}
    per_name = {n: ops for n, ops in per_name.items() if ops}
    if not per_name:
        return None
    # Ops that every resolvable leftover name accepts.
    common = set.intersection(*(set(ops) for ops in per_name.values()))
    if not common:
        return None  # the keys disagree: no prefix is applied, they stay unexpected
    if len(common) > 1:
        first = next(iter(per_name))
        raise _PrefixAmbiguous(
            AmbiguousFQNError(
                first, [per_name[first][op] for op in common], "several container prefixes fit every key"
            ),
            list(per_name),
        )
    (op,) = common
    for n, ops in per_name.items():
        hit = _pick(n, idx.dotted_hits(ops[op]), idx, shapes)
        if hit is not None:
            hits[n] = hit
    return op


def _state_dict_names(model: nn.Module, idx: _ModelNames) -> dict[tuple[int, str | None], str]:
    """``{(tensor index, eager name): state_dict key}`` by tensor identity (``keep_vars=True``)."""
    by_id = {id(t.tensor): i for i, t in enumerate(idx.tensors)}
    out: dict[tuple[int, str | None], str] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        i = by_id.get(id(value))
        if i is None:
            continue
        out.setdefault((i, None), key)
        names = idx.tensors[i].names
        for eager in names:
            if key == eager or canonical_fqn(key, model) == eager:
                out.setdefault((i, eager), key)
    return out


def resolve(
    names: Iterable[str],
    model: nn.Module,
    shapes: Mapping[str, ShapeSpec] | None = None,
    *,
    spelling: Spelling = "eager",
) -> dict[str, str]:
    """``{source name: eager FQN of model}`` for every name; see :func:`resolve_report`.

    An eager name maps to itself; a name reaching a non-persistent buffer is resolved too (the
    caller decides). Target tensors no name reaches are not an error here.

    Raises:
        UnknownNameError: a name matches no tensor of ``model`` (lists the closest eager FQNs).
        FlatParamError, AmbiguousFQNError, FQNCollisionError: as in :func:`resolve_report`.
    """
    rep = resolve_report(names, model, shapes, spelling=spelling)
    if rep.unexpected:
        known = sorted({n for t in eager_tensors(model) for n in t.names})
        raise UnknownNameError(rep.unexpected[0], known, "tensor name for this model")
    return rep.mapping


Resolution = NameMatch
match_names = resolve_report

__all__ = ["NameMatch", "Resolution", "match_names", "resolve", "resolve_report"]
