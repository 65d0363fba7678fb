"""Which entries of a training checkpoint beside the model are training state, not model state.

A training loop saves ``{"model": sd, "optimizer": osd, "step": t, "epoch": 3, "rng": ...}`` (or
the same one level down, ``{"state": {"model": sd}, "step": t}``). Structure alone cannot tell a
``step`` tensor beside the model container from a model weight stored at the top level
(``{"weight": t, "ema": {...}}`` must stay ambiguous, never load the EMA silently), so the names
training loops give these entries decide, here once for every source (pickles, DCP): the loop
counters, the RNG states and the schedulers / scalers / data loaders of torchtitan, Lightning,
accelerate, DeepSpeed and hand-written loops. Optimizer state_dicts are recognised by structure
elsewhere (``{"state", "param_groups"}``).
"""

from __future__ import annotations

import re

# Full, case-insensitive names (a suffix form for RNG states: "cuda_rng_state", "np_rng_states").
_TRAINING_STATE = re.compile(
    r"(?i)(step|steps|global_step|epoch|epochs|iteration|iterations|iter|num_steps|num_updates"
    r"|consumed_samples|consumed_tokens|tokens_seen|seed"
    r"|rng|rngs|\w*rng_states?|random_states?"
    r"|(lr_)?schedulers?|(grad_)?scaler|dataloader|train_state|loops|callbacks)"
)  # not "generator", "sampler", "amp", "loss": a model can have a submodule or tensor so named


def is_training_state(name: object) -> bool:
    """True for a checkpoint entry named like training-loop state (``step``, ``epoch``, ``rng``,
    ``cuda_rng_state``, ``lr_scheduler``, ``scaler``, ``dataloader``, ...; see module docstring)."""
    return isinstance(name, str) and _TRAINING_STATE.fullmatch(name) is not None


__all__ = ["is_training_state"]
