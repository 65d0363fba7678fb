"""Which kind of filesystem a file or directory is on, where the fastest way to move its bytes
differs: tmpfs / ramfs (page-cache memory in 4 KiB pages, nothing to write back) or anything else.
Read from ``/proc/self/mountinfo`` once per device (``st_dev``): parsing it costs ~0.1 ms a call.
"""

from __future__ import annotations

import os
import re

_IN_MEMORY: dict[int, bool] = {}  # st_dev -> on tmpfs / ramfs
_OCTAL = re.compile(r"\\([0-7]{3})")  # mountinfo writes space, tab, newline, backslash as \040 \011 \012 \134


def in_memory_dir(directory: str) -> bool:
    """True when ``directory`` is on tmpfs / ramfs (False if unknown)."""
    try:
        dev = os.stat(directory).st_dev
    except OSError:
        return False
    known = _IN_MEMORY.get(dev)
    if known is None:
        known = _IN_MEMORY[dev] = _mount_type(os.path.realpath(directory)) in ("tmpfs", "ramfs")
    return known


def _mount_type(real: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """The filesystem type of the longest mount point above the resolved path ``real``
    (``mountinfo``: proc(5)'s format; "" if unreadable)."""
    try:
        with open(mountinfo) as f:
            mounts = [line.split(" - ") for line in f]
    except OSError:
        return ""
    best, fstype = "", ""
    for pre, post in (m for m in mounts if len(m) == 2):
        point = _OCTAL.sub(lambda m: chr(int(m[1], 8)), pre.split()[4])
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, fstype = point, post.split()[0]
    return fstype
