"""The ``fqnckpt`` command line (also ``python -m checkpoint``): inspect, migrate, verify, diff.

Each subcommand is a :class:`Command` in ``_COMMANDS`` (add one with :func:`register_command`,
e.g. the ``demo`` command). ``--json`` goes before or after the subcommand; long work shows a tqdm
bar on stderr (only after one second). Exit codes: 0 success, 1 a check found a mismatch, 2 bad
input: one line on stderr naming the file, key and flag at fault (with ``--json`` also one JSON
object on stdout: ``error``, ``message``, ``file``, ``key``, ``flag``). No exception leaves as a
traceback (``FQNCKPT_TRACEBACK=1`` prints it, for bug reports).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

# Only light modules at the top: --version / --help must not import torch; each
# command imports what it needs when it runs.
from .common import check_trust, emit, human, load_model, plural
from .errors import EXIT_BAD_INPUT, BadInput, Parser, UsageError, cli_spelling, one_line, report_error

EXIT_OK, EXIT_MISMATCH = 0, 1
__all__ = ["EXIT_OK", "EXIT_MISMATCH", "EXIT_BAD_INPUT", "BadInput", "cli_spelling", "main", "build_parser"]
_SHORT_TABLE_ROWS = 10  # renamed keys shown by `migrate` without --keys


@dataclass(frozen=True)
class Command:
    """A subcommand: ``add_arguments(parser)`` declares its options, ``run(args)`` returns the exit code."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


_COMMANDS: dict[str, Command] = {}


def register_command(cmd: Command) -> Command:
    """Add a subcommand to ``fqnckpt`` (e.g. ``demo``). Raises ``ValueError`` if the name is taken."""
    if cmd.name in _COMMANDS:
        raise ValueError(f"fqnckpt command {cmd.name!r} is already registered")
    _COMMANDS[cmd.name] = cmd
    return cmd


# -- inspect ---------------------------------------------------------------------------------------------
def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="checkpoint file or directory (any supported format)")
    p.add_argument("--keys", action="store_true", help="list every key with shape and dtype")
    p.add_argument("--key", help="container inside a pickle ('model', 'optimizer', 'a/b')")
    p.add_argument(
        "--trust", action="append", default=[], metavar="MODULE.NAME", help="trusted pickle global"
    )


def _inspect(args: argparse.Namespace) -> int:
    from ..plan.schemes import naming_schemes
    from .parts import adapter_dir_config, extra_state_summary, fqnckpt_parts, manager_root, open_inspected, part_index

    check_trust(args)
    root = manager_root(args.path)
    if root is not None:
        return _inspect_manager(args, root)
    parts = fqnckpt_parts(args.path)
    path, key = args.path, args.key
    if parts is not None:  # one of fqnckpt's checkpoints: --key names a part, each part is shown
        if key not in (None, "model", "optimizer"):
            raise BadInput(f"--key {key!r}: {args.path} is an fqnckpt checkpoint; its parts are model and "
                           "optimizer", flag="--key", file=args.path)  # fmt: skip
        path, key = part_index(parts, key or "model", "--key"), None
    with open_inspected(path, key=key, trusted=args.trust) as src:
        keys = src.keys()
        dtypes = Counter(str(src.spec(k).dtype).removeprefix("torch.") for k in keys)
        # Counts are of tensors: a key with two wrapper segments is one tensor of naming "wrapper".
        per_key = {k: naming_schemes(k) for k in keys}
        schemes = Counter(kind for v in per_key.values() for kind in {x.split(":")[0] for x in v})
        wrappers = Counter(
            seg for v in per_key.values() for seg in {x.split(":", 1)[1] for x in v if ":" in x}
        )
        per_file = src.per_file()  # true figures: a DCP tensor split over files counts in each
        opt = src.optimizer
        data = {
            "path": str(args.path),
            "format": src.format,
            "container": src.container,
            "files": src.files,
            "tensors": len(keys),
            "total_bytes": src.total_bytes(),
            "dtypes": dict(dtypes),
            "naming_schemes": dict(schemes),  # scheme -> number of tensors
            "layout": _layout_of(keys, path, src),  # framework layout and version (checkpoint.layout_versions)
            "wrapper_segments": dict(wrappers),  # segment -> number of tensors
            "per_file": per_file,
            "skipped": src.skipped,
            "notes": src.notes,
            "optimizer": opt is not None,
            "optimizer_state": {
                "container": opt.container,
                "tensors": len(opt.state),
                "params": len(opt.param_ids),
                "param_groups": len(opt.groups),
                "bytes": sum(src.nbytes(k) for k in opt.state),
            }
            if opt is not None
            else None,
        }
        src_extra = extra_state_summary(None, src) if parts is None else None
        if args.keys:
            data["keys"] = {
                k: {"shape": list(src.spec(k).shape), "dtype": str(src.spec(k).dtype)} for k in keys
            }
    lines = [
        f"{data['path']}: {src.format}" + (f" (container {src.container!r})" if src.container else ""),
        f"  tensors: {len(keys)}, {human(data['total_bytes'])} ({data['total_bytes']} bytes)",
        f"  dtypes: {', '.join(f'{d} x{n}' for d, n in sorted(dtypes.items()))}",
        "  naming (tensors): "
        + (", ".join(f"{s} x{n}" for s, n in sorted(schemes.items())) or "plain eager names"),
    ]
    if data["layout"]:
        lines.append(f"  layout: {data['layout']}")
    if wrappers:
        lines.append(
            f"  wrapper segments (tensors): {', '.join(f'{w} x{n}' for w, n in sorted(wrappers.items()))}"
        )
    part_lines = _inspect_parts(parts, data) if parts is not None and args.key is None else []
    lines.append("  files:")
    lines += [f"    {f}: {plural(v['tensors'], 'tensor')}, {human(v['bytes'])}" for f, v in sorted(per_file.items())]
    if part_lines:  # the other parts' files, as their indexes (the model index's record) name them
        opt_files = data["parts"]["optimizer"]["per_file"] if data["parts"]["optimizer"] else {}
        lines += [f"    {f}: {plural(v['tensors'], 'tensor')}, {human(v['bytes'])}" for f, v in sorted(opt_files.items())]
        lines += [f"    {f}: {human(n)}" for f, n in (data["parts"]["extra_state_files"] or {}).items()]
    if opt is not None:
        o = data["optimizer_state"]
        lines.append(f"  optimizer state: {plural(o['tensors'], 'tensor')} for {plural(o['params'], 'param')}, "
                     f"{plural(o['param_groups'], 'param group')}, {human(o['bytes'])}")  # fmt: skip
    if src.skipped:
        lines.append(f"  non-tensor entries skipped: {sorted(src.skipped)}")
    lines += [f"  note: {n}" for n in src.notes]
    if part_lines:
        lines += part_lines
    elif parts is None and (adapter_cfg := adapter_dir_config(args.path)) is not None:  # peft's save_pretrained
        data["adapter_config"] = adapter_cfg
        lines.append("  adapter config: " + ", ".join(f"{k}={v}" for k, v in adapter_cfg.items()))
    elif src_extra:
        data["extra_state"] = src_extra
        lines.append(f"  extra state: {len(src_extra)} {'entry' if len(src_extra) == 1 else 'entries'}")
        lines += [f"    {k}: {v}" for k, v in src_extra.items()]
    lines += _inspect_leftovers(args.path, data)
    if args.keys:
        lines.append("  keys:")
        lines += [f"    {k}  {tuple(v['shape'])}  {v['dtype']}" for k, v in data["keys"].items()]
    other = _other_layout(args.path, keys, data["layout"], args.trust)
    if other is not None:
        data["transformers_names"] = other
        changed = other["from"]
        lines.append(f"  {other['as']} ({other['model']} of config.json, by {other['recipe']}): {other['tensors']} tensors, "
                     f"{len(changed)} of them named or built otherwise, from {len({k for v in changed.values() for k in v})} keys")  # fmt: skip
        lines += [f"    {t} <- {src[0]}" + (f" (+{len(src) - 1} more)" if len(src) > 1 else "")
                  for t, src in (changed.items() if args.keys else list(changed.items())[:3])]  # fmt: skip
        if not args.keys and len(changed) > 3:
            lines.append(f"    ... {len(changed) - 3} more (--keys lists all)")
    emit(args, data, "\n".join(lines))
    return EXIT_OK


def _other_layout(path: str, keys: Sequence[str], layout: str | None, trust: list[str]) -> dict | None:
    """For a checkpoint of a transformers MoE model with its ``config.json`` beside it, the names
    of its other layout by the model's own conversion mapping: per-expert keys (what
    ``save_pretrained`` writes) -> the names the model holds in memory, as ``load`` and
    ``from_pretrained`` read them; fused keys (``save(layout="memory")``) -> what
    ``save_pretrained`` writes. ``{"as", "model", "recipe", "tensors", "from": {name: [stored
    keys]}}`` for the names that differ; None otherwise (transformers is imported only for these
    two layouts). Headers only."""
    if layout not in ("hf per-expert", "hf fused-experts (transformers 5)"):
        return None
    where = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        with open(os.path.join(where, "config.json"), "rb") as f:
            config = json.loads(f.read())
    except (OSError, ValueError):
        return None
    from ..convert.hf_files import meta_model_from_config
    from ..convert.reader import open_pretrained, pretrained_conversion
    from ..convert.transformers_rules import changes_keys, pretrained_recipe

    try:
        model = meta_model_from_config(config, f"{where}: config.json")
        if layout == "hf per-expert":
            how, rec = "in memory", pretrained_conversion(keys, model, set(model.state_dict()))
        else:
            how, rec = "as save_pretrained writes it", pretrained_recipe(model).inverse()
            rec = rec if changes_keys(rec, keys) else None
    except ValueError:  # transformers missing, no model of its own for this config, a mapping not translated
        return None
    if rec is None:
        return None
    with open_pretrained(path, rec, model, trusted_globals=trust) as converted:
        plan = converted.plan
        changed = {t: g.source_keys() for g in plan.groups for t in g.targets}
        changed.update({t: [s] for t, s in plan.unchanged.items() if t != s})
        return {"as": how, "model": type(model).__name__, "recipe": rec.name, "tensors": len(converted.keys()),
                "from": dict(sorted(changed.items()))}  # fmt: skip


def _layout_of(keys, path, src) -> str | None:
    """:func:`~checkpoint.layout_versions.detect_layout` of the names; Meta's shards (a directory of
    them, one ``consolidated.NN.pth``, or a pickle beside Meta's ``params.json``) are Meta's
    layout, not torchtitan's legacy names they share, with the split a directory shows."""
    from ..layout_versions import detect_layout
    from ..sources.sniffing import META_SHARD
    from .parts import MetaShards

    found = detect_layout(keys)
    if found not in ("meta / torchtitan legacy", "torchtitan legacy"):  # Meta's names are torchtitan's legacy ones
        return found
    if isinstance(src, MetaShards):
        return f"meta {src.split or 'llama2 / llama3'} ({len(src.files)} model-parallel shards)"
    p = Path(os.fspath(path))
    if META_SHARD.fullmatch(p.name) or (p.is_file() and (p.parent / "params.json").is_file()):
        return "meta (one model-parallel shard: the same in Llama 2 and 3)"
    return found


def _inspect_parts(parts, data: dict) -> list[str]:
    """``data["parts"]`` and the text lines for the optimizer and extra state of an fqnckpt
    checkpoint (``data["parts"]["optimizer"]["per_file"]`` and ``["extra_state_files"]``: their
    files, which ``inspect`` lists with the model's)."""
    from .parts import adapter_config_summary, extra_state_files, extra_state_summary, optimizer_summary

    opt, extra = optimizer_summary(parts), extra_state_summary(parts)
    data["parts"] = {"model": os.path.basename(parts.model), "optimizer": opt, "extra_state": extra,
                     "extra_state_files": extra_state_files(parts)}  # fmt: skip
    adapter_cfg = adapter_config_summary(parts)
    if parts.adapter is not None:
        data["parts"]["adapter"] = os.path.basename(parts.adapter)
    if adapter_cfg is not None:
        data["parts"]["adapter_config"] = adapter_cfg
    lines = [f"  parts: model ({os.path.basename(parts.model)})"
             + (f", optimizer ({opt['index']})" if opt else "") + (", extra state (extra_state.json)" if extra else "")
             + (", peft adapter (adapter_model.safetensors + adapter_config.json)" if parts.adapter else "")]  # fmt: skip
    if opt is not None:
        lines.append(f"  optimizer: {opt['optimizer_class']}, {plural(opt['tensors'], 'state tensor')} "
                     f"({', '.join(opt['state_slots'])}) for {plural(opt['params'], 'param')}, "
                     f"{plural(len(opt['param_groups']), 'param group')}, {human(opt['bytes'])}")  # fmt: skip
        for i, g in enumerate(opt["param_groups"]):
            hyper = ", ".join(f"{k}={v}" for k, v in g.items() if k != "params")
            lines.append(f"    group {i}: {plural(g['params'], 'param')}; {hyper}")
    if adapter_cfg is not None:
        lines.append("  adapter config: " + ", ".join(f"{k}={v}" for k, v in adapter_cfg.items()))
    if extra is not None:
        lines.append(f"  extra state: {len(extra)} {'entry' if len(extra) == 1 else 'entries'}")
        lines += [f"    {k}: {v}" for k, v in extra.items()]
    return lines


def _inspect_leftovers(path, data: dict) -> list[str]:
    """``data["leftovers"]`` and text lines: what killed saves left at a checkpoint, local or at a
    URL (staging manifests and directories, the objects they name, incomplete multipart uploads),
    removed by the next save there (:func:`checkpoint.storage.commit.leftovers`)."""
    from ..storage.location import resolve, store_of
    from ..storage.commit import leftovers

    left = leftovers(store_of(resolve(path)))
    if not any(left.values()):
        return []
    data["leftovers"] = left
    return [
        f"  leftovers of unfinished saves (removed by the next save here or by fqnckpt recover): {len(left['staging'])} staging manifest(s) / dir(s) "
        f"{left['staging']}, objects {left['objects']}, incomplete multipart uploads {left['uploads']}"
    ]


def _inspect_manager(args: argparse.Namespace, root) -> int:
    """``inspect`` of a CheckpointManager root: its steps, the latest, and foreign entries."""
    steps = [{"step": s, "path": d, "complete": ok} for s, d, ok in root.steps]
    data = {"path": args.path, "format": "checkpoint-manager", "steps": steps, "latest": root.latest,
            "foreign": root.foreign}  # fmt: skip
    done = sum(ok for *_, ok in root.steps)
    lines = [f"{args.path}: CheckpointManager root, {plural(len(steps), 'step')} ({done} complete); "
             f"latest: {root.latest or 'none'}"]  # fmt: skip
    lines += [f"  {os.path.basename(s['path'])}: {'complete' if s['complete'] else 'INCOMPLETE'}" for s in steps]
    if root.foreign:
        lines.append(f"  not steps (foreign names, never loaded or removed by the manager): {root.foreign}")
    if root.latest:
        lines.append(f"  inspect a step: fqnckpt inspect {root.latest}")
    emit(args, data, "\n".join(lines))
    return EXIT_OK


# -- migrate ---------------------------------------------------------------------------------------------
def _migrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="source checkpoint (pickle, safetensors, index, DCP directory)")
    p.add_argument("dst", help="output checkpoint directory")
    p.add_argument(
        "--model",
        metavar="MODULE:CALLABLE",
        help="called with no arguments, returns the target eager nn.Module (meta device is enough), "
        "e.g. checkpoint.cli.demo:minilm_model; the current directory is importable",
    )
    p.add_argument("--fqn-map", metavar="FILE", help="FQN map JSON saved at capture time")
    p.add_argument(
        "--rule", action="append", default=[], metavar="REGEX=REPL", help="renaming rule (repeatable)"
    )
    p.add_argument("--key", help="container inside a pickle ('model', 'optimizer', 'a/b')")
    p.add_argument(
        "--trust", action="append", default=[], metavar="MODULE.NAME", help="trusted pickle global"
    )
    p.add_argument("--dry-run", action="store_true", help="plan and report, write nothing")
    p.add_argument("--keys", action="store_true", help="list every renamed key, not the first few")
    p.add_argument("--max-shard-size", default="5GB", help="bytes per output file, e.g. 5GB, 500MB")
    p.add_argument(
        "--allow-unresolved", action="store_true", help="drop (and report) keys that do not resolve"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at DST")
    p.add_argument("--recipe", help="convert tensors between layouts ('fqnckpt recipes' lists them; 'auto')")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=N", help="model dimension for --recipe")
    p.add_argument("--layout", metavar="VERSION", help="layout version --recipe writes or expects "
                   "(e.g. legacy for torchtitan's old names, llama2 for Meta's column-split shards; "
                   "'fqnckpt recipes' lists them): the same as --recipe NAME@VERSION")


def _check_migrate_flags(args: argparse.Namespace):
    """Validate the flags that need no checkpoint before anything is read: ``--rule``,
    ``--max-shard-size``, ``--fqn-map`` (returns the compiled rules and the loaded FQN map)."""
    from ..errors import CheckpointError
    from ..migrating import load_fqn_map, compile_rules
    from ..storage.format import parse_size

    try:
        rules = compile_rules(args.rule)
    except ValueError as e:
        raise BadInput(str(e), flag="--rule") from None
    try:
        parse_size(args.max_shard_size)
    except ValueError as e:
        raise BadInput(str(e), flag="--max-shard-size") from None
    check_trust(args)
    fmap = None
    if args.fqn_map is not None:
        try:
            fmap = load_fqn_map(args.fqn_map)
        except (CheckpointError, OSError, ValueError) as e:
            raise BadInput(one_line(str(e)), flag="--fqn-map", file=args.fqn_map) from None
    return [(pat, repl) for pat, _, repl in rules], fmap


def _migrate(args: argparse.Namespace) -> int:
    from ..errors import CheckpointExistsError, MigrationError
    from ..migrating import migrate

    rules, fmap = _check_migrate_flags(args)
    if getattr(args, "layout", None) and not args.recipe:
        raise BadInput("--layout names the layout version of a --recipe conversion", flag="--layout")
    model = load_model(args.model) if args.model else None
    if args.recipe:
        return importlib.import_module("checkpoint.cli.convert").run_migrate(args, model)
    try:
        report = migrate(
            args.src, args.dst, model=model, fqn_map=fmap, rules=rules, key=args.key,
            dry_run=args.dry_run, max_shard_size=args.max_shard_size, allow_unresolved=args.allow_unresolved,
            trusted_globals=args.trust, overwrite=args.overwrite, progress=None,
        )  # fmt: skip
        code = EXIT_OK
    except CheckpointExistsError as e:  # the message names the API's overwrite=True; say the flag
        raise BadInput(cli_spelling(str(e)), flag="--overwrite", file=e.path) from None
    except MigrationError as e:
        report, code = e.report, EXIT_MISMATCH
        print(f"fqnckpt migrate: {one_line(cli_spelling(str(e)))}", file=sys.stderr)
    c = report.counts()
    lines = [
        f"{report.source} ({report.source_format}) -> {report.destination or '(dry run, nothing written)'}",
        f"  renamed {c['renamed']}, unchanged {c['unchanged']}, unresolved {c['unresolved']}, "
        f"shape-mismatched {c['shape_mismatched']}, missing {c['missing']}",
    ]
    renamed = [e for e in report.entries if e.source != e.target]
    if renamed:
        lines.append("  renamed:")
        shown = renamed if args.keys else renamed[:_SHORT_TABLE_ROWS]
        width = max(len(e.source) for e in shown)
        lines += [f"    {e.source:<{width}} -> {e.target}   [{'; '.join(e.decided_by)}]" for e in shown]
        if len(shown) < len(renamed):
            lines.append(f"    ... {len(renamed) - len(shown)} more (--keys lists all; --json for machines)")
    for u in report.unresolved:
        lines.append(f"  unresolved: {u.source}: {cli_spelling(u.reason)}")
    for col in report.collisions:
        lines.append(f"  collision: {col.sources} -> {col.target}")
    for m in report.shape_mismatched:
        lines.append(
            f"  shape mismatch: {m.source} {tuple(m.source_shape)} vs model {m.target} {tuple(m.model_shape)}"
        )
    if report.missing:
        lines.append(f"  missing (model keys absent from the source): {report.missing}")
    if report.ignorable:
        lines.append(f"  ignorable (non-persistent buffers, dropped): {report.ignorable}")
    lines += [f"  note: {n}" for n in report.notes]
    emit(args, report.model_dump(mode="json") | {"ok": report.ok}, "\n".join(lines))
    return code


# -- verify ----------------------------------------------------------------------------------------------
def _verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="checkpoint directory or file (any supported format)")


def _verify(args: argparse.Namespace) -> int:
    from ..verifying import verify
    from .parts import manager_root

    root = manager_root(args.path)
    if root is not None:  # many checkpoints, one per step: say which one to verify
        hint = f"verify a step: fqnckpt verify {root.latest}" if root.latest else "it holds no complete step"
        raise BadInput(f"{args.path} is a CheckpointManager root ({plural(len(root.steps), 'step')}), not one "
                       f"checkpoint; {hint}", file=str(args.path))  # fmt: skip
    rep = verify(args.path, progress=None)
    algos = sorted({f.algorithm for f in rep.files if f.expected_digest is not None})
    what = (
        f"{'/'.join(algos) or 'digests'} checked" if rep.checksummed else "structure checked, not checksummed"
    )
    head = (
        f"{args.path}: {'OK' if rep.ok else 'MISMATCH'} ({rep.format}, {plural(rep.tensors, 'tensor')}, "
        f"{plural(len(rep.files), 'file')}, {what})"
    )
    if not rep.ok and not rep.files and not rep.tensors:  # refused while opening: nothing was hashed
        head = f"{args.path}: MISMATCH ({rep.format}, refused while opening it, before any tensor was checked)"
    lines = [head] + [f"  problem: {p}" for p in rep.problems] + [f"  note: {n}" for n in rep.notes]
    names = [f.file for f in rep.files]
    if names:
        lines.append(f"  files: {', '.join(names[:12])}" + (f" (+{len(names) - 12} more; --json lists all)" if len(names) > 12 else ""))
    emit(args, rep.model_dump(mode="json") | {"ok": rep.ok, "bad_files": rep.bad_files}, "\n".join(lines))
    return EXIT_OK if rep.ok else EXIT_MISMATCH


register_command(
    Command(
        "inspect", "format, files, sizes, dtypes and naming schemes of a checkpoint", _inspect_args, _inspect
    )
)
register_command(
    Command("migrate", "rewrite a checkpoint under eager FQNs, with a report", _migrate_args, _migrate)
)
register_command(
    Command(
        "verify", "check a checkpoint's structure, and its checksums where recorded", _verify_args, _verify
    )
)



# -- recover ---------------------------------------------------------------------------------------------
def _recover_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="checkpoint directory or URL a save into was interrupted")


def _recover(args: argparse.Namespace) -> int:
    from ..errors import CheckpointNotFoundError
    from ..storage.opening import recover

    done = recover(args.path)
    local = None if "://" in str(args.path) else str(args.path)
    if local is not None and not os.path.isdir(local) and not done["completed"] and not done["removed"]:
        # Nothing here and nothing left beside it by a save: a mistyped path, not a clean checkpoint.
        raise CheckpointNotFoundError(local, "not a directory, and no save into it left anything to recover")
    lines = [f"{args.path}: completed the interrupted commit {c}" for c in done["completed"]]
    lines += [f"{args.path}: removed {n} (left by a save that can no longer commit)" for n in done["removed"]]
    emit(args, {"path": args.path, **done}, "\n".join(lines) or f"{args.path}: nothing of an interrupted save to recover")
    return EXIT_OK


register_command(
    Command(
        "recover", "complete a save interrupted after its commit point and remove what dead saves left, "
        "as the next save there would (only entries a marker or manifest of fqnckpt names)", _recover_args, _recover,
    )
)  # fmt: skip


def _lazy_command(name: str, help: str, module: str, add: str, run: str) -> None:
    """A subcommand whose module is imported only when it is used (e.g. it pulls in transformers)."""
    register_command(
        Command(
            name,
            help,
            lambda p: getattr(importlib.import_module(module), add)(p),
            lambda a: getattr(importlib.import_module(module), run)(a),
        )
    )


_lazy_command("diff", "compare keys, shapes, dtypes and values (by hash) of two checkpoints, part by part",
              "checkpoint.cli.diff", "add_arguments", "run")  # fmt: skip

_lazy_command("recipes", "list the built-in conversion recipes (migrate --recipe NAME)",
              "checkpoint.cli.convert", "recipes_args", "run_recipes")  # fmt: skip
# demo: see checkpoint/cli/demo.py
_lazy_command("demo", "the main job on a real model (all-MiniLM-L6-v2 or a built-in one), with a table of checks",
              "checkpoint.cli.demo", "add_arguments", "run_demo")  # fmt: skip


# -- entry point -----------------------------------------------------------------------------------------
def version() -> str:
    """``fqnckpt X.Y.Z (torch A.B.C)`` from the installed distributions' metadata (no torch import)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    def v(name: str) -> str:
        try:
            return dist_version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"fqnckpt {v('fqnckpt')} (torch {v('torch')}, python {sys.version.split()[0]})"


class _VersionAction(argparse.Action):
    """``--version``: the distributions' metadata is read only when asked (~0.1 s of imports)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        help = help or "show program's version number and exit"
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version())  # stdout, as argparse's own version action
        parser.exit()


def build_parser(arguments_for: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The argparse parser with one subparser per registered :class:`Command`.

    ``arguments_for``: the commands whose options are declared (default: all). ``main`` passes only
    the command on the line, so ``--help`` / ``--version`` import no command's module."""
    parser = Parser(
        prog="fqnckpt",
        description="PyTorch checkpoints in eager FQNs",
        epilog="exit codes: 0 ok, 1 a check found a mismatch, 2 bad input. 'fqnckpt COMMAND --help' for options.",
    )
    parser.add_argument("--version", action=_VersionAction)
    parser.add_argument(
        "--json", action="store_true", default=False, help="machine-readable output on stdout"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for cmd in _COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        if arguments_for is not None and cmd.name not in arguments_for:
            continue
        # SUPPRESS: the subcommand's default must not undo a --json given before it.
        p.add_argument(
            "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
        )
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fqnckpt``; returns the exit code (0 ok, 1 mismatch found, 2 bad input, 130 interrupted).

    Every exception is reported as one line naming the file / key / flag (see module docstring);
    only ``SystemExit`` from ``--help`` / ``--version`` passes through.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv[: argv.index("--")] if "--" in argv else "--json" in argv
    command = next((a for a in argv if a in _COMMANDS), "")
    try:
        args = build_parser(arguments_for={command}).parse_args(argv)
    except UsageError as e:
        return report_error(e, argparse.Namespace(), command or "", as_json)
    for name in _PATH_ARGS:  # a quoted "~/run" reaches us unexpanded: as every API call, expanded here
        value = getattr(args, name, None)
        if isinstance(value, str) and value.startswith("~"):
            setattr(args, name, os.path.expanduser(value))
    try:
        code = args._run(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:
        print(f"fqnckpt {args.command}: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - every error becomes one line (DCP's derive from BaseException)
        try:
            return report_error(e, args, args.command, args.json)
        except BrokenPipeError:
            return _stdout_closed()


_PATH_ARGS = ("path", "src", "dst", "a", "b")


def _stdout_closed() -> int:
    """The reader of stdout went away (``fqnckpt inspect ... | head``): not an error of ours. As
    Python's documentation of SIGPIPE advises, stdout is pointed at /dev/null so that the flush at
    exit cannot raise again; 141 (128 + SIGPIPE) is what a shell tool stopped by the pipe returns."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a file descriptor (captured): nothing will flush it
        pass
    return 141


if __name__ == "__main__":
    sys.exit(main())
