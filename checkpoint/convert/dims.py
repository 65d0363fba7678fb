"""Model dimensions of a conversion, read from every source that states them and compared.

A dimension (``n_heads``, ``dim``, ...) may be stated by Meta's ``params.json``, transformers'
``config.json`` beside the source, the target model's config, the caller's ``dims=`` / ``--dim``,
and the tensors' own shapes. Letting one override another converts silently wrong when they
disagree (RoPE permuted per head of the wrong size gives a model that loads and talks gibberish), so
every value is validated and every pair of sources that states a dimension must agree; the
disagreement is refused naming both sources and both values.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any

from .recipes import RecipeError

# Name -> what it is; the only names a conversion reads (a misspelled one is refused, not ignored).
KNOWN_DIMS: dict[str, str] = {
    "dim": "hidden width (embedding columns)",
    "n_layers": "decoder layers",
    "n_heads": "attention (query) heads",
    "n_kv_heads": "key / value heads",
    "head_dim": "rows per attention head",
    "qk_rope_head_dim": "DeepSeek-V3 RoPE rows per head",
    "rope_interleave": "DeepSeek-V3 RoPE pairs interleaved (1) or halves (0)",
    "shards": "Meta model-parallel consolidated.NN.pth files",
    "vocab_size": "token embedding rows",
}
_ZERO_OK = {"rope_interleave"}  # a flag, 0 or 1


class DimError(RecipeError):
    """A dimension that is not a positive integer, has no known name, or that two sources state
    differently (both named). ``dim`` is the dimension's name; the CLI blames ``--dim`` for it
    when ``from_caller`` is True."""

    def __init__(self, msg: str, dim: str, from_caller: bool):
        super().__init__(msg)
        self.dim, self.from_caller = dim, from_caller


def check_value(name: str, value: Any, where: str, from_caller: bool = False) -> int:
    """``value`` as the int it must be.

    Raises:
        DimError: ``name`` unknown, or ``value`` not an int (a bool, a float such as 4.7 or 4.0, a
            string) or not positive (0 / 1 for ``rope_interleave``)."""
    if name not in KNOWN_DIMS:
        raise DimError(f"{where}: unknown dimension {name!r}; known: {sorted(KNOWN_DIMS)}", name, from_caller)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # numpy / torch ints are integers too
        raise DimError(f"{where}: dimension {name} must be a positive integer, got {value!r}", name, from_caller)
    value = int(value)
    if name in _ZERO_OK:
        if value not in (0, 1):
            raise DimError(f"{where}: dimension {name} must be 0 or 1, got {value}", name, from_caller)
    elif value <= 0:
        raise DimError(f"{where}: dimension {name} must be a positive integer, got {value}", name, from_caller)
    return value


def resolve(sources: Iterable[tuple[str, Mapping[str, Any] | None]], caller: str = "dims=") -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Every dimension from every named source: ``(dims, {source: its dims})``.

    Args:
        sources: ``(name, {dim: value})`` pairs, e.g. ``("params.json", {...})``; the one named
            ``caller`` is the caller's own (``dims=`` / ``--dim``): its unknown names are refused
            (other sources' extra fields are theirs).

    Raises:
        DimError: a bad value (see :func:`check_value`), or two sources that disagree (both named
            with their values)."""
    out: dict[str, int] = {}
    origin: dict[str, str] = {}
    stated: dict[str, dict[str, int]] = {}
    for name, given in sources:
        if not given:
            continue
        mine = name == caller
        checked = {}
        for k, v in given.items():
            if not mine and k not in KNOWN_DIMS:
                continue
            checked[k] = check_value(k, v, name, mine)
        stated[name] = checked
        for k, v in checked.items():
            if k in out and out[k] != v:
                raise DimError(f"dimension {k} disagrees: {origin[k]} gives {out[k]}, {name} gives {v}", k, mine)
            out[k] = v
            origin.setdefault(k, name)
    return out, stated


def shape_dims(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
    """What the tensors themselves say, from the Hugging Face Llama-family names among ``shapes``:
    ``dim`` (embedding columns) and ``vocab_size`` (embedding rows). {} for other layouts. (Not
    the layer count: DeepSeek-V3's multi-token-prediction layers follow the decoder's under the
    same name; :func:`~checkpoint.convert.layers.layer_problems` checks it.)"""
    emb = shapes.get("model.embed_tokens.weight")
    return {"vocab_size": int(emb[0]), "dim": int(emb[1])} if emb is not None and len(emb) == 2 else {}


def tensor_problems(shapes: Mapping[str, tuple[int, ...]], dims: Mapping[str, int]) -> list[str]:
    """Where the Hugging Face Llama-family tensors among ``shapes`` contradict ``dims``:
    ``q_proj`` rows != ``n_heads * head_dim``, ``k_proj`` / ``v_proj`` rows !=
    ``n_kv_heads * head_dim``, columns != ``dim``, rows not whole heads; [] when they agree (or
    there is nothing to compare). ``head_dim`` defaults to ``dim // n_heads``."""
    bad: list[str] = []
    n, g, d = dims.get("n_heads"), dims.get("n_kv_heads"), dims.get("dim")
    hd = dims.get("head_dim") or (d // n if d and n and d % n == 0 else None)
    for k, s in shapes.items():
        if not k.startswith("model.layers.") or len(s) != 2:
            continue
        tail = k.split(".", 3)[3]
        heads = n if tail == "self_attn.q_proj.weight" else g if tail in ("self_attn.k_proj.weight", "self_attn.v_proj.weight") else None
        if heads is not None and tail.endswith("_proj.weight"):
            if hd is not None and s[0] != heads * hd:
                bad.append(f"{k} has {s[0]} rows, dims give {heads} heads x {hd} = {heads * hd}")
            elif s[0] % heads:
                bad.append(f"{k} has {s[0]} rows, not {heads} whole heads")
            if d is not None and s[1] != d:
                bad.append(f"{k} has {s[1]} columns, dims give dim={d}")
        if len(bad) >= 6:
            break
    return bad


__all__ = ["KNOWN_DIMS", "DimError", "check_value", "resolve", "shape_dims", "tensor_problems"]
