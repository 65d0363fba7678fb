"""The one committed checkpoint a thread reads, on any byte store (:func:`checkpoint_view`).

Below the readers and the extra-state reader, so that none imports another: every part read
inside one view (model index, optimizer, extra state) belongs to the same save. On a local
directory the view also holds the reader's shared lock
(:func:`checkpoint.storage.local_commit.read_view`: no commit runs while files are opened); on
object storage the model index fetched once is the commit marker.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

from . import paths
from .bytestore import ByteStore, LocalStore
from .local_commit import read_view
from .location import store_of
from .commit import MODEL_INDEX, recorded_object
from .st_header import parse_index_bytes

_views = threading.local()


class CheckpointView:
    """One committed checkpoint on ``store``: its model index fetched once (``index_raw`` is None
    when there is none; ``index`` parsed on first use), and the objects it names.

    Raises (``index``): CorruptCheckpointError: the model index does not parse."""

    def __init__(self, store: ByteStore):
        self.store = store
        self.index_raw = store.get(MODEL_INDEX)
        self._cache: dict[str, bytes | None] = {}

    @functools.cached_property
    def index(self):
        return parse_index_bytes(self.index_raw, self.store.url_of(MODEL_INDEX)) if self.index_raw else None

    def object_of(self, name: str) -> str | None:
        """The object holding file ``name`` of this checkpoint (None: this save has none)."""
        if name == MODEL_INDEX:
            return name if self.index_raw is not None else None
        return recorded_object(self.index, name)

    def member_bytes(self, name: str) -> bytes | None:
        """Bytes of file ``name`` of this checkpoint, None when it has none (fetched once)."""
        if name == MODEL_INDEX:
            return self.index_raw  # the commit marker this view holds, never fetched again
        if name not in self._cache:
            obj = self.object_of(name)
            if obj is not None:
                paths.check_name(self.store.url, obj)
            self._cache[name] = self.store.get(obj) if obj is not None else None
        return self._cache[name]


@contextlib.contextmanager
def checkpoint_view(where: Any) -> Iterator[CheckpointView]:
    """One committed checkpoint at ``where`` (a local path, or a byte store that
    :func:`~checkpoint.storage.location.resolve` gave) for every part read inside, whatever the
    backend: a :class:`CheckpointView` held for this thread (nested blocks on the same URL share
    it: every part read inside belongs to the same save), and on a local directory the reader's
    shared lock (:func:`~checkpoint.storage.local_commit.read_view`).

    Raises:
        InterruptedCommitError: a local commit of ours was interrupted there (nothing is changed).
    """
    store = store_of(where)
    lock = read_view(store.root) if isinstance(store, LocalStore) else contextlib.nullcontext()
    held: dict[str, CheckpointView] = _views.__dict__.setdefault("held", {})
    with lock:
        if store.url in held:
            yield held[store.url]
            return
        view = held[store.url] = CheckpointView(store)
        try:
            yield view
        finally:
            del held[store.url]


def current_view(url: str) -> CheckpointView | None:
    """The view of ``url`` this thread holds (see :func:`checkpoint_view`), if any."""
    return getattr(_views, "held", {}).get(url.rstrip("/"))
