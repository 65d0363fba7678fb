"""Helpers every ``fqnckpt`` subcommand uses: output (text or ``--json``), sizes, ``--model`` and
``--trust`` flags."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

from .errors import BadInput


def emit(args: argparse.Namespace, data: Any, text: str) -> None:
    """Print a command's result (``--json``: ``data``), credentials scrubbed (one scrubber:
    :mod:`checkpoint.storage.secrets`)."""
    from ..storage.secrets import scrub, scrub_data

    print(json.dumps(scrub_data(data), indent=2, sort_keys=True, default=str) if args.json else scrub(text))


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def plural(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


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


def check_trust(args: argparse.Namespace) -> None:
    """Each ``--trust MODULE.NAME`` must import (before any pickle is looked at)."""
    trusted = getattr(args, "trust", None) or []
    if not trusted:
        return  # the readers import torch: not for a safetensors inspect
    from ..sources.readers import resolve_globals

    for g in trusted:
        try:
            resolve_globals([g])
        except Exception:  # noqa: BLE001 - any import failure is the flag's fault
            raise BadInput(
                f"--trust {g!r}: cannot import it (give a class or function as MODULE.NAME)",
                flag="--trust",
                key=g,
            ) from None
