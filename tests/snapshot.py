"""Bit-exact before / after snapshots of modules, state_dicts and optimizers, for rejection tests.

A rejected operation must change nothing. ``Snapshot(model, optimizer, ...)`` records, for every
tensor reachable from the objects (each name of a module's parameters and buffers, tied names
included; each state_dict value; every tensor and Python value of an optimizer's
``state_dict()`` including ``param_groups``): its Python type and object identity, dtype, device,
shape, strides, storage offset, storage identity (data pointer), ``requires_grad``, and its bytes.
``snap.assert_unchanged()`` takes the snapshot again and fails listing every difference.

Usage::

    snap = Snapshot(model, optimizer)
    with pytest.raises(SomeError):
        checkpoint.load(model, path, optimizer=optimizer)
    snap.assert_unchanged()
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor


def tensor_facts(t: torch.Tensor) -> tuple:
    """Everything that decides what ``t`` reads and where it lives, its bytes included (None for
    meta tensors, which hold no data)."""
    if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):  # lazy: no shape, no data yet
        return (type(t).__name__, id(t), t.requires_grad)
    extra: tuple = ()
    if isinstance(t, DTensor):
        extra = ("dtensor", id(t), tuple(t.shape), tuple(map(str, t.placements)), str(t.device_mesh), t.requires_grad)
        t = t._local_tensor  # the stored shard itself: to_local() makes a new view (another id) per call
    if t.layout != torch.strided:
        data = ("layout", str(t.layout), tensor_facts(t.to_dense()))
        return (type(t).__name__, id(t), t.dtype, str(t.device), tuple(t.shape), data, *extra)
    data = None
    if not t.is_meta:
        flat = t.detach().resolve_conj().resolve_neg().to("cpu").contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    storage = t.untyped_storage().data_ptr() if not t.is_meta else None
    return (
        type(t).__name__, id(t), t.dtype, str(t.device), tuple(t.shape), tuple(t.stride()),
        t.storage_offset(), storage, t.requires_grad, t.is_conj(), t.is_neg(), data, *extra,
    )  # fmt: skip


def freeze(v: object) -> object:
    """A comparable, exact form of a nested value (floats by their bits, so nan == nan)."""
    if isinstance(v, torch.Tensor):
        return ("tensor", tensor_facts(v))
    if isinstance(v, float):
        return ("float", v.hex())
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(freeze(x) for x in v))
    if isinstance(v, Mapping):
        return (type(v).__name__, tuple((freeze(k), freeze(x)) for k, x in v.items()))
    return (type(v).__name__, repr(v))


def facts_of(obj: object) -> dict[str, object]:
    """{name: frozen facts} of one module / state_dict / optimizer / tensor."""
    if isinstance(obj, torch.nn.Module):
        out: dict[str, object] = {}
        for name, p in obj.named_parameters(remove_duplicate=False):
            out[f"param {name}"] = freeze(p)
        for name, b in obj.named_buffers(remove_duplicate=False):
            out[f"buffer {name}"] = freeze(b)
        return out
    if isinstance(obj, torch.optim.Optimizer):
        sd = obj.state_dict()
        out = {f"param_groups[{i}]": freeze(g) for i, g in enumerate(sd["param_groups"])}
        out.update({f"state[{k}]": freeze(v) for k, v in sd["state"].items()})
        out["state keys"] = freeze(sorted(sd["state"]))
        # The live parameter objects the optimizer holds (not only their positions).
        out["params"] = tuple(id(p) for g in obj.param_groups for p in g["params"])
        return out
    if isinstance(obj, Mapping):
        return {f"key {k!r}": freeze(v) for k, v in obj.items()}
    if isinstance(obj, torch.Tensor):
        return {"tensor": freeze(obj)}
    if callable(getattr(obj, "state_dict", None)):  # a stateful object (LR scheduler, dataloader)
        return {"state_dict": freeze(obj.state_dict())}
    raise TypeError(f"cannot snapshot a {type(obj).__name__}")


class Snapshot:
    """Facts of ``objs`` now; :meth:`assert_unchanged` compares them with the facts later."""

    def __init__(self, *objs: object):
        self.objs = objs
        self.before = [facts_of(o) for o in objs]

    def differences(self) -> list[str]:
        out = []
        for i, (obj, before) in enumerate(zip(self.objs, self.before)):
            after = facts_of(obj)
            for k in sorted(set(before) | set(after)):
                if before.get(k, "<absent>") != after.get(k, "<absent>"):
                    out.append(f"object {i} ({type(obj).__name__}): {k} changed")
        return out

    def assert_unchanged(self) -> None:
        diff = self.differences()
        assert not diff, "rejected operation changed its target:\n" + "\n".join(diff)


def dir_snapshot(root, with_mtime: bool = False) -> dict[str, object]:
    """Every entry under directory ``root`` (relative path -> bytes, or ``(bytes, st_mtime_ns)``
    with ``with_mtime``; directories -> None), hidden ones too: equal snapshots before and after
    mean nothing on disk changed (with ``with_mtime``, nothing was rewritten either)."""
    import os

    out: dict[str, object] = {}
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                data = fh.read()
            out[os.path.relpath(p, root)] = (data, os.stat(p).st_mtime_ns) if with_mtime else data
    return out
