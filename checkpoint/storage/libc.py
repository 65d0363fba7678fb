"""Linux libc calls that neither os nor torch expose (sync_file_range, madvise with
MADV_POPULATE_WRITE): looked up once through ctypes, False where absent."""

from __future__ import annotations

import functools
import sys


@functools.cache
def libc_function(name: str, argtypes: tuple, restype=None):
    """libc's ``name`` with ``argtypes`` (ctypes types) and an int ``restype``, errno kept; False
    off Linux or where libc lacks it (callers then fall back to what os offers)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return False
    fn.argtypes = list(argtypes)
    fn.restype = restype or ctypes.c_int
    return fn
