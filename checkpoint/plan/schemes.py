"""``naming_schemes``: which naming kinds a stored key shows (reports and ``fqnckpt inspect``).

Pure string work with no torch.distributed import, so ``fqnckpt inspect`` stays quick."""

from __future__ import annotations

import re

from fqn.segments import WRAPPER_SEGMENTS

_DYNAMO = re.compile(r"^(L_+self_|l_+self_|L_+s_|self_+modules|getattr_|l__self___)|___dict_____modules")
_EXPORT = re.compile(r"^[pbc]_[A-Za-z0-9_]+$")


def naming_schemes(name: str) -> list[str]:
    """Naming kinds a key shows: ``wrapper:<segment>``, ``dynamo``, ``export``,
    ``parametrization``, ``weight_norm_legacy``, ``fsdp1_flat_param``; ``[]`` for a plain name.
    Heuristic, for reports and ``fqnckpt inspect`` only; never used to decide a name."""
    segs = name.split(".")
    out = [f"wrapper:{s}" for s in dict.fromkeys(segs) if s in WRAPPER_SEGMENTS]
    if _DYNAMO.search(name):
        out.append("dynamo")
    elif "." not in name and _EXPORT.match(name):
        out.append("export")
    if "parametrizations" in segs:
        out.append("parametrization")
    if segs[-1] in ("weight_g", "weight_v"):
        out.append("weight_norm_legacy")
    if "_flat_param" in segs or "flat_param" in segs:
        out.append("fsdp1_flat_param")
    return out
