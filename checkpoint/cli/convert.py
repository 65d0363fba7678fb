"""``fqnckpt recipes`` and ``fqnckpt migrate --recipe NAME``: tensor-changing conversions."""

from __future__ import annotations

import argparse
import sys

from .errors import BadInput, cli_spelling, one_line

EXIT_OK, EXIT_MISMATCH = 0, 1


def recipes_args(p: argparse.ArgumentParser) -> None:
    del p  # no options


def run_recipes(args: argparse.Namespace) -> int:
    import json

    from ..convert.recipes import recipe_table  # no torch: listing is instant

    rows = recipe_table()
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        need = "  (needs --model or the source's config.json)" if r["needs_model"] else ""
        print(f"{r['name']:<{width}}  inverse {r['inverse']:<{width}}  {r['summary']}{need}")
        if r.get("versions"):
            print(f"{'':<{width}}  layout versions (@): {', '.join(r['versions'])}")
        if r.get("options"):
            print(f"{'':<{width}}  options (+): {', '.join(r['options'])}")
        if r.get("source"):
            print(f"{'':<{width}}  follows: {r['source']}")
    return EXIT_OK


def parse_dims(items: list[str]) -> dict[str, int]:
    """``["n_heads=32", ...]`` -> dict; each name known and each value an ASCII integer (``int()``
    also takes ``²`` and ``٣``), positive (checked by :func:`checkpoint.convert.dims.check_value`).

    Raises:
        BadInput: naming the bad item, ``flag="--dim"``."""
    import re

    from ..convert.dims import DimError, check_value

    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or re.fullmatch(r"[+-]?[0-9]+", value) is None:
            raise BadInput(f"--dim {item!r} must be NAME=INTEGER (e.g. n_kv_heads=8)", flag="--dim")
        try:
            out[name] = check_value(name, int(value), "--dim", True)
        except DimError as e:
            raise BadInput(str(e), flag="--dim") from None
    return out


def run_migrate(args: argparse.Namespace, model) -> int:
    """``migrate --recipe``: plan (checked), write, print the rules applied and how often."""
    from ..convert import ConversionError, RecipeError
    from ..convert.dims import DimError
    from ..errors import CheckpointExistsError
    from ..migrating import migrate

    if getattr(args, "layout", None):
        if "@" in args.recipe:
            raise BadInput("give the layout version once: --layout or --recipe NAME@VERSION", flag="--layout")
        name, *opts = args.recipe.split("+")
        args.recipe = "+".join([f"{name}@{args.layout}", *opts])
    if args.rule or args.fqn_map:
        raise BadInput("--recipe does the renaming itself: drop --rule / --fqn-map", flag="--recipe")
    try:
        report = migrate(
            args.src, args.dst, model=model, recipe=args.recipe, dims=parse_dims(args.dim), key=args.key,
            dry_run=args.dry_run, max_shard_size=args.max_shard_size, trusted_globals=args.trust,
            overwrite=args.overwrite, progress=None,
        )  # fmt: skip
        code = EXIT_OK
    except DimError as e:
        raise BadInput(cli_spelling(str(e)), flag="--dim" if e.from_caller else "--recipe") from None
    except RecipeError as e:
        raise BadInput(cli_spelling(str(e)), flag="--recipe") from None
    except CheckpointExistsError as e:
        raise BadInput(cli_spelling(str(e)), flag="--overwrite", file=e.path) from None
    except ConversionError as e:
        report, code = e.report, EXIT_MISMATCH
        print(f"fqnckpt migrate: {one_line(cli_spelling(str(e)))}", file=sys.stderr)
    if not hasattr(report, "source_format"):  # a quantization recipe (checkpoint.convert.quant_recipes)
        if args.json:
            import json

            print(json.dumps(report.model_dump(mode="json") | {"ok": True}, indent=2))
        else:
            print(f"{report.source} -> {report.destination if report.written else '(nothing written)'}  recipe {report.recipe}\n"
                  f"  {len(report.dequantized) + len(report.quantized):>5} weights "
                  f"{'quantized' if report.quantized else 'dequantized to ' + report.dtype}\n"
                  f"  {len(report.kept):>5} keys copied unchanged")  # fmt: skip
        return code
    unchecked = report.unchecked_line()
    if unchecked:
        print(f"fqnckpt migrate: {unchecked.replace('dims=', '--dim')} (pass --model, or put config.json / params.json "
              f"beside the source, to check them)", file=sys.stderr)  # fmt: skip
    for note in report.notes:
        print(f"fqnckpt migrate: {cli_spelling(note)}", file=sys.stderr)
    lines = [f"{report.source} ({report.source_format}, {report.shards} shard(s)) -> "
             f"{report.destination or '(nothing written)'}  recipe {report.recipe}"]  # fmt: skip
    for u in report.rules:
        if u.groups:
            lines.append(f"  {u.groups:>5} x {u.rule}")
    if report.unchanged:
        lines.append(f"  {len(report.unchanged):>5} keys copied unchanged")
    if report.dropped:
        lines.append(f"  dropped (not weights): {report.dropped}")
    lines += [f"  {p.kind}: {p.message}" for p in report.problems]
    if args.json:
        import json

        print(json.dumps(report.model_dump(mode="json") | {"ok": report.ok}, indent=2))
    else:
        print("\n".join(lines))
    return code
