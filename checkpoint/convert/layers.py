"""Per-layer completeness of a source checkpoint, checked before a conversion reads a byte.

A conversion without ``model=`` cannot compare its targets with a module, so a key missing from
one layer (``layers.3.attention.wk.weight``) would otherwise give a checkpoint that is one tensor
short, found only when a model loads it. The rule, over the keys under each layer container (the
text before the first all-digit path component, e.g. ``layers`` or ``model.layers``):

- a layer whose key suffixes are a proper subset of another layer's is incomplete (its missing
  keys are named). Layers of different kinds (dense and MoE layers of DeepSeek-V3 or Qwen3-MoE)
  differ by disjoint keys, never by a subset, so they pass. A model whose layers legitimately
  differ only by extra keys in some of them is refused here: convert it with ``model=``, whose
  exact check (every model tensor filled once, with its shape) replaces this one;
- layer indices are ``0 .. n-1`` with none missing, and ``n`` equals ``dims["n_layers"]`` when the
  source or the model gives it (``params.json``, ``config.num_hidden_layers``).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping

from .report import Problem

_LAYER = re.compile(r"^(?P<prefix>(?:[^.]+\.)*?[^.]+)\.(?P<index>\d+)\.(?P<rest>.+)$")


def layer_problems(keys: Iterable[str], dims: Mapping[str, int]) -> list[Problem]:
    """Problems (kind ``incomplete``) of the per-layer rule above for source ``keys``; [] if none."""
    layers: dict[str, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    for key in keys:
        m = _LAYER.match(key)
        if m is not None:
            layers[m["prefix"]][int(m["index"])].add(m["rest"])
    # The container with the most layers is the decoder's (one per prefix would also flag e.g.
    # expert indices, which the suffix sets already cover).
    if not layers:
        return []
    prefix = max(layers, key=lambda p: (len(layers[p]), p))
    by_index = layers[prefix]
    want = dims.get("n_layers")
    if want is not None:  # DeepSeek-V3's multi-token-prediction layers follow the decoder's (eh_proj marks them)
        by_index = {i: r for i, r in by_index.items() if not (i >= want and "eh_proj.weight" in r)}
    if not by_index:
        return []
    problems: list[Problem] = []
    indices = sorted(by_index)
    if indices != list(range(len(indices))) or (want is not None and len(indices) != want):
        n = want if want is not None else indices[-1] + 1
        absent = sorted(set(range(n)) - set(indices))
        surplus = sorted(set(indices) - set(range(n)))
        problems.append(Problem(
            kind="incomplete", keys=[f"{prefix}.{i}" for i in absent + surplus],
            message=f"{prefix}: layers {indices[0]}..{indices[-1]} present ({len(indices)}), expected 0..{n - 1}"
            + (f"; absent {absent[:10]}" if absent else "") + (f"; beyond n_layers {surplus[:10]}" if surplus else ""),
        ))  # fmt: skip
    kinds = {frozenset(s) for s in by_index.values()}
    for i in indices:
        have = by_index[i]
        fuller = [s for s in kinds if have < s]
        if fuller:
            gone = sorted(min(fuller, key=len) - have)
            problems.append(Problem(
                kind="incomplete", keys=[f"{prefix}.{i}.{r}" for r in gone],
                message=f"layer {prefix}.{i} lacks {len(gone)} key(s) the other layers have: "
                + ", ".join(f"{prefix}.{i}.{r}" for r in gone[:5]),
            ))  # fmt: skip
    return problems


__all__ = ["layer_problems"]
