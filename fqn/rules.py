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
    segment names no child at all); a real child called ``module`` stays. Where reading such a
    segment as the real child leads to no tensor or module of ``model`` (``DataParallel`` over a
    model with a child ``module``: ``module.fc.weight``), it is read as the wrapper's
    (``fc.weight``).

    Raises:
        FlatParamError: a segment is FSDP1's ``_flat_param`` (no eager FQN exists for it).
    """
    segs = name.split(".")
    for seg in segs:
        if seg in FLAT_PARAM_SEGMENTS:
            raise FlatParamError(name)
    if model is None:
        return ".".join(s for s in segs if s not in WRAPPER_SEGMENTS)
    out, complete, forked = _walk(segs, model)
    if complete or not forked:
        return ".".join(out)
    # A wrapper segment that is also a real child (DataParallel over a model with a child called
    # ``module``: ``module.fc.weight``) was taken as the child and the rest then named nothing.
    # Only then read it as the wrapper's too: the first reading that names a real tensor or module
    # wins (earlier segments read as children first), else the greedy reading stands.
    for alt in _readings(segs, 0, model, []):
        return ".".join(alt)
    return ".".join(out)


def _walk(segs: list[str], model: nn.Module) -> tuple[list[str], bool, bool]:
    """Greedy walk: ``(kept segments, names a tensor / module of model, met a segment that is both a
    wrapper segment and a real child)``."""
    out: list[str] = []
    cur: nn.Module | None = model
    complete = True
    forked = False
    for i, seg in enumerate(segs):
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
                complete = False
            continue
        child = _child(cur, seg)
        if child is not None:
            forked = forked or seg in WRAPPER_SEGMENTS
            out.append(seg)
            cur = child
        elif seg in WRAPPER_SEGMENTS:
            continue  # the checkpoint was written through a wrapper the target does not have
        else:
            out.append(seg)
            complete = complete and i == len(segs) - 1 and _is_tensor_of(cur, seg)
            cur = None  # a parameter / buffer name, or unknown: nothing more to walk
    return out, complete, forked


def _is_tensor_of(module: nn.Module, name: str) -> bool:
    return name in module._parameters or name in module._buffers


def _readings(segs: list[str], i: int, cur: nn.Module, out: list[str]):
    """Every reading of ``segs[i:]`` from ``cur`` that names a real tensor or module, each segment
    in ``WRAPPER_SEGMENTS`` that is also a real child read first as the child, then as a wrapper's."""
    if i == len(segs):
        yield out
        return
    seg = segs[i]
    slot = _wrapper_slot(cur)
    if slot is not None and seg == slot[0]:
        yield from _readings(segs, i + 1, slot[1], out)
        return
    while slot is not None:
        cur = slot[1]
        slot = _wrapper_slot(cur)
    child = _child(cur, seg)
    if child is not None:
        yield from _readings(segs, i + 1, child, [*out, seg])
    if seg in WRAPPER_SEGMENTS:
        yield from _readings(segs, i + 1, cur, out)
    elif child is None and i == len(segs) - 1 and _is_tensor_of(cur, seg):
        yield [*out, seg]


def strip_transparent_parametrization(name: str) -> str:
    """``X.parametrizations.W.original`` -> ``X.W`` (string form of a transparent parametrization)."""
    return re.sub(r"(^|\.)parametrizations\.([^.]+)\.original$", r"\1\2", name)
