"""Load and save speed paths: ``checkpoint.storage.pread`` (the pieces of every tensor of a load
shared by the calling thread and pool threads, byte-exact; a file that ends early names the file
and the tensor; pieces shrunk so tensors stay small), the writer's hash thread and writeback
starts, and the GC pause of load / save (off while planning, restored after, also on error)."""

from __future__ import annotations

import os
import time

import pytest
import torch

import checkpoint
from checkpoint.errors import CorruptCheckpointError, LoadError
from checkpoint.storage import pread
from tests.crews import BothSides


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(pread, "PIECE", 4096)
    monkeypatch.setattr(pread, "_THREADS", 3)


@pytest.fixture
def both_sides(monkeypatch):
    return BothSides(monkeypatch)


def test_pieces_in_threads_load_exact_values(tmp_path, small_pieces):
    g = torch.Generator().manual_seed(0)
    sd = {"big": torch.randn(10_001, generator=g), "odd": torch.randn(3, 2047, generator=g),
          "small": torch.arange(5, dtype=torch.int64), "bf": torch.randn(9000, generator=g).bfloat16()}  # fmt: skip
    checkpoint.save(sd, tmp_path / "ck")
    got = {k: torch.zeros_like(v) for k, v in sd.items()}
    checkpoint.load(got, tmp_path / "ck")
    assert all(torch.equal(got[k], v) for k, v in sd.items())


def test_pieces_of_all_tensors_are_shared_by_the_calling_and_pool_threads(tmp_path, small_pieces, both_sides, monkeypatch):
    g = torch.Generator().manual_seed(3)
    sd = {f"w.{i}": torch.randn(3000 + i, generator=g) for i in range(4)}  # 3 pieces or more each
    sd["tiny"] = torch.arange(3, dtype=torch.int8)
    checkpoint.save(sd, tmp_path / "ck")
    real = os.preadv

    def preadv(fd, bufs, off, *flags):
        if flags:  # the page-cache probe
            return real(fd, bufs, off, *flags)
        both_sides.enter()
        return real(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", preadv)
    # As cached (the probe may meet pages still under writeback from the save: the cold path's test is below).
    monkeypatch.setattr(pread, "_in_cache", lambda jobs: True)
    got = {k: torch.zeros_like(v) for k, v in sd.items()}
    checkpoint.load(got, tmp_path / "ck")
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    # one queue for all the copies, and at most one for the digest check before them
    assert len(both_sides.names) >= 12 and both_sides.crews in (1, 2)
    assert both_sides.saw_both()


def test_bytes_not_in_the_page_cache_are_read_by_one_thread_in_file_order(tmp_path, small_pieces, monkeypatch):
    import threading

    g = torch.Generator().manual_seed(5)
    sd = {f"w.{i}": torch.randn(3000 + i, generator=g) for i in range(4)}
    checkpoint.save(sd, tmp_path / "ck")
    reads, probes, real = [], [], os.preadv

    def preadv(fd, bufs, off, *flags):
        if flags:  # RWF_NOWAIT: as when the page is still on the device
            probes.append(off)
            raise BlockingIOError(11, "Resource temporarily unavailable")
        reads.append((threading.current_thread().name, off))
        return real(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", preadv)
    got = {k: torch.zeros_like(v) for k, v in sd.items()}
    checkpoint.load(dict(reversed(got.items())), tmp_path / "ck")  # asked for in another order
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    assert probes and len(reads) >= 12  # (probed by the check and by the copies)
    assert {n for n, _ in reads} == {threading.main_thread().name}
    assert [o for _, o in reads] == sorted(o for _, o in reads)  # one stream, readahead works


def test_a_piece_failing_on_a_pool_thread_names_its_tensor_and_file(tmp_path, small_pieces):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(range(256)) * 64)  # 16384 bytes
    ok, short = bytearray(8192), bytearray(12288)
    fd = os.open(path, os.O_RDONLY)
    try:
        runs = [pread.Run(fd, [memoryview(ok)], ["ok"], 0, str(tmp_path), "short.bin"),
                pread.Run(fd, [memoryview(short)], ["short"], 8192, str(tmp_path), "short.bin")]  # fmt: skip
        with pytest.raises(CorruptCheckpointError, match=r"short\.bin.*'short'.*ends early"):
            pread.read_runs(runs)
        assert pread.read_runs(runs[:1]) == 8192 and bytes(ok) == path.read_bytes()[:8192]
    finally:
        os.close(fd)


def test_save_hashes_beside_the_write_and_starts_writeback_on_disks(tmp_path, monkeypatch):
    from checkpoint.storage import fskind, writeback, writer

    g = torch.Generator().manual_seed(4)
    sd = {"big": torch.randn(3 << 20, generator=g), "small": torch.randn(7, generator=g),
          "mid": torch.randn(600_000, generator=g).bfloat16()}  # fmt: skip
    started = []
    monkeypatch.setattr(writeback, "available", lambda: True)
    monkeypatch.setattr(writeback, "start_writeback", lambda fd, off, n: started.append((off, n)))
    monkeypatch.setattr(fskind, "in_memory_dir", lambda d: False)  # as on a disk
    checkpoint.save(sd, tmp_path / "disk")
    size = os.path.getsize(tmp_path / "disk" / "model-00001-of-00001.safetensors")
    assert started and started[0][0] == 0 and all(n >= writer.SequentialFileWriter.WRITEBACK for _, n in started)
    assert all(a + n == b for (a, n), (b, _) in zip(started, started[1:])) and sum(n for _, n in started) <= size
    started.clear()
    monkeypatch.setattr(fskind, "in_memory_dir", lambda d: True)  # tmpfs: nothing to write back
    monkeypatch.setattr(writer, "_hasher", lambda: None)  # one CPU: hashed on the writing thread
    checkpoint.save(sd, tmp_path / "mem")
    assert started == []
    # Both saves hold the same bytes and the same digests (the thread's equal the inline ones).
    a, b = (checkpoint.open_checkpoint(tmp_path / n) for n in ("disk", "mem"))
    assert a.meta.files == b.meta.files
    assert (tmp_path / "disk" / "model-00001-of-00001.safetensors").read_bytes() == (tmp_path / "mem" / "model-00001-of-00001.safetensors").read_bytes()
    checkpoint.verify(tmp_path / "disk")


def test_a_file_ending_early_names_file_and_tensor(tmp_path, small_pieces):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(range(256)) * 40)  # 10240 bytes
    out = bytearray(3 * 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        head = pread.Run(fd, [memoryview(out)[:8192]], ["w"], 100, str(tmp_path), "short.bin")
        assert pread.read_runs([head]) == 8192
        assert bytes(out[:8192]) == path.read_bytes()[100:8292]
        with pytest.raises(CorruptCheckpointError, match=r"short\.bin.*'w'.*ends early"):
            pread.read_runs([pread.Run(fd, [memoryview(out)], ["w"], 0, str(tmp_path), "short.bin")])
    finally:
        os.close(fd)


def test_adjacent_small_tensors_are_read_by_one_preadv_per_run(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(1)
    sd = {f"t.{i}": torch.randn(3, 5, generator=g).to([torch.float32, torch.bfloat16, torch.int8][i % 3])
          for i in range(300)}  # fmt: skip
    sd["empty"] = torch.zeros(0, 4)
    checkpoint.save(sd, tmp_path / "ck", max_shard_size=4000)  # several shard files
    files = len(list((tmp_path / "ck").glob("*.safetensors")))
    calls, real = [], os.preadv

    def short_preadv(fd, bufs, offset, *flags):  # at most 1,000 bytes a call: runs resume mid-buffer
        if flags:  # (a probe of the page cache)
            return real(fd, bufs, offset, *flags)
        calls.append(len(bufs))
        want, out = 1000, []
        for b in bufs:
            out.append(memoryview(b)[: min(len(b), want)])
            want -= len(out[-1])
            if not want:
                break
        return real(fd, out, offset)

    got = {k: torch.full_like(v, 7) for k, v in sd.items()}
    def counting(fd, bufs, off, *flags):
        if not flags:  # (RWF_NOWAIT probes of the page cache are not reads)
            calls.append(len(bufs))
        return real(fd, bufs, off, *flags)

    monkeypatch.setattr(os, "preadv", counting)
    checkpoint.load(got, tmp_path / "ck")
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    # per file: one call hashing its tensors (check_first, one buffer) and one into every target
    assert len(calls) == 2 * files and sum(calls) == 300 + files
    calls.clear()
    got = {k: torch.full_like(v, 7) for k, v in sd.items()}
    monkeypatch.setattr(os, "preadv", short_preadv)
    checkpoint.load(got, tmp_path / "ck")
    assert all(torch.equal(got[k], v) for k, v in sd.items()) and len(calls) > files


def test_a_block_that_is_one_byte_range_is_read_straight_into_its_target(tmp_path):
    """read_many's (key, out, slices) form (a DTensor's local blocks): row blocks, one row of a
    column block, blocks of 0 rows; other blocks, strided slices and other dtypes are refused."""
    g = torch.Generator().manual_seed(2)
    sd = {"m": torch.randn(6, 4, 3, generator=g), "v": torch.arange(10, dtype=torch.int16),
          "bf": torch.randn(5, 8, generator=g).bfloat16()}  # fmt: skip
    checkpoint.save(sd, tmp_path / "ck")
    cases = [
        ("m", (slice(2, 5), slice(0, 4), slice(0, 3)), True),  # rows 2-4, whole rows
        ("m", (slice(3, 4), slice(1, 3), slice(0, 3)), True),  # one row: a run of its columns
        ("m", (slice(3, 4), slice(2, 3), slice(1, 2)), True),  # one element
        ("m", (slice(4, 4), slice(0, 4), slice(0, 3)), True),  # no rows: nothing to read
        ("m", (slice(0, 2), slice(0, 2), slice(0, 3)), False),  # two rows of half columns
        ("m", (slice(0, 6), slice(0, 4), slice(0, 2)), False),  # a column block
        ("m", (slice(0, 6, 2), slice(0, 4), slice(0, 3)), False),  # strided
        ("v", (slice(7, 10),), True),
        ("bf", (slice(1, 3), slice(0, 8)), True),
    ]
    with checkpoint.open_checkpoint(tmp_path / "ck") as rd:
        outs = [torch.full_like(sd[k][sl], 9) for k, sl, _ in cases]
        before = [o._version for o in outs]
        done = rd.read_many([(k, o, sl) for (k, sl, _), o in zip(cases, outs)])
        assert done == [ok for _, _, ok in cases]
        # Written behind torch's back, counted as copy_ would be (autograd / never-written checks).
        assert [o._version > v for o, v in zip(outs, before)] == done
        for (k, sl, ok), o in zip(cases, outs):
            assert torch.equal(o, sd[k][sl] if ok else torch.full_like(o, 9)), (k, sl)
        wrong = torch.zeros(3, 4, 3, dtype=torch.float64)  # another dtype: not read, untouched
        assert rd.read_many([("m", wrong, cases[0][1])]) == [False] and not wrong.any()


def test_a_run_ending_early_names_the_first_tensor_not_read(tmp_path, monkeypatch):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(range(250)))
    a, b, c = bytearray(100), bytearray(100), bytearray(100)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pread.pread_run(fd, [memoryview(a), memoryview(b)], ["a", "b"], 10, str(tmp_path), "short.bin") == 200
        assert bytes(a) + bytes(b) == path.read_bytes()[10:210]
        with pytest.raises(CorruptCheckpointError, match=r"short\.bin.*'c'.*ends early"):
            pread.pread_run(fd, [memoryview(a), memoryview(b), memoryview(c)], ["a", "b", "c"], 0,
                            str(tmp_path), "short.bin")  # fmt: skip
        calls = []

        def failing(fd, bufs, off):  # the second call fails: the tensor it was filling is named
            if calls:
                raise OSError(5, "simulated EIO")
            calls.append(1)
            return os.pread(fd, 50, off) and 150  # claims a and half of b

        monkeypatch.setattr(os, "preadv", failing)
        with pytest.raises(LoadError, match=r"short\.bin: loading 'b' failed: OSError.*simulated EIO"):
            pread.pread_run(fd, [memoryview(a), memoryview(b)], ["a", "b"], 0, str(tmp_path), "short.bin")
    finally:
        os.close(fd)


def test_load_and_save_pause_the_gc_and_restore_it_even_on_error(tmp_path, monkeypatch):
    import gc

    import checkpoint.loading

    seen = []
    real = checkpoint.loading.plan_load
    monkeypatch.setattr(
        checkpoint.loading, "plan_load", lambda *a, **k: (seen.append(gc.isenabled()), real(*a, **k))[1]
    )
    checkpoint.save({"w": torch.ones(3)}, tmp_path / "ck")
    assert gc.isenabled()
    checkpoint.load({"w": torch.zeros(3)}, tmp_path / "ck")
    with pytest.raises(checkpoint.CheckpointMismatchError):
        checkpoint.load({"v": torch.zeros(3)}, tmp_path / "ck")
    assert seen == [False, False] and gc.isenabled()
    gc.disable()  # a caller that disabled it keeps it disabled
    try:
        checkpoint.load({"w": torch.zeros(3)}, tmp_path / "ck")
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_saves_and_loads_with_its_own_threads(tmp_path):
    """The read and hash pools are per process: a child forked after the parent used them (crash
    trials fork ranks) gets new ones instead of waiting forever on threads it does not have."""
    import signal

    sd = {"a": torch.randn(3 << 20)}  # large: hashed on the hash thread, read in pieces
    checkpoint.save(sd, tmp_path / "ck")
    got = {"a": torch.zeros(3 << 20)}
    checkpoint.load(got, tmp_path / "ck")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 3
        try:
            torch.set_num_threads(1)  # torch's own intra-op pool is not fork-safe either
            checkpoint.save(sd, tmp_path / "ck", overwrite=True)
            back = {"a": torch.zeros(3 << 20)}
            checkpoint.load(back, tmp_path / "ck")
            code = 0 if torch.equal(back["a"], sd["a"]) else 4
        finally:
            os._exit(code)
    deadline = time.monotonic() + 300  # a hang guard only: a child that works exits in seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung in save / load")


def test_mount_points_with_escaped_characters_are_matched(tmp_path):
    """proc(5): mountinfo writes space, tab, newline and backslash in mount points as octal
    escapes; each is decoded before the longest mount point above a path is chosen."""
    from checkpoint.storage import fskind

    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
        "30 22 0:27 / /tmp/a\\040b rw - tmpfs tmpfs rw\n"
        "31 22 0:28 / /tmp/t\\011ab rw - ramfs none rw\n"
        "32 22 0:29 / /tmp/b\\134s rw - tmpfs none rw\n"
    )
    got = {p: fskind._mount_type(p, str(info)) for p in ("/tmp/a b/x", "/tmp/t\tab", "/tmp/b\\s/y/z", "/tmp/a", "/tmp/b\\sx")}
    assert got == {"/tmp/a b/x": "tmpfs", "/tmp/t\tab": "ramfs", "/tmp/b\\s/y/z": "tmpfs", "/tmp/a": "ext4", "/tmp/b\\sx": "ext4"}
    assert fskind._mount_type("/x", str(tmp_path / "missing")) == ""


def test_get_of_many_pieces_is_hashed_while_read_on_every_thread(tmp_path, small_pieces, both_sides, monkeypatch):
    """``get`` of a tensor of many pieces: exact bytes, pieces read by the calling and pool
    threads and hashed in file order as they come in (``read_hashed``); a byte flipped in a
    middle piece still fails the digest, naming tensor and file."""

    from checkpoint.storage import tensor_read

    g = torch.Generator().manual_seed(7)
    sd = {"big": torch.randn(64, 1000, generator=g), "small": torch.arange(6.0)}
    checkpoint.save(sd, tmp_path / "ck")
    monkeypatch.setattr(pread, "_in_cache", lambda jobs: True)
    real = pread.Run.read

    def read(self):
        both_sides.enter()
        return real(self)

    monkeypatch.setattr(pread.Run, "read", read)
    hashed = []
    real_hashed = tensor_read.read_hashed
    monkeypatch.setattr(tensor_read, "read_hashed", lambda *a: hashed.append(a[1]) or real_hashed(*a))
    with checkpoint.open_checkpoint(tmp_path / "ck") as r:
        assert torch.equal(r.get("big"), sd["big"]) and torch.equal(r.get("small"), sd["small"])
        begin, end = r._spans["big"]
        shard = os.path.join(r.root, r.files[0])
    assert hashed == ["big", "small"] and len(both_sides.names) >= 60  # 256000 bytes in 4096-byte pieces
    assert both_sides.crews >= 1 and both_sides.saw_both()
    with open(shard, "r+b") as f:  # one bit of a middle piece
        f.seek((begin + end) // 2)
        b = f.read(1)
        f.seek((begin + end) // 2)
        f.write(bytes([b[0] ^ 1]))
    with checkpoint.open_checkpoint(tmp_path / "ck") as r:
        with pytest.raises(CorruptCheckpointError, match=r"'big'.*xxh3-128") as e:
            r.get("big")
        assert e.value.key == "big" and r.files[0] in str(e.value)
        assert torch.equal(r.get("small"), sd["small"])


def test_converting_and_strided_reads_share_pieces_with_one_copy_thread_each(tmp_path, both_sides, monkeypatch):
    """Targets not read straight (another dtype, strides, a column block of either) are filled
    in pieces of ``CHUNK`` bytes shared by the calling thread and pool threads, each piece read
    and copied by one thread with torch's kernels on that thread alone; exact values, bytes
    outside a strided target untouched, and torch's thread count unchanged afterwards. Every
    call shares its pieces (:class:`BothSides` makes both sides take some, whatever the load)."""
    import threading

    from checkpoint.storage import tensor_read

    g = torch.Generator().manual_seed(9)
    sd = {"w": torch.randn(96, 300, generator=g), "v": torch.randn(5000, generator=g)}
    checkpoint.save(sd, tmp_path / "ck")
    monkeypatch.setattr(tensor_read, "CHUNK", 4096)
    monkeypatch.setattr(pread, "_THREADS", 3)
    shared = tensor_read._omp() is not None  # without OpenMP control pieces run on the calling thread
    seen = []

    def piece(real):  # a piece's read: one range (pread_run) or a block's runs of rows (_scatter)
        def read(*a):
            seen.append((threading.current_thread().name, torch.get_num_threads()))
            both_sides.enter()
            return real(*a)

        return read

    monkeypatch.setattr(pread, "pread_run", piece(pread.pread_run))
    monkeypatch.setattr(tensor_read, "_scatter", piece(tensor_read._scatter))
    before = torch.get_num_threads()
    calls = []

    def one_call(what, fill) -> None:
        seen.clear()
        both_sides.names.clear()
        crews = both_sides.crews
        assert fill()
        calls.append((what, both_sides.crews - crews, both_sides.saw_both(), list(seen)))

    with checkpoint.open_checkpoint(tmp_path / "ck") as r:
        for key, slices in (("w", None), ("w", [slice(3, 90), slice(10, 290)]), ("v", None)):
            want = sd[key][tuple(slices)] if slices else sd[key]
            for dtype in (torch.float64, torch.bfloat16):
                out = torch.zeros(want.shape, dtype=dtype)
                one_call((key, slices, dtype), lambda k=key, o=out, s=slices: r.copy_into(k, o, s))
                assert torch.equal(out, want.to(dtype)), (key, slices, dtype)
            base = torch.full((*want.shape[:-1], 2 * want.shape[-1]), 7.0)
            one_call((key, slices, "strided"), lambda k=key, b=base, s=slices: r.copy_into(k, b[..., ::2], s))
            assert torch.equal(base[..., ::2], want) and bool((base[..., 1::2] == 7.0).all())
    assert torch.get_num_threads() == before
    for what, crews, both, pieces in calls:
        assert len(pieces) > 3, (what, pieces)  # more pieces than the 3 threads
        if shared:
            assert crews == 1 and both, (what, crews, pieces)
            assert {k for _, k in pieces} == {1}, (what, pieces)  # every piece's copy on its thread alone


def test_a_new_tensor_read_whole_has_its_pages_populated_first(tmp_path, monkeypatch):
    """``get`` reads into a new tensor: each piece's pages are faulted in by one
    ``MADV_POPULATE_WRITE`` before its ``preadv`` (every byte of the tensor covered, values
    exact); a load into the caller's tensors populates nothing; ``populate`` maps the pages of
    fresh anonymous memory and skips memory already mapped."""
    import ctypes
    import mmap

    monkeypatch.setattr(pread, "PIECE", 1 << 20)
    g = torch.Generator().manual_seed(4)
    sd = {"w": torch.randn(1024, 1024, generator=g)}  # 4 MiB: 4 pieces
    checkpoint.save(sd, tmp_path / "ck")
    seen, real = [], pread.populate
    monkeypatch.setattr(pread, "populate", lambda v: seen.append(len(v)) or real(v))
    with checkpoint.open_checkpoint(tmp_path / "ck") as r:
        assert torch.equal(r.get("w"), sd["w"])
        assert sum(seen) == sd["w"].nbytes and len(seen) == 4
        seen.clear()
        out = torch.zeros(1024, 1024)
        checkpoint.load({"w": out}, tmp_path / "ck")
        assert torch.equal(out, sd["w"]) and seen == []
    if pread.libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)):
        m = mmap.mmap(-1, 64 << 10)
        view = memoryview(m)
        page = ctypes.addressof(ctypes.c_char.from_buffer(view))
        assert not pread._resident(page)
        real(view)
        assert pread._resident(page) and m[:] == bytes(64 << 10)
        del view, page
        m.close()