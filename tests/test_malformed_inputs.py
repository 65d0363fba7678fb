"""Malformed inputs on the read and write paths (header checks from bytes, column-block reads,
the DCP readers): each test pins one kind of malformed input. Bad input raises our error naming file and tensor (never a bare ``ValueError`` /
``TypeError`` from numpy or torch), nothing is half-loaded, and every reader says the same as
``verify``."""

from __future__ import annotations

import json
import os
import re
import struct

import pytest
import torch

import checkpoint
from checkpoint import CorruptCheckpointError
from checkpoint.cli import main as cli_main


def write_st(p, header_bytes: bytes, data: bytes = b"") -> None:
    """A safetensors file by hand: u64 LE header length, header bytes (space-padded), data."""
    header_bytes += b" " * (-len(header_bytes) % 8)
    p.write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + data)


# -- tensors of more dims than numpy holds -----------------------------------------------------------


@pytest.mark.parametrize("ndim", [33, 65])
def test_tensor_of_more_dims_than_numpy_holds(tmp_path, capsys, monkeypatch, ndim):
    """torch holds any number of dims, numpy 32 (1.x) or 64 (2.x): the byte views of save, get,
    get_slice and the block copies (straight, converting, strided; every window size) raised a bare
    ``ValueError: number of dimensions must be within [0, 64]``. Every path reads the exact values."""
    import torch.distributed.checkpoint as dcp

    from checkpoint.dcp import StorageReader
    from checkpoint.storage import tensor_read

    a = torch.arange(60.0).reshape([1] * (ndim - 3) + [3, 4, 5])
    ck = tmp_path / "ck"
    checkpoint.save({"a": a, "b": torch.ones(2)}, ck)
    assert checkpoint.verify(ck).ok
    unit = [slice(0, 1)] * (ndim - 3)
    with checkpoint.open_checkpoint(ck) as r:
        assert torch.equal(r.get("a"), a)
        for span, gap, window, rows in ((2 << 10, 16 << 10, 8 << 20, 1 << 20), (0, 0, 1000, 1000), (0, 64, 1 << 20, 1)):
            monkeypatch.setattr(tensor_read, "SHORT_RUN", span)
            monkeypatch.setattr(tensor_read, "GAP", gap)
            monkeypatch.setattr(tensor_read, "WINDOW", window)
            monkeypatch.setattr(tensor_read, "ROWS_WINDOW", rows)
            for sl in (unit + [slice(1, 3), slice(0, 4), slice(1, 4)], unit + [slice(1, 3), slice(0, 4, 2)], unit + [slice(2, 3)]):
                assert torch.equal(r.get_slice("a", sl), a[tuple(sl)]), sl
                step1 = [slice(s.start, s.stop) for s in sl]
                want = a[tuple(step1)]
                for dtype, strided in ((torch.float32, False), (torch.float64, False), (torch.float32, True)):
                    base = torch.full((*want.shape[:-1], 2 * want.shape[-1]) if strided else want.shape, 7, dtype=dtype)
                    out = base[..., ::2] if strided else base
                    assert r.copy_into("a", out, step1, check=True)
                    assert torch.equal(out, want.to(dtype)), (step1, dtype, strided)
    for out in (torch.zeros_like(a), torch.zeros_like(a, dtype=torch.float64), torch.zeros(*a.shape[:-1], 10)[..., ::2]):
        checkpoint.load({"a": out, "b": torch.zeros(2)}, ck)
        assert torch.equal(out, a.to(out.dtype))
    target = {"a": torch.zeros_like(a), "b": torch.zeros(2)}
    dcp.load(target, storage_reader=StorageReader(str(ck)), no_dist=True)
    assert torch.equal(target["a"], a)
    checkpoint.migrate(ck, tmp_path / "m")
    assert torch.equal(checkpoint.open_checkpoint(tmp_path / "m").get("a"), a)
    assert cli_main(["diff", str(ck), str(tmp_path / "m")]) == 0
    capsys.readouterr()


# -- a tensor named twice in a header, hidden by JSON escapes ----------------------------------------

_F32 = b'{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'


@pytest.mark.parametrize(
    "header",
    [
        # the second entry's key spelled with an escape: safetensors (serde) keeps the last entry,
        # and the count of the literal word "data_offsets" does not betray the repeat
        b'{"a":{"dtype":"F32","shape":[1],"d\\u0061ta_offsets":[0,4]},"a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}}',
        b'{"\\u0061":' + _F32 + b',"a":' + _F32 + b"}",
        b'{"a":' + _F32 + b',"a":' + _F32 + b"}",
    ],
    ids=["escaped-field", "escaped-name", "plain"],
)
def test_tensor_named_twice_through_escapes_is_refused_everywhere(tmp_path, capsys, header):
    ck = tmp_path / "ck"
    ck.mkdir()
    write_st(ck / "model.safetensors", header, b"\0\0\x80\x3f")
    target = {"a": torch.zeros(1)}
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors.*header names tensor 'a' twice"):
        checkpoint.open_checkpoint(ck)
    with pytest.raises(CorruptCheckpointError, match="names tensor 'a' twice"):
        checkpoint.load(target, ck)
    assert torch.equal(target["a"], torch.zeros(1))
    report = checkpoint.verify(ck)
    assert not report.ok and any("names tensor 'a' twice" in p for p in report.problems), report.problems
    for cmd in ("inspect", "verify", "migrate"):
        argv = [cmd, str(ck)] + ([str(tmp_path / "out")] if cmd == "migrate" else [])
        rc = cli_main(argv)
        err = capsys.readouterr()
        assert rc in (1, 2) and "names tensor 'a' twice" in err.out + err.err, (cmd, rc, err)
    assert not (tmp_path / "out").exists()


# -- DCP chunks that do not cover their tensor exactly ----------------------------------------------


def _dcp_hf_shards(root, chunks) -> None:
    """Per-rank shard files as torch's HuggingFaceStorageWriter(save_distributed=True) writes
    them: one file per chunk of tensor ``w`` (``(offset, values)``), placed by DCP_SHARDING_INFO."""
    root.mkdir()
    for i, (off, vals) in enumerate(chunks):
        data = torch.tensor(vals, dtype=torch.float32).numpy().tobytes()
        head = {"w": {"dtype": "F32", "shape": [len(vals)], "data_offsets": [0, len(data)]},
                "__metadata__": {"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [off]}})}}  # fmt: skip
        write_st(root / f"shard-0000{i + 1}-model-00001-of-00001.safetensors", json.dumps(head).encode(), data)


@pytest.mark.parametrize(
    "chunks, needle",
    [
        ([(0, [1, 2]), (1, [3, 4]), (4, [5, 6])], "overlap"),  # sums to the size [6], gap at 3
        ([(0, [1, 2]), (4, [5, 6])], "leave a gap"),  # element 2, 3 stored nowhere
        ([(0, [1, 2]), (0, [3, 4])], "leave a gap or overlap"),
    ],
    ids=["overlap-and-gap", "gap", "same-offsets"],
)
def test_dcp_chunks_not_covering_the_tensor_are_refused(tmp_path, capsys, chunks, needle):
    """Chunks must cover the tensor exactly, for the migration source and the DCP StorageReader
    alike: a gap would come back as uninitialised memory (and ``migrate`` would write it into a
    new checkpoint); equal volume and distinct offsets are not coverage (an overlap and a gap of
    one size have both)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from checkpoint.dcp import StorageReader
    from checkpoint.sources import open_source

    src = tmp_path / "hf"
    _dcp_hf_shards(src, chunks)
    with pytest.raises(CorruptCheckpointError, match=f"'w'.*{needle}"):
        open_source(src).get("w")
    with pytest.raises(CorruptCheckpointError, match=f"'w'.*{needle}"):
        checkpoint.migrate(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert cli_main(["migrate", str(src), str(tmp_path / "out2")]) == 2
    assert "'w'" in capsys.readouterr().err and not (tmp_path / "out2").exists()
    target = {"w": torch.full((6,), 7.0)}
    with pytest.raises(CheckpointException, match=f"(?s)'w'.*{needle}"):  # DCP wraps the reader's error
        dcp.load(target, storage_reader=StorageReader(str(src)), no_dist=True)
    assert torch.equal(target["w"], torch.full((6,), 7.0))


def test_dcp_metadata_chunk_gap_is_refused(tmp_path):
    """A DCP ``.metadata`` whose chunk covers part of its tensor: refused by name (it was read
    with the rest uninitialised)."""
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp

    from checkpoint.sources import open_source

    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(6.0), "v": torch.ones(2)}, checkpoint_id=str(src), no_dist=True)
    md = pickle.loads((src / ".metadata").read_bytes())
    md.state_dict_metadata["w"].chunks[0].sizes = torch.Size([4])
    (src / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CorruptCheckpointError, match=r"dcp: DCP tensor 'w' has chunks holding 4 elements, not its 6"):
        open_source(src).get("v")
    with pytest.raises(CorruptCheckpointError, match="'w' has chunks holding 4"):
        checkpoint.migrate(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- index entries no file system can hold -----------------------------------------------------------


@pytest.mark.parametrize("name", ["x" * 300 + ".safetensors", "\u00e9" * 130 + ".safetensors"], ids=["ascii", "multibyte"])
@pytest.mark.parametrize("where", ["local", "memory"])
def test_index_entry_longer_than_a_file_name_is_refused(tmp_path, capsys, name, where):
    """An index naming a shard of over 255 bytes (NAME_MAX): ``open_source`` / ``migrate`` raised a
    bare ``OSError: [Errno 36] File name too long`` from ``stat``; now the one path rule refuses it
    on every reader, local or remote, before anything is read or written."""
    import fsspec

    from checkpoint.errors import UnsafePathError
    from checkpoint.sources import open_source
    from tests.snapshot import Snapshot

    ck = tmp_path / "ck"
    checkpoint.save({"a": torch.ones(2), "b": torch.zeros(3)}, ck)
    ip = ck / "model.safetensors.index.json"
    idx = json.loads(ip.read_text())
    idx["weight_map"]["a"] = name
    del idx["metadata"]["fqnckpt"]  # another tool's index
    ip.write_text(json.dumps(idx))
    url = str(ck)
    if where == "memory":
        url = f"memory://hostile-{tmp_path.name}/ck"
        for f in ck.iterdir():
            fsspec.filesystem("memory").pipe(url.removeprefix("memory:/") + "/" + f.name, f.read_bytes())
    target = {"a": torch.zeros(2), "b": torch.zeros(3)}
    snap = Snapshot(target)
    refused = r"index entry '.*\.\.\.' of .*ck is refused: not a plain file name \(longer than 255 bytes"
    with pytest.raises(UnsafePathError, match=refused):
        checkpoint.open_checkpoint(url)
    with pytest.raises(UnsafePathError, match=refused):
        checkpoint.load(target, url)
    snap.assert_unchanged()
    report = checkpoint.verify(url)
    assert not report.ok and any("longer than 255 bytes" in p for p in report.problems), report.problems
    assert cli_main(["inspect", url]) == 2 and "longer than 255 bytes" in capsys.readouterr().err
    if where == "local":
        with pytest.raises(UnsafePathError, match=refused):
            open_source(ck)
        with pytest.raises(UnsafePathError, match=refused):
            checkpoint.migrate(ck, tmp_path / "out")
        assert not (tmp_path / "out").exists()


# -- a flipped byte in a tensor the block copies do not hash -----------------------------------------


def _flip_first_byte_of(path_or_store, key: str, where: str) -> None:
    """Flip one bit of tensor ``key``'s first stored byte in the checkpoint's only shard."""
    import fsspec

    if where == "local":
        (shard,) = [p for p in path_or_store.iterdir() if p.suffix == ".safetensors"]
        raw = bytearray(shard.read_bytes())
    else:
        fs = fsspec.filesystem("memory")
        (shard,) = [n for n in fs.ls(path_or_store, detail=False) if n.endswith(".safetensors")]
        raw = bytearray(fs.cat(shard))
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8 + n + json.loads(raw[8 : 8 + n])[key]["data_offsets"][0]] ^= 1
    if where == "local":
        shard.write_bytes(bytes(raw))
    else:
        fs.pipe(shard, bytes(raw))


@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.parametrize("key", ["vec", "scalar", "mat"])
def test_flipped_byte_of_any_rank_refused_by_converting_strided_and_sliced_reads(tmp_path, where, key):
    """The digest check of converting / strided loads (``copy_into(check=True)``) hashed whole
    rows of 2-D and wider tensors only: a flipped byte of a 1-D tensor (biases, norms) or a 0-D
    one loaded silently into a float64, bfloat16 or strided target; ``get_slice`` of the whole
    tensor returned it unchecked (local and remote). Every whole read is checked now (a 0-D one
    before the target is written)."""
    from checkpoint.dcp import StorageReader

    src = {"vec": torch.arange(5.0) + 1, "scalar": torch.tensor(3.5), "mat": torch.randn(3, 4)}
    url = tmp_path / "ck" if where == "local" else f"memory://flip-{tmp_path.name}-{key}/ck"
    checkpoint.save(src, url)
    _flip_first_byte_of(url if where == "local" else url.removeprefix("memory:/"), key, where)
    shape = src[key].shape
    targets = [torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.bfloat16)]
    if shape:
        targets.append(torch.zeros(*shape[:-1], 2 * shape[-1])[..., ::2])
    for out in targets:
        target = {k: torch.zeros_like(v) for k, v in src.items()} | {key: out}
        before = out.clone()
        with pytest.raises(CorruptCheckpointError, match=f"tensor '{key}': its bytes differ from the index's xxh3-128 digest"):
            checkpoint.load(target, url)
        if not shape:  # read whole and checked before the copy (wider ones are hashed as they land)
            assert torch.equal(out, before), (out.dtype, out.stride())
    with checkpoint.open_checkpoint(url) as r:
        for slices in ([slice(None)] * len(shape), [slice(0, None)][: len(shape)]):
            with pytest.raises(CorruptCheckpointError, match=f"tensor '{key}': its bytes differ"):
                r.get_slice(key, slices)
        if len(shape) == 2:  # a partial block cannot be checked: read as stored
            assert r.get_slice(key, [slice(1, 3)]).shape == (2, 4)
    if where == "local" and shape:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        target = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in src.items()}
        with pytest.raises(CheckpointException, match=f"(?s)tensor '{key}': its bytes differ"):
            dcp.load(target, storage_reader=StorageReader(str(url)), no_dist=True)


@pytest.mark.parametrize("key", ["vec", "mat"])
def test_migrate_refuses_flipped_bytes_instead_of_digesting_them_anew(tmp_path, capsys, key):
    """The migration source read fqnckpt checkpoints without their index's digests: ``migrate``
    copied a flipped byte into a new checkpoint with fresh digests, whose ``verify`` then said OK
    (the corruption laundered). Whole reads of the source are checked like ``load``'s."""
    from checkpoint.sources import open_source

    src = {"vec": torch.arange(5.0) + 1, "mat": torch.randn(3, 4)}
    ck = tmp_path / "ck"
    checkpoint.save(src, ck)
    _flip_first_byte_of(ck, key, "local")
    refused = f"model-00001-of-00001.safetensors: tensor '{key}': its bytes differ from the index's xxh3-128 digest"
    s = open_source(ck)
    with pytest.raises(CorruptCheckpointError, match=refused):
        s.get(key)
    with pytest.raises(CorruptCheckpointError, match=refused):
        s.get_slice(key, (slice(0, None),))
    other = "mat" if key == "vec" else "vec"
    assert torch.equal(s.get(other), src[other])
    with pytest.raises(CorruptCheckpointError, match=refused):
        checkpoint.migrate(ck, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert cli_main(["migrate", str(ck), str(tmp_path / "out2")]) == 2
    assert refused in capsys.readouterr().err and not (tmp_path / "out2").exists()


# -- a save beside another tool's checkpoint that readers would open instead --------------------------


def _tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("writer", ["save", "dcp"])
def test_save_beside_a_dcp_checkpoint_is_refused_not_shadowed(tmp_path, writer):
    """A directory holding torch's DCP checkpoint (``.metadata`` + ``*.distcp``), saved over with
    ``checkpoint.save(overwrite=True)`` or the DCP StorageWriter: the save committed beside it,
    then ``checkpoint.load`` and the migration source read the old DCP checkpoint (they open a
    directory with ``.metadata`` as DCP) while ``inspect`` and the StorageReader read the new one.
    Refused like a stale ``model.safetensors``: nothing written, the old checkpoint intact."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from checkpoint import CheckpointExistsError
    from checkpoint.dcp import StorageWriter

    d = tmp_path / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.zeros(3)}, checkpoint_id=str(d), no_dist=True)
    before = _tree(d)
    refused = r"(?s)\['\.metadata'\] exist there and no record of the checkpoint names them"
    if writer == "save":
        with pytest.raises(CheckpointExistsError, match=refused):
            checkpoint.save({"w": torch.ones(3)}, d, overwrite=True)
    else:
        with pytest.raises(CheckpointException, match=refused), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(str(d)), no_dist=True)
    assert _tree(d) == before
    target = {"w": torch.full((3,), 7.0)}
    checkpoint.load(target, d)
    assert torch.equal(target["w"], torch.zeros(3))


def test_remote_save_beside_a_dcp_metadata_object_is_refused(tmp_path):
    from checkpoint import CheckpointExistsError
    from tests.backends import names, put

    url = f"memory://shadow-{tmp_path.name}/ck"
    put(url, None, ".metadata", b"not ours")
    with pytest.raises(CheckpointExistsError, match=r"\['\.metadata'\] exist there"):
        checkpoint.save({"w": torch.ones(3)}, url, overwrite=True)
    assert names(url, None) == {".metadata"}


# -- ints JSON side files cannot carry --------------------------------------------------------------


@pytest.mark.parametrize("where", ["extra_state", "optimizer"])
def test_int_over_the_json_digit_limit_is_refused_before_anything_is_written(tmp_path, where):
    """An int of more than 4300 decimal digits (Python's int / str conversion limit) in extra state
    or an optimizer param group: ``save`` failed in ``json.dumps`` with a bare ``ValueError``
    ("Exceeds the limit (4300 digits)"). Refused by name while encoding, the old checkpoint kept;
    an int just under the limit round-trips."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = tmp_path / "ck"
    checkpoint.save(model, ck, optimizer=opt, extra_state={"step": 1})
    before = _tree(ck)
    huge = -(10**5000)
    if where == "optimizer":
        opt.param_groups[0]["huge"] = huge
        kwargs, needle = {"optimizer": opt}, "optimizer param group 0 'huge' is an int of 16610 bits"
    else:
        kwargs, needle = {"extra_state": {"big": {"x": [1, huge]}}}, "extra_state \"big['x'][1]\" is an int of 16610 bits"
    with pytest.raises(TypeError, match=re.escape(needle) + ".*more than 4300 decimal digits"):
        checkpoint.save(model, ck, overwrite=True, **kwargs)
    assert _tree(ck) == before
    fits = 10**4000
    opt.param_groups[0]["huge"] = fits
    checkpoint.save(model, ck, overwrite=True, optimizer=opt, extra_state={"big": fits})
    back, es = torch.optim.SGD(model.parameters(), lr=0.5), {"big": None}
    checkpoint.load(model, ck, optimizer=back, extra_state=es)
    assert back.param_groups[0]["huge"] == fits and es["big"] == fits


# -- a file rewritten in place while verify reads it -------------------------------------------------


@pytest.mark.parametrize("change", ["header", "cut"])
def test_verify_of_a_file_rewritten_in_place_reports_it(tmp_path, monkeypatch, capsys, change):
    """A shard rewritten in place (same inode) after ``verify`` opened the checkpoint: verify
    re-parsed the header to total its tensors and died with ``ExternalError: verifying failed:
    JSONDecodeError`` (or ``struct.error`` on a cut file), naming no file. The totals come from the
    header validated on open; the digests name the file and what changed."""
    from checkpoint.storage import reader as R

    ck = tmp_path / "ck"
    checkpoint.save({"a": torch.ones(4), "b": torch.zeros(2)}, ck)
    (shard,) = [p for p in ck.iterdir() if p.suffix == ".safetensors"]
    real = R.CheckpointReader.check_file

    def rewritten(self, name):
        if change == "header":
            with open(shard, "r+b") as f:
                f.seek(8)
                f.write(b"garbage!")
        else:
            os.truncate(shard, 3)
        return real(self, name)

    monkeypatch.setattr(R.CheckpointReader, "check_file", rewritten)
    report = checkpoint.verify(ck)
    assert not report.ok
    (problem,) = report.problems
    assert problem.startswith(f"{shard}: xxh3_128 ") and "header bytes changed" in problem, problem
    assert ("size 3 bytes, index says" in problem) == (change == "cut")
    assert cli_main(["verify", str(ck)]) == 1 and "not a valid safetensors file" in capsys.readouterr().out  # damaged by now


@pytest.mark.parametrize("where", ["local", "memory"])
def test_index_number_over_the_digit_limit_is_corrupt(tmp_path, capsys, where):
    """An index whose ``total_size`` has 5001 digits: ``json.loads`` raises a plain ``ValueError``
    (Python's int / str limit), not ``JSONDecodeError``: ``open_checkpoint`` / ``load`` raised it
    bare and ``verify`` / ``inspect`` wrapped it as "verifying failed"; a remote ``verify`` raised
    on any index that does not parse instead of reporting it. Now the index is corrupt, by name,
    on every reader (the migration source already said so through pydantic)."""
    import fsspec

    ck = tmp_path / "ck"
    checkpoint.save({"a": torch.ones(2)}, ck)
    ip = ck / "model.safetensors.index.json"
    raw = ip.read_text()
    assert '"total_size": 8' in raw
    ip.write_text(raw.replace('"total_size": 8', '"total_size": 1' + "0" * 5000))
    url = str(ck)
    if where == "memory":
        url = f"memory://digits-{tmp_path.name}/ck"
        for f in ck.iterdir():
            fsspec.filesystem("memory").pipe(url.removeprefix("memory:/") + "/" + f.name, f.read_bytes())
    refused = r"model\.safetensors\.index\.json.*index is not JSON: Exceeds the limit \(4300 digits\)"
    with pytest.raises(CorruptCheckpointError, match=refused):
        checkpoint.open_checkpoint(url)
    target = {"a": torch.zeros(2)}
    with pytest.raises(CorruptCheckpointError, match=refused):
        checkpoint.load(target, url)
    assert torch.equal(target["a"], torch.zeros(2))
    report = checkpoint.verify(url)
    assert not report.ok and any("index is not JSON" in p for p in report.problems), report.problems
    assert cli_main(["inspect", url]) == 2 and "index is not JSON" in capsys.readouterr().err


def test_remote_object_cut_after_open_names_file_and_tensor(tmp_path):
    """An object of a remote checkpoint replaced by a shorter one after it was opened: a block
    read in several ranged GETs (a column block: spread runs) assigned the short reply into the
    target and raised a bare ``ValueError: memoryview assignment``; the other reads said "object
    ends early" without the tensor. Every read names file and tensor now."""
    import fsspec
    from safetensors.torch import save as st_save

    fs = fsspec.filesystem("memory")
    where = f"/cut-{tmp_path.name}"
    whole = st_save({"m": torch.ones(256, 256), "z": torch.ones(10)})
    fs.pipe(f"{where}/model.safetensors", whole)
    r = checkpoint.open_checkpoint(f"memory:/{where}")
    fs.pipe(f"{where}/model.safetensors", whole[: len(whole) // 2])
    named = rf"memory:/{where}/model\.safetensors: tensor '(m|z)': object ends early"
    for read in (
        lambda: r.get_slice("m", [slice(0, 256), slice(0, 2)]),  # 256 spread runs: concurrent ranged GETs
        lambda: r.get_slice("m", [slice(200, 256)]),
        lambda: r.get("m"),
        lambda: r.get("z"),
    ):
        with pytest.raises(CorruptCheckpointError, match=named):
            read()


# -- a single file larger than the machine's memory ---------------------------------------------------


def test_single_file_larger_than_memory_opens(tmp_path, capsys):
    """A one-file checkpoint larger than RAM + swap (here a sparse file: its header says so, its
    data is a hole): every reader failed with a bare ``RuntimeError: unable to mmap ... Cannot
    allocate memory``, because the header's copy was validated by ``safe_open(framework="pt")``,
    which maps it through torch privately writable (kernel-accounted). Keys, specs and blocks
    read now; nothing of the file is mapped."""
    with open("/proc/meminfo") as f:
        mem = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f}
    n = 2 * (mem["MemTotal"] + mem.get("SwapTotal", 0))  # bytes of one uint8 tensor
    n -= n % 4096
    ck = tmp_path / "ck"
    ck.mkdir()
    p = ck / "model.safetensors"
    head = json.dumps({"big": {"dtype": "U8", "shape": [n // 4096, 4096], "data_offsets": [0, n]}}).encode()
    head += b" " * (-len(head) % 8)
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        try:
            f.truncate(8 + len(head) + n)  # a hole: no disk blocks
        except OSError as e:  # a file system without files this large
            pytest.skip(f"no sparse file of {n} bytes here: {e}")
    with checkpoint.open_checkpoint(ck) as r:
        assert r.keys() == ["big"] and tuple(r.spec("big").shape) == (n // 4096, 4096)
        assert torch.equal(r.get_slice("big", [slice(3, 5)]), torch.zeros(2, 4096, dtype=torch.uint8))
    assert cli_main(["inspect", str(ck)]) == 0 and "big" not in capsys.readouterr().err


# -- optimizer param groups naming a parameter twice -------------------------------------------------


@pytest.mark.parametrize("damage", ["same-params-other-lr", "in-two-groups", "twice-in-one"])
def test_saved_param_groups_naming_a_parameter_twice_are_refused(tmp_path, damage):
    """Saved param groups holding one parameter twice (an invalid optimizer state: torch's
    ``add_param_group`` refuses it): two groups with the same parameters and other learning rates
    collapsed into one lookup and the last silently won (lr 99 restored). Refused by name, model
    and optimizer unchanged."""
    import copy

    from tests.snapshot import Snapshot

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(1, 2)).sum().backward()
    opt.step()
    ck = tmp_path / "ck"
    checkpoint.save(model, ck, optimizer=opt)
    ip = ck / "optimizer.safetensors.index.json"
    idx = json.loads(ip.read_text())
    groups = idx["metadata"]["fqnckpt"]["optimizer"]["param_groups"]
    other = copy.deepcopy(groups[0]) | {"lr": 99.0}
    if damage == "in-two-groups":
        other["params"] = ["weight"]
    if damage == "twice-in-one":
        groups[0]["params"] = ["weight", "weight", "bias"]
    else:
        groups.append(other)
    del idx["metadata"]["fqnckpt"]["index_xxh3_128"]  # damaged, not re-digested
    ip.write_text(json.dumps(idx))
    target = torch.nn.Linear(2, 2)
    topt = torch.optim.Adam(target.parameters(), lr=0.5)
    snap = Snapshot(target, topt)
    needle = "param group 0 names 'weight' twice" if damage == "twice-in-one" else "param groups 0 and 1 both hold 'weight'"
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{ip}: saved optimizer {needle}")):
        checkpoint.load(target, ck, optimizer=topt)
    snap.assert_unchanged()


# -- get_slice arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "memory", "source"])
def test_get_slice_arguments_checked_alike_on_every_reader(tmp_path, where):
    """``get_slice`` with more slices than dims: the remote reader ignored the extra one (zip) and
    returned a block where the local reader raised ``IndexError``; a non-slice item raised a bare
    ``AttributeError: 'int' object has no attribute 'indices'``; a step past the dim made torch fail
    with "as_strided: Negative strides". One check on every reader; numpy ints index as in torch."""
    import numpy as np

    from checkpoint.sources import open_source

    t = torch.arange(60.0).reshape(3, 4, 5)
    url = tmp_path / "ck" if where != "memory" else f"memory://slices-{tmp_path.name}/ck"
    checkpoint.save({"t": t}, url)
    r = open_source(url) if where == "source" else checkpoint.open_checkpoint(url)
    for sl in ([slice(1, 3), slice(0, 4, 2)], [slice(np.int64(1), np.int32(3), np.int64(2))], [slice(-2, None)]):
        assert torch.equal(r.get_slice("t", sl), t[tuple(sl)]), sl
    assert torch.equal(r.get_slice("t", [slice(1, 3, 2**70), slice(0, 4, 5)]), t[1:2, 0:1])  # step past the dim
    for bad, kind, needle in (
        ([slice(0, 1)] * 4, IndexError, "tensor 't' has 3 dims, got 4 slices"),
        ([1], TypeError, "get_slice takes a slice of ints per dim, got 1 for dim 0"),
        ([slice(0, 2), None], TypeError, "got None for dim 1"),
        ([slice(0.5, 2)], TypeError, "got slice(0.5, 2, None) for dim 0"),
        ([slice(None, None, -1)], ValueError, "slice step must be positive, got -1 for dim 0"),
    ):
        with pytest.raises(Exception) as e:  # noqa: PT011 - the source names file and tensor around it
            r.get_slice("t", bad)
        if where == "source":
            assert isinstance(e.value, checkpoint.CheckpointError) and needle in str(e.value), e.value
        else:
            assert isinstance(e.value, kind) and needle in str(e.value), e.value
        if where == "local" and kind is not ValueError:  # the block copy takes the same slices
            with pytest.raises(kind, match=re.escape(needle)):
                r.copy_into("t", torch.zeros(1, 1, 1), bad)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_dtype_torch_cannot_hold_named_alike_by_every_reader(tmp_path, capsys, where):
    """A tensor of a safetensors dtype fqnckpt has no torch dtype for (``F6_E2M3``, sub-byte):
    the torch-free ``inspect`` / migration source said "<path>: tensor 'a' has dtype F6_E2M3 torch
    cannot hold", the local reader "model.safetensors: tensor 'a' has unsupported dtype ..."
    without the directory (so the DCP StorageReader's error named no checkpoint). One message, full
    path, on every reader; the other tensors still read."""
    import fsspec

    ck = tmp_path / "ck"
    ck.mkdir()
    head = {"a": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [4, 7]}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    write_st(ck / "model.safetensors", json.dumps(head).encode(), b"\0\0\x80\x3f\x11\x11\x11")
    url = str(ck)
    if where == "memory":
        url = f"memory://f6-{tmp_path.name}/ck"
        fsspec.filesystem("memory").pipe(url.removeprefix("memory:/") + "/model.safetensors", (ck / "model.safetensors").read_bytes())
    with checkpoint.open_checkpoint(url) as r:
        assert torch.equal(r.get("b"), torch.ones(1))
        with pytest.raises(CorruptCheckpointError, match=re.escape(f"{url}/model.safetensors: tensor 'a' has dtype F6_E2M3 torch cannot hold")):
            r.get("a")
    if where == "local":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        from checkpoint.dcp import StorageReader

        with pytest.raises(CheckpointException, match=re.escape(f"{url}/model.safetensors: tensor 'a' has dtype F6_E2M3")):
            dcp.load({"b": torch.zeros(1)}, storage_reader=StorageReader(url), no_dist=True)
        assert cli_main(["inspect", url]) == 2
        assert f"{url}/model.safetensors: tensor 'a' has dtype F6_E2M3 torch cannot hold" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["local", "memory"])
def test_save_of_file_names_readers_refuse_is_refused(tmp_path, where):
    """``fqn_to_index_mapping`` with a file index of 300 digits: the shard's name is over the 255
    bytes readers take. On ``memory://`` (object names of any length) the DCP save committed a
    checkpoint that no reader could open (the old one gone); locally it failed with ENAMETOOLONG
    from the staging directory. Refused by name before anything is written, on every backend."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from checkpoint.dcp import StorageWriter

    url = str(tmp_path / "ck") if where == "local" else f"memory://names-{tmp_path.name}/ck"
    checkpoint.save({"w": torch.zeros(3)}, url)
    with pytest.raises(CheckpointException, match=r"(?s)UnsavableError.*its file name is refused by every reader: .*longer than 255 bytes"):
        dcp.save({"w": torch.ones(3), "v": torch.zeros(2)}, no_dist=True,
                 storage_writer=StorageWriter(url, fqn_to_index_mapping={"w": 10**300, "v": 1}))  # fmt: skip
    assert checkpoint.verify(url).ok
    target = {"w": torch.full((3,), 7.0)}
    checkpoint.load(target, url)
    assert torch.equal(target["w"], torch.zeros(3))


# -- DCP StorageReader targets ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["expanded", "inference", "self-overlapping"])
def test_dcp_reader_checks_every_target_before_the_first_read(tmp_path, kind):
    """``dcp.load`` through the StorageReader into a target ``checkpoint.load`` refuses: an
    expand()ed one failed midway in ``copy_`` with a bare ``RuntimeError`` (after other targets
    were written), an inference tensor was written behind torch's back. The same named refusal
    as ``checkpoint.load`` (:class:`UnwritableTargetError`), before any target or non-tensor
    value changes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from checkpoint.dcp import StorageReader

    ck = tmp_path / "ck"
    checkpoint.save({"a": torch.ones(3), "w": torch.arange(6.0).reshape(2, 3)}, ck, extra_state={"step": 7})
    if kind == "expanded":
        w = torch.zeros(3).expand(2, 3)
    elif kind == "self-overlapping":
        w = torch.zeros(4).as_strided((2, 3), (1, 1))
    else:
        with torch.inference_mode():
            w = torch.zeros(2, 3)
    sd = {"a": torch.zeros(3), "w": w, "step": 0}
    needle = {"expanded": "share memory", "self-overlapping": "share memory", "inference": "inference tensor"}[kind]
    with pytest.raises(CheckpointException, match=f"(?s)UnwritableTargetError: loading {re.escape(str(ck))}: target tensor 'w' .*{needle}"):
        dcp.load(sd, storage_reader=StorageReader(str(ck)), no_dist=True)
    assert torch.equal(sd["a"], torch.zeros(3)) and sd["step"] == 0 and not w.any()


def test_dcp_hf_shard_header_not_json_names_the_shards(tmp_path, capsys):
    """DCP per-rank shards whose ``DCP_SHARDING_INFO`` is not JSON: the migration source said
    "DCP read of '.metadata' failed" (there is no .metadata; torch builds it from the headers).
    The error names the shard headers and files; the CLI exits 2 with it."""
    from checkpoint.sources import open_source

    src = tmp_path / "hf"
    _dcp_hf_shards(src, [(0, [1, 2])])
    p = src / "shard-00001-model-00001-of-00001.safetensors"
    head = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {"DCP_SHARDING_INFO": "{not json"}}
    write_st(p, json.dumps(head).encode(), torch.tensor([1.0, 2.0]).numpy().tobytes())
    needle = f"{src}: DCP read of 'DCP_SHARDING_INFO headers' in ['{p.name}'] failed: JSONDecodeError"
    with pytest.raises(CorruptCheckpointError, match=re.escape(needle)):
        open_source(src)
    assert cli_main(["inspect", str(src)]) == 2 and needle in capsys.readouterr().err
