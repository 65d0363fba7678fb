"""The distributed save's write and hash paths: each rank starts writeback of what it
wrote; whole tensors are hashed from memory, and of split tensors each rank hashes the digest
chunks (format version 3) lying in its own bytes from memory, reading back only chunks that
straddle another rank's bytes; the digests equal format version 3's computed here from xxhash
itself (the oracle), and a flipped byte in any rank's piece or at a border is found."""

from __future__ import annotations

import json
import os

import pytest
import torch
import xxhash

import checkpoint
from checkpoint.write import digests, parts, plan
from checkpoint.storage import digest, writeback
from checkpoint.storage.layout import TensorSpec, plan_layout
from checkpoint.storage.writer import BlockWriter, create_shard_file


def _xxh(t: torch.Tensor, chunk: int = 1 << 20) -> str:
    """Format version 3's digest of ``t``'s bytes (plain xxh3-128 up to ``chunk`` bytes, else of
    the chunks' digests), from xxhash itself."""
    b = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    if len(b) <= chunk:
        return xxhash.xxh3_128_hexdigest(b)
    return xxhash.xxh3_128_hexdigest(b"".join(xxhash.xxh3_128_digest(b[i : i + chunk]) for i in range(0, len(b), chunk)))


def test_default_shard_size_splits_distributed_saves_into_world_files():
    from checkpoint.storage import layout

    mib = 2**20
    specs = [TensorSpec(f"w{i}", (64 * mib,), torch.uint8) for i in range(16)]  # 1 GiB, 64 MiB each
    assert layout.default_shard_size(specs, 1) == 5 * 10**9  # one process: transformers' 5 GB
    assert layout.default_shard_size(specs, 4) == 256 * mib and layout.default_shard_size(specs, 3) == -(-2**30 // 3)
    assert layout.default_shard_size(specs, 64) == layout.MIN_SPLIT_SHARD_BYTES == 64 * mib  # the floor
    assert layout.default_shard_size([], 4) == 64 * mib
    big = [TensorSpec(f"x{i}", (10**9,), torch.float32) for i in range(4)]
    assert layout.default_shard_size(big, 2) == 5 * 10**9  # 16 GB on 2 ranks: capped at 5 GB
    for world, n in ((1, 1), (2, 2), (4, 4), (8, 8), (16, 16), (32, 16)):
        assert len(plan_layout(specs, None, world=world).files) == n
        assert len(plan_layout(specs, "5GB", world=world).files) == 1  # explicit: as given
    small = [TensorSpec(f"s{i}", (mib,), torch.uint8) for i in range(100)]  # 100 MiB < 2 x 64 MiB
    assert len(plan_layout(small, None, world=2).files) == 2 and len(plan_layout(small, None, world=4).files) == 2
    assert len(plan_layout(small[:60], None, world=4).files) == 1  # under the floor: one file


def test_write_orders_start_ranks_at_different_files():
    names = ["a", "a", "b", "c", "c", "c", "d"]  # slots in file order
    assert plan.write_orders(names, 1) == [list(range(7))]
    assert plan.write_orders(names, 2) == [list(range(7)), [3, 4, 5, 6, 0, 1, 2]]
    assert plan.write_orders(names, 4) == [
        list(range(7)), [2, 3, 4, 5, 6, 0, 1], [3, 4, 5, 6, 0, 1, 2], [6, 0, 1, 2, 3, 4, 5]
    ]
    # fewer files than ranks: ranks share starting files; every rank writes every slot once
    assert plan.write_orders(["a", "b"], 3) == [[0, 1], [0, 1], [1, 0]]
    assert plan.write_orders(["a"] * 3, 2) == [[0, 1, 2]] * 2 and plan.write_orders([], 2) == [[], []]


def test_hash_spans_reads_ranges_and_refuses_past_end(tmp_path):
    p = tmp_path / "f"
    data = os.urandom(5000)
    p.write_bytes(data)
    got = digest.hash_spans(str(p), [("x", 8, 4008), ("e", 10, 10), ("all", 0, 5000)])
    assert got == {
        "x": xxhash.xxh3_128_hexdigest(data[8:4008]),
        "e": xxhash.xxh3_128_hexdigest(b""),
        "all": xxhash.xxh3_128_hexdigest(data),
    }
    with pytest.raises(OSError, match="'y'.*past the file's end"):
        digest.hash_spans(str(p), [("y", 4000, 5001)])


def test_block_writer_starts_writeback_over_what_it_wrote(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(writeback, "available", lambda: True)
    monkeypatch.setattr(writeback, "start_writeback", lambda fd, off, n: calls.append((off, n)))
    monkeypatch.setattr(BlockWriter, "PIECE", 1 << 12)
    monkeypatch.setattr(BlockWriter, "WRITEBACK", 3 << 12)
    t = torch.arange(2 * 4096, dtype=torch.float32).reshape(8, 1024)  # 32 KiB, rows of 4 KiB
    plan = plan_layout([TensorSpec.of("w", t)], 1 << 30).files[0]
    path = str(tmp_path / plan.name)
    os.close(create_shard_file(path, plan))
    slot = plan.slots[0]
    w = BlockWriter(path, writeback_on=True)
    try:
        w.write(slot, t[2:8], (2, 0))  # this rank's rows 2..7: 24 KiB
    finally:
        w.close()
    begin = slot.begin + 2 * 4096
    # every 12 KiB written: writeback of its span; nothing left at close
    assert calls == [(begin, 3 << 12), (begin + (3 << 12), 3 << 12)]
    with open(path, "rb") as f:
        f.seek(begin)
        assert f.read(6 * 4096) == t[2:8].numpy().tobytes()
    calls.clear()
    w = BlockWriter(path, writeback_on=False)  # tmpfs: nothing to write back
    try:
        w.write(slot, t[:2], (0, 0))
    finally:
        w.close()
    assert calls == []


def test_world_of_one_dtensor_save_digests_and_errors(tmp_path, monkeypatch):
    """A world of one: DTensors on a one-rank mesh are whole on their writer (hashed from memory
    beside the pwrite); the recorded digests equal xxhash's of the bytes; a rank's error in the
    fused check-and-gather is raised as itself."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from checkpoint.ranks import dist as cdist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        g = torch.Generator().manual_seed(0)
        full = {
            "a": torch.randn(300, 40, generator=g),
            "b": torch.randint(0, 9, (7, 3), generator=g),
            "c": torch.randn(5, generator=g).to(torch.bfloat16),
        }
        sd = {
            "a": distribute_tensor(full["a"], mesh, [Shard(0)]),
            "b": distribute_tensor(full["b"], mesh, [Replicate()]),
            "c": distribute_tensor(full["c"], mesh, [Shard(0)]),
        }
        hashed_back = []
        real = digests.read_back_chunks
        monkeypatch.setattr(digests, "read_back_chunks", lambda d, b: hashed_back.append(b) or real(d, b))
        idx = checkpoint.save(sd, tmp_path / "ck", max_shard_size=2000)
        assert hashed_back == []  # every tensor whole on its writer: none read back
        assert idx.metadata.fqnckpt.tensor_digests() == {k: _xxh(v) for k, v in full.items()}
        assert checkpoint.verify(tmp_path / "ck").ok
        loaded = {k: torch.zeros_like(v) for k, v in full.items()}
        assert checkpoint.load(loaded, tmp_path / "ck").ok
        assert all(torch.equal(loaded[k], v) for k, v in full.items())
        assert cdist.check_all_gather("x", None, {"v": 1}) == [{"v": 1}]
        with pytest.raises(KeyError, match="mine"):
            cdist.check_all_gather("x", KeyError("mine"), 1)
    finally:
        dist.destroy_process_group()


def test_read_back_chunks_hashes_file_ranges_and_refuses_cut_files(tmp_path):
    data = os.urandom(10_000)
    (tmp_path / "f").write_bytes(data)
    got = digests.read_back_chunks(str(tmp_path), {"f": [("b", 3, 9000, 10_000), ("a", 0, 10, 510)]})
    assert got == {"a": [(0, xxhash.xxh3_128_digest(data[10:510]))], "b": [(3, xxhash.xxh3_128_digest(data[9000:]))]}
    with pytest.raises(OSError, match="'c'.*cut short"):
        digests.read_back_chunks(str(tmp_path), {"f": [("c", 0, 9500, 10_001)]})


_FULL = {"rows": (64, 33), "cols": (8, 512), "odd": (13, 7), "rep": (9, 40)}  # 8448 / 16384 / 182 / 1440 bytes
_PL = {"rows": "S0", "cols": "S1", "odd": "S0", "rep": "R"}


def _split_full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {k: torch.randn(*s, generator=g) for k, s in _FULL.items()}
    out["odd"] = out["odd"].to(torch.bfloat16)
    return out


def _two_rank_split_save(rank, world, path, chunk):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    digest.TENSOR_CHUNK = chunk  # small chunks: several per rank's piece, some straddling
    read, hashed_here = [], []
    real_back, real_chunked = digests.read_back_chunks, parts.write_chunked
    digests.read_back_chunks = lambda d, back: read.extend(x[:2] for v in back.values() for x in v) or real_back(d, back)

    def write_chunked(w, slot, local, offset, got, back):
        n = len(got)
        real_chunked(w, slot, local, offset, got, back)
        hashed_here.extend((slot.spec.fqn, j) for j, _ in got[n:])

    parts.write_chunked = write_chunked
    mesh = init_device_mesh("cpu", (world,))
    pl = {"S0": [Shard(0)], "S1": [Shard(1)], "R": [Replicate()]}
    sd = {k: distribute_tensor(v, mesh, pl[_PL[k]], src_data_rank=None) for k, v in _split_full().items()}
    idx = checkpoint.save(sd, path)
    return idx.metadata.fqnckpt.tensor_digests(), sorted(read), sorted(hashed_here)


def test_two_ranks_hash_their_own_chunks_and_read_back_only_straddling_ones(tmp_path):
    from checkpoint.ranks.launch import run_ranks
    from checkpoint.storage.format import IndexFile, index_name

    res = run_ranks(_two_rank_split_save, 2, str(tmp_path / "ck"), 100, backend="gloo", timeout=120)
    full = _split_full()
    want = {k: _xxh(v, 100) for k, v in full.items()}
    assert res[0][0] == res[1][0] == want
    raw = (tmp_path / "ck" / index_name()).read_bytes()
    assert IndexFile.model_validate_json(raw).metadata.fqnckpt.tensor_digest_chunk == 100
    assert checkpoint.verify(tmp_path / "ck").ok
    (_, read0, mem0), (_, read1, mem1) = res[0], res[1]
    # rows: rank 0 writes bytes [0, 4224), rank 1 [4224, 8448): 85 chunks of 100 bytes; rank 0
    # hashes chunks 0-41 from memory and reads back chunk 42 ([4200, 4300), straddling); rank 1
    # hashes 43-84 from memory (chunk 42 starts in rank 0's bytes)
    assert [j for f, j in mem0 if f == "rows"] == list(range(42)) and [j for f, j in read0 if f == "rows"] == [42]
    assert [j for f, j in mem1 if f == "rows"] == list(range(43, 85)) and not [j for f, j in read1 if f == "rows"]
    # cols (Shard(1): each rank's runs are 1 KiB row halves): every chunk is hashed exactly once,
    # in all, each by the rank writing its first byte
    cols = sorted(j for f, j in mem0 + mem1 + read0 + read1 if f == "cols")
    assert cols == list(range(164))
    # odd (bf16, 182 bytes, rows 0-6 on rank 0 = 98 bytes): chunk 0 straddles (read back by rank 0),
    # chunk 1 ([100, 182)) lies in rank 1's bytes; rep is whole on rank 0: no chunks
    assert [j for f, j in read0 if f == "odd"] == [0] and [j for f, j in mem1 if f == "odd"] == [1]
    assert not [x for x in mem0 + mem1 + read0 + read1 if x[0] == "rep"]


def test_flipped_byte_in_any_ranks_piece_or_at_a_border_fails_verify_and_load(tmp_path):
    """A 2-rank save with 100-byte digest chunks: one byte flipped inside rank 0's piece, inside
    rank 1's, on each side of the rank border, on each side of a chunk border, in the straddling
    chunk, and in the last byte: verify names the file and tensor, load and get raise
    CorruptCheckpointError naming both; the file restored, all pass again."""
    from checkpoint.ranks.launch import run_ranks
    from checkpoint.storage.format import index_name
    from checkpoint.storage.opening import open_checkpoint

    ck = tmp_path / "ck"
    run_ranks(_two_rank_split_save, 2, str(ck), 100, backend="gloo", timeout=120)
    full = _split_full()
    idx = checkpoint.storage.format.IndexFile.model_validate_json((ck / index_name()).read_bytes())
    for key, offsets in (("rows", (7, 2000, 4223, 4224, 4199, 4200, 4250, 6000, 8447)), ("cols", (0, 1023, 1024, 2047, 16383))):
        name = idx.weight_map[key]
        head = (ck / name).read_bytes()
        n = 8 + int.from_bytes(head[:8], "little")
        b = json.loads(head[8:n])[key]["data_offsets"][0]
        for off in offsets:
            raw = flipped(ck / name, n + b + off)
            rep = checkpoint.verify(ck)
            assert not rep.ok and rep.bad_files == [name] and f"['{key}']" in rep.problems[0], (key, off)
            out = {k: torch.zeros_like(v) for k, v in full.items()}
            with pytest.raises(checkpoint.CorruptCheckpointError) as e:
                checkpoint.load(out, ck)
            assert key in str(e.value) and name in str(e.value), (key, off)
            with open_checkpoint(ck) as rd, pytest.raises(checkpoint.CorruptCheckpointError, match=name):
                rd.get(key)
            (ck / name).write_bytes(raw)
    assert checkpoint.verify(ck).ok
    out = {k: torch.zeros_like(v) for k, v in full.items()}
    assert checkpoint.load(out, ck).ok and all(torch.equal(out[k], v) for k, v in full.items())


def flipped(p, i: int) -> bytes:
    raw = p.read_bytes()
    b = bytearray(raw)
    b[i] ^= 0x01
    p.write_bytes(bytes(b))
    return raw


_GROUPED_PL = ["S0", "R", "S1", "S0", "R", "S0"]  # split, whole, split, split, whole, split


def _two_rank_grouped_saves(rank, world, root):
    """A file per tensor (rank 1 starts at the fourth file); then rank 1 fails writing t3, its
    first: it stops there, rank 0 learns of it at the writing check, nothing is committed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor


    wrote = []
    real_write = BlockWriter.write

    def write(self, slot, local, offset):
        wrote.append(slot.spec.fqn)
        if rank == 1 and slot.spec.fqn == "t3" and failing:
            raise OSError(28, "No space left on device")
        return real_write(self, slot, local, offset)

    BlockWriter.write = write
    mesh = init_device_mesh("cpu", (world,))
    pl = {"S0": [Shard(0)], "S1": [Shard(1)], "R": [Replicate()]}
    sd = {f"t{i}": distribute_tensor(v, mesh, pl[_GROUPED_PL[i]], src_data_rank=None) for i, v in enumerate(_grouped_full())}
    failing = False
    idx = checkpoint.save(sd, os.path.join(root, "ok"), max_shard_size=2000)  # a file per tensor
    ok = (idx.metadata.fqnckpt.tensor_digests(), list(wrote))
    wrote.clear()
    failing = True
    try:
        checkpoint.save(sd, os.path.join(root, "bad"), max_shard_size=2000)
        outcome = "saved"
    except Exception as e:  # noqa: BLE001 - compared below
        outcome = f"{type(e).__name__}: {e}"
    bad = (sorted(set(wrote)), outcome)
    # The default max_shard_size cuts a distributed save into >= world-size files (the
    # 64 MiB floor lowered so these 8 KiB count as large); an explicit one is honoured;
    # below the floor the state stays one file.
    from checkpoint.storage import layout

    BlockWriter.write = real_write
    floor, layout.MIN_SPLIT_SHARD_BYTES = layout.MIN_SPLIT_SHARD_BYTES, 1
    try:
        files = {
            "split": checkpoint.save(sd, os.path.join(root, "split")).files(),
            "one": checkpoint.save(sd, os.path.join(root, "one"), max_shard_size="5GB").files(),
            "each": checkpoint.save(sd, os.path.join(root, "each"), max_shard_size=2000).files(),
        }
    finally:
        layout.MIN_SPLIT_SHARD_BYTES = floor
    files["tiny"] = checkpoint.save(sd, os.path.join(root, "tiny")).files()
    return ok, bad, files


def _grouped_full() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 24, generator=g) for _ in range(5)] + [torch.randn(16, 24, generator=g).to(torch.bfloat16)]


def test_two_ranks_write_files_apart_and_agree_on_a_failure(tmp_path):
    from checkpoint.ranks.launch import run_ranks

    res = run_ranks(_two_rank_grouped_saves, 2, str(tmp_path), backend="gloo", timeout=120)
    want = {f"t{i}": _xxh(v) for i, v in enumerate(_grouped_full())}
    (d0, wrote0), (d1, wrote1) = res[0][0], res[1][0]
    assert d0 == d1 == want
    assert checkpoint.verify(tmp_path / "ok").ok
    # rank 0 writes the files from the first, rank 1 from the fourth (different files at a time);
    # the replicated t1, t4 are rank 0's
    assert wrote0 == ["t0", "t1", "t2", "t3", "t4", "t5"] and wrote1 == ["t3", "t5", "t0", "t2"]
    (bwrote0, out0), (bwrote1, out1) = res[0][1], res[1][1]
    assert bwrote0 == ["t0", "t1", "t2", "t3", "t4", "t5"] and bwrote1 == ["t3"]  # rank 1 stopped at its failure
    assert out1.startswith("CheckpointWriteError") and "No space left" in out1
    assert out0.startswith("RankAgreementError") and "rank 1" in out0
    assert not (tmp_path / "bad").exists()
    assert sorted(os.listdir(tmp_path)) == ["each", "ok", "one", "split", "tiny"]
    # default max_shard_size, 2 ranks: 8448 bytes cut at ceil(8448 / 2) = 4224 bytes a file
    # (greedy in name order: t0+t1, t2+t3, t4+t5); the same plan on both ranks
    files = res[0][2]
    assert files == res[1][2]
    assert files["split"] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert files["one"] == files["tiny"] == ["model-00001-of-00001.safetensors"]
    assert files["each"] == [f"model-0000{k}-of-00006.safetensors" for k in range(1, 7)]
    from safetensors.torch import load_file  # the outside reader: each file, by the index

    for name in ("split", "one", "tiny", "each"):
        assert checkpoint.verify(tmp_path / name).ok
        idx = checkpoint.storage.format.IndexFile.model_validate_json((tmp_path / name / "model.safetensors.index.json").read_bytes())
        got = {}
        for f in idx.files():
            got.update(load_file(tmp_path / name / f))
        assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in zip(want, _grouped_full()))
        assert all(got[k].dtype == v.dtype for k, v in zip(want, _grouped_full()))


@pytest.mark.parametrize("spare", [True, False])
def test_single_process_save_hashes_each_chunk_as_written(tmp_path, monkeypatch, spare):
    """A single-process save hashes a tensor of more than one chunk on the hash thread beside its
    pwrite when a CPU is idle, else each 1 MiB digest chunk on the writing thread right after its
    pwrite; a tensor of one chunk at most (not small) is written straight and hashed right after
    on the writing thread either way: the index holds format version 3's digests computed from
    xxhash itself, for tensors of exactly one chunk, one chunk and a byte, several and a half, and
    small ones through the staging buffer; the bytes read back equal the tensors."""
    from checkpoint.storage import writer

    monkeypatch.setattr(writer, "_spare_core", lambda: spare)
    monkeypatch.setattr(writer.threads, "cpus", lambda: 2)
    ways = []
    for name in ("_write_hashing", "_write_beside_hash"):
        f = getattr(writer.SequentialFileWriter, name)
        monkeypatch.setattr(writer.SequentialFileWriter, name, lambda self, *a, f=f, name=name: ways.append(name) or f(self, *a))
    c = digest.TENSOR_CHUNK
    sd = {
        "one_chunk": torch.arange(c, dtype=torch.uint8),
        "chunk_and_a_byte": torch.arange(c + 1, dtype=torch.int64).to(torch.uint8),
        "three_and_a_half": torch.randn(7 * c // 8, generator=torch.Generator().manual_seed(3)),
        "small": torch.randn(5, 3, generator=torch.Generator().manual_seed(4)).bfloat16(),
        "empty": torch.zeros(0, 4),
    }
    idx = checkpoint.save(sd, tmp_path / "ck")
    (rec,) = idx.metadata.fqnckpt.files.values()
    assert rec.tensors == {k: _xxh(v) for k, v in sd.items()}
    # file order: three_and_a_half (float32), then the uint8 chunk_and_a_byte, one_chunk
    assert ways == (["_write_beside_hash"] * 2 if spare else ["_write_hashing"] * 2) + ["_write_hashing"]
    out = {k: torch.full_like(v, 7) for k, v in sd.items()}
    checkpoint.load(out, tmp_path / "ck")
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    checkpoint.verify(tmp_path / "ck")
