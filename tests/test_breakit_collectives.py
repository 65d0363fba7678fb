"""Mesh-scoped load collectives on 4 ranks with a 2-D mesh (dp x tp): loads into DTensors of
the 1-D ``tp`` sub-meshes ({0, 1} and {2, 3}) agree within their pair only, and every message
names ranks as the default group numbers them. One spawn of 4 ranks runs every case."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import checkpoint


def _model(scale: float = 1.0) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Linear(16, 8)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(scale)
    return m


def _on(m: torch.nn.Module, mesh, weight_dim: int) -> torch.nn.Module:
    """``m``'s weight as ``Shard(weight_dim)`` and bias as ``Replicate`` DTensors on the 1-D
    ``mesh``, made from local tensors (no collective)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    w, b = m.weight.detach(), m.bias.detach()
    part = w.chunk(mesh.size(), dim=weight_dim)[mesh.get_local_rank()].contiguous()
    m.weight = torch.nn.Parameter(DTensor.from_local(part, mesh, [Shard(weight_dim)], run_check=False, shape=w.shape, stride=w.stride()))
    m.bias = torch.nn.Parameter(DTensor.from_local(b.clone(), mesh, [Replicate()], run_check=False))
    return m


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _outcome(m, load) -> tuple:
    before = [_local(p).detach().clone() for p in m.parameters()]
    try:
        load()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        after = [_local(p).detach() for p in m.parameters()]
        return ("refused", type(e).__name__, str(e), all(map(torch.equal, before, after)))
    return ("loaded", [_local(p).detach().clone() for p in m.parameters()])


def _ranks(rank: int, world: int, cks: dict[str, str]) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    out = {}
    for dim in (0, 1):
        m = _on(_model(0.0), tp, dim)
        out[f"tp Shard({dim})"] = _outcome(m, lambda: checkpoint.load(m, cks["st"]))
    m = _on(_model(0.0), tp, 0)
    out["tp dcp"] = _outcome(m, lambda: checkpoint.load(m, cks["dcp"]))
    # Rank 3 fails on an argument: rank 2 (its tp pair) fails naming rank 3; 0 and 1 load.
    m = _on(_model(0.0), tp, 0)
    kw = {"dtype": torch.int64} if rank == 3 else {}
    out["rank 3 fails"] = _outcome(m, lambda: checkpoint.load(m, cks["st"], **kw))
    # A flipped byte found by the pair {2, 3}: each names a default-group rank.
    m = _on(_model(0.0), tp, 0)
    out["corrupt"] = _outcome(m, lambda: checkpoint.load(m, cks["bad"] if rank >= 2 else cks["st"]))
    # Every placement of a 1-D sub-mesh in one state_dict (_StridedShard too), each pair on its own.
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    ref = _placed()
    kinds = {"strided": [_StridedShard(0, split_factor=2)], "col": [Shard(1)], "rows": [Shard(0)], "rep": [Replicate()]}
    sd = {k: distribute_tensor(torch.zeros_like(ref[k]), tp, kinds[k], src_data_rank=None) for k in kinds}
    want = {k: distribute_tensor(ref[k], tp, kinds[k], src_data_rank=None).to_local() for k in kinds}
    try:
        checkpoint.load(sd, cks["placed"])
        out["placements"] = ("loaded", all(torch.equal(sd[k].to_local(), want[k]) for k in kinds))
    except BaseException as e:  # noqa: BLE001
        out["placements"] = ("refused", type(e).__name__, str(e))
    # A flipped byte in the second 1 MiB chunk of 'big' (Shard(0) rows: found after the pair's
    # exchange of chunk digests) on pair {2, 3}; pair {0, 1} loads an intact copy.
    big = {"big": distribute_tensor(torch.zeros(1024, 1024), tp, [Shard(0)], src_data_rank=None)}
    try:
        checkpoint.load(big, cks["big bad"] if rank >= 2 else cks["big"])
        out["big"] = ("loaded", torch.equal(big["big"].to_local(), _big().chunk(2)[rank % 2]))
    except BaseException as e:  # noqa: BLE001
        out["big"] = ("refused", type(e).__name__, str(e), torch.count_nonzero(big["big"].to_local()).item() == 0)
    # Rank 3 fails inside dcp.load's read (an OS error on its file): rank 2 fails naming rank 3.
    from torch.distributed.checkpoint import FileSystemReader

    real_read = FileSystemReader.read_data

    def failing_read(self, *a, **k):
        if rank == 3:
            raise OSError("EIO on rank three's read")
        return real_read(self, *a, **k)

    FileSystemReader.read_data = failing_read
    m = _on(_model(0.0), tp, 0)
    out["dcp rank 3 fails"] = _outcome(m, lambda: checkpoint.load(m, cks["dcp"]))
    m = _model(0.0)  # a plain load (DCP without collectives): rank 3 names itself
    out["dcp plain rank 3 fails"] = _outcome(m, lambda: checkpoint.load(m, cks["dcp"]))
    FileSystemReader.read_data = real_read
    # Pair {2, 3} loads DTensors while 0 and 1 load plain tensors (no collective).
    m = _on(_model(0.0), tp, 0) if rank >= 2 else _model(0.0)
    out["pair beside plain"] = _outcome(m, lambda: checkpoint.load(m, cks["st"]))
    dist.barrier()
    return out


def _placed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"strided": torch.randn(8, 6, generator=g), "col": torch.randn(5, 6, generator=g),
            "rows": torch.randn(9, 3, generator=g), "rep": torch.randn(4, generator=g)}  # fmt: skip


def _big() -> torch.Tensor:
    return torch.arange(1024 * 1024, dtype=torch.float32).view(1024, 1024)


def _flip_at(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset, 0 if offset >= 0 else 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    import torch.distributed.checkpoint as dcp

    from checkpoint.ranks.launch import run_ranks

    tmp = tmp_path_factory.mktemp("breakit_collectives")
    m = _model()
    checkpoint.save(m, str(tmp / "st"))
    checkpoint.save(m, str(tmp / "bad"))
    (shard,) = [f for f in os.listdir(tmp / "bad") if f.endswith(".safetensors")]
    path = str(tmp / "bad" / shard)
    with open(path, "r+b") as f:  # the last byte: the last row of weight or of bias
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 0xFF]))
    checkpoint.save(_placed(), str(tmp / "placed"))
    checkpoint.save({"big": _big()}, str(tmp / "big"))
    checkpoint.save({"big": _big()}, str(tmp / "big bad"))
    (shard,) = [f for f in os.listdir(tmp / "big bad") if f.endswith(".safetensors")]
    _flip_at(str(tmp / "big bad" / shard), -(3 << 20))  # in the second of the four 1 MiB chunks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(m.state_dict(), checkpoint_id=str(tmp / "dcp"), no_dist=True)
    return run_ranks(_ranks, 4, {k: str(tmp / k) for k in ("st", "bad", "dcp", "placed", "big", "big bad")}, timeout=120)


def _want(rank: int, dim: int) -> list[torch.Tensor]:
    m = _model()
    return [m.weight.detach().chunk(2, dim=dim)[rank % 2], m.bias.detach()]


def _loaded(got, want):
    assert got[0] == "loaded", got
    assert all(map(torch.equal, got[1], want)), got


@pytest.mark.parametrize("dim", [0, 1])
def test_tp_sub_mesh_loads_each_pair(four, dim):
    for rank, out in enumerate(four):
        _loaded(out[f"tp Shard({dim})"], _want(rank, dim))


def test_tp_sub_mesh_loads_dcp(four):
    for rank, out in enumerate(four):
        _loaded(out["tp dcp"], _want(rank, 0))


def test_argument_error_fails_its_pair_naming_default_ranks(four):
    for rank in (0, 1):
        _loaded(four[rank]["rank 3 fails"], _want(rank, 0))
    got3, got2 = four[3]["rank 3 fails"], four[2]["rank 3 fails"]
    assert got3[0] == "refused" and got3[1] == "TypeError" and got3[3], got3
    assert got2[0] == "refused" and got2[1] == "RankAgreementError" and got2[3], got2
    assert "rank 3" in got2[2] and "rank 1" not in got2[2], got2


def test_corruption_found_on_a_pair_names_default_ranks(four):
    for rank in (0, 1):
        _loaded(four[rank]["corrupt"], _want(rank, 0))
    for rank in (2, 3):
        got = four[rank]["corrupt"]
        assert got[0] == "refused" and got[1] == "CorruptCheckpointError" and got[3], got
        assert "rank 0" not in got[2] and "rank 1" not in got[2], got


def test_pair_beside_plain_ranks(four):
    for rank in (0, 1):
        m = _model()
        _loaded(four[rank]["pair beside plain"], [m.weight.detach(), m.bias.detach()])
    for rank in (2, 3):
        _loaded(four[rank]["pair beside plain"], _want(rank, 0))


def test_every_placement_on_a_sub_mesh_loads(four):
    assert [out["placements"] for out in four] == [("loaded", True)] * 4


def test_chunk_mismatch_found_by_a_pair_fails_both_naming_default_ranks(four):
    for rank in (0, 1):
        assert four[rank]["big"] == ("loaded", True), four[rank]["big"]
    for rank in (2, 3):
        got = four[rank]["big"]
        assert got[0] == "refused" and got[1] == "CorruptCheckpointError" and got[3], got
        assert "'big'" in got[2] and "rank 0" not in got[2] and "rank 1" not in got[2], got


def test_dcp_read_error_of_one_rank_fails_its_pair_naming_default_ranks(four):
    for rank in (0, 1):
        _loaded(four[rank]["dcp rank 3 fails"], _want(rank, 0))
    for rank in (2, 3):
        got = four[rank]["dcp rank 3 fails"]
        assert got[0] == "refused" and got[3], got
        assert "rank three" in got[2] and "rank 3" in got[2] and "rank 1" not in got[2], got
    got = four[3]["dcp plain rank 3 fails"]
    assert got[0] == "refused" and got[3] and "on rank 3" in got[2], got
    m = _model()
    for rank in (0, 1, 2):
        _loaded(four[rank]["dcp plain rank 3 fails"], [m.weight.detach(), m.bias.detach()])
