"""Integrity digests (format version 3: xxh3-128 per tensor, chunked above 1 MiB, header and
index; version 2: plain xxh3-128 per tensor; version 1: sha256 per file): one flipped byte anywhere
is found, per-tensor digests do not depend on the layout, and checkpoints of the previous format
versions still verify."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

import checkpoint
from checkpoint.errors import ChecksumMismatchError
from checkpoint.storage import digest
from checkpoint.storage.format import FORMAT_VERSION, index_name
from checkpoint.storage.reader import check_file, read_index
from checkpoint.storage.opening import open_checkpoint


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(3, 4, generator=g),
        "a.bias": torch.randn(4, generator=g).to(torch.bfloat16),
        "b.ids": torch.randint(0, 9, (5,), generator=g),
        "c.big": torch.randn(300_000, generator=g),  # > 1 MiB: the chunked hash-then-write path
        "empty": torch.zeros(0, 3),
    }


def v3_digest(b: bytes, chunk: int = 1 << 20) -> str:
    """The oracle of format version 3's tensor digest, from xxhash itself: plain xxh3-128 up to
    ``chunk`` bytes, else xxh3-128 of the chunks' 16-byte digests."""
    import xxhash

    if len(b) <= chunk:
        return xxhash.xxh3_128_hexdigest(b)
    return xxhash.xxh3_128_hexdigest(b"".join(xxhash.xxh3_128_digest(b[i : i + chunk]) for i in range(0, len(b), chunk)))


def tbytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_chunked_digest_equals_the_oracle_however_fed():
    rnd = __import__("random").Random(1)
    for n in (0, 1, 99, 100, 101, 199, 200, 201, 1234):
        b = rnd.randbytes(n)
        assert digest.tensor_hexdigest(b, 100) == v3_digest(b, 100)
        assert digest.tensor_hexdigest(b, None) == digest.hexdigest(b)  # version 2
        for _ in range(10):
            h, pos = digest.tensor_hasher(100), 0
            while pos < n:
                k = rnd.choice([1, 3, 99, 100, 101, 250])
                h.update(memoryview(b)[pos : pos + k])
                pos += k
            assert h.hexdigest() == v3_digest(b, 100)
        if n % 4 == 0 and n:  # a typed buffer (float32 items): its bytes count, not its items
            typed = memoryview(__import__("numpy").frombuffer(b, dtype="float32"))
            assert digest.tensor_hexdigest(typed, 100) == v3_digest(b, 100)
        # a flipped bit anywhere changes it
        for i in {0, n // 2, 99, 100, n - 1} & set(range(n)):
            c = bytearray(b)
            c[i] ^= 0x10
            assert digest.tensor_hexdigest(bytes(c), 100) != digest.tensor_hexdigest(b, 100)


def flipped(p, i: int, bit: int = 0x01) -> bytes:
    raw = p.read_bytes()
    b = bytearray(raw)
    b[i] ^= bit
    p.write_bytes(bytes(b))
    return raw


def test_digests_recorded_match_bytes_and_are_layout_independent(tmp_path):
    sd = state()
    idx1 = checkpoint.save(sd, tmp_path / "one")
    idx2 = checkpoint.save(sd, tmp_path / "many", max_shard_size=64)
    meta1, meta2 = idx1.metadata.fqnckpt, idx2.metadata.fqnckpt
    assert meta1.format_version == meta2.format_version == FORMAT_VERSION == 3
    assert meta1.tensor_digest_chunk == digest.TENSOR_CHUNK == 1 << 20
    assert len(idx1.files()) == 1 and len(idx2.files()) > 2
    want = {k: v3_digest(tbytes(v)) for k, v in sd.items()}
    assert want["c.big"] != digest.hexdigest(tbytes(sd["c.big"]))  # chunked: 1.2 MB
    assert meta1.tensor_digests() == meta2.tensor_digests() == want
    for idx, d in ((idx1, "one"), (idx2, "many")):
        rep = checkpoint.verify(tmp_path / d)
        assert rep.ok, rep.problems
        assert [f.algorithm for f in rep.files] == ["xxh3_128"] * len(idx.files())
        assert [f.digest for f in rep.files] == [idx.metadata.fqnckpt.files[n].digest for n in idx.files()]


def test_every_flipped_byte_of_a_file_is_found(tmp_path):
    sd = {"x": torch.arange(6, dtype=torch.float32), "y": torch.tensor([7, 8], dtype=torch.int16)}
    idx = checkpoint.save(sd, tmp_path / "ck")
    (name,) = idx.files()
    rec = idx.metadata.fqnckpt.files[name]
    p = tmp_path / "ck" / name
    raw = p.read_bytes()
    assert check_file(str(p), rec).problem is None
    for i in range(len(raw)):  # header length, JSON header, padding and every data byte
        b = bytearray(raw)
        b[i] ^= 0x04
        p.write_bytes(bytes(b))
        assert check_file(str(p), rec).problem is not None, f"flip at byte {i} not found"
    p.write_bytes(raw)
    p.write_bytes(raw + b"\0")  # appended byte
    assert "size" in check_file(str(p), rec).problem


def test_every_flipped_byte_of_the_index_is_found(tmp_path):
    sd = {"x": torch.arange(6, dtype=torch.float32), "y": torch.tensor([7, 8], dtype=torch.int16)}
    idx = checkpoint.save(sd, tmp_path / "ck", max_shard_size=16)
    ip = tmp_path / "ck" / index_name()
    raw = ip.read_bytes()
    assert raw.count(idx.metadata.fqnckpt.index_xxh3_128.encode()) == 1
    assert checkpoint.verify(tmp_path / "ck").ok
    for i in range(len(raw)):
        b = bytearray(raw)
        b[i] ^= 0x01
        ip.write_bytes(bytes(b))
        assert not checkpoint.verify(tmp_path / "ck").ok, (
            f"flip at index byte {i} ({raw[max(0, i - 20) : i + 20]!r}) not found"
        )
    ip.write_bytes(raw)
    # Through the public API: a changed hyper-parameter-like value in the index is a problem.
    data = json.loads(raw)
    data["metadata"]["fqnckpt"]["alias_groups"] = [["x", "y"]]
    ip.write_text(json.dumps(data, indent=2) + "\n")
    rep = checkpoint.verify(tmp_path / "ck")
    assert not rep.ok and len(rep.problems) == 1 and "index bytes changed" in rep.problems[0]
    with pytest.raises(ChecksumMismatchError, match="index bytes changed"):
        checkpoint.load(dict(sd), tmp_path / "ck", verify=True)


def test_flipped_data_byte_names_the_tensor(tmp_path):
    idx = checkpoint.save(state(), tmp_path / "ck")
    (name,) = idx.files()
    p = tmp_path / "ck" / name
    n = int.from_bytes(p.read_bytes()[:8], "little")
    head = json.loads(p.read_bytes()[8 : 8 + n])
    b, e = head["c.big"]["data_offsets"]
    flipped(p, 8 + n + (b + e) // 2, 0x80)
    rep = checkpoint.verify(tmp_path / "ck")
    assert not rep.ok and rep.bad_files == [name] and "['c.big']" in rep.problems[0]
    with pytest.raises(ChecksumMismatchError, match=r"c\.big"):
        checkpoint.load(state(), tmp_path / "ck", verify=True)


def _rewrite_as_version_1(root) -> dict[str, str]:
    """Turn a checkpoint into what the previous code wrote: format_version 1, a sha256 per file,
    no per-tensor or index digests. Returns {file: sha256}."""
    ip = os.path.join(root, index_name())
    data = json.loads(open(ip, "rb").read())
    meta = data["metadata"]["fqnckpt"]
    shas = {}
    for name, rec in meta["files"].items():
        with open(os.path.join(root, name), "rb") as f:
            shas[name] = hashlib.sha256(f.read()).hexdigest()
        meta["files"][name] = {"size": rec["size"], "sha256": shas[name]}
    meta["format_version"] = 1
    del meta["index_xxh3_128"]
    del meta["tensor_digest_chunk"]
    with open(ip, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
    return shas


def test_previous_format_version_still_verifies(tmp_path):
    sd = state()
    idx2 = checkpoint.save(sd, tmp_path / "ck", max_shard_size=64)
    shas = _rewrite_as_version_1(tmp_path / "ck")
    idx = read_index(str(tmp_path / "ck" / index_name()))
    assert idx.metadata.fqnckpt.format_version == 1
    rep = checkpoint.verify(tmp_path / "ck")
    assert rep.ok, rep.problems
    assert {f.file: (f.algorithm, f.digest) for f in rep.files} == {k: ("sha256", v) for k, v in shas.items()}
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    checkpoint.load(out, tmp_path / "ck", verify=True)
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    victim = idx2.weight_map["c.big"]
    flipped(tmp_path / "ck" / victim, -1)
    rep = checkpoint.verify(tmp_path / "ck")
    assert not rep.ok and rep.bad_files == [victim] and shas[victim] in rep.problems[0]
    with pytest.raises(ChecksumMismatchError, match=victim):
        checkpoint.load(state(), tmp_path / "ck", verify=True)


def _rewrite_as_version_2(root, sd) -> None:
    """Turn a checkpoint into what format version 2 wrote: plain xxh3-128 tensor digests (also
    above 1 MiB), no ``tensor_digest_chunk``; file and index digests recomputed."""
    from checkpoint.storage.format import IndexFile

    ip = os.path.join(root, index_name())
    data = json.loads(open(ip, "rb").read())
    meta = data["metadata"]["fqnckpt"]
    for name, rec in meta["files"].items():
        rec["tensors"] = {k: digest.hexdigest(tbytes(sd[k])) for k in rec["tensors"]}
        rec["digest"] = digest.combine(rec["header"], rec["tensors"].values())
    meta["format_version"] = 2
    del meta["tensor_digest_chunk"]
    idx = IndexFile.model_validate(data)
    with open(ip, "wb") as f:
        f.write(idx.to_json_bytes())


def test_version_2_checkpoints_still_verify_and_load_checked(tmp_path):
    sd = state()
    idx3 = checkpoint.save(sd, tmp_path / "ck", max_shard_size=64)
    _rewrite_as_version_2(tmp_path / "ck", sd)
    idx = read_index(str(tmp_path / "ck" / index_name()))
    meta = idx.metadata.fqnckpt
    assert meta.format_version == 2 and meta.tensor_digest_chunk is None
    assert meta.tensor_digests()["c.big"] == digest.hexdigest(tbytes(sd["c.big"]))  # plain, as version 2 wrote
    rep = checkpoint.verify(tmp_path / "ck")
    assert rep.ok, rep.problems
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    assert checkpoint.load(out, tmp_path / "ck").ok
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    victim = idx3.weight_map["c.big"]
    flipped(tmp_path / "ck" / victim, -5)
    rep = checkpoint.verify(tmp_path / "ck")
    assert not rep.ok and rep.bad_files == [victim] and "['c.big']" in rep.problems[0]
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"c\.big") as e:
        checkpoint.load({k: torch.empty_like(v) for k, v in sd.items()}, tmp_path / "ck")
    assert victim in str(e.value)
    with open_checkpoint(tmp_path / "ck") as rd, pytest.raises(checkpoint.CorruptCheckpointError, match=victim):
        rd.get("c.big")


def test_chunk_field_follows_the_format_version(tmp_path):
    checkpoint.save(state(), tmp_path / "ck")
    ip = tmp_path / "ck" / index_name()
    good = ip.read_bytes()
    for version, chunk in ((3, None), (2, 1 << 20)):
        data = json.loads(good)
        data["metadata"]["fqnckpt"]["format_version"] = version
        if chunk is None:
            del data["metadata"]["fqnckpt"]["tensor_digest_chunk"]
        ip.write_text(json.dumps(data))
        with pytest.raises(checkpoint.CorruptCheckpointError, match="tensor_digest_chunk"):
            open_checkpoint(tmp_path / "ck")


def test_version_1_index_with_version_2_records_is_refused(tmp_path):
    checkpoint.save(state(), tmp_path / "ck")
    ip = tmp_path / "ck" / index_name()
    data = json.loads(ip.read_bytes())
    data["metadata"]["fqnckpt"]["format_version"] = 1
    ip.write_text(json.dumps(data))
    with pytest.raises(checkpoint.CorruptCheckpointError, match="format version 1"):
        open_checkpoint(tmp_path / "ck")


def test_run_hashes_in_any_order_from_threads_equal_one_hash():
    """RunHashes (a load's check, fed by the read pool as pieces land): ranges landing out of
    order, from several threads, hash each wanted view exactly as one call does; an unwanted
    view is not hashed; a range never landing leaves it incomplete (then the load hashes the
    target itself)."""
    import random
    import threading

    rnd = random.Random(0)
    views = [bytearray(rnd.randbytes(n)) for n in (1, 4096, 0, 70_001, 3)]
    want = [True, True, True, False, True]
    total = sum(map(len, views))
    for trial in range(20):
        cuts = sorted({0, total, *(rnd.randrange(total) for _ in range(rnd.randrange(1, 30)))})
        ranges = list(zip(cuts[:-1], cuts[1:]))
        rnd.shuffle(ranges)
        h = digest.RunHashes(views, want)
        parts = [ranges[i::3] for i in range(3)]
        ts = [threading.Thread(target=lambda p=p: [h.landed(a, b) for a, b in p]) for p in parts]
        [t.start() for t in ts]
        [t.join() for t in ts]
        assert h.complete()
        for i, v in enumerate(views):
            assert h.digest(i) == (digest.hexdigest(bytes(v)) if want[i] else None)
    h = digest.RunHashes(views, want)
    h.landed(0, total)  # one read of the whole run: one hash per view
    assert h.complete() and [h.digest(i) for i in range(len(views))] == [
        digest.hexdigest(bytes(v)) if w else None for v, w in zip(views, want)
    ]
    h = digest.RunHashes(views, want)
    h.landed(10, total)  # the first range never lands (its read failed)
    assert not h.complete()


def test_run_hashes_of_chunked_digests_hash_each_range_where_it_lands():
    """RunHashes with a format-3 chunk and one wanted view: ranges of whole chunks landing in
    any order from several threads are hashed by the thread that landed them (none left
    pending), and the digest equals the chunked digest of the bytes; a range cutting a chunk,
    or a range never landing, leaves the run incomplete (then the caller hashes the view)."""
    import random
    import threading

    rnd = random.Random(1)
    c = 4096
    view = bytearray(rnd.randbytes(37 * c + 123))
    total, want = len(view), digest.tensor_hexdigest(bytes(view), c)
    for trial in range(10):
        cuts = sorted({0, total, *(rnd.randrange(1, 38) * c for _ in range(rnd.randrange(1, 20)))})
        ranges = list(zip(cuts[:-1], cuts[1:]))
        rnd.shuffle(ranges)
        h = digest.RunHashes([view], [True], c)
        parts = [ranges[i::3] for i in range(3)]
        ts = [threading.Thread(target=lambda p=p: [h.landed(a, b) for a, b in p]) for p in parts]
        [t.start() for t in ts]
        [t.join() for t in ts]
        assert h.complete() and h.digest(0) == want and not h.pending
    h = digest.RunHashes([view], [True], c)
    h.landed(0, c + 1)
    h.landed(c + 1, total)  # a chunk cut in two
    assert not h.complete()
    h = digest.RunHashes([view], [True], c)
    h.landed(c, total)  # the first chunk never lands
    assert not h.complete()
    h = digest.RunHashes([view], [True], c)
    h.landed(0, total)  # one read of the whole run
    assert h.complete() and h.digest(0) == want


def test_flipped_byte_found_in_every_piece_of_a_pooled_load(tmp_path, monkeypatch):
    """checkpoint.load hashes on the read pool's threads as pieces land: a byte flipped in any
    piece of a tensor read in pieces (small PIECE: many of them, shared by threads), or in one
    of many small tensors read by one preadv, is a CorruptCheckpointError naming that tensor;
    the unflipped checkpoint loads and checks clean."""
    from checkpoint.errors import CorruptCheckpointError
    from checkpoint.storage import pread

    monkeypatch.setattr(pread, "PIECE", 4096)
    monkeypatch.setattr(pread, "_THREADS", 3)
    g = torch.Generator().manual_seed(1)
    sd = {"big": torch.randn(64, 257, generator=g), **{f"s{i}": torch.randn(7, generator=g) for i in range(40)}}
    idx = checkpoint.save(sd, tmp_path / "ck")
    (name,) = idx.files()
    p = tmp_path / "ck" / name
    n = int.from_bytes(p.read_bytes()[:8], "little")
    head = json.loads(p.read_bytes()[8 : 8 + n])
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    checkpoint.load(target, tmp_path / "ck")
    assert all(torch.equal(target[k], v) for k, v in sd.items())
    b, e = head["big"]["data_offsets"]
    spots = [("big", at) for at in (b, b + 4096 + 5, (b + e) // 2, e - 1)] + [("s17", head["s17"]["data_offsets"][0] + 3)]
    for key, at in spots:
        raw = flipped(p, 8 + n + at)
        with pytest.raises(CorruptCheckpointError, match=f"tensor '{key}'") as err:
            checkpoint.load({k: torch.zeros_like(v) for k, v in sd.items()}, tmp_path / "ck")
        assert err.value.key == key
        p.write_bytes(raw)


@pytest.mark.parametrize("version", [3, 2])
@pytest.mark.parametrize("kind", ["float64", "bfloat16", "strided", "1-D float64"])
def test_flipped_byte_found_by_a_converting_or_strided_load(tmp_path, monkeypatch, kind, version):
    """A plain target read through ``copy_into`` (another dtype, or not contiguous: the bytes go
    through pieces read, copied and hashed by several threads: format 3's chunks hashed by each
    piece's thread, format 2's plain digest fed in file order) is checked against the index's
    digest too: a flipped byte anywhere in the tensor (first and last byte, either side of every
    piece boundary, the middle) is a CorruptCheckpointError naming it, for a float64 and a 1-D
    target too; the unflipped checkpoint loads exactly."""
    from checkpoint.errors import CorruptCheckpointError
    from checkpoint.storage import pread, tensor_read
    from checkpoint.storage.reader import CheckpointReader

    monkeypatch.setattr(pread, "PIECE", 4096)  # many pieces, shared by threads
    monkeypatch.setattr(tensor_read, "CHUNK", 4096)
    monkeypatch.setattr(pread, "_THREADS", 3)
    g = torch.Generator().manual_seed(2)
    sd = {"w": torch.randn(*((12480,) if kind.startswith("1-D") else (96, 130)), generator=g)}
    if version == 3:
        monkeypatch.setattr(digest, "TENSOR_CHUNK", 2048)  # pieces of 2 chunks, rows cut anywhere
    idx = checkpoint.save(sd, tmp_path / "ck")
    if version == 2:  # the tensor is one chunk: its digest is version 2's; read as version 2
        monkeypatch.setattr(CheckpointReader, "digest_chunk", property(lambda self: None))
    (name,) = idx.files()
    p = tmp_path / "ck" / name
    n = int.from_bytes(p.read_bytes()[:8], "little")
    b, e = json.loads(p.read_bytes()[8 : 8 + n])["w"]["data_offsets"]

    def target() -> torch.Tensor:
        if kind == "strided":
            return torch.zeros(130, 96).t()
        return torch.zeros(sd["w"].shape, dtype=getattr(torch, kind.split()[-1]))

    t = target()
    checkpoint.load({"w": t}, tmp_path / "ck")
    assert torch.equal(t, sd["w"].to(t.dtype))
    row = 130 * 4 if sd["w"].dim() == 2 and version == 2 else 4
    step = 4096 // row * row  # bytes of a piece (whole rows in version 2)
    cuts = [c + d for c in range(b + step, e, step) for d in (-1, 0)]
    if version == 3:
        cuts += [c + d for c in range(b + 2048, e, 4096) for d in (-1, 0)]  # inside a piece, between chunks
    assert len(cuts) >= 20
    for at in (b, (b + e) // 2, e - 1, *cuts):
        raw = flipped(p, 8 + n + at)
        with pytest.raises(CorruptCheckpointError, match="tensor 'w'"):
            checkpoint.load({"w": target()}, tmp_path / "ck")
        p.write_bytes(raw)


def test_every_reader_checks_chunked_digests_of_large_tensors(tmp_path):
    """Format version 3 (tensors above 1 MiB digested in chunks) through every reader that checks
    digests: load (plain and converting targets), get, the migration source, migrate, DCP's
    StorageReader, verify, and a memory:// checkpoint's remote reader; then one flipped byte in
    the middle of the large tensor is refused by each, naming file and tensor."""
    import torch.distributed.checkpoint as dcp

    from checkpoint.dcp import StorageReader
    from checkpoint.sources import open_source

    sd = state()
    ck = tmp_path / "ck"
    checkpoint.save(sd, ck)
    checkpoint.save(sd, "memory://fqnckpt-chunked-digest/ck")
    big = sd["c.big"]

    def readers():
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        yield "load", lambda: checkpoint.load(out, ck) and out["c.big"]
        wide = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in sd.items()}
        yield "load float64", lambda: checkpoint.load(wide, ck) and wide["c.big"].float()
        yield "get", lambda: open_checkpoint(ck).get("c.big")
        yield "migration source", lambda: open_source(ck).get("c.big")
        target = {"c.big": torch.zeros_like(big)}
        yield "dcp", lambda: dcp.load(target, storage_reader=StorageReader(str(ck)), no_dist=True) or target["c.big"]

    for name, read in readers():
        assert torch.equal(read(), big), name
    assert checkpoint.verify(ck).ok and checkpoint.verify("memory://fqnckpt-chunked-digest/ck").ok
    remote = {k: torch.zeros_like(v) for k, v in sd.items()}
    assert checkpoint.load(remote, "memory://fqnckpt-chunked-digest/ck").ok and torch.equal(remote["c.big"], big)
    checkpoint.migrate(ck, tmp_path / "out")
    assert checkpoint.verify(tmp_path / "out").ok
    name = read_index(str(ck / index_name())).weight_map["c.big"]
    head = (ck / name).read_bytes()
    n = 8 + int.from_bytes(head[:8], "little")
    begin = json.loads(head[8:n])["c.big"]["data_offsets"][0]
    flipped(ck / name, n + begin + (1 << 20) + 5)  # in the second chunk
    for what, read in readers():
        with pytest.raises(BaseException) as e:  # DCP wraps ours in a CheckpointException (a BaseException)
            read()
        text = str(e.value) + "".join(str(f) for f in getattr(e.value, "failures", {}).values())
        assert "'c.big'" in text and name in text and "digest" in text, what
    rep = checkpoint.verify(ck)
    assert not rep.ok and "['c.big']" in rep.problems[0]
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"c\.big"):
        checkpoint.migrate(ck, tmp_path / "out2")
