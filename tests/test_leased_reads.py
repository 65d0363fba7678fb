"""A load reads its files from mappings held under a read lease (checkpoint.storage.leased):
a writer or a truncation that comes between the check and the copies waits until the load ends,
so the bytes copied are the bytes checked and no mapped read can meet a cut file (SIGBUS); where
no lease can be had, every read goes through preadv and the load is the same."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

import checkpoint
from checkpoint.storage import leased
from checkpoint.storage.reader import CheckpointReader
from checkpoint.storage.opening import open_checkpoint
from tests.helpers import assert_same_state, leases_here


@pytest.fixture
def saved(tmp_path):
    if not leases_here(tmp_path):
        pytest.skip("no read leases on this filesystem or platform")
    g = torch.Generator().manual_seed(0)
    sd = {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(4)}  # 2 MiB each: mapped
    root = str(tmp_path / "ckpt")
    checkpoint.save(sd, root)
    (shard,) = [f for f in os.listdir(root) if f.endswith(".safetensors")]
    return sd, root, os.path.join(root, shard)


def _after_check(monkeypatch, action):
    """Run ``action(reader)`` right after the load's check (its first ``check_first``; the copies'
    own call finds every tensor checked), before any copy."""
    original = CheckpointReader.check_first
    calls = []

    def check_then(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            action(self)
        return out

    monkeypatch.setattr(CheckpointReader, "check_first", check_then)


def _spy(action):
    original = CheckpointReader.check_first

    def check_then(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        action(self)
        return out

    return check_then


def _wait_broken(reader: CheckpointReader) -> None:
    """Until the lease of every mapped file reports a writer waiting (bounded: a hang guard)."""
    maps = [m for m in reader._maps.values() if m is not None]
    assert maps, "the load mapped no file under a lease"
    for m in maps:
        for _ in range(20000):
            if not m.intact():
                break
            threading.Event().wait(0.001)
        assert not m.intact()


def _flipper(shard: str):
    """``(bytes before, opened, thread)``: a thread (not started) that opens ``shard`` for writing
    (waiting while a load holds its lease), notes it in ``opened`` and flips its last byte."""
    with open(shard, "rb") as f:
        before = f.read()
    offset, opened = len(before) - 1, []  # the last byte of the last tensor

    def flip() -> None:
        with open(shard, "r+b") as f:  # waits while the load holds its lease
            opened.append(True)
            f.seek(offset)
            f.write(bytes([before[offset] ^ 0xFF]))

    return before, opened, threading.Thread(target=flip)


def test_load_maps_under_a_lease_and_gives_it_back(saved, monkeypatch):
    sd, root, shard = saved
    seen = []
    monkeypatch.setattr(CheckpointReader, "check_first", _spy(lambda r: seen.append([(n, m.intact()) for n, m in r._maps.items() if m is not None])))
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    checkpoint.load(dst, root)
    assert seen and all(s == [(os.path.basename(shard), True)] for s in seen)  # mapped and leased
    assert_same_state(dst, sd)
    assert leased._by_fd == {}
    fd = os.open(shard, os.O_WRONLY)  # the lease is given back: a writer opens at once
    os.close(fd)


def test_writer_between_check_and_copies_waits_for_the_load(saved, monkeypatch):
    sd, root, shard = saved
    before, opened, writer = _flipper(shard)
    offset = len(before) - 1

    def start_writer(reader):
        writer.start()
        _wait_broken(reader)  # the writer waits in open(); the copies run now
        assert not opened

    _after_check(monkeypatch, start_writer)
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    checkpoint.load(dst, root)
    writer.join(timeout=120)
    assert opened == [True]
    assert_same_state(dst, sd)  # the bytes checked, not the flipped ones
    with open(shard, "rb") as f:
        after = f.read()
    assert after[offset] == before[offset] ^ 0xFF and after[:offset] == before[:offset]


def test_truncation_between_check_and_copies_waits_no_sigbus(saved, monkeypatch):
    sd, root, shard = saved
    size = os.path.getsize(shard)
    child = []

    def truncate_from_another_process(reader):
        child.append(subprocess.Popen([sys.executable, "-c", f"import os; os.truncate({shard!r}, 8)"]))
        _wait_broken(reader)

    _after_check(monkeypatch, truncate_from_another_process)
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    checkpoint.load(dst, root)  # a mapped copy of a cut file would end this process by SIGBUS
    assert child[0].wait(timeout=120) == 0
    assert_same_state(dst, sd)
    assert os.path.getsize(shard) == 8 and size > 8


def test_file_open_for_writing_loads_without_a_mapping(saved, monkeypatch):
    sd, root, shard = saved
    taken = []
    original = leased.take
    monkeypatch.setattr(leased, "take", lambda fd: taken.append(original(fd)) or taken[-1])
    with open(shard, "r+b"):  # a read lease cannot be had while the file is open for writing
        dst = {k: torch.zeros_like(v) for k, v in sd.items()}
        checkpoint.load(dst, root)
    assert taken and all(t is None for t in taken)  # tried at the check and again after it: never had
    assert_same_state(dst, sd)


def test_own_sigurg_handler_means_no_lease(saved):
    sd, root, _ = saved
    got = []
    old = signal.signal(signal.SIGURG, lambda *a: got.append(a))
    try:
        assert not leased.usable()
        dst = {k: torch.zeros_like(v) for k, v in sd.items()}
        checkpoint.load(dst, root)
    finally:
        signal.signal(signal.SIGURG, old)
    assert_same_state(dst, sd)
    assert got == [] and leased._by_fd == {}


def test_mapped_and_unmapped_reads_agree_on_every_read(saved, monkeypatch):
    sd, root, _ = saved
    outs = []
    for enabled in (True, False):
        monkeypatch.setattr(leased, "enabled", enabled)
        with open_checkpoint(root) as r:
            got = {k: torch.zeros_like(v) for k, v in sd.items()}
            r.read_many(list(got.items()))
            col = torch.zeros(512, 100)
            r.copy_into("w1", col, [slice(0, 512), slice(300, 400)], check=True)
            half = torch.zeros(256, 1024, dtype=torch.float64)
            r.copy_into("w2", half, [slice(256, 512), slice(0, 1024)])
            outs.append((got, col, half, r.get_slice("w3", [slice(0, 512), slice(7, 1000)])))
        assert leased._by_fd == {}
    (a, *ra), (b, *rb) = outs
    assert_same_state(a, sd)
    assert_same_state(b, sd)
    for x, y in zip(ra, rb):
        assert torch.equal(x, y)
    assert torch.equal(ra[0], sd["w1"][:, 300:400]) and torch.equal(ra[1], sd["w2"][256:].double())


def test_a_device_error_reading_pages_in_sends_the_read_to_preadv(saved, monkeypatch):
    """``madvise(MADV_POPULATE_READ)`` failing with EIO (a device's error, which a touch of the
    page would turn into SIGBUS): no mapped byte is read, every read goes through ``preadv``, and
    the load is exact."""
    import ctypes
    import errno

    from checkpoint.storage import pread

    sd, root, _ = saved
    calls = []

    def failing(addr, n, advice):
        calls.append(advice)
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(leased, "_populate", failing)
    preads = []
    real = pread.os.preadv
    monkeypatch.setattr(pread.os, "preadv", lambda *a: preads.append(1) or real(*a))
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    checkpoint.load(dst, root)
    assert_same_state(dst, sd)
    assert calls and set(calls) == {leased._MADV_POPULATE_READ} and preads


@pytest.mark.parametrize("when", ["before the copies", "during the copies"])
def test_a_rewrite_without_a_lease_is_refused(saved, monkeypatch, when):
    """No lease (leases off): a write in place after the check is found by the file's change
    time. Before the copies it is refused with every target unchanged; during them it is refused
    too, saying the targets may hold unchecked bytes (what a load without a lease can promise)."""
    from checkpoint.errors import CorruptCheckpointError
    from checkpoint.storage import pread
    from tests.snapshot import Snapshot

    sd, root, shard = saved
    monkeypatch.setattr(leased, "enabled", False)

    def flip() -> None:
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) - 1)
            last = f.read(1)
            f.seek(os.path.getsize(shard) - 1)
            f.write(bytes([last[0] ^ 0xFF]))

    if when == "before the copies":
        _after_check(monkeypatch, lambda r: flip())
    else:
        real, done = pread.pread_run, []

        def flip_first(*args, **kwargs):
            if not done:
                done.append(flip())
            return real(*args, **kwargs)

        monkeypatch.setattr(pread, "pread_run", flip_first)
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    snap = Snapshot(dst)
    with pytest.raises(CorruptCheckpointError) as err:
        checkpoint.load(dst, root)
    assert err.value.file == shard and "changed while being loaded" in str(err.value)
    if when == "before the copies":
        snap.assert_unchanged()
    else:
        assert "may hold some of its new bytes" in str(err.value)


def _evicted(shard: str) -> None:
    """Drop ``shard``'s pages from the page cache (the check then reads it from the device, with no
    lease taken for it); skips where the filesystem keeps them (tmpfs)."""
    fd = os.open(shard, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if leased.resident(fd, os.path.getsize(shard)):
            pytest.skip("this filesystem keeps the file in memory: no read from the device")
    finally:
        os.close(fd)


def _after_confirm(monkeypatch, action):
    """Run ``action(reader)`` right after the load's ``confirm_unchanged`` (before any copy)."""
    original = CheckpointReader.confirm_unchanged

    def confirm_then(self):
        original(self)
        action(self)

    monkeypatch.setattr(CheckpointReader, "confirm_unchanged", confirm_then)


def test_a_file_read_from_the_device_is_leased_after_its_check(saved, monkeypatch):
    """A file the check reads from the device is mapped under a lease once it is in the page cache
    (its stamp compared while the lease holds): a writer coming after waits until the load ends,
    and the copies copy the bytes checked."""
    sd, root, shard = saved
    _evicted(shard)
    before, opened, writer = _flipper(shard)
    _evicted(shard)

    def start_writer(reader):
        name = os.path.basename(shard)
        assert reader._maps.get(name) is not None and name not in reader._stamps
        writer.start()
        _wait_broken(reader)
        assert not opened

    _after_confirm(monkeypatch, start_writer)
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    checkpoint.load(dst, root)
    writer.join(timeout=120)
    assert opened == [True]
    assert_same_state(dst, sd)  # the bytes checked, not the flipped ones
    assert leased._by_fd == {}


def test_a_file_read_from_the_device_and_rewritten_before_its_lease_is_refused(saved, monkeypatch):
    """A write in place between the check of a file read from the device and the lease taken
    after it is found by the stamp compared under the lease: refused, every target unchanged, no
    lease left held."""
    from checkpoint.errors import CorruptCheckpointError
    from tests.snapshot import Snapshot

    sd, root, shard = saved
    _evicted(shard)
    taken = []
    real_take = leased.take
    monkeypatch.setattr(leased, "take", lambda fd: taken.append(real_take(fd)) or taken[-1])

    def flip(reader) -> None:
        assert reader._stamps and not any(m is not None for m in reader._maps.values())
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) - 1)
            last = f.read(1)
            f.seek(os.path.getsize(shard) - 1)
            f.write(bytes([last[0] ^ 0xFF]))

    _after_check(monkeypatch, flip)
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    snap = Snapshot(dst)
    with pytest.raises(CorruptCheckpointError) as err:
        checkpoint.load(dst, root)
    assert err.value.file == shard and "changed while being loaded" in str(err.value)
    snap.assert_unchanged()
    assert any(m is not None for m in taken)  # the lease was had, and the stamp refused the file
    assert leased._by_fd == {}
    fd = os.open(shard, os.O_WRONLY)  # given back: a writer opens at once
    os.close(fd)
