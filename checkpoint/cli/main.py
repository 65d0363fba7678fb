"""The ``fqnckpt`` command line (also ``python -m checkpoint``): inspect, migrate, verify, diff.

Each subcommand is a :class:`Command` in ``_COMMANDS`` (add one with :func:`register_command`,
e.g. the ``demo`` command). Every command takes ``--json``; long work shows a tqdm bar on stderr
(only after one second). Exit codes: 0 success, 1 a check found a mismatch, 2 bad input (the
message names the file and key).
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

from tqdm import tqdm

EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT = 0, 1, 2
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


class BadInput(Exception):
    """Bad command-line input (exit code 2)."""


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str) if args.json else text)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


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

    with open_source(args.path, key=args.key, trusted_globals=args.trust) as src:
        keys = src.keys()
        dtypes = Counter(str(src.spec(k).dtype).removeprefix("torch.") for k in keys)
        schemes = Counter(
            s.split(":")[0] if s.startswith("wrapper") else s for k in keys for s in naming_schemes(k)
        )
        wrappers = Counter(
            s.split(":", 1)[1] for k in keys for s in naming_schemes(k) if s.startswith("wrapper:")
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
            "naming_schemes": dict(schemes),
            "wrapper_segments": dict(wrappers),
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
        "  naming: " + (", ".join(f"{s} x{n}" for s, n in sorted(schemes.items())) or "plain eager names"),
    ]
    if wrappers:
        lines.append(f"  wrapper segments: {', '.join(f'{w} x{n}' for w, n in sorted(wrappers.items()))}")
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


def load_model(spec: str):
    """``"pkg.mod:factory"`` -> ``factory()`` (an ``nn.Module``). The current directory is importable.

    Raises:
        BadInput: malformed spec, import failure, or the callable does not return an ``nn.Module``.
    """
    import torch.nn as nn

    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise BadInput(f"--model {spec!r} must be MODULE:CALLABLE")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise BadInput(f"--model {spec!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the module itself raises / does not parse: no traceback
        raise BadInput(f"--model {spec!r}: importing {mod_name} failed: {type(e).__name__}: {e}") from None
    try:
        model = obj() if callable(obj) and not isinstance(obj, nn.Module) else obj
    except Exception as e:  # noqa: BLE001 - e.g. a class that needs a config: say so, no traceback
        raise BadInput(f"--model {spec!r}: calling {attr}() failed: {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise BadInput(f"--model {spec!r} gave a {type(model).__name__}, not an nn.Module")
    return model


def _migrate(args: argparse.Namespace) -> int:
    from ..errors import CheckpointExistsError, MigrationError
    from ..migrate import migrate

    model = load_model(args.model) if args.model else None
    try:
        report = migrate(
            args.src, args.dst, model=model, fqn_map=args.fqn_map, rules=args.rule, key=args.key,
            dry_run=args.dry_run, max_shard_size=args.max_shard_size, allow_unresolved=args.allow_unresolved,
            trusted_globals=args.trust, overwrite=args.overwrite, progress=True,
        )  # fmt: skip
        code = EXIT_OK
    except CheckpointExistsError as e:  # the message names the API's overwrite=True; say the flag
        raise BadInput(str(e).replace("overwrite=True", "--overwrite")) from None
    except MigrationError as e:
        report, code = e.report, EXIT_MISMATCH
        print(f"fqnckpt: {e}", file=sys.stderr)
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
        lines.append(f"  unresolved: {u.source}: {u.reason}")
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
    p.add_argument("path", help="fqnckpt checkpoint directory or file")


def _verify(args: argparse.Namespace) -> int:
    import checkpoint

    from ..errors import ChecksumMismatchError, CorruptCheckpointError, TensorNotInShardError

    verify = getattr(checkpoint, "verify", None)
    try:
        if verify is not None:
            result = verify(args.path)
        else:  # checkpoint.verify not exported yet: re-hash every file through the reader
            from ..storage.reader import open_checkpoint

            with open_checkpoint(args.path) as r:
                result = {f: r.verify_file(f) for f in r.files}
    except (ChecksumMismatchError, CorruptCheckpointError, TensorNotInShardError) as e:
        _emit(args, {"path": args.path, "ok": False, "error": str(e)}, f"{args.path}: MISMATCH: {e}")
        return EXIT_MISMATCH
    ok = bool(getattr(result, "ok", True)) if result is not None else True
    data = result.model_dump(mode="json") if hasattr(result, "model_dump") else result
    _emit(args, {"path": args.path, "ok": ok, "result": data}, f"{args.path}: {'OK' if ok else 'MISMATCH'}")
    return EXIT_OK if ok else EXIT_MISMATCH


# -- diff ------------------------------------------------------------------------------------------------
def _diff_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="first checkpoint (any supported format)")
    p.add_argument("b", help="second checkpoint (any supported format)")
    p.add_argument("--no-values", action="store_true", help="compare keys, shapes and dtypes only")
    p.add_argument(
        "--trust", action="append", default=[], metavar="MODULE.NAME", help="trusted pickle global"
    )


def tensor_digest(t) -> str:
    """sha256 of a tensor's bytes (C order); its dtype and shape are compared separately."""
    import torch

    t = t.detach().contiguous()
    return hashlib.sha256(t.view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b"").hexdigest()


def _diff(args: argparse.Namespace) -> int:
    from ..sources import open_source

    with (
        open_source(args.a, trusted_globals=args.trust) as a,
        open_source(args.b, trusted_globals=args.trust) as b,
    ):
        ka, kb = set(a.keys()), set(b.keys())
        common = sorted(ka & kb)
        shape = [k for k in common if tuple(a.spec(k).shape) != tuple(b.spec(k).shape)]
        dtype = [k for k in common if a.spec(k).dtype != b.spec(k).dtype]
        values: list[str] = []
        if not args.no_values:
            same_meta = [k for k in common if k not in shape and k not in dtype]
            total = sum(a.nbytes(k) for k in same_meta)
            with tqdm(total=total, unit="B", unit_scale=True, desc="diff", delay=1.0, file=sys.stderr) as bar:
                for k in same_meta:  # one tensor of each side in memory at a time
                    if tensor_digest(a.get(k)) != tensor_digest(b.get(k)):
                        values.append(k)
                    bar.update(a.nbytes(k))
    data = {
        "a": args.a,
        "b": args.b,
        "only_in_a": sorted(ka - kb),
        "only_in_b": sorted(kb - ka),
        "shape_differs": shape,
        "dtype_differs": dtype,
        "value_differs": values,
        "compared_values": not args.no_values,
    }
    same = not any(
        data[f] for f in ("only_in_a", "only_in_b", "shape_differs", "dtype_differs", "value_differs")
    )
    data["same"] = same
    lines = [f"{args.a} vs {args.b}: {'same' if same else 'DIFFERENT'} ({len(common)} common keys)"]
    for f in ("only_in_a", "only_in_b", "shape_differs", "dtype_differs", "value_differs"):
        if data[f]:
            lines.append(f"  {f.replace('_', ' ')}: {data[f]}")
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
register_command(Command("verify", "re-hash a checkpoint's files against its index", _verify_args, _verify))
register_command(
    Command("diff", "compare keys, shapes, dtypes and values (by hash) of two checkpoints", _diff_args, _diff)
)
# demo: imported lazily (it pulls in transformers); see checkpoint/demo.py
register_command(
    Command(
        "demo",
        "the main job on a real model (all-MiniLM-L6-v2 or a built-in one), with a table of checks",
        lambda p: importlib.import_module("checkpoint.cli.demo").add_arguments(p),
        lambda a: importlib.import_module("checkpoint.cli.demo").run_demo(a),
    )
)


# -- entry point -----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with one subparser per registered :class:`Command`."""
    parser = argparse.ArgumentParser(
        prog="fqnckpt",
        description="PyTorch checkpoints in eager FQNs",
        epilog="exit codes: 0 ok, 1 a check found a mismatch, 2 bad input. 'fqnckpt COMMAND --help' for options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in _COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fqnckpt``; returns the exit code (0 ok, 1 mismatch found, 2 bad input)."""
    import fqn

    from ..errors import CheckpointError

    args = build_parser().parse_args(argv)
    try:
        return args._run(args)
    except (BadInput, CheckpointError, fqn.FQNError, OSError, ValueError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        # One line: pydantic / multi-line messages are joined, pydantic's doc links dropped.
        lines = [ln.strip() for ln in str(msg).splitlines() if ln.strip()]
        msg = "; ".join(ln for ln in lines if not ln.startswith("For further information visit"))
        print(f"fqnckpt {args.command}: error: {msg}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
