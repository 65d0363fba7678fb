"""``fqnckpt diff``: compare two checkpoints part by part (model, optimizer, extra state).

Tensors are matched by name (raw, ``--canonical`` or the eager FQNs of ``--model``; with a
transformers ``--model``, a side in transformers' on-disk layout, e.g. a MoE model's per-expert
keys, is read through the model's own conversion mapping, as ``load`` reads it), then shape,
dtype and, unless ``--no-values``, the sha256 of their bytes in C order (every dtype the formats
hold: 0-dim, bool, complex, conjugate / negative views resolved first, float8). One tensor under
several names is one tensor: the names of a tied group on one side (GPT-2's ``lm_head.weight``
and ``transformer.wte.weight``) match one stored tensor on the other; fqnckpt's index lists the
names a tensor is saved under (``alias_groups``); two names of one side with the same bytes are
one tensor, with different bytes a conflict.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from .common import check_trust, emit, load_model
from .errors import BadInput
from .parts import Parts, adapter_config_summary, extra_state_entries, fqnckpt_parts, part_index

EXIT_OK, EXIT_MISMATCH = 0, 1
_FIELDS = ("only_in_a", "only_in_b", "unresolved_in_a", "unresolved_in_b", "conflicting_in_a",
           "conflicting_in_b", "shape_differs", "dtype_differs", "value_differs")  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="first checkpoint (any supported format)")
    p.add_argument("b", help="second checkpoint (any supported format)")
    p.add_argument("--no-values", action="store_true", help="compare keys, shapes and dtypes only")
    p.add_argument(
        "--part",
        choices=("model", "optimizer", "extra_state", "adapter", "all"),
        default="all",
        help="what to compare (default all: every part either side holds)",
    )
    names = p.add_mutually_exclusive_group()
    names.add_argument(
        "--model",
        metavar="MODULE:CALLABLE",
        help="resolve both sides' keys to this model's eager FQNs first (as migrate --model does)",
    )
    names.add_argument(
        "--canonical", action="store_true", help="strip wrapper segments (_orig_mod., module., ...) first"
    )
    p.add_argument(
        "--trust", action="append", default=[], metavar="MODULE.NAME", help="trusted pickle global"
    )


def tensor_digest(t) -> str:
    """sha256 of a tensor's bytes in C order; dtype and shape are compared separately. Conjugate
    and negative views are resolved (their bytes are the values they show), 0-dim tensors are
    one element; every dtype is hashed as raw bytes (bool, complex, float8 included)."""
    import torch

    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if not t.numel():
        return hashlib.sha256(b"").hexdigest()
    return hashlib.sha256(t.cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


@dataclass
class _Side:
    """One side of one tensor part: ``names`` maps each compared name to the source keys holding
    it (several when one side stores one tensor under several names)."""

    src: Any
    names: dict[str, list[str]]
    unresolved: list[str]
    digests: dict[str, str] = field(default_factory=dict)

    def digest(self, key: str) -> str:
        if key not in self.digests:
            self.digests[key] = tensor_digest(self.src.get(key))
        return self.digests[key]


def _resolver(model, canonical: bool) -> Callable[[list[str], Any], tuple[dict[str, str], list[str]]]:
    """``resolve(keys, src) -> ({key: name compared}, unresolved keys)``. With ``model`` names go
    through ``migrate``'s resolution and end at the canonical FQN of their tied group, so a side
    storing one alias matches a side storing another."""
    from fqn import canonical_fqn, eager_tensors

    if model is None:
        return lambda keys, src: ({k: canonical_fqn(k) if canonical else k for k in keys}, [])
    from ..plan.names import plan_names

    canon = {n: t.fqn for t in eager_tensors(model) for n in t.names}

    def resolve(keys, src):
        specs = {k: (tuple(src.spec(k).shape), src.spec(k).dtype) for k in keys}
        planned, bad = plan_names(keys, specs, model=model, fqn_map=None, rules=[])
        return {k: canon.get(t, t) for k, (t, _) in planned.items()}, sorted(u.source for u in bad)

    return resolve


def _group(mapped: dict[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for k, name in mapped.items():
        out.setdefault(name, []).append(k)
    return out


def _model_side(src, parts: Parts | None, resolve, by_model: bool) -> _Side:
    keys = src.keys()
    mapped, unresolved = resolve(keys, src)
    names = _group(mapped)
    if parts is not None and not by_model:
        # The names fqnckpt saved a tensor under besides the stored one (``alias_groups``); with
        # --model every name of a tied group resolves to the group's canonical FQN anyway.
        stored = set(keys)
        for group in parts.alias_groups:
            key = next((n for n in group if n in stored), None)
            if key is not None:
                aliases, _ = resolve([n for n in group if n not in stored], src)
                for name in aliases.values():
                    names.setdefault(name, [key])
    return _Side(src, names, unresolved)


def _split_state_key(key: str) -> tuple[str, str]:
    """``state.<fqn>.<slot>`` -> (fqn, slot) (slot names hold no dot)."""
    fqn, _, slot = key.removeprefix("state.").rpartition(".")
    return fqn, slot


def _optimizer_side(src, parts: Parts | None, fqn_name: Callable[[str], str]) -> _Side | None:
    """fqnckpt's optimizer part (keys ``state.<fqn>.<slot>``), or the optimizer state a pickle /
    DCP source holds (named by its parameter names when it has them, else by its ids)."""
    names: dict[str, list[str]] = {}
    if parts is not None:
        for k in src.keys():
            fqn, slot = _split_state_key(k)
            names.setdefault(f"state.{fqn_name(fqn)}.{slot}", []).append(k)
        return _Side(src, names, [])
    opt = src.optimizer
    if opt is None:
        return None
    pos = {pid: i for i, pid in enumerate(opt.param_ids)}
    for k, (pid, slot) in opt.state.items():
        fqn = opt.param_names[pos[pid]] if opt.param_names and pid in pos else str(pid)
        names.setdefault(f"state.{fqn_name(fqn)}.{slot}", []).append(k)
    return _Side(src, names, [])


def _compare(a: _Side, b: _Side, values: bool, on_bytes: Callable[[int], None]) -> dict:
    out: dict[str, Any] = {f: [] for f in _FIELDS}
    out["unresolved_in_a"], out["unresolved_in_b"] = list(a.unresolved), list(b.unresolved)
    out["tied_in_a"], out["tied_in_b"] = [], []
    for side, tag in ((a, "a"), (b, "b")):
        for name, keys in list(side.names.items()):
            if len(keys) < 2:
                continue
            specs = {(tuple(side.src.spec(k).shape), side.src.spec(k).dtype) for k in keys}
            if len(specs) == 1 and (not values or len({side.digest(k) for k in keys}) == 1):
                out[f"tied_in_{tag}"].append(sorted(keys))  # one tensor under several names
            else:
                out[f"conflicting_in_{tag}"].append(f"{name}: {sorted(keys)}")
    ka, kb = set(a.names), set(b.names)
    common = sorted(ka & kb)
    out["only_in_a"], out["only_in_b"] = sorted(ka - kb), sorted(kb - ka)
    same_meta = []
    for name in common:
        sa, sb = a.src.spec(a.names[name][0]), b.src.spec(b.names[name][0])
        if tuple(sa.shape) != tuple(sb.shape):
            out["shape_differs"].append(name)
        elif sa.dtype != sb.dtype:
            out["dtype_differs"].append(name)
        else:
            same_meta.append(name)
    if values:
        for name in same_meta:  # one tensor of each side in memory at a time
            if a.digest(a.names[name][0]) != b.digest(b.names[name][0]):
                out["value_differs"].append(name)
            on_bytes(a.src.nbytes(a.names[name][0]))
    out["common"] = len(common)
    out["values_compared"] = len(same_meta) if values else 0
    out["same"] = not any(out[f] for f in _FIELDS)
    return out


def _groups_json(parts: Parts | None, src, fqn_name: Callable[[str], str]) -> str | None:
    """The optimizer's param groups as canonical JSON (params by compared name), or None."""
    if parts is not None:
        meta = parts.optimizer_meta
        if meta is None:
            return None
        groups = [g.model_dump() | {"params": [fqn_name(p) for p in g.params]} for g in meta.param_groups]
        return json.dumps({"class": meta.optimizer_class, "groups": groups}, sort_keys=True, default=repr)
    opt = src.optimizer
    if opt is None:
        return None
    return json.dumps({"groups": opt.groups}, sort_keys=True, default=repr)


def _extra_state(parts: Parts | None, src) -> dict[str, str] | None:
    """``{entry name: canonical JSON of the entry}`` of a checkpoint's extra state (shared and
    per-rank entries of fqnckpt's, a DCP checkpoint's non-model entries: one classification,
    :func:`~.parts.extra_state_entries`), or None."""
    try:
        entries = extra_state_entries(parts, src)
    except (TypeError, ValueError) as e:  # a DCP entry extra state cannot hold
        raise BadInput(f"{src.path}: {e}; compare the other parts with --part model / optimizer",
                       file=str(src.path)) from None  # fmt: skip
    if entries is None:
        return None
    return {k: json.dumps(e.model_dump(mode="json"), sort_keys=True) for k, e in entries.items()}


def _compare_extra(a: dict[str, str], b: dict[str, str]) -> dict:
    out: dict[str, Any] = {f: [] for f in _FIELDS}
    out["only_in_a"], out["only_in_b"] = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    common = sorted(a.keys() & b.keys())
    out["value_differs"] = [k for k in common if a[k] != b[k]]
    out["common"], out["values_compared"] = len(common), len(common)
    out["same"] = not any(out[f] for f in _FIELDS)
    return out


def _absent(on: str) -> dict:
    return {"same": False, "present_only_in": on}


def _open(path: str, part: str, parts: Parts | None, trust: list[str]):
    from ..sources import open_source

    if parts is not None:
        return open_source(part_index(parts, part, "--part"), trusted_globals=trust)
    return open_source(path, trusted_globals=trust)


def run(args: argparse.Namespace) -> int:
    """Compare ``args.a`` and ``args.b``; exit 0 when every part compared is the same, else 1."""
    from fqn import canonical_fqn

    from ..progress import progress_bar

    check_trust(args)
    model = load_model(args.model) if args.model else None
    resolve = _resolver(model, args.canonical)
    if model is not None:
        from fqn import eager_tensors

        canon = {n: t.fqn for t in eager_tensors(model) for n in t.names}
        fqn_name = lambda f: canon.get(canonical_fqn(f), canonical_fqn(f))  # noqa: E731
    else:
        fqn_name = canonical_fqn if args.canonical else (lambda f: f)
    pa, pb = fqnckpt_parts(args.a), fqnckpt_parts(args.b)
    results: dict[str, dict] = {}
    with ExitStack() as stack:
        ma = stack.enter_context(_open(args.a, "model", pa, args.trust))
        mb = stack.enter_context(_open(args.b, "model", pb, args.trust))
        wanted = ("model", "optimizer", "extra_state", "adapter") if args.part == "all" else (args.part,)
        sides: dict[str, tuple[Any, Any]] = {}
        converted: dict[str, str] = {}
        if "model" in wanted:
            za, zb = (_in_model_layout(stack, src, path, model, tag, converted, args.trust)
                      for src, path, tag in ((ma, args.a, "a"), (mb, args.b, "b")))  # fmt: skip
            sides["model"] = (_model_side(za, pa if za is ma else None, resolve, model is not None),
                              _model_side(zb, pb if zb is mb else None, resolve, model is not None))  # fmt: skip
        if "optimizer" in wanted:
            oa = stack.enter_context(_open(args.a, "optimizer", pa, args.trust)) if pa and pa.optimizer else ma
            ob = stack.enter_context(_open(args.b, "optimizer", pb, args.trust)) if pb and pb.optimizer else mb
            sa = _optimizer_side(oa, pa, fqn_name) if pa is None or pa.optimizer else None
            sb = _optimizer_side(ob, pb, fqn_name) if pb is None or pb.optimizer else None
            sides["optimizer"] = (sa, sb)
            ga, gb = _groups_json(pa, ma, fqn_name), _groups_json(pb, mb, fqn_name)
        if "adapter" in wanted:  # peft's adapter file beside a PEFT model's base, by peft's names
            sides["adapter"] = tuple(
                _model_side(stack.enter_context(_open(x, "adapter", p, args.trust)), None, resolve, False)
                if p is not None and p.adapter else None
                for x, p in ((args.a, pa), (args.b, pb))
            )
        total = sum(s[0].src.nbytes(k[0]) for s in sides.values() if s[0] is not None and s[1] is not None
                    for k in s[0].names.values()) if not args.no_values else 0  # fmt: skip
        with progress_bar(total, "diff", None) as bar:
            for part, (sa, sb) in sides.items():
                if sa is None and sb is None:
                    continue
                if sa is None or sb is None:
                    results[part] = _absent("b" if sa is None else "a")
                    continue
                results[part] = _compare(sa, sb, not args.no_values, bar.update)
        if "adapter" in results and "present_only_in" not in results["adapter"]:
            r = results["adapter"]  # the saved peft configs: the same tensors under another config compute otherwise
            ca, cb = adapter_config_summary(pa) or {}, adapter_config_summary(pb) or {}
            r["config_differs"] = {k: [ca.get(k), cb.get(k)] for k in dict.fromkeys([*ca, *cb]) if ca.get(k) != cb.get(k)}
            r["same"] = r["same"] and not r["config_differs"]
        if "optimizer" in results and "present_only_in" not in results["optimizer"]:
            r = results["optimizer"]
            r["param_groups_compared"] = ga is not None and gb is not None and (pa is None) == (pb is None)
            r["param_groups_differ"] = r["param_groups_compared"] and ga != gb
            r["same"] = r["same"] and not r["param_groups_differ"]
        if "extra_state" in wanted:
            ea, eb = _extra_state(pa, ma), _extra_state(pb, mb)
            if ea is not None and eb is not None:
                results["extra_state"] = _compare_extra(ea, eb)
            elif ea is not None or eb is not None:
                results["extra_state"] = _absent("a" if ea is not None else "b")
    if args.part != "all" and args.part not in results:
        raise BadInput(f"neither {args.a} nor {args.b} has a {args.part} part", flag="--part")
    if converted and "model" in results:
        results["model"]["converted"] = converted
    return _report(args, model, results)


def _in_model_layout(stack: ExitStack, src, path: str, model, tag: str, converted: dict[str, str], trust: list[str]):
    """``src``, or with a transformers ``--model`` whose own conversion mapping changes ``src``'s
    keys (a ``save_pretrained`` directory of a MoE model: per-expert keys), the checkpoint read
    through that conversion, in the model's names (``converted[tag]`` says which), so that it
    compares with a checkpoint of the model's in-memory layout."""
    if model is None:
        return src
    from fqn import eager_tensors

    from ..convert.reader import open_pretrained, pretrained_conversion

    rec = pretrained_conversion(src.keys(), model, {n for t in eager_tensors(model) for n in t.names})
    if rec is None:
        return src
    converted[tag] = f"{rec.name} (transformers' conversion mapping of the model)"
    return stack.enter_context(open_pretrained(path, rec, model, trusted_globals=trust))


def _report(args: argparse.Namespace, model, results: dict[str, dict]) -> int:
    naming = (
        f"eager FQNs of {args.model}" if model is not None else "canonical names" if args.canonical else "raw names"
    )
    same = all(r["same"] for r in results.values())
    data: dict[str, Any] = {"a": args.a, "b": args.b, "names": naming, "part": args.part, "same": same,
                            "compared_values": not args.no_values, "parts": results}  # fmt: skip
    if "model" in results and "common" in results["model"]:
        data |= {k: v for k, v in results["model"].items() if k != "same"}  # the fields of one part
    m = results.get("model", {})
    if args.no_values:
        compared = "values not compared (--no-values): keys, shapes and dtypes only"
    else:
        compared = f"values compared by sha256 for {sum(r.get('values_compared', 0) for r in results.values())} tensors"
    what = f"{m['common']} common tensors" if "common" in m else ", ".join(results) or "nothing"
    lines = [f"{args.a} vs {args.b}: {'same' if same else 'DIFFERENT'} ({what} by {naming}; {compared})"]
    for tag, how in m.get("converted", {}).items():
        lines.append(f"  {tag} read as the model holds it: {how}")
    for part, r in results.items():
        pad = "  " if part == "model" else "    "
        if "present_only_in" in r:
            lines.append(f"  {part}: only in {r['present_only_in']}")
            continue
        if part != "model":
            lines.append(f"  {part}: {'same' if r['same'] else 'DIFFERENT'} ({r['common']} common, "
                         f"{r['values_compared']} values compared)")  # fmt: skip
        for f in _FIELDS:
            if r[f]:
                lines.append(f"{pad}{f.replace('_', ' ')} ({len(r[f])}): {r[f][:20]}")
        for tag in ("a", "b"):
            if r.get(f"tied_in_{tag}"):
                lines.append(f"{pad}one tensor under several names in {tag}: {r[f'tied_in_{tag}'][:5]}")
        if r.get("config_differs"):
            shown = "; ".join(f"{k}: {a} vs {b}" for k, (a, b) in r["config_differs"].items())
            lines.append(f"{pad}adapter config differs: {shown}")
        if r.get("param_groups_differ"):
            lines.append(f"{pad}param groups differ (hyper-parameters or parameters)")
    if m.get("common") == 0 and (m.get("only_in_a") or m.get("only_in_b")) and model is None and not args.canonical:
        lines.append("  hint: --canonical strips wrapper segments; --model MODULE:CALLABLE resolves to eager FQNs")
    emit(args, data, "\n".join(lines))
    return EXIT_OK if same else EXIT_MISMATCH


__all__ = ["add_arguments", "run", "tensor_digest"]
