"""DCP as a first-class source: ``load(module, dcp_dir)`` through
torch.distributed.checkpoint, ``migrate`` of the tutorial layout ``{"model", "optim"}`` into model
and optimizer files, true per-file figures in ``inspect``, errors that name DCP."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.nn as nn

import checkpoint
from checkpoint.cli.main import main as cli
from checkpoint.errors import CheckpointError, CheckpointMismatchError, CorruptCheckpointError
from checkpoint.ranks.launch import run_ranks
from tests.helpers import assert_same_state
from tests.helpers import trained


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(6, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.enc(x)))


def _dcp_save(state, path):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


@pytest.fixture
def tutorial(tmp_path):
    """``dcp.save({"model": ..., "optim": ...})`` as the DCP tutorial does (get_state_dict)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = trained(Net, steps=2, weight_decay=0.1)
    msd, osd = get_state_dict(model, opt)
    _dcp_save({"model": msd, "optim": osd}, tmp_path / "dcp")
    return model, opt, tmp_path / "dcp"


def _snapshot(model, opt=None):
    snap = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if opt is not None:
        snap["__opt__"] = repr(opt.state_dict())
    return snap


def test_tutorial_layout_migrates_model_and_optimizer_files(tutorial, tmp_path, capsys):
    model, opt, src = tutorial
    report = checkpoint.migrate(src, tmp_path / "out", model=Net())
    assert report.ok and report.container == "model"
    assert report.mapping == {k: k for k in model.state_dict()}  # no optim.* among model keys
    with checkpoint.open_checkpoint(tmp_path / "out") as r:
        assert r.keys() == sorted(model.state_dict())
    targets = sorted(e.target for e in report.optimizer_entries)
    assert targets == sorted(
        f"state.{n}.{s}" for n, _ in model.named_parameters() for s in ("step", "exp_avg", "exp_avg_sq")
    )
    # Loadable with the optimizer: exact state, hyper-parameters, and the next step matches.
    fresh = Net()
    new_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    checkpoint.load(fresh, tmp_path / "out", optimizer=new_opt)
    assert_same_state(_snapshot(fresh), _snapshot(model))
    ref, got = opt.state_dict(), new_opt.state_dict()
    assert got["param_groups"] == ref["param_groups"]
    for i, slots in ref["state"].items():
        assert slots.keys() == got["state"][i].keys()
        assert all(torch.equal(v, got["state"][i][k]) for k, v in slots.items())
    x = torch.randn(4, 6)
    for m, o in ((model, opt), (fresh, new_opt)):
        m(x).square().sum().backward()
        o.step()
    assert_same_state(_snapshot(fresh), _snapshot(model))

    # The CLI says the same: exit 0, and inspect reports the optimizer state.
    assert cli(["migrate", str(src), str(tmp_path / "cli-out")]) == 0
    capsys.readouterr()
    assert cli(["inspect", "--json", str(src)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tensors"] == 4 and data["container"] == "model"
    assert data["optimizer_state"] == {
        "container": "optim", "tensors": 12, "params": 4, "param_groups": 1,
        "bytes": sum(s[k].nbytes for s in ref["state"].values() for k in s),
    }  # fmt: skip


def test_load_reads_dcp_with_names_resolved(tutorial, tmp_path):
    model, _, src = tutorial
    plain = Net()
    rep = checkpoint.load(plain, src)
    assert rep.ok and rep.loaded_keys == sorted(model.state_dict())
    assert_same_state(_snapshot(plain), _snapshot(model))
    wrapped = nn.Module()
    wrapped.model = Net()  # the checkpoint's container prefix "model." is the target's child
    checkpoint.load(wrapped, src)
    assert_same_state(_snapshot(wrapped.model), _snapshot(model))
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}  # a plain state_dict target
    checkpoint.load(sd, src)
    assert_same_state(sd, _snapshot(model))


def test_dcp_errors_name_dcp_and_change_nothing(tutorial, tmp_path):
    _, opt, src = tutorial
    target = nn.Linear(6, 8)
    before = _snapshot(target)
    with pytest.raises(CheckpointMismatchError, match="DCP checkpoint") as e:
        checkpoint.load(target, src)
    assert e.value.report.unexpected_keys == ["enc.bias", "enc.weight", "head.bias", "head.weight"]
    assert_same_state(_snapshot(target), before)
    with pytest.raises(CheckpointError, match="not a parameter of the model"):
        checkpoint.load(Net(), src, optimizer=opt)  # an optimizer of another module
    with pytest.raises(CheckpointError, match="DCP stores no checksums"):
        checkpoint.load(Net(), src, verify=True)

    # A truncated data file: DCP raises CheckpointException (a BaseException); ours names DCP,
    # the file, the keys and the rank, and the target is untouched.
    data = [f for f in os.listdir(src) if f.endswith(".distcp")]
    assert len(data) == 1
    with open(src / data[0], "r+b") as f:
        f.truncate(64)
    target = Net()
    before = _snapshot(target)
    with pytest.raises(CorruptCheckpointError) as e:
        checkpoint.load(target, src)
    msg = str(e.value)
    assert "DCP" in msg and data[0] in msg and "rank 0" in msg and "model.enc.weight" in msg
    assert_same_state(_snapshot(target), before)
    code = cli(["migrate", str(src), str(tmp_path / "out"), "--model", "tests.test_migrate_dcp:Net"])
    assert code == 2 and not (tmp_path / "out").exists()


# -- 2 ranks: a tensor split over both .distcp files ----------------------------------------------
def _sharded_worker(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model, _ = trained(Net, steps=2, weight_decay=0.1)
    sd = {k: distribute_tensor(v.detach(), mesh, [Shard(0)]) for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": sd}, checkpoint_id=path)
    # Load into another placement: each rank reads its slices, resharded.
    target = Net()
    for mod in (target.enc, target.head):
        for name, p in list(mod.named_parameters(recurse=False)):
            pl = [Shard(1)] if p.dim() == 2 else [Replicate()]
            mod.register_parameter(name, nn.Parameter(distribute_tensor(torch.zeros_like(p), mesh, pl)))
    rep = checkpoint.load(target, path)
    first = {
        "full": {k: v.full_tensor().clone() for k, v in target.state_dict().items()},
        "local_shapes": {k: tuple(v.to_local().shape) for k, v in target.state_dict().items()},
    }

    # Optimizer state of Shard(0) DTensor parameters ({"model", "optim"}, get_state_dict) loaded
    # into the Shard(1) / Replicate target's optimizer: DCP reshards it, the planner names it.
    from torch.distributed.checkpoint.state_dict import get_state_dict

    src = Net()
    for mod in (src.enc, src.head):
        for name, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    opt = torch.optim.AdamW(src.parameters(), lr=1e-2)
    for p in src.parameters():
        p.grad = distribute_tensor(torch.full(p.shape, 0.5), mesh, [Shard(0)])
    opt.step()
    msd, osd = get_state_dict(src, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path + "_opt")
    opt2 = torch.optim.AdamW(target.parameters(), lr=1e-2)
    rep2 = checkpoint.load(target, path + "_opt", optimizer=opt2)
    names = dict(zip(target.parameters(), [n for n, _ in target.named_parameters()]))
    return {
        "opt_loaded": rep2.optimizer_loaded,
        "opt_state": {
            names[p]: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in s.items()}
            for p, s in opt2.state.items()
        },
        "opt_placements": {names[p]: str(s["exp_avg"].placements) for p, s in opt2.state.items()},
        "want_state": {
            n: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in opt.state[p].items()}
            for n, p in src.named_parameters()
        },
        "loaded": rep.loaded_keys,
        **first,
    }


@pytest.mark.slow
def test_two_rank_dcp_inspect_per_file_load_resharded(tmp_path, capsys):
    path = str(tmp_path / "dcp2")
    res = run_ranks(_sharded_worker, 2, path, backend="gloo", timeout=180)
    model, _ = trained(Net, steps=2, weight_decay=0.1)
    want = _snapshot(model)
    for r in res:
        assert r["loaded"] == sorted(want)
        assert_same_state(r["full"], want)
        assert r["opt_loaded"] and sorted(r["opt_state"]) == sorted(want)
        for n, slots in r["want_state"].items():
            assert sorted(slots) == ["exp_avg", "exp_avg_sq", "step"]
            assert all(torch.equal(r["opt_state"][n][k], v) for k, v in slots.items())
        assert r["opt_placements"]["enc.weight"] == "(Shard(dim=1),)"  # the target's placement
    assert res[0]["local_shapes"]["enc.weight"] == (8, 3)  # Shard(1) of (8, 6): its half only

    assert cli(["inspect", "--json", path]) == 0
    data = json.loads(capsys.readouterr().out)
    total = sum(v.nbytes for v in want.values())
    assert data["total_bytes"] == total and data["tensors"] == 4
    # Every tensor is split over both files: each file holds 4 tensors and half of the bytes.
    assert data["per_file"] == {
        "__0_0.distcp": {"tensors": 4, "bytes": total // 2},
        "__1_0.distcp": {"tensors": 4, "bytes": total // 2},
    }
    single = Net()  # a single process without a process group reads it too
    checkpoint.load(single, path)
    assert_same_state(_snapshot(single), want)


def test_dcp_hf_rank_shards_load(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    model, _ = trained(Net, steps=2, weight_decay=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            model.state_dict(),
            storage_writer=HuggingFaceStorageWriter(str(tmp_path / "hf"), save_distributed=True),
            no_dist=True,
        )
    target = Net()
    assert checkpoint.load(target, tmp_path / "hf").ok
    assert_same_state(_snapshot(target), _snapshot(model))


def test_small_dcp_items_are_parsed_from_memory_and_large_ones_through_dcps_view(tmp_path, monkeypatch):
    """An item up to SLICE_IN_MEMORY bytes is read in one call and torch.load parses it
    from BytesIO (C seek / read); a larger one keeps DCP's file view; values are equal either way."""
    import io

    from checkpoint.sources import dcp as dcp_source

    g = torch.Generator().manual_seed(8)
    sd = {"small": torch.randn(4, generator=g), "big": torch.randn(64, 64, generator=g)}
    _dcp_save({"model": sd}, tmp_path / "dcp")
    monkeypatch.setattr(dcp_source, "SLICE_IN_MEMORY", 8000)  # the small item's zip ~1.5 KB, the big one's > 16 KB
    parsed, real = [], torch.load

    def spy(f, *a, **k):
        if k.get("map_location") == "cpu":  # DCP's tensor reads (FileSystemReader.read_data)
            parsed.append(type(f) is io.BytesIO)
        return real(f, *a, **k)

    monkeypatch.setattr(torch, "load", spy)
    checkpoint.migrate(tmp_path / "dcp", tmp_path / "out")
    assert sorted(parsed) == [False, True]
    with checkpoint.open_checkpoint(tmp_path / "out") as r:
        assert r.keys() == ["big", "small"] and all(torch.equal(r.get(k), v) for k, v in sd.items())


def test_a_dcp_item_length_damaged_in_metadata_is_refused_as_dcp_refuses_it(tmp_path):
    """A negative or too long item length in ``.metadata`` (damaged) is never read from memory
    (``file.read(-1)`` would take the rest of the file and load): DCP's own view refuses it."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    _dcp_save({"model": {"a": torch.ones(3), "b": torch.zeros(3)}}, tmp_path / "dcp")
    for length in (-1, 10**6):
        md_path = tmp_path / "dcp" / ".metadata"
        md = pickle.loads(md_path.read_bytes())  # our own test file (the library never unpickles freely)
        assert isinstance(md, Metadata)
        next(v for k, v in md.storage_data.items() if k.fqn == "model.a").length = length
        md_path.write_bytes(pickle.dumps(md))
        out = tmp_path / f"out{length}"
        with pytest.raises(CorruptCheckpointError, match="DCP"):
            checkpoint.migrate(tmp_path / "dcp", out)
        assert not out.exists()
