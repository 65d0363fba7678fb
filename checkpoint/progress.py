"""The one progress-bar policy of fqnckpt's long operations (save, load, migrate, verify, diff).

``progress=None`` (the default everywhere) shows a tqdm bar on stderr only when stderr is a
terminal, and only once the work has taken over a second (tqdm's ``delay``); ``True`` always
(still after a second), ``False`` never.
"""

from __future__ import annotations

import sys

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
