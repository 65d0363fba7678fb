"""Loading into accelerator targets (CUDA, ...) through pinned host buffers, copies overlapped
with reads.

``preadv`` cannot read into accelerator memory. Reading each tensor into a new pageable CPU
tensor and ``copy_``-ing it over (what ``safe_open`` + ``.to("cuda")`` does) allocates host memory
per tensor and makes each host-to-device copy synchronous. Here the reader's
:meth:`~checkpoint.storage.reader.CheckpointReader.read_many` (``preadv`` on its threads) fills one
of two host buffers of :data:`CHUNK` bytes, pinned when the target is on CUDA, with the next pieces
of the targets; each piece is then copied to its target with ``non_blocking=True`` on the current
stream, and the next chunk is read into the other buffer while those copies run. An event recorded
after a chunk's copies says when its buffer may be filled again. Tensors larger than a chunk are
read in row ranges (each one byte range of the file).

Ownership (:mod:`checkpoint.storage.ownership`, rule 1): the copies read the pinned buffers, so
:func:`read_to_device` returns or raises only after every copy it issued has finished.
Verified on CPU targets through the same code path (tests/test_device_load.py); the CUDA run is
``tests/gpu/run.sh``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

CHUNK = 64 << 20  # bytes per host buffer (two are used)
_ALIGN = 64


def _pieces(
    out: torch.Tensor, gsl: tuple[slice, ...], item: int, chunk: int, d: int = 0
) -> Iterator[tuple[torch.Tensor, tuple[slice, ...]]]:
    """``(target piece, global slices)`` of at most ``chunk`` bytes each (a piece of one element
    can be larger), cut along the first dim that has more than one index; a block that is one byte
    range of the file (see ``CheckpointReader._block_span``) gives pieces that are too."""
    n = out.numel() * item
    lens = out.shape
    while d < len(lens) and lens[d] == 1:
        d += 1
    if n <= chunk or d >= len(lens):
        yield out, gsl
        return
    row = n // lens[d]
    start = gsl[d].start
    if row <= chunk:
        k = max(1, chunk // row)
        for lo in range(0, lens[d], k):
            hi = min(lens[d], lo + k)
            yield out.narrow(d, lo, hi - lo), gsl[:d] + (slice(start + lo, start + hi),) + gsl[d + 1 :]
        return
    for lo in range(lens[d]):
        sub = gsl[:d] + (slice(start + lo, start + lo + 1),) + gsl[d + 1 :]
        yield from _pieces(out.narrow(d, lo, 1), sub, item, chunk, d + 1)


def _event(device: torch.device):
    if device.type == "cuda":
        ev = torch.cuda.Event()
        ev.record()
        return ev
    return None  # other devices: copy_ without non_blocking is finished when it returns


def read_to_device(reader, items: Sequence[tuple], chunk: int = CHUNK) -> list[bool]:
    """Read ``(key, out)`` / ``(key, out, global slices)`` items (as
    :meth:`CheckpointReader.read_many` takes them) whose ``out`` is not on the CPU, through two
    host buffers of ``chunk`` bytes (pinned for CUDA targets); per item, whether it was read
    (False: not one byte range of the file, or another dtype than stored; the caller copies it
    another way, overwriting what a partial read left). Targets may be non-contiguous views.

    Raises: what ``read_many`` raises (key and file named), after every copy issued finished.
    """
    done = [True] * len(items)
    if not items:
        return done
    pin = any(it[1].device.type == "cuda" for it in items) and torch.cuda.is_available()
    work: list[tuple[int, str, torch.Tensor, tuple[slice, ...] | None]] = []
    for i, it in enumerate(items):
        key, out = it[0], it[1]
        try:
            shape = tuple(reader.spec(key).shape)
        except Exception:  # noqa: BLE001 - unknown here: the caller's own path names it
            done[i] = False
            continue
        gsl = it[2] if len(it) > 2 else tuple(slice(0, n) for n in shape)
        if len(it) <= 2 and tuple(out.shape) != shape:
            done[i] = False
            continue
        for piece, sl in _pieces(out, tuple(gsl), out.element_size(), chunk):
            if piece.numel():
                work.append((i, key, piece, sl if (len(it) > 2 or piece is not out) else None))
    if not work:
        return done
    aligned = [-(-p.numel() * p.element_size() // _ALIGN) * _ALIGN for _, _, p, _ in work]
    size = max(max(aligned), min(chunk, sum(aligned)))
    bufs: list[torch.Tensor | None] = [None, None]  # the second only when a chunk follows
    events: list = [None, None]
    which = 0

    def flush(batch) -> None:
        nonlocal which
        if bufs[which] is None:
            bufs[which] = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        buf = bufs[which]
        if events[which] is not None:
            events[which].synchronize()  # its previous copies are done: the buffer may be refilled
            events[which] = None
        staged, at = [], 0
        for i, key, piece, sl in batch:
            n = piece.numel() * piece.element_size()
            view = buf[at : at + n].view(piece.dtype).view(piece.shape)
            staged.append((key, view) if sl is None else (key, view, sl))
            at += -(-n // _ALIGN) * _ALIGN
        ok = reader.read_many(staged)
        for (i, _, piece, _), st, good in zip(batch, staged, ok):
            if good and done[i]:
                piece.copy_(st[1], non_blocking=pin)
            else:
                done[i] = False
        events[which] = _event(piece.device)
        which ^= 1

    try:
        batch, fill = [], 0
        for w, n in zip(work, aligned):
            if batch and fill + n > size:
                flush(batch)
                batch, fill = [], 0
            batch.append(w)
            fill += n
        if batch:
            flush(batch)
    finally:  # rule 1: the copies read the host buffers (an error may leave some without an event)
        if pin:
            torch.cuda.current_stream().synchronize()
        else:
            for ev in events:
                if ev is not None:
                    ev.synchronize()
    return done


__all__ = ["CHUNK", "read_to_device"]
