"""The check before the copies agrees across ranks: a flipped data byte is refused by name
(CorruptCheckpointError, or DCP's CheckpointException carrying its text: file and tensor named)
with every target as it was on every rank, whatever each rank loads (ranks with different copies,
sub-meshes, 2-D meshes, format-2 digests, optimizer state of a Shard(0) parameter, object
storage's read_into), and a rank's refusal never leaves another rank waiting."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

import checkpoint
from checkpoint.storage import digest
from checkpoint.storage.format import IndexFile, index_name

SHARD = "model-00001-of-00001.safetensors"


def reference() -> dict[str, torch.Tensor]:
    """``w``: 512 bytes (one digest chunk); ``big``: 3 MiB (three 1 MiB chunks of format 3)."""
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(4, 4, generator=g), "w": torch.randn(8, 16, generator=g),
            "big": torch.randn(1024, 768, generator=g)}  # fmt: skip


def flip(ck: str, key: str, at: int = 100) -> None:
    """One bit of byte ``at`` of tensor ``key``'s data in ``SHARD``."""
    p = os.path.join(ck, SHARD)
    raw = bytearray(open(p, "rb").read())
    (n,) = struct.unpack("<Q", raw[:8])
    b, _ = json.loads(raw[8 : 8 + n])[key]["data_offsets"]
    raw[8 + n + b + at] ^= 0x10
    with open(p, "wb") as f:
        f.write(bytes(raw))


def as_format_2(ck: str) -> None:
    """The checkpoint as format version 2 wrote it: plain xxh3-128 tensor digests, no
    ``tensor_digest_chunk``; file and index digests recomputed (it verifies clean)."""
    sd = reference()
    ip = os.path.join(ck, index_name())
    data = json.loads(open(ip, "rb").read())
    meta = data["metadata"]["fqnckpt"]
    for rec in meta["files"].values():
        rec["tensors"] = {k: digest.hexdigest(sd[k].reshape(-1).view(torch.uint8).numpy().tobytes()) for k in rec["tensors"]}
        rec["digest"] = digest.combine(rec["header"], rec["tensors"].values())
    meta["format_version"] = 2
    del meta["tensor_digest_chunk"]
    with open(ip, "wb") as f:
        f.write(IndexFile.model_validate(data).to_json_bytes())


def _saved(tmp_path, name: str, key: str | None, fmt: int = 3) -> str:
    ck = str(tmp_path / name)
    checkpoint.save(reference(), ck)
    if fmt == 2:
        as_format_2(ck)
    assert checkpoint.verify(ck).ok
    if key is not None:
        flip(ck, key)
    return ck


def _outcome(target: dict, load) -> tuple:
    """``("loaded", equal to the reference)`` or ``("refused", error type, its text, untouched)``."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    try:
        load()
    except BaseException as e:  # noqa: BLE001 - reported (DCP raises a BaseException)
        return ("refused", type(e).__name__, str(e)[-1500:], not any(local(t).any() for t in target.values()))
    ref = reference()
    return ("loaded", all(torch.equal(t.full_tensor() if isinstance(t, DTensor) else t, ref[k]) for k, t in target.items()))


def _refused_by_name(got: tuple, key: str) -> None:
    assert got[0] == "refused", got
    assert got[1] in ("CorruptCheckpointError", "CheckpointException"), got
    assert SHARD in got[2] and "xxh3-128" in got[2] and f"'{key}'" in got[2], got
    assert got[3], ("a target changed before the refusal", got)


# -- 2 ranks, one shared spawn --------------------------------------------------------------------


def _two_ranks(rank: int, world: int, cases: dict[str, str]) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from checkpoint.dcp import StorageReader

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "one"))
    ref = reference()
    out = {}
    # Rank 0 alone holds 'a' (a 1-rank sub-mesh) ahead of 'w', Replicate on both ranks.
    target = {"a": distribute_tensor(torch.zeros_like(ref["a"]), mesh["one"], [Replicate()])} if rank == 0 else {}
    target["w"] = distribute_tensor(torch.zeros_like(ref["w"]), mesh["dp"], [Replicate()])
    out["turns"] = _outcome(target, lambda: checkpoint.load(target, cases["w"], strict=False))
    # A format-2 checkpoint into Shard(0) rows through dcp.load.
    target = {"w": distribute_tensor(torch.zeros_like(ref["w"]), mesh["dp"], [Shard(0)])}
    out["dcp format 2"] = _outcome(target, lambda: dcp.load(target, storage_reader=StorageReader(cases["w f2"])))
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from checkpoint.ranks.launch import run_ranks

    tmp = tmp_path_factory.mktemp("break2")
    cases = {"w": _saved(tmp, "w", "w"), "w f2": _saved(tmp, "w-f2", "w", fmt=2)}
    return run_ranks(_two_ranks, 2, cases, timeout=120)


def test_replicate_tensor_checked_when_ranks_plan_different_copies(two_ranks):
    """Rank 0 holds one more DTensor (on its own 1-rank sub-mesh) ahead of a Replicate DTensor
    both ranks hold: the ranks count the turn of the shared tensor differently, no rank hashes it,
    and its flipped byte loaded silently on both ranks."""
    for got in two_ranks:
        _refused_by_name(got["turns"], "w")


def test_dcp_load_of_a_format_2_checkpoint_into_shard0_rows_is_checked(two_ranks):
    """dcp.load through our StorageReader of a format-2 checkpoint (no chunk digests) into
    Shard(0) rows: no rank reads the tensor whole and it has no chunks to exchange, so no rank
    checked it and the flipped byte loaded silently (checkpoint.load refuses it)."""
    for got in two_ranks:
        _refused_by_name(got["dcp format 2"], "w")


# -- a mismatch found after the exchange: every rank raises, none waits -------------------------


def _sub_mesh_stages(rank: int, world: int, ck: str) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    one = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "one"))["one"]
    ref = reference()
    if rank == 0:
        target = {"big": distribute_tensor(torch.zeros_like(ref["big"]), one, [Shard(0)])}
    else:
        target = {"w": distribute_tensor(torch.zeros_like(ref["w"]), one, [Replicate()])}
    return _outcome(target, lambda: checkpoint.load(target, ck, strict=False))


def test_chunk_digest_mismatch_stops_every_rank_without_a_hang(tmp_path):
    """Each rank loads its own stage's parameters (1-rank sub-meshes): rank 0 'big' in Shard(0)
    rows, rank 1 'w'. A flipped byte in 'big' is found from the gathered chunk digests after the
    ranks' exchange, by rank 0 alone; rank 1 went on to the closing agreement and waited there
    until the collective timeout (run_ranks: 'ranks did not finish')."""
    from checkpoint.ranks.launch import run_ranks

    ck = _saved(tmp_path, "big", "big")
    results = run_ranks(_sub_mesh_stages, 2, ck, timeout=60)
    _refused_by_name(results[0], "big")
    assert results[1][0] == "refused" and "'big'" in results[1][2], results[1]


# -- 4 ranks, a 2x2 mesh ---------------------------------------------------------------------------


def _mesh_2x2(rank: int, world: int, cases: dict[str, str]) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from checkpoint.dcp import StorageReader

    from checkpoint.storage.writer import stats

    mesh = init_device_mesh("cpu", (2, 2))
    out = {}
    for key, ck in cases.items():
        for pl in ((Shard(0), Shard(1)), (Shard(1), Shard(0))):
            name = "big" if key == "intact" else key
            target = {name: distribute_tensor(torch.zeros_like(reference()[name]), mesh, list(pl))}
            stats.reset()
            out[(key, str(pl))] = _outcome(target, lambda: dcp.load(target, storage_reader=StorageReader(ck)))
            out[(key, str(pl), "bytes checked")] = stats.bytes_checked
    return out


def test_dcp_load_of_blocks_on_a_2d_mesh_is_checked(tmp_path):
    """dcp.load through our StorageReader into (Shard(0), Shard(1)) / (Shard(1), Shard(0)) on a
    2x2 mesh: each rank reads a block of some rows and some columns, which the coordinator's plan
    neither gives a rank to check whole nor sends to the row-chunk exchange: the flipped byte
    (of a one-chunk tensor and of a chunked one) loaded silently on every rank."""
    from checkpoint.ranks.launch import run_ranks

    cases = {"w": _saved(tmp_path, "w", "w"), "big": _saved(tmp_path, "big", "big")}
    cases["intact"] = _saved(tmp_path, "intact", None)
    results = run_ranks(_mesh_2x2, 4, cases, timeout=120)
    for res in results:
        for (key, pl, *what), got in res.items():
            if key == "intact":
                assert what or got == ("loaded", True), (pl, got)
            elif not what:
                _refused_by_name(got, key)
    # The intact 'big' (three 1 MiB digest chunks) read in blocks by 4 ranks, two of them holding
    # each row: every chunk hashed by exactly one rank (3 MiB checked in all, not 6).
    checked = [k for k in results[0] if k[0] == "intact" and k[2:]]
    assert len(checked) == 2
    for k in checked:
        assert sum(res[k] for res in results) == reference()["big"].nbytes, k


# -- one process ------------------------------------------------------------------------------------


def test_digest_chunks_are_shared_out_one_rank_each():
    """The coordinator's share of a row-read tensor's digest chunks (10 chunks of 4 bytes, the
    last one 2): disjoint rows give each rank the chunks starting in them; ranks holding the same
    rows split those chunks in consecutive parts; chunks no rank's rows hold go to every rank
    alike; every chunk to exactly one rank."""
    from checkpoint.dcp.reader import _share_chunks

    assert _share_chunks(38, 4, [(0, 0, 20), (1, 20, 38)], 2) == [(0, 0, 20), (1, 20, 38)]
    # Rows 0..18 held by ranks 0 and 1, the rest by ranks 2 and 3 (a 2x2 mesh's blocks).
    assert _share_chunks(38, 4, [(0, 0, 19), (1, 0, 19), (2, 19, 38), (3, 19, 38)], 4) == [
        (0, 0, 8), (1, 8, 20), (2, 20, 28), (3, 28, 38)
    ]  # fmt: skip
    # Rank 1's planned rows [30, 38) hold chunks 8 and 9 only: chunks 0..7 shared by both ranks.
    assert _share_chunks(38, 4, [(1, 30, 38)], 2) == [(0, 0, 16), (1, 16, 32), (1, 32, 38)]


def _optimizer_shard0(rank: int, world: int, ck: str) -> tuple:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def build(scale: float):
        torch.manual_seed(0)
        m = torch.nn.Linear(16, 8, bias=False)
        m.weight = torch.nn.Parameter(distribute_tensor(m.weight.detach() * scale, mesh, [Shard(0)]))
        o = torch.optim.Adam(m.parameters(), lr=0.1 * scale)
        m.weight.grad = torch.ones_like(m.weight) * scale
        o.step()
        return m, o

    m, o = build(1.0)
    checkpoint.save(m, ck, optimizer=o)
    dist.barrier()
    if rank == 0:
        (shard,) = [f for f in os.listdir(ck) if f.startswith("optimizer-") and f.endswith(".safetensors")]
        p = os.path.join(ck, shard)
        raw = bytearray(open(p, "rb").read())
        (n,) = struct.unpack("<Q", raw[:8])
        b, _ = json.loads(raw[8 : 8 + n])["state.weight.exp_avg"]["data_offsets"]
        raw[8 + n + b + 5] ^= 0x10
        with open(p, "wb") as f:
            f.write(bytes(raw))
    dist.barrier()
    m, o = build(2.0)
    before = (m.weight.to_local().clone(), o.state_dict()["state"][0]["exp_avg"].to_local().clone())
    try:
        checkpoint.load(m, ck, optimizer=o)
    except BaseException as e:  # noqa: BLE001 - reported
        after = (m.weight.to_local(), o.state_dict()["state"][0]["exp_avg"].to_local())
        return ("refused", type(e).__name__, str(e)[-1500:], all(map(torch.equal, before, after)) and o.param_groups[0]["lr"] == 0.2)
    return ("loaded", o.param_groups[0]["lr"])


def test_optimizer_state_of_a_shard0_parameter_is_checked(tmp_path):
    """The optimizer part's Adam state of a Shard(0) weight (FSDP's placement), one bit of
    'state.weight.exp_avg' flipped: the optimizer part is read in row blocks while planning, never
    checked, so the flipped byte loaded silently into the optimizer on both ranks."""
    from checkpoint.ranks.launch import run_ranks

    for got in run_ranks(_optimizer_shard0, 2, str(tmp_path / "ck"), timeout=120):
        assert got[0] == "refused", got
        assert got[1] == "CorruptCheckpointError" and "optimizer-00001-of-00001.safetensors" in got[2], got
        assert "'state.weight.exp_avg'" in got[2] and got[3], got


# -- ranks that disagree on whether a load is collective -------------------------------------------


def test_object_storage_read_into_leaves_out_unchanged_on_refusal():
    """RemoteCheckpointReader.read_into (memory://) fetched the flipped tensor into ``out`` and
    refused it only afterwards: ``out`` held the flipped bytes."""
    import uuid

    import fsspec

    url = f"memory://break-{uuid.uuid4().hex}/ck"
    checkpoint.save(reference(), url)
    fs = fsspec.filesystem("memory")
    (path,) = [p for p in fs.find(url.removeprefix("memory:/")) if p.endswith(".safetensors")]
    raw = bytearray(fs.cat(path))
    (n,) = struct.unpack("<Q", raw[:8])
    b, _ = json.loads(raw[8 : 8 + n])["w"]["data_offsets"]
    raw[8 + n + b + 100] ^= 0x10
    fs.pipe(path, bytes(raw))
    out = torch.zeros(8, 16)
    with checkpoint.open_checkpoint(url) as r, pytest.raises(checkpoint.CorruptCheckpointError, match="'w'"):
        r.read_into("w", out)
    assert torch.equal(out, torch.zeros(8, 16))
