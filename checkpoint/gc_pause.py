"""``gc_paused``: the cyclic garbage collector off for the length of one load / save / migrate.

Why: planning a checkpoint of 10^4-10^5 tensors creates several objects per tensor (specs,
entries, actions) and frees almost none, so each allocation threshold starts a collection that
walks everything alive, a large share of a load of 20,000 tensors (tests/bench/checkpoint_bench.py
shows it). Reference counting still frees everything; collection resumes on return (or raise).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def gc_paused(fn: F) -> F:
    """Decorate ``fn`` so the cyclic collector is disabled while it runs (re-enabled after, if it
    was enabled on entry: nested calls and callers that disabled it themselves are left alone)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return wrapper  # type: ignore[return-value]
