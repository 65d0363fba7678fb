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
import hashlib
import importlib
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str) if args.json else text)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _plural(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


# -- inspect ---------------------------------------------------------------------------------------------
def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="checkpoint file or directory (any supported format)")
    p.add_argument("--keys", action="store_true", help="list every key with shape and dtype")
    p.add_argument("--key", help="container inside a pickle ('model', 'optimizer', 'a/b')")
    p.add_argument(
        "--trust", action="append", default=[], metavar="MODULE.NAME", help="trusted pickle global"
    )


def _inspect(args: argparse.Namespace) -> int:
    from ..migrate import naming_schemes
    from ..sources import open_source

    _check_trust(args)
    with open_source(args.path, key=args.key, trusted_globals=args.trust) as src:
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
        if args.keys:
            data["keys"] = {
                k: {"shape": list(src.spec(k).shape), "dtype": str(src.spec(k).dtype)} for k in keys
            }
    lines = [
        f"{data['path']}: {src.format}" + (f" (container {src.container!r})" if src.container else ""),
        f"  tensors: {len(keys)}, {_human(data['total_bytes'])} ({data['total_bytes']} bytes)",
        f"  dtypes: {', '.join(f'{d} x{n}' for d, n in sorted(dtypes.items()))}",
        "  naming (tensors): "
        + (", ".join(f"{s} x{n}" for s, n in sorted(schemes.items())) or "plain eager names"),
    ]
    if wrappers:
        lines.append(
            f"  wrapper segments (tensors): {', '.join(f'{w} x{n}' for w, n in sorted(wrappers.items()))}"
        )
    lines.append("  files:")
    lines += [f"    {f}: {v['tensors']} tensors, {_human(v['bytes'])}" for f, v in sorted(per_file.items())]
    if opt is not None:
        o = data["optimizer_state"]
        lines.append(f"  optimizer state: {o['tensors']} tensors for {o['params']} params, {o['param_groups']} "
                     f"param groups, {_human(o['bytes'])}")  # fmt: skip
    if src.skipped:
        lines.append(f"  non-tensor entries skipped: {sorted(src.skipped)}")
    lines += [f"  note: {n}" for n in src.notes]
    if args.keys:
        lines.append("  keys:")
        lines += [f"    {k}  {tuple(v['shape'])}  {v['dtype']}" for k, v in data["keys"].items()]
    _emit(args, data, "\n".join(lines))
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


def load_model(spec: str):
    """``"pkg.mod:factory"`` -> ``factory()`` (an ``nn.Module``). The current directory is importable.

    Raises:
        BadInput: malformed spec, import failure, or the callable does not return an ``nn.Module``.
    """
    import torch.nn as nn

    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise BadInput(f"--model {spec!r} must be MODULE:CALLABLE", flag="--model")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise BadInput(f"--model {spec!r}: {e}", flag="--model") from None
    except Exception as e:  # noqa: BLE001 - the module itself raises / does not parse: no traceback
        raise BadInput(
            f"--model {spec!r}: importing {mod_name} failed: {type(e).__name__}: {e}", flag="--model"
        ) from None
    try:
        model = obj() if callable(obj) and not isinstance(obj, nn.Module) else obj
    except Exception as e:  # noqa: BLE001 - e.g. a class that needs a config: say so, no traceback
        raise BadInput(
            f"--model {spec!r}: calling {attr}() failed: {type(e).__name__}: {e}", flag="--model"
        ) from None
    if not isinstance(model, nn.Module):
        raise BadInput(f"--model {spec!r} gave a {type(model).__name__}, not an nn.Module", flag="--model")
    return model


def _check_trust(args: argparse.Namespace) -> None:
    """Each ``--trust MODULE.NAME`` must import (before any pickle is looked at)."""
    from ..sources.readers import resolve_globals

    for g in getattr(args, "trust", None) or []:
        try:
            resolve_globals([g])
        except Exception:  # noqa: BLE001 - any import failure is the flag's fault
            raise BadInput(
                f"--trust {g!r}: cannot import it (give a class or function as MODULE.NAME)",
                flag="--trust",
                key=g,
            ) from None


def _check_migrate_flags(args: argparse.Namespace):
    """Validate the flags that need no checkpoint before anything is read: ``--rule``,
    ``--max-shard-size``, ``--fqn-map`` (returns the compiled rules and the loaded FQN map)."""
    from ..errors import CheckpointError
    from ..migrate import _load_fqn_map, compile_rules
    from ..storage.format import parse_size

    try:
        rules = compile_rules(args.rule)
    except ValueError as e:
        raise BadInput(str(e), flag="--rule") from None
    try:
        parse_size(args.max_shard_size)
    except ValueError as e:
        raise BadInput(str(e), flag="--max-shard-size") from None
    _check_trust(args)
    fmap = None
    if args.fqn_map is not None:
        try:
            fmap = _load_fqn_map(args.fqn_map)
        except (CheckpointError, OSError, ValueError) as e:
            raise BadInput(one_line(str(e)), flag="--fqn-map", file=args.fqn_map) from None
    return [(pat, repl) for pat, _, repl in rules], fmap


def _migrate(args: argparse.Namespace) -> int:
    from ..errors import CheckpointExistsError, MigrationError
    from ..migrate import migrate

    rules, fmap = _check_migrate_flags(args)
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
    _emit(args, report.model_dump(mode="json") | {"ok": report.ok}, "\n".join(lines))
    return code


# -- verify ----------------------------------------------------------------------------------------------
def _verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="checkpoint directory or file (any supported format)")


def _verify(args: argparse.Namespace) -> int:
    from ..verify import verify

    rep = verify(args.path, progress=None)
    algos = sorted({f.algorithm for f in rep.files if f.expected_digest is not None})
    what = (
        f"{'/'.join(algos) or 'digests'} checked" if rep.checksummed else "structure checked, not checksummed"
    )
    head = (
        f"{args.path}: {'OK' if rep.ok else 'MISMATCH'} ({rep.format}, {_plural(rep.tensors, 'tensor')}, "
        f"{_plural(len(rep.files), 'file')}, {what})"
    )
    lines = [head] + [f"  problem: {p}" for p in rep.problems] + [f"  note: {n}" for n in rep.notes]
    _emit(args, rep.model_dump(mode="json") | {"ok": rep.ok, "bad_files": rep.bad_files}, "\n".join(lines))
    return EXIT_OK if rep.ok else EXIT_MISMATCH


# -- diff ------------------------------------------------------------------------------------------------
def _diff_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="first checkpoint (any supported format)")
    p.add_argument("b", help="second checkpoint (any supported format)")
    p.add_argument("--no-values", action="store_true", help="compare keys, shapes and dtypes only")
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
    """sha256 of a tensor's bytes (C order); its dtype and shape are compared separately."""
    import torch

    t = t.detach().contiguous()
    return hashlib.sha256(t.view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b"").hexdigest()


def _diff_names(src, model, canonical: bool) -> tuple[dict[str, str], list[str]]:
    """``{name compared: source key}`` and the keys that resolve to no name (with ``model``).
    With ``model`` names go through ``migrate``'s resolution and end at the canonical FQN of
    their tied group, so a side storing one alias matches a side storing another."""
    from fqn import canonical_fqn, eager_tensors

    keys = src.keys()
    if model is None:
        mapped = {k: canonical_fqn(k) if canonical else k for k in keys}
        unresolved: list[str] = []
    else:
        from ..migrate import plan_names

        specs = {k: (tuple(src.spec(k).shape), src.spec(k).dtype) for k in keys}
        planned, bad = plan_names(keys, specs, model=model, fqn_map=None, rules=[])
        canon = {n: t.fqn for t in eager_tensors(model) for n in t.names}
        mapped = {k: canon.get(t, t) for k, (t, _) in planned.items()}
        unresolved = sorted(u.source for u in bad)
    out: dict[str, str] = {}
    for k, name in mapped.items():
        if name in out:  # two keys of one side name one tensor: compare the first, report the rest
            unresolved.append(f"{k} (same tensor as {out[name]})")
            continue
        out[name] = k
    return out, unresolved


def _diff(args: argparse.Namespace) -> int:
    from ..progress import progress_bar
    from ..sources import open_source

    _check_trust(args)
    model = load_model(args.model) if args.model else None
    with (
        open_source(args.a, trusted_globals=args.trust) as a,
        open_source(args.b, trusted_globals=args.trust) as b,
    ):
        na, bad_a = _diff_names(a, model, args.canonical)
        nb, bad_b = _diff_names(b, model, args.canonical)
        ka, kb = set(na), set(nb)
        common = sorted(ka & kb)
        shape = [k for k in common if tuple(a.spec(na[k]).shape) != tuple(b.spec(nb[k]).shape)]
        dtype = [k for k in common if a.spec(na[k]).dtype != b.spec(nb[k]).dtype]
        values: list[str] = []
        same_meta = [k for k in common if k not in shape and k not in dtype]
        if not args.no_values:
            total = sum(a.nbytes(na[k]) for k in same_meta)
            with progress_bar(total, "diff", None) as bar:
                for k in same_meta:  # one tensor of each side in memory at a time
                    if tensor_digest(a.get(na[k])) != tensor_digest(b.get(nb[k])):
                        values.append(k)
                    bar.update(a.nbytes(na[k]))
    naming = (
        f"eager FQNs of {args.model}"
        if model is not None
        else "canonical names"
        if args.canonical
        else "raw names"
    )
    data = {
        "a": args.a,
        "b": args.b,
        "names": naming,
        "common": len(common),
        "only_in_a": sorted(ka - kb),
        "only_in_b": sorted(kb - ka),
        "unresolved_in_a": bad_a,
        "unresolved_in_b": bad_b,
        "shape_differs": shape,
        "dtype_differs": dtype,
        "value_differs": values,
        "compared_values": not args.no_values,
        "values_compared": 0 if args.no_values else len(same_meta),
    }
    fields = ("only_in_a", "only_in_b", "unresolved_in_a", "unresolved_in_b", "shape_differs", "dtype_differs",
              "value_differs")  # fmt: skip
    same = not any(data[f] for f in fields)
    data["same"] = same
    if args.no_values:
        compared = "values not compared (--no-values): keys, shapes and dtypes only"
    else:
        compared = f"values compared by sha256 for {len(same_meta)} tensors"
    lines = [
        f"{args.a} vs {args.b}: {'same' if same else 'DIFFERENT'} "
        f"({len(common)} common tensors by {naming}; {compared})"
    ]
    for f in fields:
        if data[f]:
            lines.append(f"  {f.replace('_', ' ')} ({len(data[f])}): {data[f][:20]}")
    if not common and (ka or kb) and model is None and not args.canonical:
        lines.append(
            "  hint: --canonical strips wrapper segments; --model MODULE:CALLABLE resolves to eager FQNs"
        )
    _emit(args, data, "\n".join(lines))
    return EXIT_OK if same else EXIT_MISMATCH


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
register_command(
    Command("diff", "compare keys, shapes, dtypes and values (by hash) of two checkpoints", _diff_args, _diff)
)


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


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with one subparser per registered :class:`Command`."""
    parser = Parser(
        prog="fqnckpt",
        description="PyTorch checkpoints in eager FQNs",
        epilog="exit codes: 0 ok, 1 a check found a mismatch, 2 bad input. 'fqnckpt COMMAND --help' for options.",
    )
    parser.add_argument("--version", action="version", version=version())
    parser.add_argument(
        "--json", action="store_true", default=False, help="machine-readable output on stdout"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for cmd in _COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
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
        args = build_parser().parse_args(argv)
    except UsageError as e:
        return report_error(e, argparse.Namespace(), command or "", as_json)
    try:
        return args._run(args)
    except KeyboardInterrupt:
        print(f"fqnckpt {args.command}: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - every error becomes one line (DCP's derive from BaseException)
        return report_error(e, args, args.command, args.json)


if __name__ == "__main__":
    sys.exit(main())
