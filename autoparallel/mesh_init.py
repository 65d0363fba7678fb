"""Random init whose values do not depend on the mesh: the same on every mesh and on one device.

Inside :func:`mesh_independent_context` every random fill (``normal_``, ``uniform_``,
``bernoulli_``, ``random_``, ``exponential_``, ``log_normal_``, ``cauchy_``, ``geometric_``, the
``rand*`` factories, and every ``torch.nn.init`` function built on them) computes element ``g``
(row-major index in the tensor's global shape) of its output from

* one 64-bit key drawn from the CPU default generator when the context starts (ranks must share its
  seed, as after ``torch.manual_seed(s)`` on every rank; with ``generator=g`` the key of that call is
  drawn from ``g`` instead),
* the stream name: the eager FQN of the filled parameter / buffer (tied tensors: the canonical one),
  or, for a temporary, the FQN whose ``nn.init`` call made it, else ``"<temporary>"``,
* the op name and the stream's call number (the k-th fill of a tensor gets its own stream: several
  fills of one tensor, such as rejection rounds, never reuse numbers),
* the op's arguments, and ``g`` itself,

through :mod:`autoparallel.rng` (Philox4x32-10, Salmon et al. 2011). A DTensor computes only the
elements of its local shard (box from
``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``): no full tensor, no
communication. Distributions (float64, then rounded to the tensor's dtype, except the first two on
float32 / bf16 / fp16 tensors, which run in float32 from exactly rounded ops only):

* ``normal_(mean, std)``: ``mean + std * z``, ``z`` by Box-Muller (see :mod:`autoparallel.rng`;
  float32 / bf16 / fp16: kind ``normal32``, series instead of ``log`` / ``cos`` / ``sin``);
* ``uniform_(a, b)``: ``a + (b - a) * u``, ``u`` with 24 bits (float32 / bf16 / fp16), 53 bits
  (float64) or 32 bits (other dtypes);
* ``trunc_normal_(mean, std, a, b)``: inverse CDF, ``mean + std * ndtri(Phi(alpha) + u (Phi(beta) -
  Phi(alpha)))`` (exact truncated normal in one pass instead of torch's rejection loop, which needs a
  global ``any`` per round; mirrored onto the lower tail, where ``Phi`` keeps its precision;
  L. Devroye, "Non-Uniform Random Variate Generation", 1986, II.2, inversion method);
* ``exponential_(l)``: inverse CDF ``-ln(u) / l``; ``cauchy_``: ``median + sigma tan(pi (u - 1/2))``;
  ``geometric_(p)``: ``ceil(ln u / ln(1 - p))``; ``log_normal_``: ``exp`` of a normal;
* ``bernoulli_(p)``: ``u < p``; ``random_(from, to)``: ``from + v mod (to - from)``, ``v`` 63 bits
  (64 for ranges above 2^63).

Semantics are torch's (:mod:`autoparallel.fill_rules`): each fill first runs torch's own op on a
1-element probe, so it refuses exactly what torch refuses (dtype, arguments), with torch's message;
``uniform_`` returns [from, to) in the tensor's dtype (a value the cast rounds up to ``to`` becomes
``from``, as torch's kernel does); ``random_`` takes torch's ranges (``random_()``: [0, 2^digits]
on floating dtypes, [0, max] on integer ones; bounds moved inwards where a low-precision dtype
cannot hold them).

Fills that need the whole tensor (``nn.init.orthogonal_``, ``nn.init.sparse_``, or user code that
builds a full tensor and copies / assigns it into a sharded DTensor) run on a full tensor made on
each rank, with the same streams as on one device, and emit one :class:`FullTensorWarning` naming
the FQN. Other seeded ops (``randperm``, ``multinomial``) on plain tensors run with a
``torch.Generator`` seeded from their stream; on a DTensor they raise ``NotImplementedError``.
Values are bit-identical across meshes on one device type. ``normal_`` / ``uniform_`` (and the
``nn.init`` functions built on them) of float32 / bf16 / fp16 tensors are bit-identical on any device
type by construction (:mod:`autoparallel.rng`); elsewhere the float64 transcendental functions may
differ in the last bit across device types.

Cost (tests/bench/init_cost.py, Llama 'small', 2 CPU ranks): ~3.5-4x the former per-shard
``normal_``, almost all of it Philox4x32-10 in torch int64 ops (~6 ns an element on one core, against
~3.5 ns for the whole of torch's ``normal_``, whose Mersenne Twister is sequential and so cannot
address an element by its index).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from fqn import eager_tensors

from .fill_rules import (
    check_like_torch,
    half_open,
    random_kind,
    random_range,
    random_transform,
    uniform_bounds,
)
from .hf_init import construction_init
from .rng import fill_box, stream_id
from .shard_views import ShardView
from .uninitialized import note_written

aten = torch.ops.aten
_TEMPORARY = "<temporary>"
_NARROW = (torch.float32, torch.bfloat16, torch.float16)
_active = threading.local()


class FullTensorWarning(UserWarning):
    """An init step made the full tensor of a sharded parameter / buffer on every rank (named by FQN)."""


class _State:
    """Per-init bookkeeping: the key, which tensor objects / storages are which FQN, call numbers."""

    def __init__(self, module: nn.Module, key: int):
        self.key = key
        self.by_id: dict[int, tuple[str, torch.Tensor]] = {}
        self.by_storage: dict[tuple, str] = {}
        self.calls: dict[str, int] = {}
        self.scope: list[str] = []
        self.warned: set[str] = set()
        for rec in eager_tensors(module):
            self.register(rec.tensor, rec.fqn)

    def register(self, t: torch.Tensor, fqn: str) -> None:
        self.by_id[id(t)] = (fqn, t)  # the tensor is kept, so its id is not reused meanwhile
        local = t._local_tensor if isinstance(t, DTensor) else t
        if local.numel() and local.device.type != "meta":
            self.by_storage[_storage_key(t)] = fqn

    def fqn_of(self, t: torch.Tensor) -> str | None:
        hit = self.by_id.get(id(t))
        if hit is not None and hit[1] is t:
            return hit[0]
        if isinstance(t, ShardView):  # a part of a tensor: a temporary, as a view is on one device
            return None
        local = t._local_tensor if isinstance(t, DTensor) else t
        if local.numel() and local.device.type != "meta":
            return self.by_storage.get(_storage_key(t))
        return None

    def stream(self, name: str, op: str, generator: torch.Generator | None):
        n = self.calls.get(name, 0)
        self.calls[name] = n + 1
        key = self.key if generator is None else _draw_key(generator)
        return stream_id(key, name, op, n)

    def name_for(self, t: torch.Tensor) -> str:
        return self.fqn_of(t) or (self.scope[-1] if self.scope else _TEMPORARY)

    def warn_full(self, name: str, why: str) -> None:
        if name not in self.warned:
            self.warned.add(name)
            warnings.warn(
                f"init of {name!r} made its full tensor on every rank ({why}); values stay "
                "mesh-independent, memory is that of the unsharded tensor",
                FullTensorWarning,
                stacklevel=4,
            )


def _storage_key(t: torch.Tensor) -> tuple:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return (
        local.device,
        local.untyped_storage().data_ptr(),
        local.storage_offset(),
        tuple(local.shape),
        local.stride(),
        tuple(t.shape),
    )


def current_state() -> _State | None:
    """The active :func:`mesh_independent_context`'s bookkeeping (FQNs of tensors, warnings), or None."""
    return getattr(_active, "state", None)


def _draw_key(generator: torch.Generator | None = None) -> int:
    device = generator.device if generator is not None else "cpu"
    w = torch.randint(0, 2**32, (2,), dtype=torch.int64, device=device, generator=generator).tolist()
    return w[0] | (w[1] << 32)


def _is_sharded(t: torch.Tensor) -> bool:
    # Split across more than one rank: its full tensor is larger than the local shard.
    return isinstance(t, DTensor) and any(
        not p.is_replicate() and t.device_mesh.size(i) > 1 for i, p in enumerate(t.placements)
    )


def _box(t: torch.Tensor, name: str) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, global shape, global offset of the local box)."""
    if not isinstance(t, DTensor):
        return t, tuple(t.shape), (0,) * t.dim()
    if any(p.is_partial() for p in t.placements):
        raise NotImplementedError(f"random init of {name!r}: Partial placements hold no values to fill")
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t._local_tensor
    if tuple(shape) != tuple(local.shape):
        raise RuntimeError(
            f"random init of {name!r}: local shard has shape {tuple(local.shape)}, its placements "
            f"{t.placements} give {tuple(shape)}"
        )
    return local, tuple(t.shape), tuple(offset)


def _local_param(p: Any, dst: torch.Tensor, offset, local_shape) -> torch.Tensor:
    """A per-element argument (e.g. Bernoulli ``p``) as the dst box's local values."""
    if isinstance(p, DTensor):
        if isinstance(dst, DTensor) and p.shape == dst.shape and p.placements == dst.placements:
            return p._local_tensor
        p = p.full_tensor()
    full = p.expand(dst.shape)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))]


def _bind(func, args, kwargs) -> dict[str, Any]:
    out = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def _fill(dst: torch.Tensor, op: str, a: dict[str, Any], state: _State) -> torch.Tensor:
    """Fill ``dst`` (DTensor or plain) in place by the mesh-independent rule of ``op``."""
    if isinstance(dst, ShardView):  # a plain tensor of the view's shape, copied in by ShardWrites
        tmp = torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
        _fill(tmp, op, a, state)
        with torch.no_grad():
            dst.copy_(tmp)
        return dst
    name = state.name_for(dst)
    local, gshape, offset = _box(dst, name)
    check_like_torch(op, local.dtype, a)  # torch's refusals (dtype, arguments) before any draw
    sid = state.stream(name, op, a.get("generator"))
    params: tuple[torch.Tensor, ...] = ()
    narrow = local.dtype in _NARROW  # float32 variates and transform, rounded on the write
    if op == "normal_":
        mean, std = a["mean"], a["std"]
        kind, tf = "normal32" if narrow else "normal", lambda v, p: v.mul_(std).add_(mean)
    elif op == "uniform_":
        lo, hi = a["from"], a["to"]
        kind = "uniform32" if narrow else "uniform53" if local.dtype == torch.float64 else "uniform"
        bounds, dt = uniform_bounds(local.dtype, lo, hi), local.dtype
        # [from, to) in the tensor's dtype: a value the cast rounds up to ``to`` becomes ``from``.
        tf = lambda v, p: half_open(v.mul_(hi - lo).add_(lo).to(dt), bounds)  # noqa: E731
    elif op == "bernoulli_":
        prob = a["p"]
        kind = "uniform"
        if isinstance(prob, torch.Tensor):
            params = (_local_param(prob, dst, offset, local.shape),)
            tf = lambda v, p: v < p[0]  # noqa: E731
        else:
            tf = lambda v, p: v < prob  # noqa: E731
    elif op == "random_":
        lo, span = random_range(local.dtype, a)
        kind, tf = random_kind(span), random_transform(lo, span)
    elif op == "exponential_":
        lam = a["lambd"]
        kind, tf = "open", lambda v, p: v.log_().mul_(-1.0 / lam)
    elif op == "log_normal_":
        mean, std = a["mean"], a["std"]
        kind, tf = "normal", lambda v, p: v.mul_(std).add_(mean).exp_()
    elif op == "cauchy_":
        med, sig = a["median"], a["sigma"]
        kind, tf = "open", lambda v, p: v.sub_(0.5).mul_(math.pi).tan_().mul_(sig).add_(med)
    elif op == "geometric_":
        denom = math.log1p(-a["p"])
        kind, tf = "open", lambda v, p: v.log_().div_(denom).ceil_()
    elif op == "trunc_normal_":
        kind, tf = "open", _trunc_normal_transform(a["mean"], a["std"], a["a"], a["b"])
    else:  # pragma: no cover - callers pass only the ops above
        raise AssertionError(op)
    # The fill's ~150 element-wise ops skip the modes below this one (they see plain local tensors
    # only; each mode's Python hook cost ~10 us an op, more than the op itself on small tensors);
    # the write to a DTensor is reported to NoteWrites by hand.
    with torch.no_grad(), _disable_current_modes():
        fill_box(local, gshape, offset, sid, kind, tf, params)
    if isinstance(dst, DTensor):
        note_written(dst)
    return dst


def _trunc_normal_transform(mean: float, std: float, a: float, b: float):
    alpha, beta = (a - mean) / std, (b - mean) / std
    flip = alpha > 0  # all mass above the mean: sample the mirrored lower tail, where Phi is precise
    lo_z, hi_z = (-beta, -alpha) if flip else (alpha, beta)
    p_lo = 0.5 * math.erfc(-lo_z / math.sqrt(2.0))
    p_hi = 0.5 * math.erfc(-hi_z / math.sqrt(2.0))

    def tf(v, p):
        z = torch.special.ndtri(v.mul_(p_hi - p_lo).add_(p_lo)).clamp_(lo_z, hi_z)
        if flip:
            z = z.neg_()
        return z.mul_(std).add_(mean).clamp_(a, b)

    return tf


_INPLACE = {
    "normal_": "normal_",
    "uniform_": "uniform_",
    "bernoulli_": "bernoulli_",
    "random_": "random_",
    "exponential_": "exponential_",
    "log_normal_": "log_normal_",
    "cauchy_": "cauchy_",
    "geometric_": "geometric_",
}


def _factory(func, a: dict[str, Any]) -> torch.Tensor:
    opts = {k: a.get(k) for k in ("dtype", "layout", "device", "pin_memory")}
    return aten.empty.memory_format(a["size"], **opts)


def _like(func, a: dict[str, Any]) -> torch.Tensor:
    opts = {k: a.get(k) for k in ("dtype", "layout", "device", "pin_memory", "memory_format")}
    return aten.empty_like.default(a["self"], **opts)


def _functional(func, a: dict[str, Any], state: _State) -> torch.Tensor | None:
    """Fresh-output random ops: an empty output filled by the matching in-place rule."""
    name = func.overloadpacket.__name__
    gen = {"generator": a.get("generator")}
    if name in ("randn", "rand", "randn_like", "rand_like"):
        out = _factory(func, a) if "size" in a else _like(func, a)
        if name.startswith("randn"):
            return _fill(out, "normal_", {"mean": 0.0, "std": 1.0, **gen}, state)
        return _fill(out, "uniform_", {"from": 0.0, "to": 1.0, **gen}, state)
    if name in ("randint", "randint_like"):
        out = _factory(func, a) if "size" in a else _like(func, a)
        lo, hi = a.get("low", 0), a["high"]
        return _fill(out, "random_", {"from": lo, "to": hi, **gen}, state)
    if name == "normal" and "size" in a:
        return _fill(_factory(func, a), "normal_", {"mean": a["mean"], "std": a["std"], **gen}, state)
    if name == "bernoulli" and func._overloadname == "default":
        out = aten.empty_like.default(a["self"])
        return _fill(out, "bernoulli_", {"p": a["self"], **gen}, state)
    return None


class _MeshIndependentRandom(TorchDispatchMode):
    """Route seeded random ops to :func:`_fill`; warn where a sharded DTensor gets a full tensor."""

    def __init__(self, state: _State):
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        state = self.state
        if torch.Tag.nondeterministic_seeded in func.tags:
            a = _bind(func, args, kwargs)
            packet = func.overloadpacket.__name__
            if packet in _INPLACE and isinstance(args[0], torch.Tensor):
                return _fill(args[0], _INPLACE[packet], a, state)
            out = _functional(func, a, state)
            if out is not None:
                return out
            return self._seeded_fallback(func, args, kwargs, a)
        if func is aten.copy_.default and _is_sharded(args[0]) and not isinstance(args[1], DTensor):
            if args[1].numel() == args[0].numel() > 1:
                state.warn_full(
                    state.fqn_of(args[0]) or f"DTensor{tuple(args[0].shape)}", "copy_ of a full tensor"
                )
        out = func(*args, **kwargs)
        if func is aten.detach.default and isinstance(args[0], torch.Tensor):
            fqn = state.fqn_of(args[0])
            if fqn is not None:
                state.register(out, fqn)
        return out

    def _seeded_fallback(self, func, args, kwargs, a):
        flat = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
        if any(isinstance(x, DTensor) for x in flat):
            raise NotImplementedError(f"{func} on a DTensor has no mesh-independent implementation")
        device = a.get("device") or (flat[0].device if flat else torch.device("cpu"))
        name = (
            self.state.name_for(flat[0])
            if flat
            else (self.state.scope[-1] if self.state.scope else _TEMPORARY)
        )
        sid = self.state.stream(name, func.overloadpacket.__name__, a.get("generator"))
        gen = torch.Generator(device=device)
        gen.manual_seed((sid[0] | sid[1] << 32) & (2**63 - 1))
        kw = {k: v for k, v in kwargs.items() if k != "generator"}
        try:
            return func.overloadpacket(*args, **kw, generator=gen)
        except (TypeError, RuntimeError) as e:
            raise NotImplementedError(f"{func} takes no generator: no mesh-independent implementation") from e


def _patched_init_functions(state: _State) -> dict[str, Callable]:
    """``nn.init`` functions without a torch-function hook: trunc_normal_ (one element-wise pass
    instead of rejection rounds) and the two that must see the whole target."""
    orig_orthogonal, orig_sparse = nn.init.orthogonal_, nn.init.sparse_

    def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        if tensor.is_meta:
            return tensor
        return _fill(
            tensor, "trunc_normal_", {"mean": mean, "std": std, "a": a, "b": b, "generator": generator}, state
        )

    def whole(orig, what):
        def run(tensor, *args, **kwargs):
            name = state.name_for(tensor)
            state.scope.append(name)
            try:
                if not isinstance(tensor, DTensor):
                    return orig(tensor, *args, **kwargs)
                local, gshape, offset = _box(tensor, name)
                if not _is_sharded(tensor):
                    orig(local, *args, **kwargs)
                    return tensor
                state.warn_full(name, f"nn.init.{what} needs the whole tensor")
                full = torch.empty(gshape, dtype=local.dtype, device=local.device)
                orig(full, *args, **kwargs)
                with torch.no_grad():
                    local.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, local.shape))])
                return tensor
            finally:
                state.scope.pop()

        run.__name__ = orig.__name__
        return run

    return {
        "trunc_normal_": trunc_normal_,
        "orthogonal_": whole(orig_orthogonal, "orthogonal_"),
        "sparse_": whole(orig_sparse, "sparse_"),
    }


@contextlib.contextmanager
def mesh_independent_context(module: nn.Module):
    """Context in which random fills of ``module``'s tensors are mesh-independent (module doc).

    Draws the 64-bit key from the CPU default generator on entry. Re-entrant (an inner entry shares
    the outer one's key and call numbers). Patches ``nn.Module.__setattr__`` (a tensor assigned to a
    parameter / buffer slot keeps the slot's FQN), ``nn.init.trunc_normal_``, ``orthogonal_`` and
    ``sparse_`` (and transformers' saved references to them) for its duration (process-wide; other
    code holding its own reference gets torch's versions: still mesh-independent through the ops
    they call, but torch's ``trunc_normal_`` then needs a global ``any`` per rejection round).
    """
    if getattr(_active, "state", None) is not None:
        yield _active.state
        return
    state = _State(module, _draw_key())
    # transformers (>= 5) keeps its own references to these nn.init functions and calls those.
    hf = sys.modules.get("transformers.initialization")
    tables = [vars(nn.init)] + [t for t in [getattr(hf, "TORCH_INIT_FUNCTIONS", None)] if isinstance(t, dict)]
    patches = _patched_init_functions(state)
    saved = [(table, name, table[name]) for table in tables for name in patches if name in table]
    # A tensor assigned to a parameter / buffer slot (``self.w = nn.Parameter(...)``) takes the
    # slot's FQN, as the parallel module's copy into its DTensor keeps it.
    slots: dict[tuple[int, str], str] = {}
    for rec in eager_tensors(module):
        for name in rec.module_names:
            path, _, attr = name.rpartition(".")
            slots[(id(module.get_submodule(path)), attr)] = rec.fqn
    setattr_before = nn.Module.__setattr__

    def setattr_keeping_fqn(self, name, value):
        setattr_before(self, name, value)
        fqn = slots.get((id(self), name))
        if fqn is not None and isinstance(value, torch.Tensor):
            state.register(value, fqn)

    _active.state = state
    # The generator runs ~150 small integer ops per 2^17-element piece: on CPU, intra-op threads
    # only add synchronisation (measured x93 slower than one thread with 2 ranks x 2 threads on 2
    # cores, tests/bench/init_cost.py), so fills run on one thread. Values do not depend on it.
    threads = torch.get_num_threads()
    try:
        for table, name, _ in saved:
            table[name] = patches[name]
        nn.Module.__setattr__ = setattr_keeping_fqn
        torch.set_num_threads(1)
        with _MeshIndependentRandom(state):
            yield state
    finally:
        torch.set_num_threads(threads)
        nn.Module.__setattr__ = setattr_before
        for table, name, fn in saved:
            table[name] = fn
        _active.state = None


def mesh_independent_init(module: nn.Module, fn: Callable[[nn.Module], Any] | None = None) -> nn.Module:
    """Run ``module.init_weights()`` (or ``fn(module)``) with mesh-independent random fills.

    On an ordinary module this gives, for the same default-generator state, bit-identical values to
    the parallel module's ``init_weights()`` on any mesh and placements (same device type). See the
    module doc for the rule and methods. A transformers model's ``init_weights`` runs as its
    constructor runs it (:func:`autoparallel.hf_init.construction_init`: ties made after the init,
    ``_is_hf_initialized`` marks cleared), however the model was built. Returns ``module``.

    Raises:
        TypeError: ``fn`` is None and ``module`` has no callable ``init_weights``.
        NotImplementedError: a seeded op on a DTensor that has no mesh-independent form.
    """
    construction = contextlib.nullcontext()
    if fn is None:
        init = getattr(module, "init_weights", None)
        if not callable(init):
            raise TypeError(f"{type(module).__name__} has no init_weights(); pass fn=")
        fn = lambda m: init()  # noqa: E731
        construction = construction_init(module)
    with construction, mesh_independent_context(module):
        fn(module)
    return module
