"""Mesh-scoped load collectives on 4 ranks (one spawn): DTensors of the 1-D ``tp`` sub-meshes
of a 2x2 mesh agree on its root mesh (every rank), so an argument error or a corrupt tensor met
by one pair fails all four; DTensors of a 1-D root mesh of some ranks ({0, 1} and {2, 3}, each
a mesh of its own) agree within it, and every message names ranks as the default process group
numbers them (group rank 1 of {2, 3} is rank 3).
"""

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
    local = DTensor.from_local(part, mesh, [Shard(weight_dim)], run_check=False, shape=w.shape, stride=w.stride())  # fmt: skip
    m.weight = torch.nn.Parameter(local)
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
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    pairs = [DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])]  # root meshes of some ranks
    pair = pairs[rank // 2]
    out = {}
    # -- tp sub-meshes of one root mesh: every rank agrees -------------------------------------
    for dim in (0, 1):
        m = _on(_model(0.0), tp, dim)
        out[f"tp Shard({dim})"] = _outcome(m, lambda: checkpoint.load(m, cks["st"]))
    m = _on(_model(0.0), tp, 0)
    out["tp dcp"] = _outcome(m, lambda: checkpoint.load(m, cks["dcp"]))
    ref = _placed()
    kinds = {"strided": [_StridedShard(0, split_factor=2)], "col": [Shard(1)], "rows": [Shard(0)]}
    kinds["rep"] = [Replicate()]
    sd = {k: distribute_tensor(torch.zeros_like(ref[k]), tp, kinds[k], src_data_rank=None) for k in kinds}
    want = {k: distribute_tensor(ref[k], tp, kinds[k], src_data_rank=None).to_local() for k in kinds}
    try:
        checkpoint.load(sd, cks["placed"])
        out["placements"] = ("loaded", all(torch.equal(sd[k].to_local(), want[k]) for k in kinds))
    except BaseException as e:  # noqa: BLE001
        out["placements"] = ("refused", type(e).__name__, str(e))
    m = _on(_model(0.0), tp, 0)  # rank 3 fails on an argument: all four fail
    kw = {"dtype": torch.int64} if rank == 3 else {}
    out["tp rank 3 fails"] = _outcome(m, lambda: checkpoint.load(m, cks["st"], **kw))
    # A flipped byte in the second 1 MiB chunk of 'big' (Shard(0) rows: found after the
    # exchange of chunk digests by the rank hashing that chunk): all four fail.
    big = {"big": distribute_tensor(torch.zeros(1024, 1024), tp, [Shard(0)], src_data_rank=None)}
    try:
        checkpoint.load(big, cks["big bad"])
        out["big"] = ("loaded",)
    except BaseException as e:  # noqa: BLE001
        unchanged = torch.count_nonzero(big["big"].to_local()).item() == 0
        out["big"] = ("refused", type(e).__name__, str(e), unchanged)
    # -- root meshes of some ranks: each pair agrees alone, messages name default ranks ------
    m = _on(_model(0.0), pair, 0)
    out["pair rank 3 fails"] = _outcome(m, lambda: checkpoint.load(m, cks["st"], **kw))
    m = _on(_model(0.0), pair, 0)
    out["pair corrupt"] = _outcome(m, lambda: checkpoint.load(m, cks["bad"] if rank >= 2 else cks["st"]))
    # Rank 3 fails inside dcp.load's read (an OS error on its file): rank 2 fails naming rank 3.
    from torch.distributed.checkpoint import FileSystemReader

    real_read = FileSystemReader.read_data

    def failing_read(self, *a, **k):
        if rank == 3:
            raise OSError("EIO on rank three's read")
        return real_read(self, *a, **k)

    FileSystemReader.read_data = failing_read
    m = _on(_model(0.0), pair, 0)
    out["dcp rank 3 fails"] = _outcome(m, lambda: checkpoint.load(m, cks["dcp"]))
    m = _model(0.0)  # a plain load (DCP without collectives): rank 3 names itself
    out["dcp plain rank 3 fails"] = _outcome(m, lambda: checkpoint.load(m, cks["dcp"]))
    FileSystemReader.read_data = real_read
    # Pair {2, 3} loads DTensors while 0 and 1 load plain tensors (no collective).
    m = _on(_model(0.0), pair, 0) if rank >= 2 else _model(0.0)
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
    checkpoint.save({"big": _big()}, str(tmp / "big bad"))
    (shard,) = [f for f in os.listdir(tmp / "big bad") if f.endswith(".safetensors")]
    _flip_at(str(tmp / "big bad" / shard), -(3 << 20))  # in the second of the four 1 MiB chunks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(m.state_dict(), checkpoint_id=str(tmp / "dcp"), no_dist=True)
    cks = {k: str(tmp / k) for k in ("st", "bad", "dcp", "placed", "big bad")}
    return run_ranks(_ranks, 4, cks, timeout=120)


def _want(rank: int, dim: int) -> list[torch.Tensor]:
    m = _model()
    return [m.weight.detach().chunk(2, dim=dim)[rank % 2], m.bias.detach()]


def _loaded(got, want):
    assert got[0] == "loaded", got
    assert all(map(torch.equal, got[1], want)), got


def _refused(got, kind, *words, absent=()):
    assert got[0] == "refused" and got[1] == kind and got[3], got
    assert all(w in got[2] for w in words) and not any(w in got[2] for w in absent), got


@pytest.mark.parametrize("dim", [0, 1])
def test_tp_sub_meshes_load(four, dim):
    for rank, out in enumerate(four):
        _loaded(out[f"tp Shard({dim})"], _want(rank, dim))


def test_tp_sub_meshes_load_dcp(four):
    for rank, out in enumerate(four):
        _loaded(out["tp dcp"], _want(rank, 0))


def test_every_placement_on_tp_sub_meshes_loads(four):
    assert [out["placements"] for out in four] == [("loaded", True)] * 4


def test_argument_error_on_a_tp_sub_mesh_fails_every_rank(four):
    _refused(four[3]["tp rank 3 fails"], "TypeError")
    for rank in (0, 1, 2):
        _refused(four[rank]["tp rank 3 fails"], "RankAgreementError", "rank 3")


def test_chunk_mismatch_on_tp_sub_meshes_fails_every_rank(four):
    for out in four:
        got = out["big"]
        _refused(got, "CorruptCheckpointError", "'big'")


def test_argument_error_of_a_pair_names_default_ranks(four):
    for rank in (0, 1):
        _loaded(four[rank]["pair rank 3 fails"], _want(rank, 0))
    _refused(four[3]["pair rank 3 fails"], "TypeError")
    _refused(four[2]["pair rank 3 fails"], "RankAgreementError", "rank 3", absent=("rank 1",))


def test_corruption_found_by_a_pair_fails_the_pair(four):
    for rank in (0, 1):
        _loaded(four[rank]["pair corrupt"], _want(rank, 0))
    for rank in (2, 3):
        got = four[rank]["pair corrupt"]
        _refused(got, "CorruptCheckpointError", "'weight'", absent=("rank 0", "rank 1"))


def test_dcp_read_error_of_one_rank_names_default_ranks(four):
    for rank in (0, 1):
        _loaded(four[rank]["dcp rank 3 fails"], _want(rank, 0))
    for rank in (2, 3):
        got = four[rank]["dcp rank 3 fails"]
        _refused(got, "CorruptCheckpointError", "rank three", "on rank 3", absent=("rank 1",))
    _refused(four[3]["dcp plain rank 3 fails"], "CorruptCheckpointError", "on rank 3")
    m = _model()
    for rank in (0, 1, 2):
        _loaded(four[rank]["dcp plain rank 3 fails"], [m.weight.detach(), m.bias.detach()])


def test_pair_beside_plain_ranks(four):
    for rank in (0, 1):
        m = _model()
        _loaded(four[rank]["pair beside plain"], [m.weight.detach(), m.bias.detach()])
    for rank in (2, 3):
        _loaded(four[rank]["pair beside plain"], _want(rank, 0))
