"""This process's thread pools for byte work that releases the GIL (``preadv``, xxhash): one pool
per name, made on first use, and forgotten in a forked child, which has none of the parent's
threads (an inherited pool takes work and never runs it: a save in such a child waited forever).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_pools: dict[str, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def pool(name: str, workers: int) -> ThreadPoolExecutor:
    """The pool ``name`` of this process (threads named ``fqnckpt-<name>``), made with
    ``workers`` threads on first use."""
    with _lock:
        p = _pools.get(name)
        if p is None:
            p = _pools[name] = ThreadPoolExecutor(workers, thread_name_prefix=f"fqnckpt-{name}")
        return p


def _forget() -> None:
    global _lock
    _pools.clear()
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)
