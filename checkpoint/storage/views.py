"""The one committed checkpoint a thread reads from object storage (:func:`remote_view`).

Below both the remote reader and the extra-state reader, so that neither imports the other: every
part read inside one view (model index, optimizer, extra state) belongs to the same save.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from . import paths
from .bytestore import ByteStore
from .commit import MODEL_INDEX, recorded_object
from .st_header import parse_index_bytes

_views = threading.local()


class RemoteView:
    """One committed checkpoint on ``store``: its model index fetched once (``index_raw`` is None
    when there is none), and the objects it names."""

    def __init__(self, store: ByteStore):
        self.store = store
        self.index_raw = store.get(MODEL_INDEX)
        self.index = parse_index_bytes(self.index_raw, store.url_of(MODEL_INDEX)) if self.index_raw else None
        meta = self.index.metadata.fqnckpt if self.index is not None else None
        self.objects = dict(meta.objects) if meta is not None and meta.objects is not None else None
        self._cache: dict[str, bytes | None] = {}

    def object_of(self, name: str) -> str | None:
        """The object holding file ``name`` of this checkpoint (None: this save has none)."""
        if name == MODEL_INDEX:
            return name if self.index_raw is not None else None
        return recorded_object(self.index, name)

    def member_bytes(self, name: str) -> bytes | None:
        """Bytes of file ``name`` of this checkpoint, None when it has none (fetched once)."""
        if name not in self._cache:
            obj = self.object_of(name)
            if obj is not None:
                paths.check_name(self.store.url, obj)
            self._cache[name] = self.store.get(obj) if obj is not None else None
        return self._cache[name]


@contextlib.contextmanager
def remote_view(store: ByteStore) -> Iterator[RemoteView]:
    """Hold one :class:`RemoteView` of ``store`` for this thread (nested blocks on the same URL
    share it): every part read inside belongs to the same save."""
    held: dict[str, RemoteView] = _views.__dict__.setdefault("held", {})
    if store.url in held:
        yield held[store.url]
        return
    view = held[store.url] = RemoteView(store)
    try:
        yield view
    finally:
        del held[store.url]


def current_view(url: str) -> RemoteView | None:
    """The view of ``url`` this thread holds (see :func:`remote_view`), if any."""
    return getattr(_views, "held", {}).get(url.rstrip("/"))
