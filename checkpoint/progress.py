"""The one progress-bar policy of fqnckpt's long operations (save, load, migrate, verify, diff).

``progress=None`` (the default everywhere) shows a tqdm bar on stderr only when stderr is a
terminal, and only once the work has taken over a second (tqdm's ``delay``); ``True`` always
(still after a second), ``False`` never.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from tqdm import tqdm

DELAY_S = 1.0  # a bar appears only for work longer than this (seconds)


def progress_enabled(progress: bool | None) -> bool:
    """``progress`` if given, else whether stderr is a terminal."""
    if progress is not None:
        return bool(progress)
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def progress_bar(total: int, desc: str, progress: bool | None) -> tqdm:
    """A byte-counting tqdm bar on stderr under the policy above; use as a context manager."""
    return tqdm(
        total=total, unit="B", unit_scale=True, desc=desc, delay=DELAY_S, file=sys.stderr,
        disable=not progress_enabled(progress), leave=False,
    )  # fmt: skip


def _rank0(progress: bool | None) -> bool | None:
    """Only rank 0 of a process group shows a bar (every rank does the same work)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return False
    return progress


@contextlib.contextmanager
def counted_fetches(parts: Any, desc: str, progress: bool | None) -> Iterator[None]:
    """``save``'s hook: each ``part.fetch(spec)`` of ``parts`` advances one bar by ``spec.nbytes``."""
    total = sum(spec.nbytes for p in parts for spec in p.specs)
    with progress_bar(total, desc, _rank0(progress)) as bar:
        if not bar.disable:
            for p in parts:
                p.fetch = _counting(p.fetch, bar)
        yield


def _counting(fetch: Callable, bar: tqdm) -> Callable:
    def fetch_and_count(spec):
        t = fetch(spec)
        bar.update(spec.nbytes)
        return t

    return fetch_and_count


@contextlib.contextmanager
def copy_progress(reader: Any, copies: Any, progress: bool | None) -> Iterator[Callable[[str], None] | None]:
    """``load``'s hook: yields ``on_copy(key)``, called before each tensor is copied, or None
    when no bar is shown (nothing to do per tensor: loads of 10^4-10^5 tensors)."""
    show = _rank0(progress)
    if not progress_enabled(show):
        yield None
        return
    sizes = {a.key: reader.spec(a.key).nbytes for a in copies}  # load's CopyActions
    with progress_bar(sum(sizes.values()), "load", show) as bar:
        yield lambda key: bar.update(sizes[key])
