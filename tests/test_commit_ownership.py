"""Save side of ownership: nothing unreadable is committed (names, dtypes, header limit); overwrite
replaces only what a checkpoint owns; a reader sees one checkpoint during a concurrent overwrite;
recovery only where a commit was provably interrupted. Every rejection snapshots the directory
(names and bytes) before and after."""

from __future__ import annotations

import os
import shutil
import struct
import threading

import pytest
import torch
from safetensors import SafetensorError, safe_open

import checkpoint
from checkpoint.testing import faults as _faults
from checkpoint.storage import local_commit as atomic
from checkpoint.errors import InterruptedCommitError, UnsavableError, UnsavableTypeError
from checkpoint.storage import limits
from tests.snapshot import dir_snapshot as snapshot


def _values(path):
    with checkpoint.open_checkpoint(path) as r:
        return {k: r.get(k) for k in r.keys()}


GOOD = {"good": torch.arange(4.0)}


# -- 1. nothing unreadable is committed ------------------------------------------------------------


@pytest.mark.parametrize(
    "sd, error, match",
    [
        ({"w\ud800": torch.ones(2)}, UnsavableError, "UTF-8"),  # lone surrogate
        ({"ok": torch.ones(2), "\udcff.bias": torch.ones(1)}, UnsavableError, "UTF-8"),
        ({"": torch.ones(2)}, UnsavableError, "empty"),
        ({"__metadata__": torch.ones(2)}, UnsavableError, "reserved"),
        ({"c": torch.ones(2, dtype=torch.complex128)}, UnsavableTypeError, "complex128"),
        ({"h": torch.ones(2, dtype=torch.complex32)}, UnsavableTypeError, "complex32"),
        ({"s": torch.eye(3).to_sparse()}, UnsavableTypeError, "sparse"),
    ],
    ids=["surrogate", "surrogate-2nd", "empty", "reserved", "complex128", "complex32", "sparse"],
)
def test_save_refuses_what_safetensors_cannot_hold(tmp_path, sd, error, match):
    path = tmp_path / "ck"
    checkpoint.save(GOOD, path)
    (path / "config.json").write_text("{}")
    before = snapshot(tmp_path)
    with pytest.raises(error, match=match) as ei:
        checkpoint.save(sd, path, overwrite=True)
    assert isinstance(ei.value, checkpoint.CheckpointError) and str(path) in str(ei.value)
    assert snapshot(tmp_path) == before
    assert _values(path).keys() == {"good"}
    with pytest.raises(error, match=match):  # a new path: nothing created either
        checkpoint.save(sd, tmp_path / "fresh")
    assert snapshot(tmp_path) == before


def test_unusual_but_valid_names_round_trip(tmp_path):
    # Negative control of the name rule: anything that is valid UTF-8 is stored and read back.
    names = ["emoji.\U0001f600", "nul\x00byte", 'quote"and\\backslash', "new\nline", "é.ü.漢字", " "]
    sd = {n: torch.full((2,), float(i)) for i, n in enumerate(names)}
    idx = checkpoint.save(sd, tmp_path / "ck")
    with checkpoint.open_checkpoint(tmp_path / "ck") as r:
        assert sorted(r.keys()) == sorted(names) and all(torch.equal(r.get(n), sd[n]) for n in names)
    with safe_open(str(tmp_path / "ck" / idx.files()[0]), framework="pt") as f:
        assert sorted(f.keys()) == sorted(names)


def test_save_streaming_and_alias_names_checked(tmp_path):
    from checkpoint import TensorSpec

    before = snapshot(tmp_path)
    with pytest.raises(UnsavableError, match="UTF-8") as ei:
        checkpoint.save_streaming(
            tmp_path / "ck", [TensorSpec("x\ud800", (2,), torch.float32)], lambda s: torch.ones(2)
        )
    assert ei.value.key == "x\ud800"
    with pytest.raises(UnsavableError, match="UTF-8"):
        checkpoint.save_streaming(
            tmp_path / "ck", [TensorSpec("x", (2,), torch.float32)], lambda s: torch.ones(2),
            alias_groups=[["x", "y\udc80"]],
        )  # fmt: skip
    assert snapshot(tmp_path) == before


def test_header_over_safetensors_limit_refused(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    checkpoint.save(GOOD, path)
    before = snapshot(tmp_path)
    names = {f"{i:03d}." + "x" * 200: torch.zeros(1) for i in range(20)}  # ~4.8 KB of header
    monkeypatch.setattr(limits, "MAX_HEADER_BYTES", 4096)
    with pytest.raises(
        UnsavableError, match="header would be .* bytes, over safetensors' limit of 4096"
    ) as ei:
        checkpoint.save(names, path, overwrite=True)
    assert ei.value.key == "model-00001-of-00001.safetensors"
    assert snapshot(tmp_path) == before
    # Smaller shards keep each header under the limit: the same names save and read back.
    checkpoint.save(names, path, overwrite=True, max_shard_size=8)
    assert sorted(_values(path)) == sorted(names)


def test_header_limit_is_safetensors_own():
    # safetensors reads the 8-byte length first and refuses n > its MAX_HEADER_SIZE before
    # anything else, so a tiny file pins the constant: at the limit it fails for another reason.
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "h.safetensors")
        for n, msg in (
            (limits.MAX_HEADER_BYTES, "invalid header length"),
            (limits.MAX_HEADER_BYTES + 1, "too large"),
        ):
            with open(p, "wb") as f:
                f.write(struct.pack("<Q", n) + b"{}      ")
            with pytest.raises(SafetensorError, match=msg):
                safe_open(p, framework="pt")


# -- 2. overwrite replaces only what a checkpoint owns ---------------------------------------------


class Net(torch.nn.Module):
    def __init__(self, n=6):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(n))


def test_overwrite_keeps_user_files_and_drops_stale_files(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "ck"
    net = Net()
    opt = torch.optim.Adam(net.parameters())
    for layer in net.layers:
        layer.weight.grad = torch.ones_like(layer.weight)
        layer.bias.grad = torch.ones_like(layer.bias)
    opt.step()
    checkpoint.save(net, path, optimizer=opt, max_shard_size=700)  # several model + optimizer shards
    old_names = set(os.listdir(path))
    assert any(n.startswith("optimizer-") for n in old_names) and len(old_names) > 6
    user = {
        "config.json": b'{"model_type": "bert"}',
        "generation_config.json": b"{}",
        "tokenizer.json": b'{"v": 1}',
        "tokenizer/vocab.txt": b"x\n",
        "sub/deeper/notes.md": b"mine",
        "adapter_model.safetensors": b"not ours",  # a .safetensors name fqnckpt never writes
        ".hidden": b"h",
    }
    for rel, data in user.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    small = {"w": torch.arange(3.0)}
    idx = checkpoint.save(small, path, overwrite=True)
    names = set(os.listdir(path))
    assert names == {"model-00001-of-00001.safetensors", "model.safetensors.index.json"} | {
        r.split("/")[0] for r in user
    }
    assert {rel: (path / rel).read_bytes() for rel in user} == user
    assert idx.files() == ["model-00001-of-00001.safetensors"]
    assert torch.equal(_values(path)["w"], small["w"]) and checkpoint.verify(path).ok
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_owned_files_rule(tmp_path):
    d = tmp_path / "ck"
    checkpoint.save({"a": torch.ones(2)}, d)
    (d / "model.safetensors").write_bytes(b"x")  # HF single-file name: no record names it
    (d / "model-00007-of-00009.safetensors").write_bytes(b"x")  # an HF shard name no index names: kept
    (d / "extra_state.rank-00000-of-00002.json").write_bytes(b"x")  # no extra_state.json lists it: kept
    (d / "migration_report.json").write_bytes(b"{}")  # the save's record does not name it: kept
    (d / "weights.safetensors").write_bytes(b"x")  # not ours: kept
    (d / "model-00003-of-00004.safetensors.bak").write_bytes(b"x")  # not ours: kept
    os.mkdir(d / "optimizer.safetensors")  # a directory is never owned
    assert atomic.owned_files(str(d)) == {"model-00001-of-00001.safetensors", "model.safetensors.index.json"}
    # A model.safetensors no record names would shadow the new index for transformers: refused.
    with pytest.raises(checkpoint.CheckpointExistsError, match=r"\['model.safetensors'\]"):
        checkpoint.save({"a": torch.zeros(2)}, d, overwrite=True)
    # A checkpoint without fqnckpt's record (another tool's index) owns the names readers open.
    (d / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00001-of-00001.safetensors"}}')
    assert {"model.safetensors", "migration_report.json"} <= atomic.owned_files(str(d))
    # An index naming files by other names owns them; entries leading elsewhere are never owned.
    (d / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "custom.bin", "b": "../x.safetensors", "c": "sub/y.safetensors"}}'
    )
    (d / "custom.bin").write_bytes(b"x")
    assert "custom.bin" in atomic.owned_files(str(d))
    assert not {"../x.safetensors", "sub/y.safetensors"} & atomic.owned_files(str(d))


def test_directory_in_place_of_a_checkpoint_file_refused_before_commit(tmp_path):
    path = tmp_path / "ck"
    checkpoint.save(GOOD, path)
    os.mkdir(path / "model-00001-of-00002.safetensors")
    before = snapshot(tmp_path)
    with pytest.raises(checkpoint.CheckpointExistsError, match="directory"):
        checkpoint.save(
            {"a": torch.ones(300), "b": torch.ones(300)}, path, overwrite=True, max_shard_size=1200
        )
    assert snapshot(tmp_path) == before


def test_migrate_overwrite_keeps_user_files(tmp_path):
    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(2)}, src)
    dst = tmp_path / "out"
    checkpoint.migrate(src, dst)
    (dst / "config.json").write_bytes(b"{}")
    checkpoint.migrate(src, dst, overwrite=True)
    assert (dst / "config.json").read_bytes() == b"{}" and (dst / "migration_report.json").exists()


# -- 3. a reader sees one checkpoint ---------------------------------------------------------------

N = 6


def _sd(v):
    return {f"t{i}": torch.full((32,), float(v)) for i in range(N)}


def _opt_pair(v):
    net = Net(2)
    for p in net.parameters():
        torch.nn.init.constant_(p, float(v))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for p in net.parameters():
        p.grad = torch.full_like(p, float(v))
    opt.step()
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(float(v))
    return net, opt


def _paused_save(path, save):
    """Run ``save()`` in a thread that stops right after the first file of its commit moved in;
    returns (thread, go event)."""
    paused, go = threading.Event(), threading.Event()
    real = _faults.fault_point

    def hook(name):
        if name == "after_first_move" and threading.current_thread().name == "writer":
            paused.set()
            go.wait(30)
        real(name)

    _faults.fault_point = hook
    t = threading.Thread(target=save, name="writer")
    t.start()
    assert paused.wait(30)
    return t, go, lambda: setattr(_faults, "fault_point", real)


def _load_values(path):
    target = _sd(-1)
    checkpoint.load(target, path)
    return {float(v[0]) for v in target.values()}


def _verify_ok(path):
    rep = checkpoint.verify(path)
    return rep.ok, rep.problems


@pytest.mark.parametrize("reader", ["load", "verify", "open_checkpoint"])
def test_reader_during_commit_sees_one_checkpoint(tmp_path, reader):
    # Same names and layout old and new: a reader that opened shards by path across the commit
    # would mix them silently. The writer is frozen mid-commit; the reader must get old or new.
    path = tmp_path / "ck"
    checkpoint.save(_sd(1), path, max_shard_size=300)
    t, go, restore = _paused_save(
        path, lambda: checkpoint.save(_sd(2), path, overwrite=True, max_shard_size=300)
    )
    out = {}

    def read():
        if reader == "load":
            out["v"] = _load_values(path)
        elif reader == "verify":
            out["v"] = _verify_ok(path)
        else:
            with checkpoint.open_checkpoint(path) as r:
                out["v"] = {float(r.get(k)[0]) for k in r.keys()}

    try:
        rt = threading.Thread(target=read)
        rt.start()
        rt.join(1.0)  # a reader that does not wait for the commit finishes here, mid-commit
        go.set()
        t.join(30)
        rt.join(30)
    finally:
        restore()
    if reader == "verify":
        assert out["v"] == (True, [])
    else:
        assert out["v"] in ({1.0}, {2.0})
    assert _load_values(path) == {2.0}


def test_load_with_optimizer_reads_one_checkpoint(tmp_path):
    path = tmp_path / "ck"
    net1, opt1 = _opt_pair(1)
    checkpoint.save(net1, path, optimizer=opt1, max_shard_size=200)
    net2, opt2 = _opt_pair(2)
    t, go, restore = _paused_save(
        path, lambda: checkpoint.save(net2, path, optimizer=opt2, overwrite=True, max_shard_size=200)
    )
    got = {}

    def read():
        net, opt = _opt_pair(0)
        checkpoint.load(net, path, optimizer=opt)
        got["w"] = {float(p.detach().flatten()[0]) for p in net.parameters()}
        got["m"] = {float(s["momentum_buffer"].flatten()[0]) for s in opt.state.values()}

    try:
        rt = threading.Thread(target=read)
        rt.start()
        rt.join(1.0)
        go.set()
        t.join(30)
        rt.join(30)
    finally:
        restore()
    ref = {
        v: {float(s["momentum_buffer"].flatten()[0]) for s in o.state.values()}
        for v, o in ((1, opt1), (2, opt2))
    }
    assert (got["w"], got["m"]) in (({1.0}, ref[1]), ({2.0}, ref[2]))


def test_opened_reader_keeps_its_checkpoint_across_overwrite(tmp_path):
    path = tmp_path / "ck"
    checkpoint.save(_sd(1), path, max_shard_size=300)
    with checkpoint.open_checkpoint(path) as r:
        checkpoint.save(_sd(2), path, overwrite=True, max_shard_size=300)
        assert {float(r.get(k)[0]) for k in r.keys()} == {1.0}
        for name in r.files:  # re-hashes the files it opened, not the new ones
            r.verify_file(name)
    assert _load_values(path) == {2.0}


# -- 4. recovery only where a commit was provably interrupted --------------------------------------


def _kill_at(path, point, sd, **kw):
    pid = os.fork()
    if pid == 0:
        try:
            os.environ["FQNCKPT_FAULT_POINT"] = point
            checkpoint.save(sd, path, overwrite=True, **kw)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status)


def test_deleted_checkpoint_never_comes_back(tmp_path):
    path = tmp_path / "ck"
    checkpoint.save(_sd(1), path)
    # A leftover of the earlier rename-aside protocol: a complete old checkpoint beside the path.
    shutil.copytree(path, tmp_path / ".ck.fqnckpt-old-0123")
    # A decided commit interrupted inside the checkpoint, then the user deletes the checkpoint.
    _kill_at(path, "after_commit_rename", _sd(2))
    assert any(n.startswith(atomic.COMMIT_TAG) for n in os.listdir(path))
    shutil.rmtree(path)
    before = snapshot(tmp_path)
    for _ in range(2):
        with pytest.raises(checkpoint.CheckpointNotFoundError):
            checkpoint.load(_sd(0), path)
        with pytest.raises(checkpoint.CheckpointNotFoundError):
            checkpoint.verify(path)
    assert snapshot(tmp_path) == before  # readers restore nothing
    checkpoint.save(_sd(3), path)
    # The copy is named like the earlier protocol's leftovers, but nothing of ours records it: it stays.
    assert sorted(os.listdir(tmp_path)) == [".ck.fqnckpt-old-0123", "ck"] and _load_values(path) == {3.0}


def test_interrupted_commit_travels_with_its_directory(tmp_path):
    path = tmp_path / "ck"
    checkpoint.save(_sd(1), path, max_shard_size=300)
    _kill_at(path, "after_first_move", _sd(2), max_shard_size=300)
    os.rename(path, tmp_path / "moved")
    checkpoint.recover(tmp_path / "moved")
    assert _load_values(tmp_path / "moved") == {2.0}  # completed where it is, whole
    assert not any(n.startswith(".") for n in os.listdir(tmp_path / "moved"))


def test_readers_never_complete_an_interrupted_commit(tmp_path):
    path = tmp_path / "ck"
    checkpoint.save(_sd(1), path, max_shard_size=300)
    _kill_at(path, "after_first_move", _sd(2), max_shard_size=300)
    before = snapshot(tmp_path)
    for read in (lambda: checkpoint.load(_sd(0), path), lambda: checkpoint.verify(path), lambda: _values(path)):
        with pytest.raises(InterruptedCommitError, match="interrupted while committing"):
            read()
    assert snapshot(tmp_path) == before
    checkpoint.save(_sd(3), path, overwrite=True, max_shard_size=300)  # the next writer completes it, then saves
    assert _load_values(path) == {3.0}
    assert not any(n.startswith(".") for n in os.listdir(path))


def test_overwrite_removes_the_parts_the_model_index_records_only(tmp_path):
    """Ownership by record on a local path: the files a save wrote beside its shards are listed in
    its model index (metadata.fqnckpt.objects). An overwrite removes the recorded parts; side
    files (JSON that users edit and tools open by name) stay until a save writes its own, and a
    file of the same name that no record names is never replaced."""
    from checkpoint.storage.layout import TensorSpec

    path = tmp_path / "ck"
    w = torch.arange(4.0)
    spec = [TensorSpec.of("w", w)]
    idx = checkpoint.save_streaming(path, spec, lambda s: w, extra_files={"notes.json": b"{}", "tokenizer_config.json": b"{}"})
    assert idx.metadata.fqnckpt.objects == {"notes.json": "notes.json", "tokenizer_config.json": "tokenizer_config.json"}
    assert set(idx.metadata.fqnckpt.object_digests) == {"notes.json", "tokenizer_config.json"}
    assert atomic.owned_files(str(path)) == {"model-00001-of-00001.safetensors", "model.safetensors.index.json"}
    (path / "notes.json").write_bytes(b'{"edited": 1}')
    checkpoint.save({"w": w}, path, overwrite=True)  # writes neither: they stay, still the checkpoint's
    assert sorted(os.listdir(path)) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json", "notes.json", "tokenizer_config.json"]
    assert (path / "notes.json").read_bytes() == b'{"edited": 1}'
    checkpoint.save_streaming(path, spec, lambda s: w, extra_files={"tokenizer_config.json": b"ours"}, overwrite=True)
    assert (path / "tokenizer_config.json").read_bytes() == b"ours"  # recorded: a save that writes its own replaces it
    (path / "model.safetensors.index.json").unlink()
    (path / "tokenizer_config.json").write_bytes(b"the user's")  # no record names it now
    with pytest.raises(checkpoint.CheckpointExistsError, match="tokenizer_config.json"):
        checkpoint.save_streaming(path, spec, lambda s: w, extra_files={"tokenizer_config.json": b"x"}, overwrite=True)
    assert (path / "tokenizer_config.json").read_bytes() == b"the user's"
