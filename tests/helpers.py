"""Helpers shared by the test files: exact state equality, a tiny model, a few training steps, the CLI.

Import them as ``from tests.helpers import assert_same_state, tiny_model, trained, run_cli``.
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["assert_same_state", "pools_idle", "run_cli", "same_state", "tiny_model", "trained"]


def _mapping_kind(m: Mapping) -> type:
    # A state_dict() is an OrderedDict and a snapshot of it a dict: the same kind of state.
    return dict if isinstance(m, dict) and type(m).__name__ in ("dict", "OrderedDict") else type(m)


def _differences(a: Any, b: Any, where: str, ordered: bool, out: list[str]) -> None:
    if isinstance(a, nn.Module) and isinstance(b, nn.Module):
        a, b = a.state_dict(), b.state_dict()
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            out.append(f"{where}: {type(a).__name__} != {type(b).__name__}")
            return
        a, b = a.detach(), b.detach()
        for what in ("dtype", "shape", "device", "layout"):
            if getattr(a, what) != getattr(b, what):
                out.append(f"{where}: {what} {getattr(a, what)} != {getattr(b, what)}")
                return
        if a.layout != torch.strided:
            a, b = a.to_dense(), b.to_dense()
        # Bits, not values: nan equals nan, -0.0 differs from 0.0.
        if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            out.append(f"{where}: tensor values differ")
        return
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if _mapping_kind(a) is not _mapping_kind(b):
            out.append(f"{where}: {type(a).__name__} != {type(b).__name__}")
            return
        if (list(a) != list(b)) if ordered else (set(a) != set(b)):
            out.append(f"{where}: keys {list(a)} != {list(b)}")
            return
        for k in a:
            _differences(a[k], b[k], f"{where}.{k}", ordered, out)
        return
    if type(a) is not type(b):
        out.append(f"{where}: {type(a).__name__} != {type(b).__name__}")
        return
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{where}: length {len(a)} != {len(b)}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _differences(x, y, f"{where}[{i}]", ordered, out)
    elif isinstance(a, float):
        if a.hex() != b.hex():  # bits: nan equals nan, -0.0 differs from 0.0
            out.append(f"{where}: {a!r} != {b!r}")
    elif a != b:
        out.append(f"{where}: {a!r} != {b!r}")


def assert_same_state(a: Any, b: Any, *, ordered: bool = False, where: str = "state") -> None:
    """Assert that ``a`` and ``b`` hold exactly the same state.

    ``a`` and ``b`` are modules (compared by their ``state_dict()``), tensors, or nested mappings,
    lists and tuples of them and of plain values (an optimizer's ``state_dict()``, extra state).
    Tensors must agree in dtype, shape, device and layout and bit for bit (``torch.equal`` on their
    bytes, so nan equals nan and -0.0 differs from 0.0); floats bit for bit; other values by type
    and ``==``; mappings by type (``dict`` and ``OrderedDict`` alike) and key set (``ordered=True``:
    key order too); lists and tuples by type, length and element. Raises ``AssertionError`` naming
    every differing path under ``where``.
    """
    out: list[str] = []
    _differences(a, b, where, ordered, out)
    assert not out, "\n".join(out[:20])


def same_state(a: Any, b: Any, *, ordered: bool = False) -> bool:
    """``True`` when :func:`assert_same_state` would pass: for code that branches on equality (a rank
    reporting a check, a trial telling the old values from the new)."""
    out: list[str] = []
    _differences(a, b, "state", ordered, out)
    return not out


def tiny_model(*sizes: int, seed: int = 0, relu: bool = False, norm: bool = False) -> nn.Module:
    """A float32 model of ``nn.Linear`` layers through ``sizes`` (default 4 -> 3 -> 2), its values
    drawn after ``torch.manual_seed(seed)``.

    Two sizes give a bare ``nn.Linear`` (keys ``weight``, ``bias``); more give an ``nn.Sequential``
    (keys ``0.weight``, ``0.bias``, ...), with an ``nn.ReLU`` between the linears when ``relu`` and a
    ``BatchNorm1d`` at the end when ``norm`` (buffers: running statistics and an int64 counter).
    """
    sizes = sizes or (4, 3, 2)
    torch.manual_seed(seed)
    if len(sizes) == 2 and not norm:
        return nn.Linear(*sizes)
    layers: list[nn.Module] = []
    for i, o in zip(sizes, sizes[1:]):
        layers += [nn.ReLU()] if relu and layers else []
        layers.append(nn.Linear(i, o))
    if norm:
        layers.append(nn.BatchNorm1d(sizes[-1]))
    return nn.Sequential(*layers)


def trained(
    model: nn.Module | Callable[[], nn.Module] | None = None,
    optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
    *,
    seed: int = 0,
    steps: int = 1,
    batch: int = 4,
    scheduler: bool = False,
    **opt_kwargs: Any,
):
    """``model`` (default :func:`tiny_model`; a module class or other callable is called after
    ``torch.manual_seed(seed)``) after ``steps`` optimizer steps on fixed random batches.

    Each step runs ``model(x).sum().backward()`` on a ``[batch, in_features]`` float32 batch (the
    first ``nn.Linear``'s input size; seeded by the step, so equal calls give equal states), then
    ``optimizer.step()``, the scheduler's step and ``zero_grad()``. ``opt_kwargs`` go to the optimizer
    (``lr`` defaults to 0.01). Returns ``(model, optimizer)``, or ``(model, optimizer, scheduler)``
    with ``scheduler=True`` (a ``LambdaLR`` halving the rate each step).
    """
    if model is None:
        model = tiny_model(seed=seed)
    elif not isinstance(model, nn.Module):
        torch.manual_seed(seed)
        model = model()
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    opt = optimizer(model.parameters(), **{"lr": 0.01, **opt_kwargs})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s) if scheduler else None
    for step in range(steps):
        x = torch.randn(batch, first.in_features, generator=torch.Generator().manual_seed(step))
        model(x).sum().backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
    return (model, opt, sched) if scheduler else (model, opt)


def run_cli(*argv: Any, capsys=None, as_json: bool = False, quiet_warnings: bool = False):
    """Run the ``fqnckpt`` command line (``checkpoint.cli.main``) in this process with ``argv`` (each
    item passed through ``str``); returns ``(exit code, stdout, stderr)``.

    With pytest's ``capsys`` the output is read from it (the capture emptied first); without, it is
    redirected around the call. ``as_json=True`` appends ``--json`` and returns stdout parsed
    (``json.loads``; a ``json.JSONDecodeError`` when the command printed no JSON).
    ``quiet_warnings=True`` silences the warnings raised during the call.
    """
    code, out, err = _run_cli([str(a) for a in argv] + (["--json"] if as_json else []), capsys, quiet_warnings)
    return code, (json.loads(out) if as_json else out), err


def _run_cli(args: list[str], capsys, quiet_warnings: bool) -> tuple[int, str, str]:
    from checkpoint.cli import main

    with warnings.catch_warnings() if quiet_warnings else contextlib.nullcontext():
        if quiet_warnings:
            warnings.simplefilter("ignore")
        if capsys is not None:
            capsys.readouterr()
            code = main(args)
            captured = capsys.readouterr()
            return code, captured.out, captured.err
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
        return code, out.getvalue(), err.getvalue()


def pools_idle(timeout: float = 60) -> None:
    """Return once every thread of every fqnckpt pool (``checkpoint.storage.threads``) has finished
    every task submitted so far: each pool's workers all meet at one barrier, and a pool takes its
    tasks in order, so a worker waiting there has finished whatever it took before. For tests that
    check nothing happens after a call returned or raised, without sleeping "long enough".
    Raises ``threading.BrokenBarrierError`` when a pool stays busy ``timeout`` seconds."""
    from checkpoint.storage import threads

    for pool in list(threads._pools.values()):
        barrier = threading.Barrier(pool._max_workers)
        for fut in [pool.submit(barrier.wait, timeout) for _ in range(pool._max_workers)]:
            fut.result()


def leases_here(root) -> bool:
    """Whether a file under directory ``root`` can be mapped under a read lease here
    (:mod:`checkpoint.storage.leased`: Linux, a filesystem with leases, the caller's file)."""
    import os

    from checkpoint.storage import leased

    path = os.path.join(root, "lease-probe")
    with open(path, "wb") as f:
        f.write(b"x" * 64)
    fd = os.open(path, os.O_RDONLY)
    try:
        m = leased.take(fd)
        if m is not None:
            m.release()
        return m is not None
    finally:
        os.close(fd)
        os.unlink(path)
