"""Loads under read leases (checkpoint.storage.leased) pushed where they could break: a load
interrupted while a mapped view is alive gives every lease back and raises its own error; what a
load copies is checked under the lease that covers the copies, also when the same reader was
checked (or the files verified) before the lease was taken."""

from __future__ import annotations

import os

import pytest
import torch

import checkpoint
from checkpoint.errors import CorruptCheckpointError
from checkpoint.storage import leased, read_check
from checkpoint.storage.opening import open_checkpoint
from checkpoint.storage.reader import CheckpointReader
from tests.helpers import assert_same_state, leases_here


@pytest.fixture
def two_files(tmp_path):
    """Four 1 MiB tensors in two shard files (each read at once is mapped under a lease)."""
    if not leases_here(tmp_path):
        pytest.skip("no read leases on this filesystem or platform")
    g = torch.Generator().manual_seed(0)
    sd = {f"w{i}": torch.randn(512, 512, generator=g) for i in range(4)}
    root = str(tmp_path / "ckpt")
    checkpoint.save(sd, root, max_shard_size=2 << 20)
    shards = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".safetensors"))
    assert len(shards) == 2
    return sd, root, shards


def _flip(path: str, offset: int) -> None:
    """Flip one byte in place (same inode, same size): a writer that came between two reads."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_interrupt_while_a_mapped_view_is_alive_gives_every_lease_back(two_files, monkeypatch):
    sd, root, _ = two_files
    real = read_check._digest.new

    def interrupted(data=None):  # Ctrl-C arriving while a view of the mapping is held
        if isinstance(data, memoryview):
            raise KeyboardInterrupt
        return real() if data is None else real(data)

    monkeypatch.setattr(read_check._digest, "new", interrupted)
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    with pytest.raises(KeyboardInterrupt):  # not a BufferError from closing the mapping
        checkpoint.load(dst, root)
    assert leased._by_fd == {}
    assert all(torch.count_nonzero(t) == 0 for t in dst.values())


def test_reader_left_open_checks_again_a_file_changed_between_loads(two_files):
    sd, root, shards = two_files
    with open_checkpoint(root) as r:
        first = torch.zeros(512, 512)
        assert r.read_many([("w3", first)]) == [True]
        assert torch.equal(first, sd["w3"])
        _flip(shards[1], os.path.getsize(shards[1]) - 1)  # the last byte of w3, between two loads
        second = torch.zeros(512, 512)
        with pytest.raises(CorruptCheckpointError, match="w3"):
            r.read_many([("w3", second)])
        assert torch.count_nonzero(second) == 0
    assert leased._by_fd == {}


def test_verified_load_checks_the_bytes_it_copies_under_the_lease(two_files, monkeypatch):
    sd, root, shards = two_files
    real = CheckpointReader.reading
    flipped = []

    def writer_before_the_span(self):  # after load(verify=True) verified the files while planning
        if not self._span_depth and not flipped:
            _flip(shards[1], os.path.getsize(shards[1]) - 1)
            flipped.append(True)
        return real(self)

    monkeypatch.setattr(CheckpointReader, "reading", writer_before_the_span)
    m = torch.nn.Module()
    for k in sd:
        m.register_buffer(k, torch.zeros(512, 512))
    with pytest.raises(CorruptCheckpointError, match="w3"):
        checkpoint.load(m, root, verify=True)
    assert flipped == [True]
    assert_same_state(m.state_dict(), {k: torch.zeros(512, 512) for k in sd})
    assert leased._by_fd == {}


def test_interrupt_while_taking_a_lease_leaves_no_lease_held(two_files, monkeypatch):
    import fcntl

    sd, root, _ = two_files
    real = leased.np.frombuffer
    calls = []

    def interrupted(*a, **k):  # Ctrl-C arriving right after the file was mapped under its lease
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(leased.np, "frombuffer", interrupted)
    with open_checkpoint(root) as r:  # a reader left open after the interrupted load
        out = torch.zeros(512, 512)
        with pytest.raises(KeyboardInterrupt):
            r.read_many([("w0", out)])
        assert calls == [1]
        fds = list(r._fds.values())
        assert fds and all(fcntl.fcntl(fd, leased.F_GETLEASE) == fcntl.F_UNLCK for fd in fds)
        monkeypatch.setattr(leased.np, "frombuffer", real)
        assert r.read_many([("w0", out)]) == [True]  # the next load maps and leases again
        assert torch.equal(out, sd["w0"])
    assert leased._by_fd == {}


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, *args: str):
    """``script`` in a new Python process (a SIGSEGV there fails the test, not the suite)."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": _REPO}
    cmd = [sys.executable, "-c", script, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)

_SHARED_READER = """
import sys, threading, torch
import checkpoint
from checkpoint.storage import leased
from checkpoint.storage.opening import open_checkpoint
root = sys.argv[1]
r = open_checkpoint(root)
want = {k: torch.load(sys.argv[2])[k] for k in ("w0", "w1")}
span_ended, in_copy = threading.Event(), threading.Event()
real = leased.LeasedMap.intact
def intact(self):  # thread B found the lease intact and is about to copy from the mapping...
    ok = real(self)
    if threading.current_thread().name == "B" and not in_copy.is_set():
        in_copy.set()
        span_ended.wait(60)  # ...while thread A's span ends
    return ok
leased.LeasedMap.intact = intact
got = []
b = threading.Thread(target=lambda: got.append(torch.equal(r.get("w1"), want["w1"])), name="B")
with r.reading():
    out = torch.zeros_like(want["w0"])
    r.read_many([("w0", out)])  # maps the file under a lease
    b.start()
    assert in_copy.wait(60)
span_ended.set()
b.join()
r.close()
print(got, torch.equal(out, want["w0"]), leased._by_fd)
"""


def test_read_of_one_thread_outlives_the_span_of_another_on_a_shared_reader(two_files, tmp_path):
    sd, root, _ = two_files
    torch.save(sd, tmp_path / "want.pt")
    p = _run(_SHARED_READER, root, str(tmp_path / "want.pt"))
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])  # -11: thread B copied from an unmapped file
    assert p.stdout.split() == ["[True]", "True", "{}"]


def test_sigurg_handler_installed_during_a_load_sees_no_notice(two_files, monkeypatch):
    import signal
    import threading

    sd, root, shards = two_files
    seen, writers = [], []
    real = CheckpointReader.check_first

    def handler_then_writer(self, *a, **k):
        out = real(self, *a, **k)
        maps = [m for m in self._maps.values() if m is not None]
        if maps and not writers:  # the program installs its own handler while the load runs
            signal.signal(signal.SIGURG, lambda *args: seen.append(args))
            w = threading.Thread(target=lambda: open(shards[0], "r+b").close())  # waits for the load
            writers.append(w)
            w.start()
            while all(m.intact() for m in maps):  # the break (and any notice) has happened
                threading.Event().wait(0.001)
        return out

    monkeypatch.setattr(CheckpointReader, "check_first", handler_then_writer)
    old = signal.getsignal(signal.SIGURG)
    try:
        dst = {k: torch.zeros_like(v) for k, v in sd.items()}
        checkpoint.load(dst, root)
        writers[0].join(timeout=120)
    finally:
        signal.signal(signal.SIGURG, old)
    assert_same_state(dst, sd)
    assert seen == [] and leased._by_fd == {}


_CLOSED_UNDER = """
import sys, threading, torch
from checkpoint.storage import leased
from checkpoint.storage.opening import open_checkpoint
r = open_checkpoint(sys.argv[1])
want = torch.load(sys.argv[2])["w0"]
closed, in_copy = threading.Event(), threading.Event()
real = leased.LeasedMap.intact
def intact(self):  # thread B found the lease intact and is about to copy from the mapping...
    ok = real(self)
    if threading.current_thread() is not threading.main_thread() and not in_copy.is_set():
        in_copy.set()
        closed.wait(60)  # ...while the main thread closes the reader
    return ok
leased.LeasedMap.intact = intact
out = torch.zeros_like(want)
b = threading.Thread(target=lambda: r.read_many([("w0", out)]))
b.start()
assert in_copy.wait(60)
r.close()
closed.set()
b.join()
print(torch.equal(out, want), r._fds, leased._by_fd)
"""


def test_close_during_another_threads_read_waits_for_it(two_files, tmp_path):
    sd, root, _ = two_files
    torch.save(sd, tmp_path / "want.pt")
    p = _run(_CLOSED_UNDER, root, str(tmp_path / "want.pt"))
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])  # -11: a copy from the unmapped file
    assert p.stdout.split() == ["True", "{}", "{}"]  # read whole (no LoadError on a closed file), then closed
