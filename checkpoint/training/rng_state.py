"""The random number generator states of one process, as one ``extra_state`` entry.

:class:`RNGState` captures torch's CPU generator, the current accelerator's generators (CUDA / XPU /
any ``torch.accelerator`` backend with ``get_rng_state_all``), Python's ``random`` and numpy's
legacy global generator (when numpy is installed), and restores them exactly. It is a per-rank
value (ranks are usually seeded apart), so the manager saves it wrapped in
:class:`~checkpoint.storage.extra_state.PerRank`.

Resuming on another world size cannot give rank ``r`` "its" state (there was no rank ``r``, or
its data changed), so :meth:`RNGState.reshard` re-derives one from the saved states by a
documented rule: rank ``r`` of the new world seeds every generator with the first 8 bytes of
``sha256(saved state of rank r % old_world || "r/new_world")``. Every new rank gets its own stream,
the same on every rerun of the resume.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import torch

try:  # numpy is a dependency of the project, but keep the RNG state usable without it
    import numpy as np
except ImportError:  # pragma: no cover
    np = None


def _accelerator_module():
    """``torch.cuda`` / ``torch.xpu`` / ...: the module of the current accelerator, or None."""
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return None
    mod = getattr(torch, acc.current_accelerator().type, None)
    return mod if mod is not None and hasattr(mod, "get_rng_state_all") else None


class RNGState:
    """Stateful view of this process's generators.

    ``state_dict()``: ``{"torch": uint8 tensor, "device": list of uint8 tensors (one per visible
    accelerator device; empty without one), "python": list (``random.getstate()``), "numpy": list
    (``numpy.random.get_state()``: name, uint32 key as ints, pos, has_gauss, cached_gaussian) or
    None}``: plain ``extra_state`` values.

    ``load_state_dict(sd)`` sets every generator; raises ``ValueError`` naming the field when the
    number of accelerator devices differs from the saved one (their streams cannot be mapped) or a
    field is missing or malformed, before any generator is set.
    """

    def state_dict(self) -> dict[str, Any]:
        acc = _accelerator_module()
        ver, internal, gauss = random.getstate()
        out: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "device": list(acc.get_rng_state_all()) if acc is not None else [],
            "python": [ver, list(internal), gauss],
            "numpy": None,
        }
        if np is not None:
            name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
            out["numpy"] = [name, key.tolist(), int(pos), int(has_gauss), float(cached)]
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for key in ("torch", "device", "python", "numpy"):
            if key not in sd:
                raise ValueError(f"RNGState: saved state has no {key!r}")
        if not isinstance(sd["torch"], torch.Tensor) or sd["torch"].dtype != torch.uint8:
            raise ValueError("RNGState: 'torch' is not a uint8 tensor")
        acc = _accelerator_module()
        n_dev = len(acc.get_rng_state_all()) if acc is not None else 0
        if len(sd["device"]) != n_dev:
            raise ValueError(
                f"RNGState: 'device' holds {len(sd['device'])} accelerator states, this process sees {n_dev}"
            )
        try:
            ver, internal, gauss = sd["python"]
            py_state = (int(ver), tuple(int(x) for x in internal), gauss)
            np_state = None
            if sd["numpy"] is not None and np is not None:
                name, key, pos, has_gauss, cached = sd["numpy"]
                np_state = (str(name), np.asarray(key, dtype=np.uint32), int(pos), int(has_gauss), float(cached))
        except (TypeError, ValueError) as e:
            raise ValueError(f"RNGState: malformed 'python' or 'numpy' state: {e}") from e
        # every field checked: now set the generators
        torch.set_rng_state(sd["torch"])
        if acc is not None:
            acc.set_rng_state_all(sd["device"])
        random.setstate(py_state)
        if np_state is not None:
            np.random.set_state(np_state)

    @staticmethod
    def reshard(saved: list[dict[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
        """A state for ``rank`` of a ``world_size``-rank world from the states ``saved`` by each
        rank of another world (rule in the module docstring); leaves every generator of this process as it was."""
        base = saved[rank % len(saved)]
        h = hashlib.sha256()
        h.update(base["torch"].numpy().tobytes())
        h.update(json.dumps(base["python"]).encode())
        h.update(f"{rank}/{world_size}".encode())
        seed = int.from_bytes(h.digest()[:8], "little")
        g = torch.Generator().manual_seed(seed)
        acc = _accelerator_module()
        dev = []
        if acc is not None:  # a device state's format is the backend's: seed it there, read, put back
            current = acc.get_rng_state_all()
            try:
                for i in range(len(current)):
                    with acc.device(i):
                        acc.manual_seed((seed + i + 1) % 2**63)
                dev = list(acc.get_rng_state_all())
            finally:
                acc.set_rng_state_all(current)
        py = random.Random(seed).getstate()
        out: dict[str, Any] = {"torch": g.get_state(), "device": dev, "python": [py[0], list(py[1]), py[2]]}
        out["numpy"] = None
        if np is not None:
            name, key, pos, has_gauss, cached = np.random.RandomState(seed % 2**32).get_state(legacy=True)
            out["numpy"] = [name, key.tolist(), int(pos), int(has_gauss), float(cached)]
        return out
