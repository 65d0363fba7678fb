"""String rules for names seen without a graph: wrapper segments, parametrizations, flattening.

Wrapper segments come from torch's module wrappers: ``_orig_mod`` (``torch.compile``'s
``OptimizedModule``), ``module`` (``DataParallel`` / ``DistributedDataParallel``),
``_fsdp_wrapped_module`` (FSDP1), ``_checkpoint_wrapped_module`` (``checkpoint_wrapper``).
"""

from __future__ import annotations

import re

import torch.nn as nn

from .errors import FlatParamError

# The names live in .segments (no torch import: ``fqnckpt inspect`` counts them without torch).
from .segments import FLAT_PARAM_SEGMENTS, WRAPPER_CLASSES, WRAPPER_SEGMENTS

_NON_ALNUM = re.compile(r"[^a-zA-Z0-9]+")


def flatten_name(name: str) -> str:
    """Dynamo's lossy flattening (``torch/_dynamo/variables/builder.py``): runs of non-alphanumerics
    become one ``_``. ``a_b.c`` and ``a.b_c`` both give ``a_b_c``; used only to *compare*."""
    return _NON_ALNUM.sub("_", name).strip("_")


def is_wrapper_module(module: nn.Module) -> bool:
    """True when ``module`` is one of torch's pure wrappers (see ``WRAPPER_CLASSES``)."""
    return any(cls.__name__ in WRAPPER_CLASSES for cls in type(module).__mro__)


def _child(module: nn.Module, seg: str) -> nn.Module | None:
    sub = module._modules.get(seg)
    return sub if isinstance(sub, nn.Module) else None


def _wrapper_slot(module: nn.Module | None) -> tuple[str, nn.Module] | None:
    """``(segment, inner module)`` when ``module`` is a torch wrapper, else None."""
    if module is None or not is_wrapper_module(module):
        return None
    return next(((s, c) for s, c in module._modules.items() if s in WRAPPER_SEGMENTS and c is not None), None)


def canonical_fqn(name: str, model: nn.Module | None = None) -> str:
    """Remove wrapper segments from ``name`` wherever they sit and however they stack.

    Without ``model`` every segment in ``WRAPPER_SEGMENTS`` is removed (``layers.0._orig_mod.w``
    -> ``layers.0.w``). With ``model`` the name is walked through the module tree and a segment is
    removed only where the model says it is a wrapper (the child is a torch wrapper class, or the
    segment names no child at all); a real child called ``module`` stays.

    Raises:
        FlatParamError: a segment is FSDP1's ``_flat_param`` (no eager FQN exists for it).
    """
    segs = name.split(".")
    for seg in segs:
        if seg in FLAT_PARAM_SEGMENTS:
            raise FlatParamError(name)
    if model is None:
        return ".".join(s for s in segs if s not in WRAPPER_SEGMENTS)
    out: list[str] = []
    cur: nn.Module | None = model
    for seg in segs:
        # Inside a wrapper: its own slot segment (``module`` of DataParallel) is the wrapper's,
        # even when the wrapped model also has a real child of that name; any other segment
        # was written without the wrapper, so step through it transparently.
        slot = _wrapper_slot(cur)
        if slot is not None and seg == slot[0]:
            cur = slot[1]
            continue
        while slot is not None:
            cur = slot[1]
            slot = _wrapper_slot(cur)
        if cur is None:
            if seg not in WRAPPER_SEGMENTS:
                out.append(seg)
            continue
        child = _child(cur, seg)
        if child is not None:
            out.append(seg)
            cur = child
        elif seg in WRAPPER_SEGMENTS:
            continue  # the checkpoint was written through a wrapper the target does not have
        else:
            out.append(seg)
            cur = None  # a parameter / buffer name, or unknown: nothing more to walk
    return ".".join(out)


def strip_transparent_parametrization(name: str) -> str:
    """``X.parametrizations.W.original`` -> ``X.W`` (string form of a transparent parametrization)."""
    return re.sub(r"(^|\.)parametrizations\.([^.]+)\.original$", r"\1\2", name)
