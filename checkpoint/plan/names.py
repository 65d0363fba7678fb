"""The one name resolver: stored keys -> target FQNs, for every source and entry point.

Each stored key goes through, in order: a saved ``fqn_map`` (names recorded at capture time), the
caller's ``rules`` (regexes applied to whole segments), wrapper-segment removal
(``fqn.canonical_fqn``), then, with a ``model``, ``fqn.resolve`` against the model's real names,
shapes and dtypes (dynamo / export flattened spellings, container prefixes, weight_norm). Nothing
is guessed: what does not resolve is reported.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.nn as nn
from pydantic import ValidationError

import fqn
from fqn import FQNMap, canonical_fqn, eager_tensors
from fqn.rules import WRAPPER_SEGMENTS

from ..errors import CorruptCheckpointError
from ..migration_report import Unresolved
from ..reports import LoadReport
from ..state import Entry, ModuleState
from ..storage.reader import CheckpointReader
from .schemes import naming_schemes  # noqa: F401 - re-exported (checkpoint.migrating)
from .values import check_tied_values, stored_key


def compile_rules(rules: Iterable[tuple[str, str] | str]) -> list[tuple[str, re.Pattern, str]]:
    """``[(regex, replacement)]`` (or ``"REGEX=REPL"`` strings) compiled so a match starts and ends
    on segment boundaries (``layer`` never matches inside ``layers``).

    Raises:
        ValueError: a rule is not ``(regex, replacement)`` or its regex does not compile.
    """
    out = []
    for rule in rules:
        if isinstance(rule, str):
            pat, sep, repl = rule.rpartition("=")
            if not sep:
                raise ValueError(f"rule {rule!r} is not REGEX=REPLACEMENT")
        else:
            pat, repl = rule
        try:
            rx = re.compile(rf"(?:(?<![^.])|(?=\.))(?:{pat})(?:(?![^.])|(?<=\.))")
        except re.error as e:
            raise ValueError(f"rule regex {pat!r} does not compile: {e}") from None
        try:
            rx.sub(repl, "")  # parses the replacement template (bad group references) up front
        except re.error as e:
            raise ValueError(f"rule {pat!r}: replacement {repl!r} is invalid: {e}") from None
        out.append((pat, rx, repl))
    return out


def _apply_rules(name: str, rules: Sequence[tuple[str, re.Pattern, str]]) -> tuple[str, list[str]]:
    used = []
    for pat, rx, repl in rules:
        new = rx.sub(repl, name)
        if new != name:
            new = ".".join(s for s in new.split(".") if s)  # a removed segment leaves no empty one
            used.append(f"rule {pat!r}")
            name = new
    return name, used


def load_fqn_map(fqn_map: FQNMap | str | os.PathLike | None) -> FQNMap | None:
    if fqn_map is None or isinstance(fqn_map, FQNMap):
        return fqn_map
    try:
        return FQNMap.from_json(Path(fqn_map).read_bytes())
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"])) or "document"
        raise CorruptCheckpointError(str(fqn_map), f"not an FQN map JSON: {where}: {err['msg']}") from None
    except OSError as e:  # missing, a directory, unreadable: ours, naming the file
        raise CorruptCheckpointError(str(fqn_map), f"cannot read the FQN map: {e.strerror or e}") from None


def _resolve(names: list[str], model: nn.Module, shapes: dict) -> tuple[dict[str, str], list[Unresolved]]:
    """``fqn.resolve_report`` over all names at once (a container prefix must fit them all), each
    name's refusal (ambiguity, flat parameter) reported by name while the others still resolve:
    one pass over the model however many names are refused (name by name it was quadratic)."""
    rep = fqn.resolve_report(names, model, shapes, errors="report")
    bad = [Unresolved(source=n, reason="matches no tensor of the model") for n in rep.unexpected]
    for n, e in rep.refused.items():
        bad.append(Unresolved(source=n, reason=str(e), candidates=list(getattr(e, "candidates", None) or [])))
    return dict(rep.mapping), bad


def _resolve_label(before: str, after: str) -> str:
    kinds = naming_schemes(before)
    if "dynamo" in kinds or "export" in kinds:
        return "fqn.resolve: flattened name matched by model names/shapes"
    if (
        "parametrization" in kinds
        or "weight_norm_legacy" in kinds
        or after.endswith(("weight_g", "weight_v"))
    ):
        return "fqn.resolve: weight_norm spelling of the model"
    if after.endswith(before) or before.endswith(after):
        return "fqn.resolve: container prefix"
    return "fqn.resolve"


def plan_names(
    keys: Sequence[str],
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    *,
    model: nn.Module | None,
    fqn_map: FQNMap | None,
    rules: Sequence[tuple[str, re.Pattern, str]],
) -> tuple[dict[str, tuple[str, list[str]]], list[Unresolved]]:
    """``{source key: (eager key, decided_by)}`` and the keys that map to nothing."""
    out: dict[str, tuple[str, list[str]]] = {}
    bad: list[Unresolved] = []
    pending: dict[str, tuple[str, list[str]]] = {}  # post-rule name -> (source key, steps)
    eager_names = {n for t in eager_tensors(model) for n in t.names} if model is not None else None
    for key in keys:
        if fqn_map is not None and key in fqn_map:
            rec = fqn_map.record(key)
            out[key] = (rec.fqn, [] if rec.fqn == key else [f"fqn_map ({rec.provenance.value})"])
            continue
        name, steps = _apply_rules(key, rules)
        try:
            canon = canonical_fqn(name, model)
        except fqn.FlatParamError as e:
            bad.append(Unresolved(source=key, reason=str(e)))
            continue
        if canon != name:
            steps.append("wrapper segments")
        if eager_names is None:
            if "dynamo" in naming_schemes(canon):
                bad.append(
                    Unresolved(
                        source=key, reason="flattened dynamo name: pass model= or fqn_map= to resolve it"
                    )
                )
            else:
                out[key] = (canon, steps)
        elif canon in eager_names:
            out[key] = (canon, steps)
        else:
            pending[canon] = (key, steps)
    if pending:
        shapes = {n: specs[src] for n, (src, _) in pending.items()}
        found, failed = _resolve(list(pending), model, shapes)
        for n, target in found.items():
            src, steps = pending[n]
            out[src] = (target, [*steps, _resolve_label(n, target)] if target != n else steps)
        reported = set()
        for u in failed:
            bad.append(Unresolved(source=pending[u.source][0], reason=u.reason, candidates=u.candidates))
            reported.add(u.source)
        for n in pending:
            if n not in found and n not in reported:
                bad.append(Unresolved(source=pending[n][0], reason="fqn.resolve returned no name for it"))
    return out, bad


def match_stored(reader: CheckpointReader, state: ModuleState, model: torch.nn.Module | None, path: str):
    """Checkpoint keys per target entry: (report, [(entry, key)]).

    A key stored under a name of the entry (or a spelling of it that the *model* resolves, e.g.
    ``_orig_mod.weight`` where the model says ``_orig_mod`` is a wrapper) fills it; when several
    do, their values must be equal (:func:`check_tied_values`). Only when none does, a stored key
    whose index alias group names the entry fills it (an alias group never overrides stored values).
    Keys still unmatched go through :func:`plan_names` against the model (container prefixes such
    as ``model.`` / ``backbone.``, flattened spellings) for every source, unless the reader named
    its keys after the model already (``reader.resolve_names = False``, a conversion); one that
    reaches a non-persistent buffer is ignorable. Linear in the number of keys and entries.
    """
    by_name = state.by_name()
    report = LoadReport(path=path)
    groups = {g[0]: g for g in reader.alias_groups}
    direct: dict[int, list[str]] = {}
    via_group: dict[int, str] = {}
    unknown: list[str] = []
    ignorable: set[str] = set()
    for key in reader.keys():
        found = False
        e = by_name.get(key)
        if e is None and model is not None:
            try:
                canon = canonical_fqn(key, model)
            except fqn.FlatParamError:
                raise fqn.FlatParamError(stored_key(reader, key), f"{path} ({reader.file_of(key)})") from None
            e = by_name.get(canon)
            if canon in state.non_persistent:
                ignorable.add(key)
        if e is not None:
            direct.setdefault(id(e), []).append(key)
            found = True
        for n in groups.get(key, ())[1:]:
            g = by_name.get(n)
            if g is not None:
                via_group.setdefault(id(g), key)
                found = True
        if not found:
            unknown.append(key)
    if unknown and model is not None and getattr(reader, "resolve_names", True):
        # Keys no name of the target reaches, from any source (an fqnckpt / Hugging Face checkpoint
        # too: a base model's keys into a model with a head, B28): container prefixes, flattened
        # spellings, resolved against the model by the one resolver.
        specs = {k: (tuple(reader.spec(k).shape), reader.spec(k).dtype) for k in unknown}
        planned, _bad = plan_names(unknown, specs, model=model, fqn_map=None, rules=())
        for key, (target, _) in planned.items():
            e = by_name.get(target)
            if e is not None:
                direct.setdefault(id(e), []).append(key)
            elif target in state.non_persistent:
                ignorable.add(key)  # a non-persistent buffer under a prefix is still ignorable
        unknown = [k for k in unknown if not (k in planned and planned[k][0] in by_name)]
    pairs: list[tuple[Entry, str]] = []
    for e in state.entries:
        keys = direct.get(id(e))
        if keys:
            if len(keys) > 1:
                order = {n: i for i, n in enumerate(e.names)}
                keys.sort(key=lambda k: (order.get(k, len(order)), k))  # the entry's own names first
                check_tied_values(reader, keys, path)
            key = keys[0]
        else:
            key = via_group.get(id(e))
        if key is None:
            report.missing_keys.append(e.fqn)
            continue
        if key != e.fqn:
            report.filled_from[e.fqn] = key
        pairs.append((e, key))
    for key in unknown:
        ignore = key in state.non_persistent or key in ignorable
        (report.ignorable_keys if ignore else report.unexpected_keys).append(key)
    return report, pairs
