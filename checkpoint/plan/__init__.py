"""The planning stage: between the readers (:mod:`checkpoint.sources`, :mod:`checkpoint.storage`)
and the entry points (``load``, ``migrate``, the CLI).

Every reading entry point goes source -> names -> values -> apply:

* :mod:`.names`: the one name resolver (stored key -> target FQN: exact, wrapper segments,
  ``fqn_map``, rules, ``fqn.resolve``, alias groups);
* :mod:`.values`: the one set of value and target checks (dtype kind and range, tied values,
  writable targets, targets sharing memory);
* :mod:`.optimizer`: the one optimizer planner (saved state -> ``optimizer.load_state_dict``);
* :mod:`.extra_state`: the one extra-state planner (class name, keys, a trial load);
* :mod:`.model`: :func:`~.model.plan_load`, which puts them together into a
  :class:`~.actions.LoadPlan`;
* :mod:`.migration`: the migration plan (eager key per source key, optimizer entries).

Nothing here mutates a target: :mod:`checkpoint.apply` carries a plan out.
"""
