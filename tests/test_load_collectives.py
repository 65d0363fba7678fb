"""The collectives of a distributed load run on the ranks of its DTensors' root mesh only.

A rank holding DTensors agrees (same checkpoint, digests, outcome) with the ranks of the mesh
its DTensors' meshes were sliced from: a DTensor rank on a mesh of its own beside a rank loading
plain tensors loads (it used to wait for that rank in the first agreement: a hang), and a rank
loading plain tensors makes no collective at all (rank 0 alone loading a module after the
process group is up). An argument error of one rank of the mesh is agreed at the first
agreement: every rank of it fails, none hangs. One spawn of 2 ranks runs every case; a hang
fails it at the harness's timeout.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import checkpoint


def model_and_optimizer(scale: float):
    """``Linear(16, 8)`` (seeded) times ``scale``, after one Adam step (state ``exp_avg`` etc.)."""
    torch.manual_seed(0)
    m = torch.nn.Linear(16, 8)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(scale)
    o = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.ones(2, 16)).sum().backward()
    o.step()
    o.zero_grad()
    return m, o


def _distributed(m: torch.nn.Module, mesh) -> None:
    """``m``'s parameters as DTensors on the 1-D ``mesh``: weight ``Shard(0)`` (this rank's rows),
    bias ``Replicate``; made from local tensors, no collective (other ranks may not hold them)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    w, b = m.weight.detach(), m.bias.detach()
    rows = w.chunk(mesh.size())[mesh.get_local_rank()].contiguous()
    m.weight = torch.nn.Parameter(DTensor.from_local(rows, mesh, [Shard(0)], run_check=False, shape=w.shape, stride=w.stride()))
    m.bias = torch.nn.Parameter(DTensor.from_local(b.clone(), mesh, [Replicate()], run_check=False))


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _snapshot(m: torch.nn.Module, o: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    """This rank's bytes of ``m``'s parameters (and ``o``'s Adam state) as copies."""
    out = [_local(p).detach().clone() for p in m.parameters()]
    if o is not None:
        out += [_local(o.state[p][k]).clone() for p in m.parameters() for k in ("exp_avg", "exp_avg_sq")]
    return out


def _outcome(m, o, load) -> tuple:
    """``("loaded", this rank's values)`` or ``("refused", error type, text, unchanged)``."""
    before = _snapshot(m, o)
    try:
        load()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        return ("refused", type(e).__name__, str(e), all(map(torch.equal, before, _snapshot(m, o))))
    return ("loaded", _snapshot(m, o))


def _ranks(rank: int, world: int, cks: dict[str, str]) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torch.distributed.device_mesh import DeviceMesh

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "one"))
    own = DeviceMesh("cpu", [0])  # a mesh of rank 0 alone (every rank makes it: its group)
    out = {}

    def fresh(on=None, adam=False):  # zero parameters (and Adam state), as DTensors on ``on`` when given
        torch.manual_seed(0)
        m = torch.nn.Linear(16, 8)
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()
        if on is not None:
            _distributed(m, on)
        if not adam:
            return m, None
        o = torch.optim.Adam(m.parameters(), lr=0.1)
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        o.step()  # zero gradients: the state exists, zero, and the parameters stay zero
        o.zero_grad()
        return m, o

    # Rank 0: DTensors on its own 1-rank mesh; rank 1: plain parameters.
    m, o = fresh(own if rank == 0 else None)
    out["sub-mesh beside plain"] = _outcome(m, None, lambda: checkpoint.load(m, cks["st"]))
    m, o = fresh(own if rank == 0 else None, adam=True)
    out["sub-mesh beside plain, optimizer"] = _outcome(m, o, lambda: checkpoint.load(m, cks["st"], optimizer=o))
    # A state_dict of DTensors beside a plain state_dict: the same on the state_dict path.
    sd = {k: _local(v) for k, v in fresh()[0].state_dict().items()}
    if rank == 0:
        from torch.distributed.tensor import DTensor, Replicate

        sd = {k: DTensor.from_local(v, own, [Replicate()], run_check=False) for k, v in sd.items()}
    out["state_dict beside plain"] = _outcome(_Dict(sd), None, lambda: checkpoint.load(sd, cks["st"]))
    # A DCP checkpoint: read by one dcp.load, collective only on the ranks holding DTensors.
    m, o = fresh(own if rank == 0 else None)
    out["dcp sub-mesh beside plain"] = _outcome(m, None, lambda: checkpoint.load(m, cks["dcp"]))
    # Both ranks hold DTensors on one mesh; rank 1 fails on an argument before any agreement.
    m, o = fresh(mesh["dp"])
    kw = {"dtype": torch.int64} if rank == 1 else {}
    out["one rank fails first"] = _outcome(m, None, lambda: checkpoint.load(m, cks["st"], **kw))
    # Plain on every rank: loads, as before.
    m, o = fresh(adam=True)
    out["plain everywhere"] = _outcome(m, o, lambda: checkpoint.load(m, cks["st"], optimizer=o))
    # Rank 0 alone loads a plain module; rank 1 waits at a barrier (no load, no collective).
    m, o = fresh()
    out["one rank alone"] = _outcome(m, None, lambda: checkpoint.load(m, cks["st"])) if rank == 0 else None
    dist.barrier()
    # DTensors on the mesh of both ranks load as before.
    m, o = fresh(mesh["dp"], adam=True)
    out["one mesh"] = _outcome(m, o, lambda: checkpoint.load(m, cks["st"], optimizer=o))
    # Pipeline stages: each rank's DTensors on its 1-rank slice of the world mesh; rank 1 asks
    # for a dtype that is refused: both stages fail (they agree on the world mesh they share).
    m, o = fresh(mesh["one"])
    kw = {"dtype": torch.int64} if rank == 1 else {}
    out["stages"] = _outcome(m, None, lambda: checkpoint.load(m, cks["st"], **kw))
    return out


class _Dict(torch.nn.Module):
    """A state_dict's tensors as the parameters ``_outcome`` snapshots."""

    def __init__(self, sd: dict[str, torch.Tensor]):
        super().__init__()
        self.sd = sd

    def parameters(self, recurse: bool = True):
        return iter(self.sd.values())


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import torch.distributed.checkpoint as dcp

    from checkpoint.ranks.launch import run_ranks

    tmp = tmp_path_factory.mktemp("collectives")
    m, o = model_and_optimizer(1.0)
    checkpoint.save(m, str(tmp / "st"), optimizer=o)
    with warnings.catch_warnings():  # torch's note that a save without process group is one process's
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(m.state_dict(), checkpoint_id=str(tmp / "dcp"), no_dist=True)
    return run_ranks(_ranks, 2, {"st": str(tmp / "st"), "dcp": str(tmp / "dcp")}, timeout=60)


def _expected(optimizer: bool) -> list[torch.Tensor]:
    """What ``_snapshot`` holds after a load of the saved model (and optimizer)."""
    m, o = model_and_optimizer(1.0)
    return _snapshot(m, o if optimizer else None)


def _loaded(got: tuple, want: list[torch.Tensor]) -> None:
    assert got[0] == "loaded", got
    assert len(got[1]) == len(want) and all(map(torch.equal, got[1], want)), got


def _refused(got: tuple, kind: str, *words: str) -> None:
    assert got[0] == "refused" and got[1] == kind, got
    assert all(w in got[2] for w in words), got
    assert got[3], ("a target changed before the refusal", got)


def test_dtensors_on_a_sub_mesh_beside_plain_tensors_load_on_every_rank(ranks):
    """Rank 0 holds DTensors on a 1-rank mesh of its own, rank 1 plain parameters: rank 0 waited
    in the first agreement alone (rank 1's load made no collective) and the run hung."""
    for got in ranks:
        _loaded(got["sub-mesh beside plain"], _expected(False))


def test_optimizer_of_a_sub_mesh_beside_plain_loads_on_every_rank(ranks):
    for got in ranks:
        _loaded(got["sub-mesh beside plain, optimizer"], _expected(True))


def test_state_dict_of_dtensors_beside_a_plain_state_dict_loads_on_every_rank(ranks):
    for got in ranks:
        _loaded(got["state_dict beside plain"], _expected(False))


def test_dcp_checkpoint_into_dtensors_of_a_sub_mesh_beside_plain_loads(ranks):
    """Rank 0's ``dcp.load`` of the DCP checkpoint runs on its mesh's ranks, rank 1's without a
    collective (it used to run on every rank: rank 0 waited for rank 1)."""
    for got in ranks:
        _loaded(got["dcp sub-mesh beside plain"], _expected(False))


def test_a_rank_failing_before_the_first_agreement_fails_every_rank(ranks):
    """Rank 1's own TypeError (dtype=torch.int64) comes before any collective; rank 0, holding
    DTensors on the same mesh, waited for it in the first agreement: now both fail."""
    _refused(ranks[1]["one rank fails first"], "TypeError", "dtype=")
    _refused(ranks[0]["one rank fails first"], "RankAgreementError", "rank 1", "TypeError", "dtype=")


def test_plain_tensors_on_every_rank_load(ranks):
    for got in ranks:
        _loaded(got["plain everywhere"], _expected(True))


def test_one_rank_alone_loads_a_plain_module(ranks):
    """Rank 0 loads a plain module while rank 1 never calls ``load``: no collective is made."""
    _loaded(ranks[0]["one rank alone"], _expected(False))


def test_pipeline_stages_sliced_from_one_mesh_fail_together(ranks):
    _refused(ranks[1]["stages"], "TypeError", "dtype=")
    _refused(ranks[0]["stages"], "RankAgreementError", "rank 1", "TypeError", "dtype=")


def test_dtensors_on_one_mesh_of_every_rank_load(ranks):
    """Both ranks hold the weight ``Shard(0)`` (and its Adam state) on the mesh of both: each
    loads its rows."""
    for rank, got in enumerate(ranks):
        want = [t.chunk(2)[rank] if t.dim() == 2 else t for t in _expected(True)]
        _loaded(got["one mesh"], want)


def test_a_load_without_process_group_makes_no_collective(tmp_path, monkeypatch):
    """One process, no process group: no exchange."""
    import torch.distributed as tdist

    def refuse(*args, **kwargs):
        raise AssertionError("a collective in a load without process group")

    for name in ("all_reduce", "all_gather_object", "broadcast_object_list", "barrier"):
        monkeypatch.setattr(tdist, name, refuse)
    m, o = model_and_optimizer(1.0)
    checkpoint.save(m, str(tmp_path / "ck"), optimizer=o)
    t, to = model_and_optimizer(0.0)
    checkpoint.load(t, str(tmp_path / "ck"), optimizer=to)
    assert all(map(torch.equal, _snapshot(t, to), _expected(True)))
