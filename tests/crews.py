"""Test support for reads shared by a crew of threads (:mod:`checkpoint.storage.ownership`):
which thread takes which piece is the scheduler's choice, so tests that need both the calling
thread and pool threads to read make them meet with events instead of sleeping."""

from __future__ import annotations

import threading


class BothSides:
    """Which thread takes which piece of a shared read is the scheduler's choice. Inside a crew
    with pool helpers (``ownership.share``), :meth:`enter`, called before a piece is read, holds a
    thread until the other side (the calling thread / a pool thread) of the same crew holds a piece
    too: each thread waits holding at most one piece and a crew has more pieces than helpers, so
    every shared read then has both sides reading, whatever the machine's load. The wait is
    bounded only so that a defect (one side never reads) fails instead of hanging. ``names``: the
    threads that read, in order; ``crews``: how many shared reads ran."""

    def __init__(self, monkeypatch):
        from checkpoint.storage import ownership

        self.names, self.crews, self._armed = [], 0, False
        self._main, self._pool = threading.Event(), threading.Event()
        real = ownership.share

        def share(name, workers, work, helpers):
            if helpers < 1 or self._armed:  # no helper (or a nested crew): nothing to wait for
                return real(name, workers, work, helpers)
            self.crews += 1
            self._main.clear()
            self._pool.clear()
            self._armed = True
            try:
                return real(name, workers, work, helpers)
            finally:
                self._armed = False

        monkeypatch.setattr(ownership, "share", share)

    def enter(self) -> None:
        me = threading.current_thread()
        self.names.append(me.name)
        if self._armed:
            mine, other = (self._main, self._pool) if me is threading.main_thread() else (self._pool, self._main)
            mine.set()
            assert other.wait(60), f"{me.name} held a piece and the other side of its crew took none"

    def saw_both(self) -> bool:
        return threading.main_thread().name in self.names and any(n.startswith("fqnckpt-read") for n in self.names)
