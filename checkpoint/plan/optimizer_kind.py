"""Is saved optimizer state the state of the target optimizer's kind? Checked before anything is
read into or written to the optimizer, for every source (fqnckpt, DCP, pickle).

``torch.optim.Optimizer.load_state_dict`` takes any state whose group sizes fit: AdamW's
``exp_avg`` / ``exp_avg_sq`` load into SGD, which then steps without its ``momentum_buffer`` and
keeps the foreign hyper-parameters. The rule here compares the saved state with what the target's
own class makes, not with a list of class names:

* **Param-group keys.** The saved group must hold every hyper-parameter of the target's class
  (``optimizer.defaults``: SGD's ``momentum`` / ``dampening``, Adam's ``betas`` / ``eps``), up to :data:`VERSION_KEYS` (keys whose
  presence differs between torch versions or that torch's own helpers add: ``initial_lr`` from LR
  schedulers, ``differentiable``, ``foreach``, ``fused``, ``capturable``, ``maximize``,
  ``decoupled_weight_decay``) and up to the keys the target class's own ``__setstate__`` fills in
  for state_dicts of older torch versions (found by running it on a copy: e.g. ``nesterov`` for
  SGD). Keys the saved group has beyond the target's are named in the message but refuse nothing
  alone: torch lets a user keep any key in a param group (a tag, a schedule), and it loads along.
* **Per-parameter state keys.** A parameter's saved state (tensors and values) must hold exactly
  the keys the target class keeps for it: found by one step of a fresh optimizer of the target's
  class, built with the saved group's hyper-parameters (they are what the load installs) on a
  zero-gradient probe parameter of the same number of dimensions (state keys depend on
  hyper-parameters, e.g. SGD keeps ``momentum_buffer`` only with ``momentum != 0``, and for some
  classes on the dimensions, e.g. Adafactor). A parameter without saved state is not compared
  (never stepped). Not compared for :data:`STATE_NOT_PROBED` (LBFGS returns from a zero-gradient
  step before its history exists) or where a probe cannot be built (a constructor needing more
  than hyper-parameters, sparse-gradient optimizers): then the group keys alone decide.

Adam and AdamW (torch 2.x: ``AdamW`` is ``Adam`` with ``decoupled_weight_decay=True``) have the
same group and state keys: one's state loads into the other (decided: they are one algorithm with
a flag). The flag then follows torch's own rule, as ``load_state_dict`` of that state_dict
would leave it: an ``AdamW`` always keeps ``decoupled_weight_decay=True`` (its ``__setstate__``
sets it), an ``Adam`` takes the saved value.
"""

from __future__ import annotations

import copy
import inspect
import numbers
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from ..optim import OptimizerMismatchError

VERSION_KEYS = frozenset(
    {"initial_lr", "differentiable", "foreach", "fused", "capturable", "maximize", "decoupled_weight_decay"}
)
STATE_NOT_PROBED = ("LBFGS",)
_NOT_HYPER = {"params", "param_names"}
# Passed to the probe as defaults: they change where and how a step runs, not the state kept.
_PROBE_DEFAULTS = {"foreach", "fused", "capturable", "differentiable"}


def _who(saved_class: str | None, optimizer: torch.optim.Optimizer) -> str:
    target = type(optimizer).__name__
    if saved_class and saved_class not in ("unknown", target):
        return f"state of {saved_class} does not fit the target {target}"
    return f"the saved state does not fit the target {target}"


def _filled_by_setstate(optimizer: torch.optim.Optimizer, hyper: dict[str, Any]) -> set[str]:
    """Keys the target class's ``__setstate__`` adds to a saved group (defaults for older
    state_dicts), found on a shallow copy of the optimizer: the optimizer itself is untouched."""
    probe = copy.copy(optimizer)
    probe.defaults = dict(optimizer.defaults)
    group = {k: v for k, v in hyper.items() if k not in _NOT_HYPER}
    try:
        probe.__setstate__({"state": {}, "param_groups": [{**group, "params": []}]})
    except Exception:  # noqa: BLE001 - a class whose __setstate__ needs more: nothing filled
        return set()
    return set(probe.param_groups[0]) - set(group) - _NOT_HYPER


def group_keys_problem(
    optimizer: torch.optim.Optimizer, gi: int, target: dict[str, Any], saved: dict[str, Any], saved_class: str | None
) -> str | None:
    """Why saved group ``saved`` (hyper-parameters) cannot be target group ``gi``, or None.
    The keys the target needs are its class's hyper-parameters (``optimizer.defaults``, the
    constructor's), not keys a user added to the target's group."""
    have = set(saved) - _NOT_HYPER
    want = (set(optimizer.defaults) & set(target)) - _NOT_HYPER
    missing = sorted(want - have - VERSION_KEYS - (_filled_by_setstate(optimizer, saved) if want - have else set()))
    if not missing:
        return None
    why = f"the saved group lacks {missing}, which {type(optimizer).__name__} needs"
    extra = sorted(have - want - VERSION_KEYS)
    if extra:
        why += f", and has {extra}, which it does not use"
    return f"{_who(saved_class, optimizer)}: param group {gi}: {why}"


def _value_kind(v: Any) -> str | None:
    """The kind a hyper-parameter's value has for :func:`group_values_problem`: ``number`` (int,
    float, bool, a numpy scalar, a one-element tensor of any shape, as torch.optim takes a tensor
    ``lr``: ``lr`` may be a float or a tensor, ``amsgrad`` 0 or False),
    ``str``, ``sequence`` (tuple / list: ``betas``), ``tensor``, ``dict``, else the type's name;
    ``None`` for None (unset: torch's ``foreach=None`` / ``fused=None`` become a value later)."""
    if v is None:
        return None
    # numbers.Number: numpy scalars too (np.float32 is no float subclass; torch takes it as lr)
    if isinstance(v, numbers.Number) or (isinstance(v, torch.Tensor) and v.numel() == 1):
        return "number"
    if isinstance(v, torch.Tensor):
        return "tensor"
    if isinstance(v, (tuple, list)):
        return "sequence"
    if isinstance(v, dict):
        return "dict"
    return "str" if isinstance(v, str) else type(v).__name__


def group_values_problem(
    optimizer: torch.optim.Optimizer, gi: int, target: dict[str, Any], saved: dict[str, Any], saved_class: str | None
) -> str | None:
    """Why saved group ``saved`` cannot be restored into target group ``gi`` because a
    hyper-parameter both hold changed kind (saved ``lr=0.1``, the target's ``lr="fast"``:
    :func:`_value_kind`), or None. Refused like every other group mismatch (and as extra state of
    another type is, :class:`~checkpoint.errors.ExtraStateMismatchError`): the load would put
    back a value of another type silently. None on either side is unset and fits any kind."""
    for k in sorted(set(saved) & set(target) - _NOT_HYPER):
        was, now = _value_kind(saved[k]), _value_kind(target[k])
        if was is not None and now is not None and was != now:
            return (
                f"{_who(saved_class, optimizer)}: param group {gi}: hyper-parameter {k!r} was saved as "
                f"{type(saved[k]).__name__} {saved[k]!r}, the target's is {type(target[k]).__name__} "
                f"{target[k]!r}; give the target's group a {was} (the saved value is then restored) or "
                "load without optimizer="
            )
    return None


class StateKeyProbe:
    """The per-parameter state keys the target's class keeps (see module docstring), cached by
    (group, number of dimensions). ``None``: not known (not compared)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.cls = type(optimizer)
        self._cache: dict[tuple[int, int], set[str] | None] = {}

    def keys(self, gi: int, hyper: dict[str, Any], ndim: int) -> set[str] | None:
        k = (gi, ndim)
        if k not in self._cache:
            self._cache[k] = self._probe(hyper, ndim)
        return self._cache[k]

    def _probe(self, hyper: dict[str, Any], ndim: int) -> set[str] | None:
        if self.cls.__name__ in STATE_NOT_PROBED:
            return None
        try:
            accepted = inspect.signature(self.cls.__init__).parameters
        except (TypeError, ValueError):
            return None
        kw = {k: v for k, v in hyper.items() if k in accepted and k not in _NOT_HYPER | _PROBE_DEFAULTS}
        kw = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        p = torch.zeros((2,) * ndim, requires_grad=True)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt = self.cls([p], **kw)
                p.grad = torch.zeros_like(p)
                opt.step(lambda: torch.zeros(()))
        except Exception:  # noqa: BLE001 - a probe this class cannot take: not compared
            return None
        return set(opt.state.get(p, {}))


def state_keys_problem(
    optimizer: torch.optim.Optimizer, fqn: str, saved_keys: Iterable[str], want: set[str] | None, saved_class: str | None
) -> str | None:
    """Why the saved state keys of parameter ``fqn`` are not the target's (``want``), or None."""
    have = set(saved_keys)
    if want is None or not have or have == want:
        return None
    extra, missing = sorted(have - want), sorted(want - have)
    parts = []
    if extra:
        parts.append(f"state {extra}, which {type(optimizer).__name__} does not keep")
    if missing:
        parts.append(f"no {missing}, which {type(optimizer).__name__} keeps")
    return f"{_who(saved_class, optimizer)}: parameter {fqn!r} has saved " + " and ".join(parts)


__all__ = ["VERSION_KEYS", "STATE_NOT_PROBED", "StateKeyProbe", "group_keys_problem", "group_values_problem", "state_keys_problem"]
