"""A file cut short after it was opened and validated, on every read path of tensor bytes: a named
error (CorruptCheckpointError / LoadError naming file and tensor, or a verify mismatch), never a
SIGBUS. The paths run in one child process (a SIGBUS would kill pytest): ``open_checkpoint.get``,
``get_slice`` (direct runs and windowed rows), loads converting dtypes and into non-contiguous
targets, the migration source (``open_source`` get / get_slice, ``migrate``), ``verify`` and the
CLI's ``diff`` / ``migrate`` / ``verify``; a ``torch.save`` zip file (read per tensor with
``preadv``, never through ``torch.load(mmap=True)``) cut while read at several points and cut
before it is opened, through ``open_source(...).get``, ``migrate`` and the CLI."""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import contextlib, glob, io, os, sys
import torch, checkpoint
from checkpoint.storage import reader as R, tensor_read
from checkpoint.cli.main import main as cli

root = sys.argv[1]
n = 3 << 20  # 12 MiB of float32: the threaded read path too
src = os.path.join(root, "c")

def fresh():
    checkpoint.save({"w": torch.ones(n), "m": torch.ones(1024, 1024)}, src, overwrite=True)
    return glob.glob(os.path.join(src, "*.safetensors"))[0]

cut = {"on": False}
def cut_after(real):
    def wrapped(*a, **k):
        out = real(*a, **k)
        if cut["on"]:
            for f in glob.glob(os.path.join(cut.get("dir", src), "*.safetensors")):
                os.truncate(f, 4096)  # header kept, data gone: after validation, before the read
        return out
    return wrapped

R.CheckpointReader._load_headers = cut_after(R.CheckpointReader._load_headers)  # open_source's too

def run(what, fn):
    fresh()
    cut["on"] = True
    try:
        out = fn()
        print(f"{what}|returned|{out}")
    except Exception as e:
        print(f"{what}|{type(e).__name__}|{str(e)[:300]}".replace("\n", " "))
    finally:
        cut["on"] = False

def cli_run(*argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = cli(list(argv))
    return f"exit {rc}: {buf.getvalue()[:300]}"

run("get", lambda: checkpoint.open_checkpoint(src).get("w"))
run("get_slice", lambda: checkpoint.open_checkpoint(src).get_slice("m", [slice(0, 1024), slice(0, 512)]))
tensor_read.SPAN = 1 << 30  # the windowed-rows path
run("get_slice_rows", lambda: checkpoint.open_checkpoint(src).get_slice("m", [slice(0, 1024), slice(3, 5)]))
run("load_convert", lambda: checkpoint.load({"w": torch.zeros(n, dtype=torch.float64), "m": torch.zeros(1024, 1024)}, src))
run("load_strided", lambda: checkpoint.load({"w": torch.zeros(2 * n)[::2], "m": torch.zeros(1024, 1024)}, src))
from checkpoint.sources import open_source
run("source_get", lambda: open_source(src).get("w"))
run("source_get_slice", lambda: open_source(src).get_slice("m", (slice(0, 1024), slice(0, 4))))
run("migrate", lambda: checkpoint.migrate(src, os.path.join(root, "out"), overwrite=True))
run("cli_migrate", lambda: cli_run("migrate", src, os.path.join(root, "out2")))
fresh()
other = os.path.join(root, "d")
checkpoint.save({"w": torch.ones(n), "m": torch.ones(1024, 1024)}, other, overwrite=True)
run("cli_diff", lambda: cli_run("diff", src, other))
real_size = os.path.getsize
def size_then_cut(p):
    s = real_size(p)
    if cut["on"] and p.endswith(".safetensors"):
        os.truncate(p, 4096)
    return s
os.path.getsize = size_then_cut
run("verify", lambda: checkpoint.verify(src).ok)
run("cli_verify", lambda: cli_run("verify", src))
os.path.getsize = real_size

# DCP's per-rank safetensors shards (HuggingFaceStorageWriter): torch's reader copies from
# safe_open's mapping; the migration source reads them with preadv.
import warnings
import torch.distributed.checkpoint as dcp
hf = os.path.join(root, "hf")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    dcp.save({"w": torch.ones(n), "m": torch.ones(1024, 1024)}, no_dist=True,
             storage_writer=dcp.HuggingFaceStorageWriter(hf, save_distributed=True))
cut["dir"] = hf
run("dcp_hf_migrate", lambda: checkpoint.migrate(hf, os.path.join(root, "o5"), overwrite=True))
del cut["dir"]

# torch.save zip files: structure read through map_location="meta", bytes with preadv. Cut after
# the records were checked (inside the data of each tensor and in the zip directory), and cut
# before opening: a named error every time, never a SIGBUS from a mapping.
import checkpoint.sources.pickle_files as PF
pt = os.path.join(root, "p.pt")
torch.save({"w": torch.ones(n), "m": torch.ones(1024, 1024)}, pt)
whole = open(pt, "rb").read()
real_check = PF._check_records
cut_at = {"n": 0}
def check_then_cut(path, fd, tensors):
    real_check(path, fd, tensors)
    if cut["on"]:
        os.truncate(path, cut_at["n"])
PF._check_records = check_then_cut
def run_pt(what, fn, at, before=False):
    with open(pt, "wb") as f:
        f.write(whole[:at] if before else whole)
    cut_at["n"] = at
    cut["on"] = not before
    try:
        print(f"{what}|returned|{fn()}")
    except Exception as e:
        print(f"{what}|{type(e).__name__}|{str(e)[:300]}".replace("\n", " "))
    finally:
        cut["on"] = False
for i, at in enumerate((4096, len(whole) // 2, len(whole) - 4 * 1024 * 1024 + 512, len(whole) - 200)):
    run_pt(f"pt_get_{i}", lambda: (lambda s: [s.get(k).sum().item() for k in ("w", "m")])(open_source(pt)), at)
    run_pt(f"pt_migrate_{i}", lambda: checkpoint.migrate(pt, os.path.join(root, "o3"), overwrite=True), at)
    run_pt(f"pt_precut_{i}", lambda: open_source(pt).get("m").sum().item(), at, before=True)
run_pt("pt_cli_migrate", lambda: cli_run("migrate", pt, os.path.join(root, "o4")), len(whole) // 2)
run_pt("pt_whole", lambda: (lambda s: [s.get(k).sum().item() for k in ("w", "m")])(open_source(pt)), len(whole), before=True)
print("ALIVE")
"""


def test_cut_file_is_a_named_error_on_every_read_path(tmp_path):
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"child died ({p.returncode}): {p.stdout[-3000:]} {p.stderr[-3000:]}"
    lines = dict(line.split("|", 1) for line in p.stdout.splitlines() if "|" in line)
    assert "ALIVE" in p.stdout
    named = ("get", "get_slice", "get_slice_rows", "load_convert", "load_strided", "source_get", "source_get_slice", "migrate",
             "dcp_hf_migrate")  # fmt: skip
    for what in named:
        kind, msg = lines[what].split("|", 1)
        assert kind in ("CorruptCheckpointError", "LoadError"), (what, lines[what])
        assert ".safetensors" in msg and ("'w'" in msg or "'m'" in msg), (what, msg)
    for what in ("cli_migrate", "cli_diff", "cli_verify"):
        kind, msg = lines[what].split("|", 1)
        assert kind == "returned" and not msg.startswith("exit 0"), (what, msg)
        assert "Traceback" not in msg and (".safetensors" in msg or "MISMATCH" in msg), (what, msg)
    assert lines["verify"] == "returned|False", lines["verify"]
    for i in range(4):  # a .pt cut while read or before: named, file and tensor (or its archive)
        for what in (f"pt_get_{i}", f"pt_migrate_{i}", f"pt_precut_{i}") if i < 3 else ("pt_precut_3",):
            kind, msg = lines[what].split("|", 1)
            assert kind in ("CorruptCheckpointError", "LoadError", "MigrationError"), (what, lines[what])
            assert "p.pt" in msg, (what, msg)
            if what.startswith("pt_get"):
                assert "'w'" in msg or "'m'" in msg, (what, msg)
    # Only the zip directory cut away after opening: every tensor byte is there, read right.
    assert lines["pt_get_3"] == f"returned|{[float(3 << 20), float(1 << 20)]}", lines["pt_get_3"]
    assert lines["pt_migrate_3"].startswith("returned|"), lines["pt_migrate_3"]
    kind, msg = lines["pt_cli_migrate"].split("|", 1)
    assert kind == "returned" and not msg.startswith("exit 0") and "p.pt" in msg and "Traceback" not in msg, msg
    assert lines["pt_whole"] == f"returned|{[float(3 << 20), float(1 << 20)]}", lines["pt_whole"]


def test_blocks_read_by_pread_equal_torch_slices(tmp_path, monkeypatch):
    """``get_slice`` through every block path (runs read straight with or without holes read
    into the junk buffer, windowed rows, tiny windows) and any step equals
    slicing the whole tensor; ``get`` of every dtype and a 0-dim / empty tensor is exact."""
    import random

    import torch

    import checkpoint
    from checkpoint.storage import tensor_read

    g = torch.Generator().manual_seed(0)
    sd = {"a": torch.randn(37, 53, generator=g), "b": torch.randn(5, 7, 11, generator=g).bfloat16(),
          "c": torch.randn(300, 70, generator=g), "s": torch.tensor(3.5), "z": torch.empty(0, 4),
          "i": torch.arange(24, dtype=torch.int8).reshape(2, 3, 4)}  # fmt: skip
    checkpoint.save(sd, tmp_path / "c")
    rnd = random.Random(1)
    with checkpoint.open_checkpoint(tmp_path / "c") as r:
        assert all(torch.equal(r.get(k), v) for k, v in sd.items())
        for span, gap, window, rows in (
            (2 << 10, 16 << 10, 8 << 20, 1 << 20), (1 << 30, 16 << 10, 1000, 300), (0, 0, 1000, 1000), (0, 64, 1 << 20, 1)
        ):
            monkeypatch.setattr(tensor_read, "SHORT_RUN", span)
            monkeypatch.setattr(tensor_read, "GAP", gap)
            monkeypatch.setattr(tensor_read, "WINDOW", window)
            monkeypatch.setattr(tensor_read, "ROWS_WINDOW", rows)
            for _ in range(100):
                k = rnd.choice("abci")
                v = sd[k]
                sl = []
                for n in v.shape:
                    lo = rnd.randint(0, n)
                    sl.append(slice(lo, rnd.randint(lo, n), rnd.choice([1, 1, 2, 3])))
                sl = sl[: rnd.randint(1, len(sl))]
                assert torch.equal(r.get_slice(k, sl), v[tuple(sl)]), (k, sl)
                # The load path: the step-1 block into a contiguous target of the stored dtype
                # (straight), another dtype (converted) and a strided view (through the window).
                step1 = [slice(s.start, s.stop) for s in sl]
                want = v[tuple(step1)]
                for dtype, strided in ((v.dtype, False), (torch.float64, False), (v.dtype, True)):
                    base = torch.full((*want.shape[:-1], 2 * want.shape[-1]) if strided else want.shape, 7, dtype=dtype)
                    out = base[..., ::2] if strided else base
                    # check=True: a block of every row is hashed on the way (a wrong hash raises).
                    assert r.copy_into(k, out, step1, check=True)
                    assert torch.equal(out, want.to(dtype)), (k, step1, dtype, strided)
                    if strided:
                        assert torch.equal(base[..., 1::2], torch.full_like(base[..., 1::2], 7))  # untouched


def test_no_file_of_the_checkpoint_is_ever_mapped(tmp_path):
    """Headers are validated by safetensors on a private sealed copy of their bytes and tensor
    bytes are read with preadv: while a reader is open (open, get, get_slice, converting and
    strided copy_into, load, a DCP-style file source) no file of the checkpoint appears in the
    process's mappings, so none can SIGBUS whatever happens to it; a header cut to half still
    names the file."""
    import torch

    import checkpoint
    from checkpoint.errors import CorruptCheckpointError

    sd = {"a": torch.randn(64, 33), "b": torch.arange(10)}
    ck = tmp_path / "ck"
    checkpoint.save(sd, ck)

    def mapped() -> list[str]:
        with open("/proc/self/maps") as f:
            return [ln.split()[-1] for ln in f if str(tmp_path) in ln]

    with checkpoint.open_checkpoint(ck) as r:
        assert torch.equal(r.get("a"), sd["a"]) and torch.equal(r.get_slice("a", [slice(1, 5)]), sd["a"][1:5])
        out = torch.empty(64, 66, dtype=torch.float64)[:, ::2]
        assert r.copy_into("a", out) and torch.equal(out, sd["a"].double())
        got = {k: torch.zeros_like(v) for k, v in sd.items()}
        checkpoint.load(got, ck)
        assert all(torch.equal(got[k], v) for k, v in sd.items())
        assert mapped() == []
        shard = ck / r.files[0]
    with open(shard, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    import os

    import pytest

    os.truncate(shard, 8 + n // 2)
    with pytest.raises(CorruptCheckpointError, match="not a valid safetensors file") as e:
        checkpoint.open_checkpoint(ck)
    assert str(shard) in str(e.value) and mapped() == []
